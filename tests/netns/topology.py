"""Two "hosts" on one machine: network namespaces joined by veth pairs, and the faults cut into them.

Layout (X, Y, D: three /24s of 10.213.0.0/16 picked per session so parallel runs do not meet):

    root namespace (test, Redis, router)
      │ 10.213.X.1 (router) + .254 (Redis)      │ 10.213.Y.1 + .254 (Redis)
      │ ctl link A                              │ ctl link B
    namespace A ("prefill host")  ───data───  namespace B ("decode host")
      10.213.X.2 on its ctl link   10.213.D.1 | 10.213.D.2   10.213.Y.2 on its ctl link

Each node publishes one address (its ctl link's). Router and Redis traffic runs over
the ctl links; KV traffic between A and B runs over the direct data veth: by a /32
route in each namespace to the other's ctl address (TCP, NCCL/Gloo and the zmq side
channel connect to published addresses), and over the data subnet itself for UCX,
which picks its own interfaces and only uses one whose route reaches the peer (an
interface without an address is none of its). Behind each /32 route sits a
blackhole route of a higher metric, so when the data link is down nothing leaks round
through the root namespace (whatever its ip_forward says): packets just vanish, as on
a cut cable. Faults:

- `data_link(False)`: `ip link set` the data veth down (A's end; B's end loses carrier);
  `data_link(True)` brings it up and puts the /32 routes back (the kernel drops routes
  through an interface set down).
- `redis_link(ns, False)`: a blackhole rule in the root namespace for what Redis (.254)
  sends to that namespace, so the node's Redis path goes silent while the router (.1)
  and the data link work on.

Each namespace gets an /etc/netns/<name>/resolv.conf (ip-netns(8) mounts it over
/etc/resolv.conf for what it runs) naming a resolver on its own loopback: the host's
resolver is out of reach from a namespace, and c10d's TCPStore client looks its peer's
name up on connect, which would otherwise stall past its timeout (NCCL/Gloo). Nothing
listens there, so a lookup fails at once.

Lifecycle: `Topology.create()` builds everything or removes what it built and raises
`NetnsUnavailable` (the caller skips); `remove()` deletes the namespaces (and with them
every veth and address; the root ends of the veths go with their peers).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "10.213"
NETNS_ETC = Path("/etc/netns")
MAX_SLOTS = 80  # 10.213.0.0 - 10.213.239.255, three /24s a slot


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ip(8), or the kernel refused)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


@dataclass(frozen=True)
class Namespace:
    name: str
    address: str  # the node's one address (on its ctl link)
    gateway: str  # the root namespace's end of the ctl link (the router listens here on A's)
    redis_address: str  # where this namespace reaches Redis
    ctl: str  # veth name inside the namespace
    data: str  # data veth name inside the namespace

    def exec_prefix(self) -> list[str]:
        """Run a command in this namespace, in an IPC namespace of its own (as a pod would)."""
        return ["ip", "netns", "exec", self.name, "unshare", "--ipc"]


@dataclass
class Topology:
    tag: str
    a: Namespace
    b: Namespace
    router_host: str
    data_subnet: str  # first three octets; A is .1, B is .2

    @classmethod
    def create(cls) -> Topology:
        """Build the namespaces and links.

        Raises:
            NetnsUnavailable: not root, no ip(8) or unshare(1), or the kernel refused; nothing is left behind.
        """
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
            raise NetnsUnavailable("network namespaces need root, ip(8) and unshare(1)")
        slot = _free_slot()
        tag = f"kw{os.getpid() % 100000}"
        x, y = f"{PREFIX}.{3 * slot}", f"{PREFIX}.{3 * slot + 1}"
        a = Namespace(f"{tag}-a", f"{x}.2", f"{x}.1", f"{x}.254", f"{tag}ar", f"{tag}ab")
        b = Namespace(f"{tag}-b", f"{y}.2", f"{y}.1", f"{y}.254", f"{tag}br", f"{tag}ba")
        topo = cls(tag, a, b, router_host=a.gateway, data_subnet=f"{PREFIX}.{3 * slot + 2}")
        try:
            topo._build()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            topo.remove()
            raise NetnsUnavailable(f"could not build network namespaces: {exc}") from exc
        return topo

    def _build(self) -> None:
        for ns, root_end in ((self.a, f"{self.tag}ra"), (self.b, f"{self.tag}rb")):
            ip("netns", "add", ns.name)
            etc = NETNS_ETC / ns.name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text("# kvwire test namespace: no DNS\nnameserver 127.0.0.1\n"
                                             "options timeout:1 attempts:1\n")
            ip("link", "add", root_end, "type", "veth", "peer", "name", ns.ctl, "netns", ns.name)
            ip("addr", "add", f"{ns.gateway}/24", "dev", root_end)
            ip("addr", "add", f"{ns.redis_address}/24", "dev", root_end)
            ip("link", "set", root_end, "up")
            ip("-n", ns.name, "link", "set", "lo", "up")
            ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", ns.ctl)
            ip("-n", ns.name, "link", "set", ns.ctl, "up")
            ip("-n", ns.name, "route", "add", "default", "via", ns.gateway)
        ip("-n", self.a.name, "link", "add", self.a.data, "type", "veth", "peer", "name", self.b.data,
           "netns", self.b.name)
        for i, (ns, peer) in enumerate(((self.a, self.b), (self.b, self.a)), start=1):
            ip("-n", ns.name, "addr", "add", f"{self.data_subnet}.{i}/24", "dev", ns.data)
            ip("-n", ns.name, "route", "add", "blackhole", f"{peer.address}/32", "metric", "1000")
        self.data_link(True)

    def data_link(self, up: bool) -> None:
        """Bring the A-B data link up (with its routes) or down."""
        if not up:
            ip("-n", self.a.name, "link", "set", self.a.data, "down")
            return
        for ns in (self.a, self.b):
            ip("-n", ns.name, "link", "set", ns.data, "up")
        for ns, peer in ((self.a, self.b), (self.b, self.a)):
            ip("-n", ns.name, "route", "replace", f"{peer.address}/32", "dev", ns.data, "src", ns.address)

    def shape_data(self, rate: str | None) -> bool:
        """Limit the data link to `rate` (tc tbf, e.g. "50mbit") each way, so a transfer lasts long
        enough for a fault to land in its middle; None lifts the limit. Returns whether tc did it."""
        ok = True
        for ns in (self.a, self.b):
            tc = ["tc", "qdisc", "del", "dev", ns.data, "root"] if rate is None else \
                ["tc", "qdisc", "replace", "dev", ns.data, "root", "tbf", "rate", rate, "burst", "64kb",
                 "latency", "1s"]
            ok = ip("netns", "exec", ns.name, *tc, check=False).returncode == 0 and ok
        return ok

    def redis_link(self, ns: Namespace, up: bool) -> None:
        """Cut (or restore) `ns`'s path to Redis, and nothing else: a rule in the root namespace drops
        what Redis sends to `ns`, so from `ns` the path goes silent (no error, no reset) as a dead
        link in between would; the router's traffic (another address) flows on."""
        ip("rule", "del" if up else "add", "from", ns.redis_address, "to", ns.address, "blackhole", "pref", "1000",
           check=not up)

    def remove(self) -> None:
        """Delete both namespaces (their veths and addresses go with them); safe to call twice."""
        for ns in (self.a, self.b):
            self.redis_link(ns, True)  # rules live in the root namespace: they outlive the namespaces
            ip("netns", "del", ns.name, check=False)
            shutil.rmtree(NETNS_ETC / ns.name, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only if no other namespace has files there


def _free_slot() -> int:
    """A slot whose addresses no interface of this namespace uses (another session's, say)."""
    used = set(re.findall(rf"inet {re.escape(PREFIX)}\.(\d+)\.", ip("-4", "-o", "addr").stdout))
    start = os.getpid() % MAX_SLOTS
    for i in range(MAX_SLOTS):
        slot = (start + i) % MAX_SLOTS
        if not {str(3 * slot), str(3 * slot + 1), str(3 * slot + 2)} & used:
            return slot
    raise NetnsUnavailable(f"every {PREFIX}.x.0/24 slot is in use")
