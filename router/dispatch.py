"""Sends work to nodes and routes their answers back to waiting HTTP requests.

Lifecycle: `start()` binds the zmq PULL socket that decode nodes answer to and starts
the task that reads it; `submit()` picks a live prefill and decode node from the
directory, registers a queue for the request, and pushes `PrefillWork` and
`DecodeWork` at once (decode waits for the KV while prefill computes); the HTTP
handler consumes the queue; `close()` stops it all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from connectors.config import NodeRole
from connectors.directory import DirectoryError, KVDirectory
from connectors.wire import (DecodeWork, NodeInfo, PrefillWork, SamplingParams, TokenChunk, WireError,
                             WorkError, pack, unpack)
from router.schemas import APIError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    prefill: NodeInfo | None  # None: no live prefill node, decode computes the prompt
    decode: NodeInfo


class Dispatcher:
    def __init__(self, directory: KVDirectory, host: str):
        self._directory = directory
        self._ctx = zmq.asyncio.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        self.reply_to = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}"
        self._pushes: dict[str, zmq.asyncio.Socket] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._rr = itertools.count()
        self._reader: asyncio.Task | None = None
        self.rejected_messages = 0

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_replies())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for sock in self._pushes.values():
            sock.close(0)
        self._pull.close(0)

    def live_nodes(self, role: NodeRole) -> list[NodeInfo]:
        try:
            return self._directory.live_nodes(role)
        except DirectoryError as exc:
            raise APIError(503, f"directory unavailable: {exc}", type_="service_unavailable") from None

    def pick(self) -> Route:
        """Choose the prefill and decode node with the most free blocks (round robin on ties).

        Without a live decode node nothing can be served (503); without a live prefill
        node the decode node computes the prompt itself.
        """
        decode = self._least_loaded(self.live_nodes(NodeRole.DECODE))
        if decode is None:
            raise APIError(503, "no live decode node", type_="service_unavailable")
        return Route(self._least_loaded(self.live_nodes(NodeRole.PREFILL)), decode)

    def _least_loaded(self, nodes: list[NodeInfo]) -> NodeInfo | None:
        if not nodes:
            return None
        turn = next(self._rr)
        return max(enumerate(nodes), key=lambda p: (p[1].free_blocks, (p[0] + turn) % len(nodes)))[1]

    async def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> tuple[Route, asyncio.Queue]:
        route = await asyncio.to_thread(self.pick)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if route.prefill is not None:
            await self._push(route.prefill, PrefillWork(request_id=request_id, prompt_token_ids=prompt_ids))
        else:
            log.warning("request %s: no live prefill node; decode computes the prompt", request_id)
        await self._push(route.decode, DecodeWork(request_id=request_id, prompt_token_ids=prompt_ids,
                                                  sampling=sampling, reply_to=self.reply_to,
                                                  prefill_node=route.prefill.node_id if route.prefill else ""))
        return route, queue

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _push(self, node: NodeInfo, msg) -> None:
        sock = self._pushes.get(node.work_address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(node.work_address)
            self._pushes[node.work_address] = sock
        await sock.send(pack(msg))

    async def _read_replies(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                msg = unpack(data, expect=(TokenChunk, WorkError))
            except WireError as exc:
                self.rejected_messages += 1
                log.warning("reply socket: rejected message: %s", exc)
                continue
            queue = self._queues.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)
