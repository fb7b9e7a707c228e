"""Continuous batching over the model runner.

A request here:

1. `add_request` validates it and puts it in the waiting queue.
2. `step()` admits waiting requests while their blocks fit (blocks for the prompt plus
   max_tokens are reserved up front, so a running request never runs out). With the prefix cache on,
   a prompt starts on the cached blocks of its longest computed prefix (always leaving its last token):
   only the rest is computed, or pulled when the connector receives tails (a pull writes past them).
3. Its prompt is computed, or its KV received: within the step when nothing else runs
   (no thread hand-off on the way to its first token); otherwise on the runner's pull
   thread (`receiving`) while steps go on decoding the others; the pull's end wakes the
   owner's loop (`wakeup`) and a later step takes it (bypassed, or computed then). A request's later
   choice (n > 1) starts from its first choice's prompt KV instead (`prompt_of`, engine/shared_prompts.py),
   its first token in the step of the first choice's (or, when its own blocks do not fit yet, before any
   waiting request is admitted).
4. Its first token is sampled; every later step decodes one more token for it, until EOS (unless
   ignore_eos) or one of stop_token_ids (reason "stop", never before min_tokens), or max_tokens ("length").
5. Finished or aborted, its blocks are freed at once, unless a pull may still be
   writing them: then when the pull ends. With the prefix cache on, every full block whose KV it
   computed or received (prompt, then answer) stays cached under its prefix's name once the prompt is
   done, and once it finishes, for a later prompt that continues it (the next turn of a conversation).
"""

from __future__ import annotations

import math
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvwire.connectors.model_input import ModelInput, SequenceInput
from kvwire.connectors.wakeup import Wakeup
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.block_names import block_names, cacheable
from kvwire.engine.outputs import ModelRunnerOutput
from kvwire.engine.runner import ModelRunner
from kvwire.engine.sampler import TokenHistory, make_generator, sample
from kvwire.engine.sequence import FinishReason, Sequence
from kvwire.engine.shared_prompts import SharedPrompts
from kvwire.engine.validation import check_params, prompt_problem
from kvwire.protocol.work import SamplingParams, TokenLogprobs


class InvalidRequest(ValueError):
    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id}: {reason}")
        self.request_id = request_id


@dataclass(frozen=True)
class StepOutput:
    sequence: Sequence
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token when params.logprobs is set


class LLMEngine:
    def __init__(self, runner: ModelRunner, allocator: BlockAllocator, max_model_len: int,
                 eos_token_id: int | None = None, wakeup: Wakeup | None = None, prefix_cache: bool = False):
        """Args:
        wakeup: woken, from the runner's pull thread, as each pull ends (the owner's loop waits on its fd).
        prefix_cache: keep computed blocks and start prompts on their cached prefix (module docstring).
        """
        self._runner = runner  # the engine's alone: its owner asks the engine
        self.allocator = allocator
        self.block_size = runner.pool.layout.block_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.receiving: dict[str, tuple[Sequence, Future]] = {}  # admitted, KV being pulled on the pull thread
        self._wakeup = wakeup
        self.prefix_cache = prefix_cache
        self.shared = SharedPrompts(allocator, self.block_size)  # later choices waiting on a first one's prompt

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    receive_kv: bool = True, prompt_of: str = "") -> Sequence:
        """Queue a request. Raises InvalidRequest when it can never run.

        Args:
            receive_kv: whether a decode-role runner should ask the connector for the
                prompt's KV (False when no prefill node is computing it).
            prompt_of: a request with the same prompt whose prompt is not done yet (`prompt_pending`, or one the
                caller adds later): this one starts from its prompt KV (engine/shared_prompts.py), unless that
                one ends first (then it computes the prompt).
        """
        self.validate(request_id, prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), params, make_generator(params.seed),
                       receive_kv=receive_kv and not prompt_of,
                       history=TokenHistory.start(prompt_ids, params, self.vocab_size, self.eos_token_id))
        if prompt_of:
            self.shared.add(seq, prompt_of)
        else:
            self.waiting.append(seq)
        return seq

    def prompt_pending(self, request_id: str) -> bool:
        """Whether `request_id` is here and its prompt is not done yet (a later choice can still start from it)."""
        return any(s.request_id == request_id for s in [*self.waiting, *(s for s, _ in self.receiving.values())])

    def after_step(self, idle: bool = False) -> None:
        """The step's outputs are out (`idle`: and nothing is left to do): the connector's deferred work (a
        consumer's read notes) runs now."""
        self._runner.after_step(idle)

    def close(self) -> None:
        """Stop the runner's pull thread (a pull in progress ends on its own)."""
        self._runner.close()

    @property
    def vocab_size(self) -> int:
        return self._runner.model.config.vocab_size

    def validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequest when the request can never run: bad prompt or sampling params, too long,
        or more blocks than the pool has."""
        if params.max_tokens < 1:
            raise InvalidRequest(request_id, "max_tokens must be at least 1")
        try:
            check_params(params)
        except ValueError as exc:
            raise InvalidRequest(request_id, str(exc)) from None
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequest(request_id, f"stop_token_ids must be in [0, {self.vocab_size})")
        problem = prompt_problem(prompt_ids, self.vocab_size, self.max_model_len, params.max_tokens)
        if problem:
            raise InvalidRequest(request_id, problem)
        if self._blocks_needed(len(prompt_ids), params) > self.allocator.num_blocks:
            raise InvalidRequest(request_id, "request needs more KV blocks than the pool has")

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed now, or when its pull ends if one is writing them."""
        for seq in [*self.waiting, *self.running, *(s for s, _ in self.receiving.values())]:
            if seq.request_id == request_id:
                seq.finish_reason = FinishReason.ABORT
        self.waiting = deque(s for s in self.waiting if not s.finished)
        self.shared.abort(request_id)
        self.waiting.extend(self.shared.orphans(request_id))  # its prompt never came: they compute it
        self._reap()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.receiving or len(self.shared))

    def can_step(self) -> bool:
        """Whether `step()` has anything to do now (else wait for new work or a pull ending: `wakeup`)."""
        return bool(self.running or any(f.done() for _, f in self.receiving.values())
                    or (self.waiting and not self.shared.ready and self._fits(self.waiting[0]))
                    or (self.shared.ready and self._fits(self.shared.ready[0].seq, shared=True)))

    @property
    def unfinished(self) -> list[Sequence]:
        return [*self.running, *self.waiting, *(s for s, _ in self.receiving.values()), *self.shared.sequences]

    def step(self) -> list[StepOutput]:
        """Admit what fits and compute (or receive) their prompts, or else decode one token for every running
        request. A step with prompts stops there: their first tokens go out before another forward runs."""
        outputs: dict[str, StepOutput] = {}
        start = time.monotonic()
        for seq, received in self._received():
            outputs[seq.request_id] = StepOutput(seq, [self._prefill(seq, received)])
        for seq, token in self._start_shared():  # before any new request: theirs is admitted already
            outputs[seq.request_id] = StepOutput(seq, [token])
        admitted = self._admit()
        for seq in admitted:
            seq.metrics.scheduler_time += time.monotonic() - start
            outputs[seq.request_id] = StepOutput(seq, [self._prefill(seq)])
        for seq, token in self._start_shared():  # those of the prompts just done: in the same step
            outputs[seq.request_id] = StepOutput(seq, [token])
        decoding = [] if outputs else [s for s in self.running if not s.finished]
        if decoding:
            result = self._decode(decoding)
            for seq in decoding:
                token = result.sampled_token_ids[result.req_id_to_index[seq.request_id]][0]
                outputs.setdefault(seq.request_id, StepOutput(seq, [])).new_token_ids.append(token)
        self._reap()
        return [self._with_logprobs(out) for out in outputs.values()]

    @staticmethod
    def _with_logprobs(out: StepOutput) -> StepOutput:
        """The step's output with its tokens' logprobs, when the request asked for them."""
        seq, n = out.sequence, len(out.new_token_ids)
        if seq.params.logprobs is None or n == 0:
            return out
        return StepOutput(seq, out.new_token_ids, seq.logprobs[-n:])

    def _blocks_needed(self, prompt_len: int, params: SamplingParams) -> int:
        return math.ceil(min(prompt_len + params.max_tokens, self.max_model_len) / self.block_size)

    def _fits(self, seq: Sequence, shared: bool = False) -> bool:
        """Whether `seq`'s blocks fit now (`shared`: a later choice, whose full prompt blocks are its leader's)."""
        held = len(seq.prompt_ids) // self.block_size if shared else 0
        return self._blocks_needed(len(seq.prompt_ids), seq.params) - held <= self.allocator.num_free

    def _start_shared(self) -> list[tuple[Sequence, int]]:
        """Start the later choices whose leader's prompt is done, while their blocks fit (engine/shared_prompts.py);
        each with its first token."""
        started = []
        while self.shared.ready and self._fits(self.shared.ready[0].seq, shared=True):
            ready = self.shared.started()
            seq, full = ready.seq, len(ready.seq.prompt_ids) // self.block_size
            fresh = self.allocator.allocate(self._blocks_needed(len(seq.prompt_ids), seq.params) - full)
            if len(ready.prompt_blocks) > full:  # the leader's partial last block: this one's own copy
                self._runner.copy_block(ready.prompt_blocks[full], fresh[0])
            self.allocator.free(ready.prompt_blocks[full:])
            seq.block_ids = ready.prompt_blocks[:full] + fresh
            seq.bypassed, seq.prompt_shared = ready.bypassed, True
            seq.metrics.mark_scheduled(time.monotonic())
            self.running.append(seq)
            started.append((seq, self._sample(seq, ready.logits.clone())))
            seq.metrics.mark_first_token(time.monotonic())
        return started

    def _admit(self) -> list[Sequence]:
        """Admit waiting requests while their blocks fit (none while a later choice waits for its own: it came
        first); those whose KV is pulled asynchronously start their pull and wait in `receiving`. Returns the ones
        to compute (or receive) in this step."""
        admitted = []
        inline = not self.running and not self.receiving  # the whole step's pulls on one thread, never two at once
        while self.waiting and not self.shared.ready and self._fits(self.waiting[0]):
            seq = self.waiting.popleft()
            self._allocate(seq)
            seq.metrics.mark_scheduled(time.monotonic())
            if seq.receive_kv and self._runner.receives_async and not inline:
                received = self._runner.start_receive(self._prompt_input(seq))
                self.receiving[seq.request_id] = (seq, received)
                if self._wakeup is not None:
                    received.add_done_callback(self._wake)
                continue
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _allocate(self, seq: Sequence) -> None:
        """Give `seq` its blocks: those of its cached prefix first (unless its KV is pulled whole), then fresh ones."""
        cached: list[int] = []
        if self.prefix_cache and not (seq.receive_kv and self._runner.pulls_whole_prompts):  # a pull writes after
            usable = cacheable(len(seq.prompt_ids), self.block_size) // self.block_size
            cached = self.allocator.share(block_names(seq.prompt_ids[:usable * self.block_size], self.block_size))
        needed = self._blocks_needed(len(seq.prompt_ids), seq.params)
        seq.block_ids = cached + self.allocator.allocate(needed - len(cached))  # fits: _fits counted idle blocks
        seq.num_cached_tokens = len(cached) * self.block_size

    def _cache(self, seq: Sequence, tokens: list[int]) -> None:
        """Name the full blocks of `tokens` (those of `seq` whose KV is written) for later prompts."""
        if self.prefix_cache:
            for block, name in zip(seq.block_ids, block_names(tokens, self.block_size)):
                self.allocator.name(block, name)

    def _wake(self, _: Future) -> None:
        """A pull ended (the pull thread): wake the owner's loop (registered only where there is a wakeup)."""
        assert self._wakeup is not None
        self._wakeup.wake()

    def _received(self) -> list[tuple[Sequence, Future]]:
        """Requests whose pull has ended, now running; aborted ones are dropped and their blocks freed."""
        done = [(rid, seq, f) for rid, (seq, f) in self.receiving.items() if f.done()]
        out = []
        for rid, seq, received in done:
            del self.receiving[rid]
            self.running.append(seq)  # an aborted one is reaped (blocks freed) at the end of the step
            if not seq.finished:
                out.append((seq, received))
        return out

    @staticmethod
    def _prompt_input(seq: Sequence) -> ModelInput:
        """The prompt's tokens past its cached prefix (all of them without one; a tail names its whole prompt)."""
        start = seq.num_cached_tokens
        return ModelInput([SequenceInput(seq.request_id, seq.prompt_ids[start:], start, seq.block_ids,
                                         prompt_ids=seq.prompt_ids if start else None)], is_prompt=True)

    def _prefill(self, seq: Sequence, received: Future | None = None) -> int:
        """Compute (or receive, or take the ended pull of) a prompt and sample its first token."""
        batch = self._prompt_input(seq)
        start = time.monotonic()
        if received is not None:
            result = self._runner.finish_prompt(batch, received)
        else:
            result = self._runner.run_prompt(batch, receive_kv=seq.receive_kv)
        seq.bypassed = result.bypassed
        self._cache(seq, seq.prompt_ids)
        seq.metrics.model_forward_time += result.forward_s
        logits = self._runner.logits(result.last_hidden)[0]  # [vocab]
        if self.shared.has_choices(seq.request_id):
            self.shared.prompt_done(seq, logits.clone())
        token = self._sample(seq, logits)
        seq.metrics.model_execute_time += time.monotonic() - start
        seq.metrics.mark_first_token(time.monotonic())
        return token

    def _decode(self, seqs: list[Sequence]) -> ModelRunnerOutput:
        batch = ModelInput(
            [SequenceInput(s.request_id, [s.last_token], s.num_tokens - 1, s.block_ids) for s in seqs],
            is_prompt=False)
        start = time.monotonic()
        hidden = self._runner.run_decode(batch)  # [B, hidden]
        forward = time.monotonic() - start
        logits = self._runner.logits(hidden)  # [B, vocab]
        tokens = [self._sample(seq, logits[i]) for i, seq in enumerate(seqs)]
        execute = time.monotonic() - start
        for seq in seqs:
            seq.metrics.model_forward_time += forward
            seq.metrics.model_execute_time += execute
        return ModelRunnerOutput.from_tokens(batch.request_ids, tokens)

    def _sample(self, seq: Sequence, logits) -> int:
        token, logprobs = sample(logits, seq.params, seq.generator, seq.history)
        seq.history.record(token)
        seq.output_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if self._is_stop(seq, token):
            seq.finish_reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        return token

    def _is_stop(self, seq: Sequence, token: int) -> bool:
        """Whether token, just appended, ends seq: EOS (unless ignore_eos) or a stop id, from min_tokens on."""
        params = seq.params
        if len(seq.output_ids) <= params.min_tokens:  # sampled while min_tokens banned EOS and the stop ids
            return False  # so only a row with nothing else left could have picked one
        is_eos = self.eos_token_id is not None and token == self.eos_token_id and not params.ignore_eos
        return is_eos or token in params.stop_token_ids

    def _reap(self) -> None:
        for seq in [s for s in self.running if s.finished]:
            if seq.finish_reason != FinishReason.ABORT:
                self._cache(seq, (seq.prompt_ids + seq.output_ids)[:-1])  # the last token's KV was never written
            self.allocator.free(seq.block_ids)
            seq.block_ids = []
            seq.metrics.finished_time = time.monotonic()
        self.running = [s for s in self.running if not s.finished]
