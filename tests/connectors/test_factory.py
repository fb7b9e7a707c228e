import pytest

from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.factory import available_transports, create_transport, register_transport, transport_class
from kvwire.connectors.standalone import open_consumer
from kvwire.connectors.transports.transport import Transport
from tests.connectors import peer


def test_every_transport_kind_is_registered_and_lazily_importable():
    assert set(available_transports()) == set(ConnectorKind)
    for kind in ConnectorKind:
        cls = transport_class(kind.value)
        assert issubclass(cls, Transport) and cls.kind == kind


def test_unknown_name_fails_loudly():
    with pytest.raises(KeyError, match="Unsupported transport: 'carrier-pigeon'.*available: .*ucx"):
        transport_class("carrier-pigeon")


def test_double_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_transport(ConnectorKind.UCX, "kvwire.connectors.transports.ucx.transport", "UCXTransport")


def test_create_transport_builds_the_configured_kind():
    config = ConnectorConfig(kind=ConnectorKind.UCX, role=NodeRole.DECODE, node_id="n1", redis_url="redis://x")
    transport = create_transport(config, 3)
    try:
        assert type(transport).__name__ == "UCXTransport"
        assert transport.epoch == 3 and transport.config is config
    finally:
        transport.close()


def test_a_standalone_role_takes_its_epoch_and_builds_the_configured_kind(redis_url):
    config = ConnectorConfig(kind=ConnectorKind.UCX, role=NodeRole.DECODE, node_id="n1", redis_url=redis_url)
    side = open_consumer(config, layout=peer.layout(), num_blocks=4)
    try:
        transport = side.consumer._transport  # test-only reach: the transport the role was built over
        assert type(transport).__name__ == "UCXTransport"
        assert transport.epoch >= 1 and side.connector.config is config
    finally:
        side.close()


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        ConnectorConfig(kind=ConnectorKind.UCX, role=NodeRole.DECODE, node_id="n", redis_url="redis://x",
                        kv_deadline_s=0)
