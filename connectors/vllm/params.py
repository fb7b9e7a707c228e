"""The per-request `kv_transfer_params` a P/D proxy hands from the prefill instance to the decode one.

1. The proxy sends the prompt to a producer with `{"do_remote_decode": true}` (and max_tokens 1).
2. The producer's `request_finished` returns `remote_params(...)`: where the KV waits (the
   names are NIXL's, so proxies written for NIXL pass them on unchanged).
3. The proxy sends the prompt to a consumer with those params; `RemotePrefill.of` reads them
   there. Params that do not parse are refused with a log line: the prompt is computed locally.

Announced ahead (kvwire's router starts decode with prefill): the proxy names the directory key
itself, `{"do_remote_decode": true, "kvwire_key": K}` to the producer, which then holds the KV
under K (`key_of`), and at the same time `{"do_remote_prefill": true, "remote_request_id": K,
"remote_tp_size": T}` to the consumer, with no `remote_num_tokens` (ANNOUNCED_AHEAD: the prompt
as the consumer tokenizes it; a producer that computed another length fails the pull, counted as
a mismatch) and no `remote_engine_id` (whichever producer announces K).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec

log = logging.getLogger(__name__)

TRANSFER = "kvwire"  # `transfer` in the params: what moves this KV (a NIXL consumer must not try)
KEY = "kvwire_key"  # in a producer's params: the directory key the proxy chose (else the producer's request id)
ANNOUNCED_AHEAD = -1  # `remote_num_tokens` of params sent before the producer computed the prompt
_KEY_CHARS = re.compile(r"[A-Za-z0-9._:-]{1,200}")


class RemotePrefill(msgspec.Struct, frozen=True):
    """A consumer's view of a prompt whose KV a producer holds."""

    remote_request_id: str  # the directory key of the KV: the producer's request id, or the proxy's `kvwire_key`
    remote_engine_id: str = ""  # the producer's node id; "": whichever announces the key (announced ahead)
    remote_num_tokens: int = ANNOUNCED_AHEAD  # prompt tokens the KV covers
    remote_block_ids: list[list[int]] = []  # the producer's blocks per KV cache group (informational: the
    # directory's location rules); a flat list (one group, as kvwire sent before it moved hybrid models) is read so
    transfer: str = TRANSFER
    remote_tp_size: int = 1  # the producer's tensor-parallel ranks, each holding its share (connectors/vllm/tp.py)

    @classmethod
    def of(cls, request_id: str, params: dict[str, Any] | None) -> RemotePrefill | None:
        """The remote prefill `params` announce, or None (none announced, or malformed: logged)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        if "remote_num_tokens" not in params and params.get("transfer") != TRANSFER:
            log.warning("request %s: kv_transfer_params name no remote_num_tokens and are not kvwire's announced "
                        "ahead (transfer %r); computing its prompt here", request_id, TRANSFER)
            return None
        blocks = params.get("remote_block_ids")
        if isinstance(blocks, list) and blocks and not isinstance(blocks[0], list):
            params = {**params, "remote_block_ids": [blocks]}
        try:
            remote = msgspec.convert(params, cls)
        except msgspec.ValidationError as exc:
            log.warning("request %s: kv_transfer_params not usable (%s); computing its prompt here", request_id, exc)
            return None
        if remote.transfer != TRANSFER:
            log.warning("request %s: kv_transfer_params are for %r, not kvwire; computing its prompt here",
                        request_id, remote.transfer)
            return None
        return remote


def key_of(request_id: str, params: dict[str, Any] | None) -> str:
    """The directory key a producer holds `request_id`'s KV under: the proxy's `kvwire_key` when it gave a usable
    one (1-200 of A-Z a-z 0-9 . _ : -), else the request id (a bad key is logged)."""
    key = (params or {}).get(KEY)
    if key is None:
        return request_id
    if isinstance(key, str) and _KEY_CHARS.fullmatch(key):
        return key
    log.warning("request %s: kv_transfer_params' %s %r is not 1-200 of A-Z a-z 0-9 . _ : -; its KV is held under "
                "the request id, and a consumer told the key recomputes", request_id, KEY, key)
    return request_id


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """Whether a producer should hold this request's KV for a consumer."""
    return bool(params and params.get("do_remote_decode"))


def remote_params(request_id: str, node_id: str, block_ids: tuple[list[int], ...], num_tokens: int,
                  tp_size: int = 1) -> dict[str, Any]:
    """What a producer's `request_finished` hands back for the consumer (step 2 above); `block_ids` per KV
    cache group (a list of lists, as NIXL sends them)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": request_id,
            "remote_engine_id": node_id, "remote_block_ids": [list(b) for b in block_ids],
            "remote_num_tokens": num_tokens,
            "transfer": TRANSFER, "remote_tp_size": tp_size}
