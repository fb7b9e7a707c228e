"""Builds a transport from its name, importing only the chosen one."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvwire.connectors.config import ConnectorConfig, ConnectorKind

if TYPE_CHECKING:
    from kvwire.connectors.transports.transport import Transport

_REGISTRY: dict[ConnectorKind, tuple[str, str]] = {}


def register_transport(kind: ConnectorKind, module: str, class_name: str) -> None:
    """Make `kind` name the class `class_name` of `module`, imported when first used.

    Raises:
        ValueError: `kind` is already registered.
    """
    if kind in _REGISTRY:
        raise ValueError(f"transport {kind!r} is already registered")
    _REGISTRY[kind] = (module, class_name)


def available_transports() -> list[ConnectorKind]:
    return sorted(_REGISTRY)


def transport_class(kind: ConnectorKind | str) -> type[Transport]:
    """Import and return the transport registered under `kind`.

    Raises:
        KeyError: no transport of that name is registered.
    """
    try:
        module, class_name = _REGISTRY[ConnectorKind(kind)]
    except (KeyError, ValueError):
        names = ", ".join(map(str, available_transports()))
        raise KeyError(f"Unsupported transport: {str(kind)!r} (available: {names})") from None
    return getattr(importlib.import_module(module), class_name)


def create_transport(config: ConnectorConfig, epoch: int) -> Transport:
    """The transport `config.kind` names, for the node incarnation `epoch`.

    Raises:
        KeyError: no transport of that name is registered.
    """
    return transport_class(config.kind)(config, epoch)


register_transport(ConnectorKind.UCX, "kvwire.connectors.transports.ucx.transport", "UCXTransport")
register_transport(ConnectorKind.TCP, "kvwire.connectors.transports.tcp.transport", "TCPTransport")
register_transport(ConnectorKind.SHM, "kvwire.connectors.transports.shm.transport", "SHMTransport")
register_transport(ConnectorKind.NCCL, "kvwire.connectors.transports.nccl.transport", "NCCLTransport")
register_transport(ConnectorKind.AUTO, "kvwire.connectors.transports.auto.transport", "AutoTransport")
