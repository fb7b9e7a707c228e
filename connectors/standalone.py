"""A producer or a consumer with no node around it: for benchmarks, tests and other engines.

1. `open_producer` / `open_consumer` open a directory, take an epoch, create the
   transport and build the role over a pool (the transport's, or `kv_caches` given).
2. The contract's face (`side.connector`) sends or receives; its role is
   `side.connector.producer` / `side.connector.consumer`.
3. `side.close()` closes the role, its transport and the directory.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch

from kvwire.connectors.config import ConnectorConfig
from kvwire.connectors.connector import ConsumerConnector, ProducerConnector
from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.directory.directory import KVDirectory
from kvwire.connectors.factory import create_transport
from kvwire.connectors.kv_pool import KVPool
from kvwire.connectors.producer.role import KVProducer
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.wire import KVLayout


@dataclass
class _Side:
    connector: ProducerConnector | ConsumerConnector
    kv_caches: list[torch.Tensor]  # per-layer views of the pool
    directory: KVDirectory

    def close(self) -> None:
        self.connector.close()
        self.directory.close()


@dataclass
class ProducerSide(_Side):
    connector: ProducerConnector

    @property
    def producer(self) -> KVProducer:
        return self.connector.producer


@dataclass
class ConsumerSide(_Side):
    connector: ConsumerConnector

    @property
    def consumer(self) -> KVConsumer:
        return self.connector.consumer


def open_producer(config: ConnectorConfig, *, layout: KVLayout | None = None, num_blocks: int = 0,
                  device: str | torch.device = "cpu", kv_caches: list[torch.Tensor] | None = None) -> ProducerSide:
    """A producer serving a pool of `num_blocks` of `layout` placed by its transport, or `kv_caches`. Released
    blocks: `side.producer.released()`, its `wakeup.fd` readable when there are some."""
    with ExitStack() as undo:  # what is opened here is closed again if the producer cannot be built
        directory = KVDirectory(config.redis_url, entry_ttl_s=config.entry_ttl_s)
        undo.callback(directory.close)
        epoch = directory.next_epoch(config.node_id)
        transport = create_transport(config, epoch)
        undo.callback(transport.close)
        if kv_caches is None:
            assert layout is not None, "a layout, or the pool's kv_caches"
            kv_caches = transport.producer_pool(layout, num_blocks, device).kv_caches
        producer = KVProducer(config, directory, epoch, transport, KVRegion.from_kv_caches(kv_caches))
        undo.pop_all()
    return ProducerSide(ProducerConnector(0, 0, config, producer), kv_caches, directory)


def open_consumer(config: ConnectorConfig, *, layout: KVLayout | None = None, num_blocks: int = 0,
                  device: str | torch.device = "cpu", kv_caches: list[torch.Tensor] | None = None,
                  inbox: bool = False) -> ConsumerSide:
    """A consumer landing KV in a new pool of `num_blocks` of `layout`, or in `kv_caches`. Expected requests
    whose KV can be pulled: `side.consumer.ready()`, its `wakeup.fd` readable when there are some. `inbox`:
    producers are told `side.consumer.kv_ready_endpoint` and push KVReady there (poll `inbox_socket` too)."""
    with ExitStack() as undo:  # what is opened here is closed again if the consumer cannot be built
        directory = KVDirectory(config.redis_url, entry_ttl_s=config.entry_ttl_s)
        undo.callback(directory.close)
        transport = create_transport(config, directory.next_epoch(config.node_id))
        undo.callback(transport.close)
        if kv_caches is None:
            assert layout is not None, "a layout, or the pool's kv_caches"
            kv_caches = KVPool.allocate(layout, num_blocks, device).kv_caches
        consumer = KVConsumer(config, directory, transport, KVRegion.from_kv_caches(kv_caches), inbox=inbox)
        undo.pop_all()
    return ConsumerSide(ConsumerConnector(0, 0, config, consumer), kv_caches, directory)
