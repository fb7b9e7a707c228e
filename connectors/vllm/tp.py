"""Tensor parallel: which KV heads each rank of a server holds, and what a decode rank pulls from which prefill rank.

vLLM splits each attention layer's KV heads over the tensor-parallel ranks (as NIXL's
`compute_tp_mapping` reads it): with `H` heads over `tp` ranks, rank `r` holds heads
`[r * H / tp, (r + 1) * H / tp)` when `H >= tp`; when `H < tp` each rank holds one head,
head `r * H // tp`, so every head has `tp / H` replicas. An MLA layer's latent is one
"head" every rank holds whole.

1. A prefill rank `p` publishes each prompt it holds under `rank_key(request id, p, P_TP)`,
   as node `identity.rank_node_id(server, p, P_TP)`.
2. Decode rank `d` of `D_TP` pulls `plan(...)`: for each of its heads, one prefill rank
   that holds it (replicas are spread over the decode ranks), grouped into one contiguous
   `HeadSlice` per prefill rank it reads. Each slice says how many decode ranks read that
   prefill rank (`pullers`): the prefill rank releases its copy once they all have.
3. A prefill rank no decode rank reads (a replica) is declined by one decode rank
   (a slice of 0 heads), so it releases at once instead of at its hold deadline.

Both servers serve the same model, so both know `H`; the decode side learns `P_TP` from
the request's `kv_transfer_params` (`remote_tp_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.connectors.wire import HeadSlice


@dataclass(frozen=True)
class TPSplit:
    """How one server splits a model's KV heads: `heads` in all (1 for MLA) over `tp` ranks."""

    heads: int
    tp: int

    def __post_init__(self) -> None:
        if self.heads < 1 or self.tp < 1 or (self.heads >= self.tp and self.heads % self.tp) or \
                (self.heads < self.tp and self.tp % self.heads):
            raise ValueError(f"{self.heads} KV heads do not split evenly over {self.tp} tensor-parallel ranks")

    @property
    def per_rank(self) -> int:
        """KV heads each rank holds."""
        return max(1, self.heads // self.tp)

    def first_head(self, rank: int) -> int:
        """The first of the heads `rank` holds (they are consecutive)."""
        return rank * self.per_rank if self.heads >= self.tp else rank * self.heads // self.tp

    def holds(self, rank: int, head: int) -> bool:
        return self.first_head(rank) <= head < self.first_head(rank) + self.per_rank


@dataclass(frozen=True)
class RankPull:
    """One pull of a decode rank: `heads` of prefill rank `rank`'s copy (0 heads: declined)."""

    rank: int
    heads: HeadSlice


def rank_key(request_id: str, rank: int, tp: int) -> str:
    """The directory key of prefill rank `rank`'s copy of a request's KV."""
    return request_id if tp == 1 else f"{request_id}-tp{rank}"


def plan(prefill: TPSplit, decode: TPSplit, rank: int) -> list[RankPull]:
    """What decode rank `rank` pulls, in prefill rank order, and the copies it declines.

    Raises:
        ValueError: the two servers split different head counts (different models).
    """
    if prefill.heads != decode.heads:
        raise ValueError(f"the prefill server has {prefill.heads} KV heads, this one {decode.heads}")
    sources = {r: _sources(prefill, decode, r) for r in range(decode.tp)}
    readers = {p: sum(p in s.values() for s in sources.values()) for p in range(prefill.tp)}
    mine = sources[rank]
    out = []
    for p in sorted(set(mine.values())):
        heads = [h for h, src in mine.items() if src == p]
        src_head = heads[0] - prefill.first_head(p)
        dst_head = heads[0] - decode.first_head(rank)
        whole = (src_head, dst_head, len(heads)) == (0, 0, prefill.per_rank) and prefill.per_rank == decode.per_rank
        out.append(RankPull(p, HeadSlice(src_head, dst_head, len(heads), per_block=not whole, pullers=readers[p])))
    for p in range(prefill.tp):
        if readers[p] == 0 and p % decode.tp == rank:
            out.append(RankPull(p, HeadSlice(0, 0, 0, pullers=1)))
    return out


def _sources(prefill: TPSplit, decode: TPSplit, rank: int) -> dict[int, int]:
    """Each head decode rank `rank` holds -> the prefill rank it is read from (replicas spread by rank)."""
    first = decode.first_head(rank)
    out = {}
    for head in range(first, first + decode.per_rank):
        replicas = [p for p in range(prefill.tp) if prefill.holds(p, head)]
        out[head] = replicas[rank % len(replicas)]
    return out
