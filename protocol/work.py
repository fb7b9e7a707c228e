"""Router ↔ node messages: the work (`PrefillWork`, `DecodeWork`, `CancelWork`) and the answers (`TokenChunk`,
`WorkError`), with how the decode node samples (`SamplingParams`).

They ride the transfer plane's envelope and wire version (connectors/wire.py, which `decode`s them once
this module is imported: `register`). The work carries the client's trace context when it came with one
(observability/tracing.py). Peers' bytes are data: only these structs decode.
"""

from __future__ import annotations

import enum

import msgspec

from kvwire.connectors.wire import AnyMessage, KVReady, register
from kvwire.observability.labels import PathReason, TransferFailure
from kvwire.observability.tracing import TraceContext


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How the decode node picks each token, and when it stops (engine/sampler.py, engine/llm_engine.py).

    The logits go through, in order: repetition, frequency and presence penalties (counting the prompt's
    tokens for repetition, the output's for all three, as vLLM does), min_tokens' ban on stop tokens, then
    temperature, top_k, top_p and min_p. Logprobs are always of the raw float32 logits, before any of that.
    Stop strings are the router's: it cuts the text and cancels the request (`CancelWork`).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # Added after WIRE_VERSION 1 shipped; the defaults change nothing.
    top_k: int = 0  # 0 (or -1): all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = []  # finish (reason "stop") on any of these, as on EOS
    ignore_eos: bool = False  # EOS does not finish the request
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the k most likely


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One sampled token's log-probability under the raw logits, and the `SamplingParams.logprobs` most
    likely tokens' (ids and logprobs, most likely first; ties to the lower id)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class PrefillWork(AnyMessage, tag="prefill", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    # where the producer pushes `KVReady`, ahead of the directory: the decode node's consumer inbox (an older
    # decode node's work endpoint)
    kv_ready_endpoint: str = msgspec.field(default="", name="notify")
    trace: TraceContext | None = None  # the client's (or the router's span's) W3C trace context


class DecodeWork(AnyMessage, tag="decode", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prefill_node: str  # "" when no prefill node was available: decode computes the prompt itself
    reply_to: str  # router's zmq endpoint for TokenChunk messages
    prefill_epoch: int = 0  # the incarnation of prefill_node the router picked; 0: unknown
    trace: TraceContext | None = None  # the client's (or the router's span's) W3C trace context
    path_reason: PathReason | None = None  # why the router took this path (None: an older router)
    # a request of the same prompt on this node (its first choice) that this one, a later choice of the client's
    # request, starts from: its prompt KV, not computed or received again (engine/shared_prompts.py); sent only to
    # nodes that say they do (NodeInfo.shares_prompts), with prefill_node "" and path_reason PROMPT_SHARED
    prompt_of: str = ""
    # the prompt tokens the router took this node's prefix cache to hold when it kept the request here as
    # cached-on-decode (PathReason.CACHED_ON_DECODE); the node counts a prefix miss when it held fewer
    cached_expected: int = 0


class DecodeStats(msgspec.Struct, frozen=True, kw_only=True):
    bypassed: bool
    transport: str  # the ConnectorKind value that moved the KV; "" when nothing was received
    kv_bytes: int
    transfer_ms: float
    ttft_ms: float
    prefill_node: str
    decode_node: str
    cached_tokens: int = 0  # of the prompt, from the decode node's prefix cache
    # why the KV a prefill node was asked for never came (the prompt was recomputed); None when it came or
    # none was asked for (kvwire_kv_transfers_failed_total counts the same reasons)
    transfer_failure: TransferFailure | None = None


class TokenChunk(AnyMessage, tag="tokens", frozen=True):
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stats: DecodeStats | None = None
    logprobs: list[TokenLogprobs] = []  # one per token_ids entry when SamplingParams.logprobs is set


class CancelWork(AnyMessage, tag="cancel", frozen=True):
    """Router → decode node: stop generating request_id (a stop string matched, or the client left).

    The node frees its blocks (or drops its wait for KV) and sends nothing more for it. Unknown ids are ignored.
    """

    request_id: str


class ErrorKind(enum.StrEnum):
    INVALID_REQUEST = "invalid_request"  # the request can never be served as sent
    INTERNAL = "internal"  # the node failed; the request itself may be fine
    DRAINING = "draining"  # the node is shutting down and no other node of its role could take the request
    NODE_LOST = "node_lost"  # the decode node serving the request left the cluster (died, or a new incarnation)


class WorkError(AnyMessage, tag="error", frozen=True):
    request_id: str
    node: str
    reason: str
    kind: ErrorKind = ErrorKind.INTERNAL


def span_attributes(stats: DecodeStats) -> dict[str, str | int | float | bool]:
    """A finished request's transfer, as span attributes (the decode node's span and the router's)."""
    return {"kvwire.bypassed": stats.bypassed, "kvwire.transport": stats.transport, "kvwire.kv_bytes": stats.kv_bytes,
            "kvwire.transfer_ms": stats.transfer_ms, "kvwire.ttft_ms": stats.ttft_ms,
            "kvwire.prefill_node": stats.prefill_node, "kvwire.decode_node": stats.decode_node,
            "kvwire.cached_tokens": stats.cached_tokens,
            **({"kvwire.transfer_failure": str(stats.transfer_failure)} if stats.transfer_failure else {})}


WorkMessage = PrefillWork | KVReady | DecodeWork | TokenChunk | WorkError | CancelWork
register(WorkMessage)
