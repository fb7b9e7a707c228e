"""What a prefill or decode node is made of, and how its process runs.

1. `run_node(config, Node)`: the ops endpoint answers /healthz at once, while the node
   builds itself.
2. The node opens its `NodeRuntime`: the model, the directory and this incarnation's
   epoch, the transport, the block allocator, the zmq work socket; a loopback transfer
   tests the transport (connectors/self_test.py: its result goes to /readyz, the
   directory and kvwire_transport_info; a failure keeps the node unregistered and not
   ready). It then builds its
   role (producer or consumer) over a pool, and its runner, passing each what it needs.
3. `warm_up`: a dummy prompt and decode steps through the runner's model and pool, and the
   transfer plane's block copies, on the node's device (engine/warmup.py; unless the config
   says `warmup=False`), leaving the allocator, the pool and the metrics as they were.
4. `start_heartbeat`: start-up's heap is frozen (engine/gc_pauses.py: a full collection, tens
   of ms, that a first request sent at once would otherwise wait out), then the node registers
   in the directory (routers may now pick it); /readyz turns 200 if the self-test passed.
5. `serve_until_signalled`: the node's loop runs until SIGTERM / SIGINT, then drains.
6. `node.close()` stops the role, then `NodeRuntime.close` deregisters and closes the
   directory and the socket. The process exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import zmq

from kvwire.connectors.checkpoint import model_fingerprint
from kvwire.connectors.config import NodeRole
from kvwire.connectors.control import auth
from kvwire.connectors.control.auth import AuthError
from kvwire.connectors.control.framing import unpack
from kvwire.connectors.control.sockets import limit_receive
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.directory.heartbeat import Heartbeat
from kvwire.connectors.factory import create_transport
from kvwire.connectors.self_test import run_self_test
from kvwire.connectors.transports.host import host_identity
from kvwire.connectors.transports.transport import Transport
from kvwire.connectors.wire import AnyMessage, KVLayout, NodeInfo, TransportCheck, WireError
from kvwire.engine.block_allocator import BlockAllocator
from kvwire.engine.gc_pauses import freeze_startup_heap
from kvwire.engine.loader import load_model
from kvwire.engine.model import LlamaForCausalLM
from kvwire.engine.model_config import kv_layout
from kvwire.engine.runner import ModelRunner
from kvwire.engine.warmup import WarmupReport, warm_up
from kvwire.node.config import NodeConfig
from kvwire.observability.labels import RejectReason, TransferFailure
from kvwire.observability.metrics import Metrics, process_metrics
from kvwire.observability.ops_server import OpsServer
from kvwire.observability.tracing import Spans

log = logging.getLogger(__name__)


class NodeLoad(NamedTuple):
    queue_depth: int  # requests waiting
    running: int  # requests in progress
    pulls: int = 0  # a decode node's: pulls that moved a prompt's KV since it started
    recomputed: dict[TransferFailure, int] = {}  # a decode node's: pulls that failed since it started, by reason
    prefix_misses: int = 0  # a decode node's: prompts kept on it as cached-on-decode whose blocks were gone
    settling: int = 0  # a prefill node's: failed pulls whose blocks stay held while their sends may still read them


class Node(Protocol):
    rt: NodeRuntime

    def serve(self, stop: threading.Event) -> None: ...
    def wake(self) -> None: ...
    @property
    def wakeup_fd(self) -> int: ...  # written to wake the loop (Wakeup.write_fd)
    def close(self) -> None: ...


@dataclass
class NodeRuntime:
    config: NodeConfig
    model: LlamaForCausalLM
    directory: KVDirectory
    epoch: int
    transport: Transport
    allocator: BlockAllocator
    work_socket: zmq.Socket
    work_endpoint: str
    load: Callable[[], NodeLoad]  # the node's queues, read by heartbeats (another thread)
    metrics: Metrics = field(default_factory=process_metrics)
    heartbeat: Heartbeat | None = None
    rejected_messages: int = 0
    transport_checks: list[TransportCheck] = field(default_factory=list)  # the start-up self-test's, per transport
    warmup: WarmupReport | None = None  # what `warm_up` did; None until it ran (or with warm-up off)
    kv_ready_endpoint: str = ""  # a decode node's consumer inbox, published with the node ("": none)
    spans: Spans = field(default_factory=Spans)  # the node's OpenTelemetry spans (none without an endpoint)
    model_fingerprint: str = ""  # of its checkpoint (engine/fingerprint.py): in its pool's layout and its NodeInfo

    @classmethod
    def open(cls, config: NodeConfig, load: Callable[[], NodeLoad]) -> NodeRuntime:
        """Load the model, open the directory and take an epoch, create the transport, bind the work socket."""
        eng = config.engine
        if eng.torch_threads:
            torch.set_num_threads(eng.torch_threads)
        model = load_model(eng.model_dir, eng.device)
        fingerprint = model_fingerprint(eng.model_dir)
        directory = KVDirectory(config.connector.redis_url, entry_ttl_s=config.connector.entry_ttl_s,
                                node_ttl_s=config.heartbeat_ttl_s, command_timeout_s=config.redis_timeout_s)
        epoch = directory.first_epoch(config.node_id, config.directory_wait_s)
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        limit_receive(sock)
        try:
            port = config.work_port or sock.bind_to_random_port(f"tcp://{config.host}")
            if config.work_port:
                sock.bind(f"tcp://{config.host}:{port}")
        except zmq.ZMQError as exc:  # the port in use, an address not this host's: an OSError, like the ops port's
            sock.close()
            raise OSError(exc.errno, f"work socket tcp://{config.host}:{config.work_port}: {exc.strerror}") from exc
        endpoint = f"tcp://{config.connector.advertised_host}:{port}"  # what routers connect to
        rt = cls(config, model, directory, epoch, create_transport(config.connector, epoch),
                 BlockAllocator(eng.num_blocks), sock, endpoint, load,
                 spans=Spans.open(f"kvwire-{config.connector.role}", config.traces_endpoint),
                 model_fingerprint=fingerprint)
        rt.transport_checks = run_self_test(config.connector, epoch)
        rt.metrics.report_transport_checks(rt.transport_checks)
        return rt

    @property
    def layout(self) -> KVLayout:
        return kv_layout(self.model.config, self.config.engine.block_size, self.model_fingerprint)

    @property
    def max_model_len(self) -> int:
        limit = self.model.config.max_position_embeddings
        return min(self.config.engine.max_model_len or limit, limit)

    def warm_up(self, runner: ModelRunner) -> None:
        """Warm the engine and the transfer plane on the node's device (engine/warmup.py), unless the config
        says not to; call it before `start_heartbeat`, so that no router picks a cold node.

        Raises:
            Whatever the model raises: a node whose forward fails must not serve.
        """
        if not self.config.warmup:
            return
        self.warmup = warm_up(runner, self.allocator, self.max_model_len)
        log.info("node %s: %s", self.config.node_id, self.warmup.describe())

    def start_heartbeat(self, on_beat: Callable[[], None] = lambda: None,
                        on_restored: Callable[[], None] = lambda: None) -> None:
        """Register the node in the directory (routers may pick it from now on) and keep it there; not when
        the transport self-test failed: the node then serves nobody, and /readyz says why. `on_beat` and
        `on_restored`: the Heartbeat's. Start-up is over: its heap is frozen first (engine/gc_pauses.py), as that
        full collection takes tens of milliseconds, which a first request sent at once would wait out."""
        freeze_startup_heap()
        failed = [c for c in self.transport_checks if not c.ok]
        if failed:
            log.error("node %s: not registering: transport self-test failed: %s", self.config.node_id,
                      "; ".join(f"{c.transport}: {c.reason}" for c in failed))
            return
        self.heartbeat = Heartbeat(self.directory, self.node_info, on_beat=on_beat, on_restored=on_restored)
        self.heartbeat.start()
        log.info("node %s (%s, epoch %d) serving on %s", self.config.node_id, self.config.connector.role,
                 self.epoch, self.work_endpoint)

    def read_work(self, expect: type | tuple[type, ...]) -> AnyMessage | None:
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

    def node_info(self) -> NodeInfo:
        load = self.load()
        return NodeInfo(node_id=self.config.node_id, role=NodeRole(self.config.connector.role), epoch=self.epoch,
                        work_endpoint=self.work_endpoint, connector=self.config.connector.kind,
                        free_blocks=self.allocator.num_free, total_blocks=self.allocator.num_blocks,
                        queue_depth=load.queue_depth, running=load.running, transport_checks=self.transport_checks,
                        pulls=load.pulls, recomputed=load.recomputed, prefix_misses=load.prefix_misses,
                        settling=load.settling,
                        host=host_identity(), pid=os.getpid(), block_size=self.config.engine.block_size,
                        prefix_cache=self.config.engine.prefix_cache,
                        kv_ready_endpoint=self.kv_ready_endpoint, model=self.model_fingerprint,
                        shares_prompts=self.config.connector.role == NodeRole.DECODE)

    def is_ready(self) -> bool:
        """Whether the transport self-test passed and the directory lists this incarnation, not draining.

        Raises:
            DirectoryError: the directory cannot be reached.
        """
        if not all(c.ok for c in self.transport_checks):
            return False
        info = self.directory.get_node(self.config.node_id)
        return info is not None and info.epoch == self.epoch and not info.draining

    def readiness_details(self) -> list[str]:
        """The transport self-test, one line per transport, and the warm-up, for /readyz's body."""
        lines = [f"transport {c.transport}: ok in {c.ms:.1f} ms over {c.path}" if c.ok else
                 f"transport {c.transport}: self-test FAILED after {c.ms:.1f} ms: {c.reason}"
                 for c in self.transport_checks]
        return lines + [self.warmup.describe() if self.warmup is not None else "warm-up: off"]

    def deregister(self) -> None:
        """Leave the directory's node list (routers stop picking the node)."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        try:
            self.directory.deregister_node(self.config.node_id)
        except Exception as exc:  # noqa: BLE001 - shutting down; the entry's TTL cleans up
            log.warning("could not deregister %s: %s", self.config.node_id, exc)

    def close(self) -> None:
        """Close the directory and the work socket (after the node has closed its role); export queued spans."""
        self.directory.close()
        self.work_socket.close(0)
        self.spans.close()


def serve_until_signalled(node: Node) -> None:
    """Run `node.serve` on this thread until SIGTERM or SIGINT, then close it."""
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("node %s: signal %d, shutting down", node.rt.config.node_id, signum)
        stop.set()
        node.wake()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Python runs on_signal on this thread, once it runs Python again; the kernel may hand the signal to any
    # thread, and this one may be asleep in a poll with a long timeout. The wakeup fd ends that sleep.
    previous = signal.set_wakeup_fd(node.wakeup_fd, warn_on_full_buffer=False)
    try:
        node.serve(stop)
    finally:
        signal.set_wakeup_fd(previous)
        node.close()


def _peer_of(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))  # the sender's IP (zmq metadata; tcp transports)
    except (zmq.ZMQError, KeyError):
        return "?"


def run_node(config: NodeConfig, make_node: Callable[[NodeConfig], Node]) -> None:
    """Run a node process: its ops endpoint (when config.http_port is set) and the node, until signalled.

    The ops endpoint answers /healthz from the start, while the model loads; /readyz
    turns 200 once the node is built and the directory lists it.
    """
    auth.install(config.auth_secret)  # before any socket opens
    with OpsServer(config.host, config.http_port or None, process_metrics()) as ops:
        node = make_node(config)  # built, warmed, its heap frozen and registered
        ops.set_ready_check(node.rt.is_ready, node.rt.readiness_details)
        serve_until_signalled(node)
