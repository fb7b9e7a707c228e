import pytest

from kvwire.connectors.base import KVConnectorBase
from kvwire.connectors.config import ConnectorConfig, ConnectorKind, NodeRole
from kvwire.connectors.factory import available_connectors, connector_class, create_connector, register_connector


def test_every_connector_kind_is_registered_and_lazily_importable():
    assert set(available_connectors()) == {k.value for k in ConnectorKind}
    for kind in ConnectorKind:
        assert issubclass(connector_class(kind.value), KVConnectorBase)


def test_unknown_name_fails_loudly():
    with pytest.raises(KeyError, match="Unsupported connector: 'carrier-pigeon'.*available: .*ucx"):
        connector_class("carrier-pigeon")


def test_double_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_connector("ucx", "kvwire.connectors.ucx.transport", "UCXConnector")


def test_create_connector_builds_the_configured_kind(redis_url):
    config = ConnectorConfig(kind=ConnectorKind.UCX, role=NodeRole.DECODE, node_id="n1", redis_url=redis_url)
    conn = create_connector(0, 0, config)
    try:
        assert type(conn).__name__ == "UCXConnector"
        assert conn.epoch >= 1 and conn.config is config
    finally:
        conn.close()


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        ConnectorConfig(kind=ConnectorKind.UCX, role=NodeRole.DECODE, node_id="n", redis_url="redis://x", kv_deadline_s=0)
