"""A network interface that vanishes while a UCX worker opens it: the worker lists the devices again.

Real UCX over a real veth pair: the pair is deleted right after UCX's context has listed it and before
its worker opens it (the window in which a container's veth torn down on the host, or another test's
network namespace removed, failed a node's start with "uct_iface_open(tcp/...) failed: No such device").
Needs root and ip(8); skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from kvwire.connectors.transports.ucx import worker
from kvwire.connectors.transports.ucx.worker import Role, UCXWorker

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and ip(8)")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def vanishing_veth(monkeypatch):
    """A veth pair with an address, up; returns a list of the contexts made, and the pair is deleted once the
    first context has listed it (so the first worker's open fails, as in the race)."""
    name = f"kwo{os.getpid() % 100000}"
    if _ip("link", "add", name, "type", "veth", "peer", "name", f"{name}p").returncode != 0:
        pytest.skip("the kernel refused a veth pair")
    octet = 1 + os.getpid() % 250
    for cmd in (("addr", "add", f"10.254.{octet}.1/24", "dev", name), ("link", "set", name, "up"),
                ("link", "set", f"{name}p", "up")):
        assert _ip(*cmd).returncode == 0, cmd
    made, real = [], worker.ucx.UCXContext

    def listing_then_deleting(*args, **kwargs):
        ctx = real(*args, **kwargs)
        made.append(ctx)
        _ip("link", "del", name)  # its peer goes with it
        return ctx

    monkeypatch.setattr(worker.ucx, "UCXContext", listing_then_deleting)
    try:
        yield made
    finally:
        _ip("link", "del", name)


def test_a_device_gone_before_the_worker_opens_it_is_listed_again(vanishing_veth):
    transport = UCXWorker(Role.PRODUCER)
    try:
        assert len(vanishing_veth) == 2  # the first worker failed on the vanished veth, the second listed without it
        assert transport.address
    finally:
        transport.close()


def test_a_device_vanishing_every_time_is_a_clear_error(monkeypatch):
    calls = []

    def no_device(ctx):
        calls.append(ctx)
        raise worker.ucx.UCXNoDeviceError("No such device")

    monkeypatch.setattr(worker.ucx, "UCXWorker", no_device)
    with pytest.raises(worker.ucx.UCXNoDeviceError, match="in 3 tries"):
        worker.open_worker({}, attempts=3, pause_s=0.0)
    assert len(calls) == 3 and len({id(c) for c in calls}) == 3  # a new context (a new listing) each time


def test_transports_that_name_no_device_here_fail_at_once(monkeypatch):
    """UCX_TLS naming nothing this host has is a configuration error, not a race: no retries."""
    opened = []
    monkeypatch.setattr(worker.ucx, "UCXWorker", lambda ctx: opened.append(ctx))
    with pytest.raises(worker.ucx.UCXNoDeviceError):
        worker.open_worker({"TLS": "no-such-transport"}, attempts=3, pause_s=0.0)
    assert opened == []
