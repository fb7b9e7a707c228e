"""Whether a producer's KV location fits this consumer's pool, before the pull; and its checksums, after.

A pull here: `check` (the layouts agree, or differ only in KV heads for a head slice; the
prompt's token and block counts agree; a pull from a later block, or of a pick of blocks, is
allowed only where nothing needs the whole prompt: the last hidden row is the prompt's, whichever
blocks move, while a pipeline stage's intermediate tensors and --verify-kv's checksums are the
whole prompt's) narrows the location to what is pulled and names the destination blocks;
after the pull, `verify` (with --verify-kv) compares each layer's checksum with the
producer's. Every refusal is a `ReceiveError` (a mismatch, or a transport fault for a bad
checksum): the caller recomputes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from kvwire.connectors.base import TransferError
from kvwire.connectors.consumer.errors import ReceiveError
from kvwire.connectors.transports.kv_checksum import layer_checksums
from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.wire import HeadSlice, KVLayout, KVLocation, models_agree
from kvwire.observability.labels import TransferFailure


class LocationFit:
    """Checks locations against `region` (the consumer's pool); `verify_kv`: checksums are compared."""

    def __init__(self, region: KVRegion, verify_kv: bool):
        self._region = region
        self._verify_kv = verify_kv

    @property
    def pulls_tails(self) -> bool:
        """Whether a pull may start at a later block (the consumer holds the ones before): not with checksums."""
        return not self._verify_kv

    def check(self, rid: str, num_tokens: int, dst_blocks: list[int], first_block: int, loc: KVLocation,
              heads: HeadSlice | None = None, pick: list[int] | None = None,
              prompt: str = "") -> tuple[KVLocation, list[int]]:
        """`(loc, destination blocks)` if `loc` fits what we need, from `first_block` on
        (`KVLocation.first_block`) or at `pick`'s positions, narrowed to `heads`; raises otherwise. `num_tokens`:
        the whole prompt's (-1: a tail the consumer cannot pull). `prompt`: our prompt's fingerprint
        (connectors/prompt.py; "": not known), which the location's must equal."""
        def bad(reason: str) -> TransferError:
            return ReceiveError(rid, loc.producer, reason, TransferFailure.MISMATCH)

        layout = self._region.layout
        other_size = loc.layout.block_size != layout.block_size and num_tokens == loc.num_tokens
        if heads is not None:
            loc = self._heads(loc, heads, bad)
        elif not _agree(msgspec.structs.replace(loc.layout, block_size=layout.block_size), layout):
            raise bad(_differ(loc.layout, layout))
        if other_size:
            loc, dst_blocks, first_block, pick = self._in_sub_blocks(loc, dst_blocks, first_block, pick, heads, bad)
        elif loc.layout.block_size != layout.block_size:
            raise bad(_differ(loc.layout, layout))
        if num_tokens < 0:
            raise bad("a prompt's tail is pulled only from a block boundary, given its whole prompt, without "
                      "--verify-kv")
        if loc.num_tokens != num_tokens:
            raise bad(f"producer has {loc.num_tokens} prompt tokens, we need {num_tokens}")
        if prompt and loc.prompt and loc.prompt != prompt:
            raise bad(f"the producer's KV is of another prompt of {num_tokens} tokens (prompt {loc.prompt}, ours "
                      f"{prompt}): were one request's kv_transfer_params given to another?")
        if any(d.shape[:1] != (num_tokens,) and (loc.intermediate or d.shape[:1] != (1,)) for d in loc.hidden):
            raise bad("hidden states are neither the prompt's last row nor every row")
        if pick is not None:
            return self._pick(loc, dst_blocks, pick, bad)
        n_blocks = math.ceil(loc.num_tokens / (loc.pull_block_size or loc.layout.block_size))
        if len(loc.block_ids) != n_blocks or len(dst_blocks) < n_blocks:
            raise bad(f"block count mismatch: producer {len(loc.block_ids)}, needed {n_blocks}, "
                      f"ours {len(dst_blocks)}")
        if first_block == 0:
            return loc, dst_blocks[:n_blocks]
        if not 0 < first_block < n_blocks or loc.intermediate or self._verify_kv:
            raise bad(f"cannot pull from block {first_block} of {n_blocks} (a pipeline stage's intermediate "
                      "tensors and checksums need the whole prompt)")
        return (msgspec.structs.replace(loc, block_ids=loc.block_ids[first_block:], first_block=first_block),
                dst_blocks[first_block:n_blocks])

    def _in_sub_blocks(self, loc: KVLocation, dst_blocks: list[int], first_block: int, pick: list[int] | None,
                       heads: HeadSlice | None,
                       bad: Callable[[str], TransferError]) -> tuple[KVLocation, list[int], int, list[int] | None]:
        """A pull between pools of different block sizes, in blocks of the smaller one on both sides
        (connectors/transports/sub_blocks.py): `loc` seen so (`pull_block_size`; its layout stays the producer's),
        and our destination blocks, first block and pick counted in them."""
        theirs, ours = loc.layout.block_size, self._region.layout.block_size
        size = min(theirs, ours)
        why = ("the producer is older" if not loc.sub_blocks else "checksums cover whole blocks" if self._verify_kv
               else "layer-wise KV moves in whole blocks" if loc.layerwise
               else f"{max(theirs, ours)} is not a multiple of {size}" if max(theirs, ours) % size else "")
        n_theirs, n_ours = math.ceil(loc.num_tokens / theirs), math.ceil(loc.num_tokens / ours)
        if not why and pick is not None and (len(loc.block_ids), len(dst_blocks)) != (n_theirs, n_ours):
            why = "several KV cache groups move in whole blocks"
        try:
            region = self._region
            if heads is not None:
                region = region.heads(heads.dst_head, heads.num_heads, heads.per_block)
            region.sub_blocks(size)
        except ValueError as exc:
            why = why or str(exc)
        if why:
            raise bad(f"the producer's KV blocks hold {theirs} tokens, ours {ours}: {why} (give prefill and decode "
                      "the same --block-size)")
        if len(loc.block_ids) != n_theirs:
            raise bad(f"block count mismatch: producer {len(loc.block_ids)}, needed {n_theirs}")
        needed = math.ceil(loc.num_tokens / size)
        loc = msgspec.structs.replace(loc, block_ids=_split(loc.block_ids, theirs // size)[:needed],
                                      pull_block_size=size)
        ratio = ours // size
        if pick is not None:
            pick = [v for j in pick for v in range(j * ratio, (j + 1) * ratio) if v < needed]
            return loc, _split(dst_blocks, ratio)[:needed], 0, pick
        return loc, _split(dst_blocks, ratio), first_block * ratio, None

    def _pick(self, loc: KVLocation, dst_blocks: list[int], pick: list[int],
                    bad: Callable[[str], TransferError]) -> tuple[KVLocation, list[int]]:
        """`loc` narrowed to the blocks at `pick`'s positions of its list, and ours at the same positions."""
        if len(loc.block_ids) != len(dst_blocks):
            raise bad(f"block count mismatch: producer {len(loc.block_ids)}, ours {len(dst_blocks)}")
        if not pick or any(not 0 <= i < len(dst_blocks) for i in pick):
            raise bad(f"a pick of {len(pick)} positions not among {len(dst_blocks)} blocks")
        if (len(pick) < len(dst_blocks)) and (loc.intermediate or self._verify_kv):
            raise bad("a pipeline stage's intermediate tensors and checksums need the whole prompt")
        return (msgspec.structs.replace(loc, block_ids=[loc.block_ids[i] for i in pick]),
                [dst_blocks[i] for i in pick])

    def _heads(self, loc: KVLocation, heads: HeadSlice, bad: Callable[[str], TransferError]) -> KVLocation:
        """`loc` narrowed to a head slice, if both pools allow it (same layout but for their head counts and block
        sizes: `_in_sub_blocks` then tells whether those pair)."""
        layout = self._region.layout
        theirs = msgspec.structs.replace(loc.layout, num_kv_heads=layout.num_kv_heads, block_size=layout.block_size)
        if not _agree(theirs, layout):
            raise bad(_differ(loc.layout, layout) + " (head counts and block sizes aside)")
        if loc.layerwise or loc.hidden or self._verify_kv:
            raise bad("a head slice of layer-wise KV, of hidden states or with checksums is not pulled")
        if heads.src_head + heads.num_heads > loc.layout.num_kv_heads:
            raise bad(f"heads {heads} are not among the producer's {loc.layout.num_kv_heads}")
        try:
            self._region.heads(heads.dst_head, heads.num_heads, heads.per_block)
        except ValueError as exc:
            raise bad(f"heads {heads}: {exc}") from None
        return msgspec.structs.replace(loc, heads=heads)

    def verify(self, rid: str, dst_blocks: list[int], loc: KVLocation) -> None:
        """--verify-kv: the blocks we hold now must match the producer's per-layer checksums."""
        if not self._verify_kv:
            return

        def bad(reason: str) -> TransferError:
            return ReceiveError(rid, loc.producer, reason, TransferFailure.TRANSPORT)

        if not loc.layer_checksums:
            raise bad("producer published no KV checksums (run it with --verify-kv too)")
        got = layer_checksums(self._region, dst_blocks)
        if got != loc.layer_checksums:
            wrong = [i for i, (a, b) in enumerate(zip(got, loc.layer_checksums)) if a != b]
            raise bad(f"KV checksum mismatch in layers {wrong}")


def _split(blocks: list[int], ratio: int) -> list[int]:
    """`blocks` as the blocks `ratio` times smaller they hold (block b: sub-blocks `b * ratio` on)."""
    return blocks if ratio == 1 else [b * ratio + i for b in blocks for i in range(ratio)]


def _agree(a: KVLayout, b: KVLayout) -> bool:
    """Layouts equal, their models too where both name one."""
    return a == b or (models_agree(a.model, b.model)
                      and msgspec.structs.replace(a, model="") == msgspec.structs.replace(b, model=""))


def _differ(theirs: KVLayout, ours: KVLayout) -> str:
    if not models_agree(theirs.model, ours.model):
        return (f"the producer's KV is of another checkpoint (model {theirs.model}, ours {ours.model}): prefill and "
                "decode must serve the same one")
    if theirs.kv_quant != ours.kv_quant:
        return (f"the producer's KV cache is {theirs.kv_quant or theirs.dtype}, ours {ours.kv_quant or ours.dtype}: "
                "serve the same --kv-cache-dtype on both")
    return f"producer layout {theirs} does not match ours {ours}"
