"""What a prefill or decode node is made of: engine parts, connector, directory entry.

Lifecycle: `NodeRuntime.start(config)` loads the model, allocates the KV pool once,
builds the connector and hands it the pool, binds the zmq work socket, and registers
the node in the directory with a heartbeat. `close()` deregisters, stops the
heartbeat, closes the connector and the socket. The node built on it reports its
queues through `load` (heartbeats carry them) and its metrics into `metrics`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import zmq

from kvwire.connectors import auth
from kvwire.connectors.auth import AuthError
from kvwire.connectors.config import NodeRole
from kvwire.connectors.directory import KVDirectory
from kvwire.connectors.directory_connector import DirectoryConnector
from kvwire.connectors.factory import create_connector
from kvwire.connectors.heartbeat import Heartbeat
from kvwire.connectors.wire import NodeInfo, WireError, unpack
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.gc_pauses import freeze_startup_heap
from kvwire.engine.kv_cache import KVPool
from kvwire.engine.loader import load_model
from kvwire.engine.model import LlamaForCausalLM
from kvwire.engine.model_config import kv_layout
from kvwire.engine.runner import ModelRunner
from kvwire.node.config import NodeConfig
from kvwire.observability.labels import RejectReason
from kvwire.observability.metrics import Metrics, process_metrics
from kvwire.observability.ops_server import OpsServer

log = logging.getLogger(__name__)


class NodeLoad(NamedTuple):
    queue_depth: int  # requests waiting
    running: int  # requests in progress


@dataclass
class NodeRuntime:
    config: NodeConfig
    model: LlamaForCausalLM
    pool: KVPool
    allocator: BlockAllocator
    connector: DirectoryConnector
    runner: ModelRunner
    work_socket: zmq.Socket
    work_address: str
    directory: KVDirectory
    heartbeat: Heartbeat
    rejected_messages: int = 0
    metrics: Metrics = field(default_factory=process_metrics)
    load: Callable[[], NodeLoad] = lambda: NodeLoad(0, 0)  # set by the node built on this runtime

    @classmethod
    def start(cls, config: NodeConfig) -> NodeRuntime:
        eng = config.engine
        if eng.torch_threads:
            torch.set_num_threads(eng.torch_threads)
        model = load_model(eng.model_dir, eng.device)
        connector = create_connector(0, 0, config.connector)
        pool = connector.allocate_kv_pool(kv_layout(model.config, eng.block_size), eng.num_blocks, eng.device)
        allocator = BlockAllocator(eng.num_blocks)
        runner = ModelRunner(model, pool, connector, config.connector.role)
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        if config.work_port:
            sock.bind(f"tcp://{config.host}:{config.work_port}")
            address = f"tcp://{config.host}:{config.work_port}"
        else:
            address = f"tcp://{config.host}:{sock.bind_to_random_port(f'tcp://{config.host}')}"
        directory = KVDirectory(config.connector.redis_url, entry_ttl_s=config.connector.entry_ttl_s,
                                node_ttl_s=config.heartbeat_ttl_s)
        rt = cls(config, model, pool, allocator, connector, runner, sock, address, directory, None)  # type: ignore[arg-type]
        rt.heartbeat = Heartbeat(directory, rt.node_info)
        rt.heartbeat.start()
        log.info("node %s (%s, epoch %d) serving on %s", config.node_id, config.connector.role,
                 connector.epoch, address)
        return rt

    def read_work(self, expect: type | tuple[type, ...]) -> object | None:
        """The next message on the work socket if it is an `expect`; malformed ones are logged and counted."""
        frame = self.work_socket.recv(copy=False)
        try:
            return unpack(frame.buffer, expect=expect)
        except WireError as exc:
            self.rejected_messages += 1
            if not isinstance(exc, AuthError):  # auth counts its own rejections
                self.metrics.messages_rejected.labels(str(RejectReason.MALFORMED)).inc()
            log.warning("node %s: rejected a message on the work socket from peer %s: %s", self.config.node_id,
                        _peer_of(frame), exc)
            return None

    @property
    def max_model_len(self) -> int:
        limit = self.model.config.max_position_embeddings
        return min(self.config.engine.max_model_len or limit, limit)

    def node_info(self) -> NodeInfo:
        load = self.load()
        return NodeInfo(node_id=self.config.node_id, role=NodeRole(self.config.connector.role),
                        epoch=self.connector.epoch, work_address=self.work_address,
                        connector=self.config.connector.kind, free_blocks=self.allocator.num_free,
                        total_blocks=self.allocator.num_blocks, queue_depth=load.queue_depth, running=load.running)

    def is_ready(self) -> bool:
        """Whether the directory lists this incarnation, not draining (its transport is up once `start` has returned).

        Raises:
            DirectoryError: the directory cannot be reached.
        """
        info = self.directory.get_node(self.config.node_id)
        return info is not None and info.epoch == self.connector.epoch and not info.draining

    def close(self) -> None:
        self.heartbeat.stop()
        try:
            self.directory.deregister_node(self.config.node_id)
        except Exception as exc:  # noqa: BLE001 - shutting down; the entry's TTL cleans up
            log.warning("could not deregister %s: %s", self.config.node_id, exc)
        self.runner.close()
        self.connector.close()
        self.directory.close()
        self.work_socket.close(0)


def serve_until_signalled(rt: NodeRuntime, node) -> None:
    """Run `node.serve` on this thread until SIGTERM or SIGINT, then close everything."""
    import signal
    import threading

    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("node %s: signal %d, shutting down", rt.config.node_id, signum)
        stop.set()
        node.wake()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        node.serve(stop)
    finally:
        node.close()
        rt.close()


def _peer_of(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")  # the sender's IP (zmq metadata; tcp transports)
    except (zmq.ZMQError, KeyError):
        return "?"


def run_node(config: NodeConfig, make_node: Callable[[NodeRuntime], object]) -> None:
    """Run a node process: its ops endpoint (when config.http_port is set), runtime and node, until signalled.

    The ops endpoint answers /healthz from the start, while the model loads; /readyz
    turns 200 once the node is built and the directory lists it.
    """
    auth.install(config.auth_secret)  # before any socket opens
    with OpsServer(config.host, config.http_port or None, process_metrics()) as ops:
        rt = NodeRuntime.start(config)
        node = make_node(rt)
        freeze_startup_heap()
        ops.set_ready_check(rt.is_ready)
        serve_until_signalled(rt, node)
