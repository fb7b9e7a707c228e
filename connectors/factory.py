"""Builds a connector from its name, importing only the chosen transport."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvwire.connectors.config import ConnectorConfig, ConnectorKind

if TYPE_CHECKING:
    from kvwire.connectors.base import KVConnectorBase

_REGISTRY: dict[str, tuple[str, str]] = {}


def register_connector(name: str, module: str, class_name: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"connector {name!r} is already registered")
    _REGISTRY[name] = (module, class_name)


def available_connectors() -> list[str]:
    return sorted(_REGISTRY)


def create_connector(rank: int, local_rank: int, config: ConnectorConfig) -> KVConnectorBase:
    """Instantiate the connector named by `config.kind`.

    Raises:
        KeyError: no connector of that name is registered.
    """
    return connector_class(str(config.kind))(rank, local_rank, config)


def connector_class(name: str) -> type[KVConnectorBase]:
    """Import and return the class registered under `name`.

    Raises:
        KeyError: no connector of that name is registered.
    """
    if name not in _REGISTRY:
        raise KeyError(f"Unsupported connector: {name!r} (available: {', '.join(available_connectors())})")
    module, class_name = _REGISTRY[name]
    return getattr(importlib.import_module(module), class_name)


register_connector(ConnectorKind.UCX, "kvwire.connectors.ucx.transport", "UCXConnector")
register_connector(ConnectorKind.TCP, "kvwire.connectors.tcp.transport", "TCPConnector")
register_connector(ConnectorKind.SHM, "kvwire.connectors.shm.transport", "SHMConnector")
register_connector(ConnectorKind.NCCL, "kvwire.connectors.nccl.transport", "NCCLConnector")
register_connector(ConnectorKind.AUTO, "kvwire.connectors.auto.transport", "AutoConnector")
