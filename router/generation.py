"""One request's choices on the decode nodes: one sub-request per prompt and choice, their replies merged.

Lifecycle:

1. `start()` submits every choice through the dispatcher, each with its own request id (the request's, with
   "-<k>" after it when there are several), each in a "kvwire.route" span (a child of the client's trace
   context; its context is what the nodes are sent). A prompt's first choice gets its own prefill and decode
   pick; its later ones (n > 1, best_of, and every choice of the same prompt again in a batch) go to that
   decode node to start from its prompt KV, when the node does that (`NodeInfo.shares_prompts`; else each is
   picked as a first one is). The first choice's prefill is sent last, so that the later ones are on the node
   before its prompt can be done.
2. `events()` yields each choice as a chunk of it arrives, until all are finished. A choice that a stop
   string ended is cancelled on its decode node (`CancelWork`) at once.
3. `close()` (always called) cancels the choices not finished — a client that left, a timeout, another
   choice's error — and forgets them all in the dispatcher. Each choice's span ends as it finishes (with the
   transfer's bytes and duration) or here.

A node's `WorkError` or the deadline fails the whole request with an APIError.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

from kvwire.observability.tracing import Spans, TraceContext
from kvwire.protocol.work import ErrorKind, TokenChunk, WorkError, span_attributes
from kvwire.router.choice import Choice
from kvwire.router.dispatch import Dispatcher
from kvwire.router.placement import Route
from kvwire.router.sampling import Plan
from kvwire.router.schemas import APIError


class Generation:
    def __init__(self, dispatcher: Dispatcher, plan: Plan, request_id: str, deadline: float,
                 make_choice: Callable[[int, str, list[int]], Choice], spans: Spans | None = None,
                 trace: TraceContext | None = None):
        self._dispatcher = dispatcher
        self._spans = spans or Spans()
        self._trace = trace  # the client's
        self.plan = plan
        self._deadline = deadline
        self.request_id = request_id
        count = len(plan.prompts) * plan.best_of
        ids = [request_id] if count == 1 else [f"{request_id}-{k}" for k in range(count)]
        self.choices = [make_choice(k, ids[k], plan.prompts[k // plan.best_of]) for k in range(count)]
        self._merged: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []

    async def start(self) -> None:
        """Send every choice's work. A prompt asked more than once is prefilled once, for its first choice, whose
        prefill waits until its later choices are sent to its decode node: there they start from its prompt KV,
        which must not be done before they arrive (a busy router between two sends once let it)."""
        firsts: dict[tuple[int, ...], tuple[Choice, Route]] = {}  # each prompt's first choice, and where it went
        asked = Counter(tuple(c.prompt_ids) for c in self.choices)
        held: list[str] = []  # first choices whose prefill waits for their later choices
        for choice in self.choices:
            sampling = self.plan.sampling_for(choice.index % self.plan.best_of)
            choice.span = self._spans.start("kvwire.route", self._trace, {
                "kvwire.request_id": choice.request_id, "kvwire.prompt_tokens": len(choice.prompt_ids)})
            first = firsts.get(key := tuple(choice.prompt_ids))  # a batch's repeated prompt: one prompt
            if first is not None and first[1].decode.shares_prompts:
                route, queue = await self._dispatcher.submit_shared(
                    choice.request_id, first[0].request_id, first[1].decode, choice.prompt_ids, sampling,
                    trace=choice.span.context)
            else:
                hold = asked[key] > 1 and key not in firsts
                route, queue = await self._dispatcher.submit(choice.request_id, choice.prompt_ids, sampling,
                                                             self.plan.disaggregate, trace=choice.span.context,
                                                             hold_prefill=hold)
                held += [choice.request_id] if hold else []
                firsts.setdefault(key, (choice, route))
            choice.path, choice.reason = route.path, route.reason
            self._pumps.append(asyncio.create_task(self._pump(choice, queue)))
        for request_id in held:
            await self._dispatcher.release_prefill(request_id)

    async def events(self) -> AsyncIterator[Choice]:
        """Each choice as a chunk of it arrives. Raises APIError on a node's error or at the deadline."""
        unfinished = len(self.choices)
        while unfinished:
            try:
                choice, msg = await asyncio.wait_for(self._merged.get(),
                                                     timeout=max(0.0, self._deadline - time.monotonic()))
            except TimeoutError:
                raise APIError(504, f"request {self.request_id} timed out", type_="timeout") from None
            if isinstance(msg, WorkError):
                raise _api_error(msg)
            if choice.finished:
                continue  # chunks the node sent before it took our cancel
            if self.plan.sampling.logprobs is not None and len(msg.logprobs) != len(msg.token_ids):
                raise APIError(500, f"request {choice.request_id}: the decode node sent {len(msg.logprobs)} logprobs "
                                    f"for {len(msg.token_ids)} tokens", type_="server_error")
            if choice.add(msg):
                self._dispatcher.cancel(choice.request_id)
            if choice.finished:
                unfinished -= 1
                self._dispatcher.forget(choice.request_id)
                self._end_span(choice)
            yield choice

    def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        for choice in self.choices:
            if not choice.finished:
                self._dispatcher.cancel(choice.request_id)
            self._dispatcher.forget(choice.request_id)
            self._end_span(choice, error="" if choice.finished else "not finished: cancelled, failed or timed out")

    @staticmethod
    def _end_span(choice: Choice, error: str = "") -> None:
        if choice.span is None:
            return
        attributes: dict[str, str | int | float | bool] = {
            "kvwire.path": str(choice.path), "kvwire.path_reason": str(choice.reason),
            "kvwire.output_tokens": len(choice.token_ids)}
        if choice.stats is not None:
            attributes.update(span_attributes(choice.stats))
        choice.span.end(attributes, error)
        choice.span = None

    def ranked(self) -> list[Choice]:
        """The n choices of each prompt to answer with (the best_of with highest total logprob), indexed anew."""
        plan, out = self.plan, []
        for p in range(len(plan.prompts)):
            group = self.choices[p * plan.best_of:(p + 1) * plan.best_of]
            if plan.best_of > plan.n:
                group = sorted(group, key=Choice.total_logprob, reverse=True)[:plan.n]
            for j, choice in enumerate(group):
                choice.index = p * plan.n + j
                if plan.logprobs is None:
                    choice.logprobs = []
                out.append(choice)
        return out

    async def _pump(self, choice: Choice, queue: asyncio.Queue) -> None:
        while True:
            msg = await queue.get()
            await self._merged.put((choice, msg))
            if isinstance(msg, WorkError) or (isinstance(msg, TokenChunk) and msg.finished):
                return


def _api_error(msg: WorkError) -> APIError:
    if msg.kind == ErrorKind.INVALID_REQUEST:
        return APIError(400, msg.reason)
    if msg.kind in (ErrorKind.DRAINING, ErrorKind.NODE_LOST):  # retryable: send it again
        return APIError(503, f"node {msg.node}: {msg.reason}", type_="service_unavailable")
    return APIError(500, f"node {msg.node}: {msg.reason}", type_="server_error")


@contextlib.asynccontextmanager
async def generation(dispatcher: Dispatcher, plan: Plan, request_id: str, deadline: float,
                     make_choice: Callable[[int, str, list[int]], Choice]):
    """A started Generation, closed on the way out whatever happens."""
    gen = Generation(dispatcher, plan, request_id, deadline, make_choice)
    try:
        await gen.start()
        yield gen
    finally:
        gen.close()
