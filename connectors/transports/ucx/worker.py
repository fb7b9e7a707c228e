"""One UCX context and worker per role (producer, consumer), polled while a transfer is in flight.

Polling, not epoll wake-ups: every rendezvous step needs both workers progressed, and a
wake-up per step cost much of the throughput (docs/BENCHMARKS.md). Between transfers nothing polls
(the owner blocks on its zmq sockets instead); the worker is created without UCX's
wake-up feature, which is why it has no event fd to wait on.

Endpoints are made from the peer's *worker address*, with error handling on (`guarded`) unless
both pools are on CUDA devices of one host (`error_handling`). Guarded, a peer that dies or a link
that breaks fails the transfers on it, never the process: without it a refused or broken TCP
connection aborted the whole process inside UCX (openucx/ucx#11629, SIGABRT in `stubs.c` when a link
went down mid-pull). UCX's shared-memory transports (sysv, posix) take part in error handling only
when told to (`UCX_SYSV_ERROR_HANDLING`, `UCX_POSIX_ERROR_HANDLING`, on here); before kvwire told them,
a guarded endpoint between two processes on one host fell back to loopback TCP, and an unguarded one
carried each big message by a rendezvous over TCP loopback anyway (UCX_PROTO_INFO: "rendezvous
zero-copy fenced write to remote | tcp/lo", three quarters of the cores in the kernel). A host pool's
context asks for UCX's own rendezvous choice above RNDV_THRESH (`_config`): a same-host message then
goes through the shared-memory FIFOs in fragments ("rendezvous fragmented copy-in copy-out |
sysv/memory"), as fast as NIXL's cross-memory-attach READ on kvwire's pool here (0.77 of it on vLLM's,
whose pieces travel packed; docs/BENCHMARKS.md), and only once
the consumer has posted its receive: an eager message nobody had posted for would sit in the
consumer's memory, and one whose producer stopped between fragments would hang the consumer's worker
as it is destroyed (ucxx drains every unexpected message then). Cross-memory attach (`cma`) stays out
unless UCX_TLS says otherwise: unguarded, a read of a producer that died mid-pull was SIGABRT in
`cma_ep.c` (tests/connectors/transports/ucx/test_dead_producer.py), and UCX does not use it for guarded tag
messages at all. Unguarded (two CUDA pools on one host, for `cuda_ipc`: NIXL's guarded endpoints got UCX's
TCP emulation for GPU-to-GPU reads on an H200, and kvwire's device path is not yet measured guarded), UCX does not
notice a dead peer: every wait has a deadline and the directory's
TTLs clean up after it. Both sides must decide alike (UCX refuses an asymmetric pair): the consumer
decides and says so (`PullRequest.guarded`); a producer asked by an older consumer decides from the
consumer's host alone, as both did before.

A consumer may read with several *lanes* (lanes.py): one worker each, each polled
by its own thread, so that one pull's copies run on several cores.
Its published address then packs every lane's worker address, and a producer sends
message i to lane i mod n.

Not thread-safe: one thread at a time uses a worker (the producer's server thread,
or, during a pull, the consumer's engine thread or that lane's thread).
"""

from __future__ import annotations

import enum
import logging
import os
import struct
import time
from collections.abc import Callable

# ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows and warns about at every start.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

from kvwire.connectors.config import MAX_PULL_LANES as MAX_LANES  # noqa: E402
from kvwire.connectors.transports.data_path import DataPath  # noqa: E402
from kvwire.connectors.transports.host import elsewhere  # noqa: E402
from kvwire.connectors.transports.ucx.libucp import force_close  # noqa: E402
from kvwire.connectors.transports.ucx.query import endpoint_transports  # noqa: E402

SEGMENT_BITS = 24  # low tag bits: message index within one transfer, and how it is packed
PACKED_BIT = 1 << (SEGMENT_BITS - 1)  # set in every tag of a packed transfer (packing.py)
DEVICE_PACK_BIT = 1 << (SEGMENT_BITS - 2)  # and this one too where its packs are device-sized (packing.pack_bytes)
MAX_PIECES = DEVICE_PACK_BIT  # messages (and pieces) one transfer may have
Requests = list[tuple[ucx.UCXRequest, Array]]  # posted UCX requests, each with the buffer it must keep alive
LANES_MAGIC = b"kvwire-ucx-lanes\x00"  # starts an address packing several lanes' worker addresses
# A network interface that goes between UCX listing the host's devices (its context) and opening them (its
# worker) fails the worker with "No such device": a container's veth torn down on the host, a test's network
# namespace removed. A new context lists the devices again; the pause doubles from OPEN_PAUSE_S each try.
OPEN_ATTEMPTS = 5
OPEN_PAUSE_S = 0.02

log = logging.getLogger(__name__)


class Role(enum.Enum):
    PRODUCER = "producer"  # a producer's send engine
    CONSUMER = "consumer"  # a consumer's puller


# Rendezvous scheme per side for a device pool: a producer on put_zcopy with a consumer on get_zcopy was the
# fastest pairing measured over UCX-over-TCP (UCX's defaults were the slowest), and as fast as any over
# shared memory / CMA (docs/BENCHMARKS.md). With error handling on UCX has no zero-copy rendezvous over shared
# memory or TCP, and these schemes would leave every big message eager: a host pool's context keeps UCX's
# own choice (fragmented rendezvous) above RNDV_THRESH instead. The environment (UCX_<NAME>) still wins.
_RNDV_SCHEME = {Role.PRODUCER: "put_zcopy", Role.CONSUMER: "get_zcopy"}
# Above one shared-memory FIFO element (8 KiB): no message is ever eager in several fragments (module docstring).
RNDV_THRESH = 8 << 10


# Every transport but cross-memory attach (see the module docstring): a dead peer must fail one pull, never
# abort the process. UCX_TLS in the environment still wins (e.g. "all" for CMA's speed, at that risk).
_TRANSPORTS = "^cma"


# UCX's keepalive off: in UCX 1.21 its periodic round over a worker's endpoints dereferenced the null transport
# endpoint of a guarded endpoint whose peer had failed (SIGSEGV in ucp_ep_do_uct_ep_am_keepalive, uct_ep=0x0, from
# ucp_worker_progress; a consumer after failed pulls: 6 of 6 runs of tests/connectors in one process crashed, 0 of
# 3 with it off). kvwire does not need it to notice a silent peer: every wait has a deadline, a producer's
# heartbeat lapses in the directory (consumer/producer_watch.py), and guarded transports still report a
# connection their kernel saw reset.
_KEEPALIVE = "inf"


def _config(role: Role, device_pool: bool) -> dict[str, str]:
    """UCX settings kvwire picks unless the environment sets them (UCX_<NAME> wins)."""
    ours = {"TLS": _TRANSPORTS, "SYSV_ERROR_HANDLING": "y", "POSIX_ERROR_HANDLING": "y",
            "KEEPALIVE_INTERVAL": _KEEPALIVE}
    if device_pool:
        ours["RNDV_SCHEME"] = _RNDV_SCHEME[role]
    else:
        ours |= {"RNDV_SCHEME": "auto", "RNDV_THRESH": str(RNDV_THRESH)}
    return {k: v for k, v in ours.items() if f"UCX_{k}" not in os.environ}


def error_handling(peer_host: str, device_pool: bool) -> bool:
    """Whether a consumer's endpoints to a producer on `peer_host` (its published host_identity) are guarded:
    always, but between two CUDA pools on one host (module docstring)."""
    return elsewhere(peer_host) or not device_pool


class EndpointClosed(RuntimeError):
    """A flow would post through endpoints that `forget_peer` closed (another pull to that peer failed or was
    abandoned): its pull fails instead."""


class Link:
    """The endpoints to one peer, one per lane of its worker(s), from `UCXWorker.link` until `forget_peer`.

    Flows post through `lane(i)`, never through an endpoint they kept: once closed, an endpoint's UCP handle may
    be freed memory. ucxx keeps the handle of a failed endpoint that kvwire force-closed (libucp.py), and a send
    posted through it was a use after free (SIGSEGV, tests/connectors/transports/ucx/test_endpoint_close.py): a
    second pull to the same consumer still held it after the first pull's failure closed it.
    """

    def __init__(self, endpoints: list[ucx.UCXEndpoint]) -> None:
        self.endpoints = endpoints
        self.closed = False

    @property
    def failed(self) -> bool:
        """An endpoint's peer failed (UCX's error callback ran: it died, or its link broke)."""
        return not all(ep.alive for ep in self.endpoints)

    def check(self) -> None:
        """Raises EndpointClosed once `forget_peer` closed this link."""
        if self.closed:
            raise EndpointClosed("the endpoints to this peer were closed after another pull to it failed or was "
                                 "abandoned")

    def lane(self, index: int) -> ucx.UCXEndpoint:
        """The endpoint for message `index` (lane index mod n). Raises EndpointClosed once the link is closed."""
        self.check()
        return self.endpoints[index % len(self.endpoints)]


class UCXWorker:
    def __init__(self, role: Role, device_pool: bool = False) -> None:
        """`device_pool`: the KV it moves is in CUDA memory (its context's rendezvous scheme: `_config`)."""
        self._ctx, self._worker = open_worker(_config(role, device_pool))
        # a peer's (packed) address, and whether error handling is on -> one endpoint per lane
        self._links: dict[tuple[bytes, bool], Link] = {}
        self._paths: dict[bytes, DataPath] = {}  # what UCX selected for those endpoints: fixed for their life
        self._parked: list[tuple[Link, float]] = []  # guarded links out of use, each closed by then at the latest
        self.address: bytes = self._worker.address.tobytes()

    def progress(self) -> bool:
        """Progress until nothing more happens; returns whether anything did (a spinning caller naps when
        nothing has for a while: connectors/spin.py)."""
        if not self._worker.progress_once():
            return False
        self._worker.progress()
        return True

    def abandon(self, peer: bytes) -> None:
        """Cancel every receive posted for `peer` (after a failure): none of them can land late."""
        self.forget_peer(peer)  # a guarded endpoint's close cancels its requests; an unguarded one's schedules them
        self._worker.cancel_inflight_requests()
        self._worker.progress()

    def forget_peer(self, peer: bytes) -> None:
        """Close every endpoint to `peer`, each once (`close_endpoint`)."""
        self._paths.pop(peer, None)
        for guarded in (False, True):
            link = self._links.pop((peer, guarded), None)
            if link is not None:
                self._close(link, guarded)

    def park(self, peer: bytes, until: float) -> bool:
        """Take the endpoints to `peer` out of use as `forget_peer` does, but leave guarded ones over TCP open
        until `close_parked` finds them failed, idle, or past `until` (time.monotonic()). Returns whether it
        parked them (others are closed now: over shared memory a peer that dies is not noticed with UCX's
        keepalive off, and nothing there needs it).

        For a pull abandoned with its sends in flight. Force-closing a guarded endpoint while part of a message
        is stuck in its TCP endpoint (the link is down) leaves UCX 1.21 discarding it, waiting on a flush; once
        the link heals and the peer's socket closes, UCX destroys it inside its read handler and then runs its
        write handler through the freed endpoint (the prefill node's SIGSEGV or SIGABRT in README's Known
        limits). Left open, the endpoint fails the ordinary way when the peer's socket closes, or its sends
        complete; either way nothing is stuck in it when it is closed.
        """
        if (peer, True) not in self._links or "tcp" not in self.path_to(peer).transports:
            self.forget_peer(peer)
            return False
        link = self._links.pop((peer, True))
        link.closed = True  # no flow posts through it from now on
        self._parked.append((link, until))
        self.forget_peer(peer)  # an unguarded link closes now (its close does not force)
        return True

    def close_parked(self, now: float, busy: Callable[[Link], bool]) -> int:
        """Close each parked link whose peer failed, that carries nothing in flight (`busy` false), or whose
        time is up (then with its sends stuck, as `forget_peer` would: logged). Returns how many stay parked."""
        parked, self._parked = self._parked, []
        for link, until in parked:
            if link.failed or not busy(link):
                self._close(link, True)
            elif now >= until:
                log.warning("UCX: closing endpoints whose sends were still in flight at the end of their drain")
                self._close(link, True)
            else:
                self._parked.append((link, until))
        return len(self._parked)

    def _close(self, link: Link, guarded: bool) -> None:
        link.closed = True  # before closing: no flow posts through these endpoints from now on
        for ep in link.endpoints:
            close_endpoint(ep, guarded, self._worker.progress)

    def forget_failed(self, peer: bytes) -> bool:
        """`forget_peer(peer)` if an endpoint to it has failed (UCX's error callback ran); returns whether."""
        link = self._links.get((peer, True))
        if link is None or not link.failed:
            return False
        self.forget_peer(peer)
        return True

    def forget_all_failed(self) -> int:
        """`forget_failed` for every peer: close each link with an endpoint whose peer failed, a consumer's worker
        that was fenced or died after its last pull from here (else one failed UCP endpoint stays open per such
        worker, for the life of the process). Returns how many links were closed."""
        failed = [peer for (peer, guarded), link in self._links.items() if guarded and link.failed]
        for peer in failed:
            self.forget_peer(peer)
        return len(failed)

    def close(self) -> None:
        for peer, _ in list(self._links):
            self.forget_peer(peer)
        self.close_parked(float("inf"), lambda link: False)

    def link(self, peer: bytes, guarded: bool = True) -> Link:
        """One endpoint per lane of the worker(s) at `peer` (made once, kept until `forget_peer` closes them).

        Args:
            guarded: endpoint error handling on (`error_handling`, the module docstring).
        Raises:
            ValueError: `peer` is not a well-formed address.
        """
        link = self._links.get((peer, guarded))
        if link is None:
            link = Link([ucx.UCXEndpoint.create_from_worker_address(
                self._worker, ucx.UCXAddress.create_from_buffer(a), guarded) for a in unpack_lanes(peer)])
            self._links[(peer, guarded)] = link
        return link

    def path_to(self, peer: bytes, guarded: bool = True) -> DataPath:
        """The transports UCX selected for the endpoints to `peer` (made now if need be: UCX picks its
        lanes when an endpoint is made from a worker address, so one query per endpoint's life); unknown, with
        the reason, if it cannot say."""
        path = self._paths.get(peer)
        if path is not None:
            return path
        try:
            path = DataPath.of([name for ep in self.link(peer, guarded).endpoints
                                for name, _ in endpoint_transports(ep.handle)])
        except Exception as exc:  # noqa: BLE001 - QueryUnavailable, a bad address, UCX's own errors: all "unknown"
            return DataPath.unknown(str(exc))
        self._paths[peer] = path
        return path


def close_endpoint(ep: ucx.UCXEndpoint, guarded: bool, progress: Callable[[], object]) -> None:
    """Close `ep` once, never leaving its requests in flight where UCX can tell a dead peer, nor a failed
    endpoint open.

    Guarded and failed (UCX's error callback ran: its peer died, its link broke): ucxx would leave the UCP
    endpoint open (libucp.py), so kvwire force-closes it itself, progressing the worker with `progress` until
    the close completes. Guarded and healthy: ucxx's blocking close cancels the endpoint's requests (each then
    completes, cancelled, on the next progress) and force-closes it, a local step with no round trip to the
    peer. ucxx's non-blocking `close()` is never used on a guarded endpoint: on one that is closing already it
    returns a request wrapper around a null pointer whose deallocation dereferences it (SIGSEGV,
    tests/connectors/transports/ucx/test_endpoint_close.py), and it left a send on the endpoint in flight for
    good. Unguarded (two CUDA pools of one host): the non-blocking close, since a blocking one flushes, and a
    flush to a dead peer would never end.
    """
    if not guarded:
        ep.close()
        return
    failed = not ep.alive  # read before close_blocking, which marks a healthy endpoint closed too
    ep.close_blocking()
    if failed and ep.handle:
        status = force_close(ep.handle, progress)
        if status != 0:
            log.warning("UCX: closing a failed endpoint returned status %d", status)


def open_worker(config: dict[str, str], attempts: int = OPEN_ATTEMPTS,
                pause_s: float = OPEN_PAUSE_S) -> tuple[ucx.UCXContext, ucx.UCXWorker]:
    """A UCX context with `config` and its worker, listing the host's devices again while one of them vanishes
    before the worker opens it (OPEN_ATTEMPTS).

    Raises:
        UCXNoDeviceError: the context found no usable device (UCX_TLS naming none here: at once), or the worker
            failed to open one `attempts` times.
    """
    for attempt in range(1, attempts + 1):
        ctx = ucx.UCXContext(config_dict=config, feature_flags=(ucx.Feature.TAG,))
        try:
            return ctx, ucx.UCXWorker(ctx)
        except ucx.UCXNoDeviceError as exc:
            if attempt == attempts:
                raise ucx.UCXNoDeviceError(f"UCX could not open this host's network devices in {attempts} tries "
                                           f"(one vanished each time): {exc}") from exc
            log.warning("UCX: a network device vanished while the worker opened it (%s); listing them again", exc)
            time.sleep(pause_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def pack_lanes(addresses: list[bytes]) -> bytes:
    """One address for a consumer's lanes: a lone worker address as it is, several packed."""
    if len(addresses) == 1:
        return addresses[0]
    return LANES_MAGIC + b"".join(struct.pack("!I", len(a)) + a for a in addresses)


def unpack_lanes(address: bytes) -> list[bytes]:
    """The worker addresses `pack_lanes` packed. Raises ValueError on a malformed packing."""
    if not address.startswith(LANES_MAGIC):
        return [address]
    out, pos = [], len(LANES_MAGIC)
    while pos < len(address):
        if pos + 4 > len(address):
            raise ValueError("truncated lane address")
        (n,), pos = struct.unpack_from("!I", address, pos), pos + 4
        if n == 0 or pos + n > len(address):
            raise ValueError("truncated lane address")
        out.append(address[pos:pos + n])
        pos += n
    if not 1 <= len(out) <= MAX_LANES:
        raise ValueError(f"{len(out)} lanes (1..{MAX_LANES} allowed)")
    return out


def tag_of(transfer_id: int, index: int, packed: bool, device_packs: bool = False) -> int:
    """The tag of message `index` of a transfer (a lane's messages are those with index mod lanes = lane);
    `packed`: the transfer packs small pieces, `device_packs`: into device-sized packs."""
    flags = (PACKED_BIT if packed else 0) | (DEVICE_PACK_BIT if device_packs else 0)
    return (transfer_id << SEGMENT_BITS) | flags | index


def all_done(requests: Requests) -> bool:
    # newest first: while a transfer runs, its last piece is the likeliest unfinished, so a poll costs one call
    return all(req.completed for req, _ in reversed(requests))


def check_errors(requests: Requests) -> None:
    """Raise the first UCX error among completed requests."""
    for req, _ in requests:
        req.check_error()
