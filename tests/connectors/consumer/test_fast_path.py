"""What carries a pull's bytes (UCX's own answer included), and the consumer's check of a same-host path."""

from __future__ import annotations

import logging

import pytest

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.consumer.fast_path import FastPathGuard, expects_shared_memory
from kvwire.connectors.transports.data_path import DataPath, PathClass, classify
from kvwire.connectors.transports.host import host_identity
from kvwire.connectors.transports.ucx import worker as ucx_worker
from kvwire.connectors.transports.ucx.query import QueryUnavailable, endpoint_transports
from kvwire.connectors.transports.ucx.worker import Role, UCXWorker, ucx
from kvwire.connectors.wire import KVLocation
from tests.connectors import peer


def _loc(host: str, kind: ConnectorKind = ConnectorKind.UCX, producer: str = "prefill-0") -> KVLocation:
    return KVLocation(request_id="r1", producer=producer, producer_epoch=1, kind=kind, side_channel="tcp://x:1",
                      transport_address=b"a", layout=peer.layout(), block_ids=[0], num_tokens=4, hidden=[],
                      host=host)


def _config(kind: ConnectorKind, require: bool = False) -> ConnectorConfig:
    return ConnectorConfig(kind=kind, role=NodeRole.DECODE, node_id="decode-0", redis_url="redis://x",
                           require_fast_path=require)


@pytest.mark.parametrize("names, want", [
    (["sysv", "cma"], PathClass.SHARED_MEMORY), (["tcp", "tcp"], PathClass.NETWORK_STACK),
    (["rc_mlx5", "tcp"], PathClass.RDMA), (["tcp", "posix"], PathClass.SHARED_MEMORY),
    (["shm"], PathClass.SHARED_MEMORY), (["gloo"], PathClass.NETWORK_STACK), (["nccl"], PathClass.UNKNOWN),
    ([], PathClass.UNKNOWN)])
def test_a_path_is_as_fast_as_its_fastest_lane(names, want):
    assert DataPath.of(names).path_class == want


def test_path_labels_drop_repeats_and_say_why_unknown():
    assert DataPath.of(["tcp", "tcp", "sysv"]).label == "tcp/sysv"
    gone = DataPath.unknown("ucp_ep_query not found")
    assert gone.label == "unknown" and str(gone) == "unknown (ucp_ep_query not found)"
    assert classify("dc_mlx5") == PathClass.RDMA and classify("self") == PathClass.SHARED_MEMORY


def test_shared_memory_is_expected_only_of_same_host_producers_over_a_connector_that_can_share():
    here, there = _loc(host_identity()), _loc("elsewhere/boot")
    for kind in (ConnectorKind.AUTO, ConnectorKind.SHM, ConnectorKind.UCX):
        assert expects_shared_memory(kind, here) and not expects_shared_memory(kind, there)
    assert not expects_shared_memory(ConnectorKind.TCP, here) and not expects_shared_memory(ConnectorKind.NCCL, here)
    assert not expects_shared_memory(ConnectorKind.UCX, _loc(""))  # an older producer names no host


def test_a_slow_same_host_path_is_warned_about_once_per_producer(caplog):
    asked = []
    guard = FastPathGuard(_config(ConnectorKind.UCX), lambda loc: asked.append(loc) or DataPath.of(["tcp"]))
    with caplog.at_level(logging.WARNING, "kvwire.connectors.consumer.fast_path"):
        for producer in ("prefill-0", "prefill-0", "prefill-1"):
            assert guard.refusal(_loc(host_identity(), producer=producer)) is None
        assert guard.refusal(_loc("elsewhere/boot")) is None  # remote: not even asked
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and len(asked) == 3
    assert "producer prefill-0 is on this host: expected sysv/posix/cma" in warnings[0]
    assert "actual tcp (over ucx)" in warnings[0] and "pulling anyway" in warnings[0]


def test_require_fast_path_refuses_only_the_network_stack(caplog):
    paths = {"prefill-0": DataPath.of(["tcp"]), "prefill-1": DataPath.of(["sysv", "cma"]),
             "prefill-2": DataPath.unknown("no ucp_ep_query")}
    guard = FastPathGuard(_config(ConnectorKind.AUTO, require=True), lambda loc: paths[loc.producer])
    with caplog.at_level(logging.INFO, "kvwire.connectors.consumer.fast_path"):
        refusal = guard.refusal(_loc(host_identity(), producer="prefill-0"))
        assert refusal is not None and "actual tcp" in refusal
        assert guard.refusal(_loc(host_identity(), producer="prefill-1")) is None
        assert guard.refusal(_loc(host_identity(), producer="prefill-2")) is None  # unknown: told, allowed
        assert guard.refusal(_loc(host_identity(), kind=ConnectorKind.SHM, producer="prefill-0")) is not None
    assert any("cannot be told: unknown (no ucp_ep_query)" in r.getMessage() for r in caplog.records)
    assert any("refusing its KV (--require-fast-path)" in r.getMessage() for r in caplog.records)


def _raw_worker(tls: str | None):
    ctx = ucx.UCXContext(config_dict={"TLS": tls} if tls else {}, feature_flags=(ucx.Feature.TAG,))
    return ctx, ucx.UCXWorker(ctx)


@pytest.mark.parametrize("tls, want", [(None, PathClass.SHARED_MEMORY), ("tcp", PathClass.NETWORK_STACK)])
def test_ucx_says_which_transports_it_selected(tls, want):
    (_, w1), (_, w2) = _raw_worker(tls), _raw_worker(tls)
    ep = ucx.UCXEndpoint.create_from_worker_address(w1, ucx.UCXAddress.create_from_buffer(w2.address.tobytes()),
                                                    False)
    try:
        lanes = endpoint_transports(ep.handle)
        assert lanes and all(name and device for name, device in lanes)
        path = DataPath.of([name for name, _ in lanes])
        assert path.path_class == want, lanes
        if tls == "tcp":
            assert path.label == "tcp"
    finally:
        ep.close()
        w1.progress()
        w2.progress()


def test_a_worker_reports_its_path_to_a_peer_and_degrades_to_unknown(monkeypatch):
    consumer, producer = UCXWorker(Role.CONSUMER), UCXWorker(Role.PRODUCER)
    try:
        assert consumer.path_to(producer.address).path_class == PathClass.SHARED_MEMORY

        def unavailable(handle: int) -> list[tuple[str, str]]:
            raise QueryUnavailable("ucp_ep_query not found")

        monkeypatch.setattr(ucx_worker, "endpoint_transports", unavailable)
        consumer.forget_peer(producer.address)  # a path is asked once per endpoint: make new ones
        path = consumer.path_to(producer.address)
        assert path.path_class == PathClass.UNKNOWN and path.unknown_reason == "ucp_ep_query not found"
    finally:
        consumer.close()
        producer.close()
    with pytest.raises(QueryUnavailable):
        endpoint_transports(0)


def test_a_producer_in_another_container_on_this_machine_is_warned_about(caplog):
    """The containers trap: another network / IPC namespace on this machine (same boot id) is another host,
    and auto moves its KV over UCX; over the network stack that is still worth a warning."""
    hostname, boot, *_ = host_identity().split("/")
    pod_beside = _loc(f"{hostname}/{boot}/net:1/ipc:2")
    guard = FastPathGuard(_config(ConnectorKind.AUTO), lambda loc: DataPath.of(["tcp"]))
    with caplog.at_level(logging.WARNING, "kvwire.connectors.consumer.fast_path"):
        assert guard.refusal(pod_beside) is None
        assert guard.refusal(_loc("other-machine/other-boot/net:1/ipc:2")) is None  # another machine: silent
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "runs on this machine in another container" in warnings[0], warnings
    strict = FastPathGuard(_config(ConnectorKind.UCX, require=True), lambda loc: DataPath.of(["tcp"]))
    assert "shared IPC namespace" in strict.refusal(pod_beside)
    fast = FastPathGuard(_config(ConnectorKind.UCX, require=True), lambda loc: DataPath.of(["sysv", "cma"]))
    assert fast.refusal(pod_beside) is None
