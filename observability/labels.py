"""The closed sets of label values the metrics use (observability/metrics.py)."""

from __future__ import annotations

import enum


class TransferFailure(enum.StrEnum):
    """Why a decode node's pull of one request's KV failed (it then recomputes)."""

    DEADLINE = "deadline"  # the KV was not READY before the KV deadline
    PRODUCER = "producer"  # the producer marked the entry FAILED, or it EXPIRED
    MISMATCH = "mismatch"  # layout, token count or block count differ from ours
    TRANSPORT = "transport"  # the transport failed while moving the bytes
    DIRECTORY = "directory"  # Redis could not be reached or held an unreadable record
    SLOW_PATH = "slow_path"  # refused: a same-host producer's KV would cross the network stack (--require-fast-path)
    # vLLM: another request of the server pulled this KV (the n > 1 children of one request share it) and the prefix
    # cache does not hold it (prefix caching off, or evicted): computed again
    PROMPT_NOT_SHARED = "prompt_not_shared"
    # vLLM: the request asks for prompt logprobs, so vLLM reads none of its prompt's KV (transferred or cached) and
    # computes it whole; the producer's KV is released unread. kvwire's router sends such requests decode-only
    PROMPT_LOGPROBS = "prompt_logprobs"


class TransportFallback(enum.StrEnum):
    """Why a pull went over a slower transport than the one it would have taken (it still moved the KV)."""

    CMA_REFUSED = "cma_refused"  # the kernel refused cross-memory attach to a same-host producer: UCX instead
    CUDA_IPC_REFUSED = "cuda_ipc_refused"  # a same-host producer's device memory could not be opened, or lies on
    # another device than ours (e.g. each server sees only its own GPU): UCX instead
    # blocks of another size than ours from a same-host producer whose memory is not read by cross-memory attach
    # (CUDA IPC, a memfd): UCX instead
    SUB_BLOCKS = "sub_blocks"
    NO_COPY_KERNEL = "no_copy_kernel"  # a GPU pool's pull copied piece by piece and plane by plane: kvwire's
    # one-kernel copies (Triton) cannot run in this process (not installed, or failed to build: logged once)


class RecomputeReason(enum.StrEnum):
    """Why a decode node computed a prompt itself instead of receiving its KV."""

    NO_PREFILL_NODE = "no_prefill_node"  # the router found no live prefill node
    PREFILL_SATURATED = "prefill_saturated"  # every live prefill node had --prefill-max-in-flight requests in flight
    PREFILL_OTHER_MODEL = "prefill_other_model"  # every live prefill node serves another checkpoint
    PREFILL_OTHER_BLOCK_SIZE = "prefill_other_block_size"  # every live prefill node keeps KV blocks of another size
    KV_NOT_RECEIVED = "kv_not_received"  # a prefill node was asked, its KV did not arrive
    # a later choice meant to start from its first choice's prompt KV (PathReason.PROMPT_SHARED): that one was not on
    # the node, its prompt was already done, or it ended before its prompt was
    PROMPT_NOT_SHARED = "prompt_not_shared"
    # kept here as cached-on-decode (PathReason.CACHED_ON_DECODE), the node's prefix cache held fewer of the
    # prompt's blocks than the router took it to (evicted since, or never there): those were computed again
    PREFIX_MISS = "prefix_miss"
    # Not recomputes: prompts the router kept on decode by design (short, cached there, or the client's wish);
    # kvwire_path_reasons_total counts those.


class RequestStatus(enum.StrEnum):
    """How the router answered a completion request."""

    OK = "ok"
    INVALID = "invalid"  # 400
    UNAVAILABLE = "unavailable"  # 503: no directory or no live decode node
    TIMEOUT = "timeout"  # 504
    ERROR = "error"  # 500 and anything unexpected
    CANCELLED = "cancelled"  # the client left before the end of its stream


class RejectReason(enum.StrEnum):
    """Why a control message from another process was dropped."""

    UNAUTHENTICATED = "unauthenticated"  # no valid seal while an auth secret is configured
    MALFORMED = "malformed"  # not a valid message of this wire version


class SelfTestOutcome(enum.StrEnum):
    """How a node's start-up transport self-test went, for kvwire_transport_info."""

    OK = "ok"
    FAILED = "failed"  # the node is not ready (its /readyz says why)


class BlockState(enum.StrEnum):
    USED = "used"
    FREE = "free"


class Queue(enum.StrEnum):
    """A node's queues, for kvwire_queue_depth."""

    PREFILL_PENDING = "prefill_pending"  # prefill: waiting for free blocks to compute
    PREFILL_HELD = "prefill_held"  # prefill: computed, blocks held until pulled
    PREFILL_SETTLING = "prefill_settling"  # prefill: pulls failed with sends in flight; blocks held until they settle
    DECODE_AWAITING_KV = "decode_awaiting_kv"  # decode: waiting for the KV to be READY
    DECODE_WAITING = "decode_waiting"  # decode: in the engine, waiting for blocks (or a later choice for its first
    # choice's prompt)
    DECODE_RUNNING = "decode_running"  # decode: generating tokens


class DirectoryOp(enum.StrEnum):
    """Timed directory operations, for kvwire_directory_op_seconds."""

    CREATE_PENDING = "create_pending"
    PUBLISH_READY = "publish_ready"
    TRANSITION = "transition"
    GET = "get"
    WAIT_FOR = "wait_for"  # includes the time spent waiting for the state
    LOOK = "look"  # several requests' entries at once
    WAIT_EVENTS = "wait_events"  # several requests' events at once, includes the wait
    DELETE = "delete"
    WRITE_NODE = "write_node"  # register or heartbeat
    LIVE_NODES = "live_nodes"
    TRANSPORT_ADDRESS_OF = "transport_address_of"  # was "get_endpoint" before 0.1.0's vocabulary pass
    RECORD_TRANSFER = "record_transfer"


class ProxyPath(enum.StrEnum):
    """How the router in vLLM mode served a request (its x-kvwire-path header)."""

    DISAGGREGATED = "disaggregated"  # a prefill instance computed the prompt, a decode instance received its KV
    DECODE_ONLY = "decode-only"  # the decode instance computed the prompt itself


class PathReason(enum.StrEnum):
    """Why the router took a request's path (in vLLM mode its x-kvwire-reason header; over kvwire's own nodes the
    `reason` of an answer's `kvwire` object)."""

    PREFILLED = "prefilled"  # a prefill instance computed the prompt and handed out where its KV waits
    PREFILLED_ALONGSIDE = "prefilled-alongside"  # ... while the decode instance, told where, waited for the KV
    CACHED_ON_DECODE = "cached-on-decode"  # the decode instance holds all but fewer than --decode-only-below tokens
    SHORT_PROMPT = "short-prompt"  # it holds none of a prompt shorter than --decode-only-below tokens
    NO_PREFILL_INSTANCE = "no-prefill-instance"  # none configured, or none up
    PREFILL_OTHER_MODEL = "prefill-other-model"  # every prefill node up serves another checkpoint than the decode
    # node picked (kvwire's own nodes: NodeInfo.model); its KV would be refused as a mismatch
    # every prefill instance up keeps KV blocks of another size than the decode instance picked (NodeInfo.block_size;
    # the vLLM router: vllm:cache_config_info): its KV would be refused as a mismatch
    PREFILL_OTHER_BLOCK_SIZE = "prefill-other-block-size"
    # every prefill instance up whose block size pairs keeps another kind of KV cache (the vLLM router:
    # vllm:cache_config_info's cache_dtype, e.g. fp8 against the model's dtype): its KV would be refused as a mismatch
    PREFILL_OTHER_KV_CACHE_DTYPE = "prefill-other-kv-cache-dtype"
    PREFILL_SATURATED = "prefill-saturated"  # every prefill instance up had --prefill-max-in-flight requests
    PREFILL_FAILED = "prefill-failed"  # the prefill instance was not reached, timed out, broke or answered 5xx
    NO_KV_PARAMS = "no-kv-transfer-params"  # it answered without them (a vLLM started with no KV connector)
    NOT_ASKED = "not-asked"  # the client's body said "disaggregate": false (kvwire's own nodes)
    # a later choice (n > 1, best_of) of a prompt: it starts from its first choice's prompt KV on that one's decode
    # node (kvwire's own nodes: DecodeWork.prompt_of), neither computed nor moved again
    PROMPT_SHARED = "prompt-shared"
    # a completions request of several prompts (the vLLM router): vLLM answers a prefill step with one prompt's
    # kv_transfer_params, which every prompt's request on the decode instance would then name
    BATCHED_PROMPTS = "batched-prompts"
    BEAM_SEARCH = "beam-search"  # vLLM's beam search answers a prefill step without kv_transfer_params
    # the client asks for prompt logprobs (`prompt_logprobs`, or `echo` with logprobs): vLLM computes such a prompt
    # whole, reading neither a transferred nor a cached KV of it
    PROMPT_LOGPROBS = "prompt-logprobs"
    # a Responses API turn naming an earlier one (previous_response_id), stored on the decode instance that
    # answered it: the prefill instances do not have it
    PREVIOUS_RESPONSE = "previous-response"


DISAGGREGATED_REASONS = frozenset({PathReason.PREFILLED, PathReason.PREFILLED_ALONGSIDE})
# the reasons the router gives over kvwire's own nodes (router/placement.py)
NODES_PATH_REASONS: tuple[PathReason, ...] = (
    PathReason.PREFILLED, PathReason.CACHED_ON_DECODE, PathReason.SHORT_PROMPT, PathReason.NO_PREFILL_INSTANCE,
    PathReason.PREFILL_OTHER_MODEL, PathReason.PREFILL_OTHER_BLOCK_SIZE, PathReason.PREFILL_SATURATED,
    PathReason.NOT_ASKED, PathReason.PROMPT_SHARED)
# the reasons the router in front of vLLM servers gives (router/vllm/)
VLLM_PATH_REASONS: tuple[PathReason, ...] = tuple(  # all but kvwire's own nodes' alone
    r for r in PathReason if r not in (PathReason.NOT_ASKED, PathReason.PREFILL_OTHER_MODEL, PathReason.PROMPT_SHARED))


def path_of(reason: PathReason) -> ProxyPath:
    """The path a request takes for `reason`."""
    return ProxyPath.DISAGGREGATED if reason in DISAGGREGATED_REASONS else ProxyPath.DECODE_ONLY


class KVEventKind(enum.StrEnum):
    """A vLLM KV cache event, as the router counts it (kvwire_vllm_kv_events_total)."""

    STORED = "stored"  # BlockStored
    REMOVED = "removed"  # BlockRemoved
    CLEARED = "cleared"  # AllBlocksCleared, or events missed (a gap in the sequence: the instance restarted)


class InstanceState(enum.StrEnum):
    """Whether a vLLM instance is in the router's rotation."""

    UP = "up"
    DOWN = "down"  # failed a request or a health check; re-admitted when GET /health answers
