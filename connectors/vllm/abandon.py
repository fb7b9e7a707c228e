"""The prompts a consumer rank will not pull, told to their producers so they release the KV now.

vLLM's scheduler says a request it was told of KV for loads none of it (its prompt was in the local prefix cache, it
asks for prompt logprobs, or it finished first: `KvwireMetadata.abandon`). Lifecycle of one such request:
1. The engine thread (`abandon`): each directory entry this rank answers for is FAILED. A producer that has not
   advertised it yet finds it so and releases its blocks then (producer/role.py `_advertise`).
2. An entry that was READY already has a producer holding the KV for a pull: its location is queued, and the pull
   thread, which owns the consumer's side channels, tells that producer between pulls (`tell`,
   `KVConsumer.abandon`), so it releases now, not at its kv_deadline_s (as NIXL's consumer notifies a producer of a
   request it will not read).
"""

from __future__ import annotations

import logging

from kvwire.connectors.consumer.role import KVConsumer
from kvwire.connectors.directory.directory import DirectoryError, KVDirectory, TransferState
from kvwire.connectors.vllm.params import RemotePrefill
from kvwire.connectors.vllm.settings import VLLMSettings
from kvwire.connectors.vllm.tp import rank_key
from kvwire.connectors.wakeup import Mailbox, Wakeup
from kvwire.connectors.wire import KVLocation

log = logging.getLogger(__name__)

REASON = "the consumer will not pull it (computed or cached the prompt itself)"


class Abandons:
    """`abandon` on the engine thread, `tell` on the pull thread; `wakeup`: the pull thread's."""

    def __init__(self, settings: VLLMSettings, directory: KVDirectory, wakeup: Wakeup | None = None):
        self._settings = settings
        self._directory = directory
        self._ready: Mailbox[KVLocation] = Mailbox(wakeup)  # READY entries failed here, for the pull thread

    def abandon(self, remote: RemotePrefill) -> None:
        """This rank will not pull `remote`'s KV: the entries of the prefill ranks it answers for are FAILED, and
        those already READY queued for `tell`."""
        split = self._settings.split
        for p in range(remote.remote_tp_size):
            if p % split.tp != self._settings.engine.tensor_rank:
                continue
            key = rank_key(remote.remote_request_id, p, remote.remote_tp_size)
            try:
                if not self._directory.fail(key, REASON):
                    continue  # already failed, expired or pulled: nothing held for us
                entry = self._directory.get(key)
            except DirectoryError as exc:
                log.warning("request %s: cannot mark abandoned: %s", key, exc)
                continue
            if entry is not None and entry.state == TransferState.FAILED and entry.location is not None:
                self._ready.put(entry.location)  # it was READY: its producer holds the KV for us

    def tell(self, consumer: KVConsumer) -> None:
        """The pull thread: tell each queued producer it will not be pulled."""
        for location in self._ready.take():
            log.debug("request %s: telling %s it will not be pulled", location.request_id, location.producer)
            consumer.abandon(location)
