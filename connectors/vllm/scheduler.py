"""The connector's scheduler half: which prompts are pulled, which are held, and what the proxy gets back.

A consumer's request (its `kv_transfer_params` name a remote prefill):

1. `matched_tokens`: its prompt tokens beyond the local prefix cache are "external", loaded
   asynchronously (vLLM parks the request until the worker reports it received). With state
   groups (Mamba) the last prompt token is not: the consumer computes it (groups.py). A request
   whose KV another request of this server pulls or pulled (the n > 1 children of one request
   share their parent's params) waits for that pull, then starts from the prefix cache
   (shared_pulls.py).
2. `after_alloc`: its blocks are known; the next step's metadata asks the worker to pull
   into those past the cached prefix. A request that will not pull (everything cached, or
   aborted before its blocks) is abandoned: the producer is told to release now.

A producer's request (`do_remote_decode`):

0. `new_request`: with state groups, its last prompt token is dropped (as vLLM's NixlConnector
   does): the prompt's state is then the one the consumer continues from.
3. `finished`: its blocks are kept (delayed free) and the worker is asked to hold and
   announce them; the returned params tell the consumer where they are. The worker reports
   the request "finished sending" once the consumer pulled it or the hold lapsed, and only
   then does vLLM free the blocks.

Block lists are per KV cache group (vLLM's hybrid allocator); groups.py picks the blocks of
each that move.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from kvwire.connectors.prompt import prompt_fingerprint
from kvwire.connectors.vllm.groups import Groups
from kvwire.connectors.vllm.metadata import Hold, KvwireMetadata, Pull
from kvwire.connectors.vllm.params import (
    ANNOUNCED_AHEAD,
    RemotePrefill,
    key_of,
    remote_params,
    wants_remote_decode,
)
from kvwire.connectors.vllm.settings import VLLMSettings
from kvwire.connectors.vllm.shared_pulls import SharedPulls
from kvwire.connectors.vllm.tally import Tally
from kvwire.observability.labels import TransferFailure

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

TRUNCATED = "kvwire_truncated"  # in a producer's kv_transfer_params: its last prompt token was dropped


class SchedulerHalf:
    def __init__(self, settings: VLLMSettings, groups: Groups):
        self._settings = settings
        self._groups = groups
        self._next = KvwireMetadata()  # what the next step's metadata carries
        self.tally = Tally()  # prompts not pulled for want of a match (stats.py)
        self._shared = SharedPulls()  # keys pulled by one request for all that name them
        self._warned_prompt_logprobs = False  # a WARNING the first time, DEBUG after

    def new_request(self, request: Request) -> None:
        """A producer's request: with state groups, drop its last prompt token (module docstring, step 0); it
        then answers one token, from the shortened prompt, which a P/D proxy discards."""
        params = request.kv_transfer_params
        backoff = self._groups.backoff
        if not (backoff and self._settings.role.produces and wants_remote_decode(params)) or params is None:
            return
        if params.get(TRUNCATED) or request.prompt_token_ids is None or request.num_prompt_tokens <= backoff:
            return
        if request.get_skip_reading_prefix_cache():  # prompt logprobs: a consumer computes the whole prompt
            return
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        params[TRUNCATED] = True  # once, even if preempted and scheduled again

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens a producer holds beyond `num_computed_tokens`, and whether they load asynchronously
        (None: not known yet, another request of this server pulls the same KV; vLLM asks again later)."""
        remote = self._remote(request)
        if remote is None:
            return 0, False
        if self._shared.must_wait(remote.remote_request_id, request.request_id):
            return None, False
        prompt = len(request.prompt_token_ids or ())
        if self._shared.pulled(remote.remote_request_id):
            self._from_prefix_cache(request, remote, self._loaded(prompt) - num_computed_tokens)
            return 0, False
        loaded = self._loaded(prompt)
        if remote.remote_num_tokens not in (loaded, ANNOUNCED_AHEAD):
            log.warning("request %s: producer %s computed %d prompt tokens, this prompt has %d (%d to load); "
                        "computing it here", request.request_id, remote.remote_engine_id, remote.remote_num_tokens,
                        prompt, loaded)
            self.tally.failed(TransferFailure.MISMATCH)
            return 0, False
        count = loaded - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _from_prefix_cache(self, request: Request, remote: RemotePrefill, uncached: int) -> None:
        """`request` names KV another request of this server pulled: it computes past its prefix-cache hit, and
        is counted when that leaves more than the prompt's last block (prefix caching off, or the blocks evicted)."""
        assert request.kv_transfer_params is not None
        request.kv_transfer_params["do_remote_prefill"] = False
        if uncached > self._groups.block_size:
            log.warning("request %s: the KV of %s was pulled for another request of this server (n > 1), and the "
                        "prefix cache does not hold it: computing %d of its prompt tokens (is prefix caching off?)",
                        request.request_id, remote.remote_request_id, uncached)
            self.tally.failed(TransferFailure.PROMPT_NOT_SHARED)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        remote = self._remote(request)
        if remote is None:
            return
        assert request.kv_transfer_params is not None
        request.kv_transfer_params["do_remote_prefill"] = False  # one pull per request, even if preempted
        if num_external_tokens == 0:  # all of it in the local prefix cache, or vLLM reads none of it
            self._next.abandon.append(remote)
            if request.get_skip_reading_prefix_cache():
                self._prompt_logprobs(request, remote)
            return
        loaded = self._loaded(len(request.prompt_token_ids or ()))
        first_block = (loaded - num_external_tokens) // self._groups.block_size
        self._shared.pulling(remote.remote_request_id, request.request_id)  # received, or recomputed if it fails
        try:
            block_ids, pick = self._groups.pull(blocks.get_block_ids(), loaded, first_block)
        except ValueError as exc:  # the worker fails it: vLLM recomputes the prompt
            log.error("request %s: cannot take the KV of %s: %s", request.request_id, remote.remote_engine_id, exc)
            self._next.pull[request.request_id] = Pull(remote, loaded, [], [], error=str(exc))
            return
        self._next.pull[request.request_id] = Pull(remote, loaded, block_ids, pick, prompt=_prompt(request, loaded))

    def _prompt_logprobs(self, request: Request, remote: RemotePrefill) -> None:
        """`request` asks for prompt logprobs: vLLM computes its prompt whole, whatever KV it was told of."""
        self.tally.failed(TransferFailure.PROMPT_LOGPROBS)
        level = logging.DEBUG if self._warned_prompt_logprobs else logging.WARNING
        self._warned_prompt_logprobs = True
        log.log(level, "request %s asks for prompt logprobs, so vLLM computes its whole prompt here: the KV %s holds "
                "for it is released unread (counted as reason prompt_logprobs; kvwire's router sends such requests "
                "decode-only)", request.request_id, remote.remote_engine_id)

    def finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's request_finished(_all_groups): whether the blocks stay (held for a consumer), and the params
        for it. `block_ids`: the request's blocks, per KV cache group."""
        from vllm.v1.request import RequestStatus

        self._shared.ended(request.request_id)
        remote = self._remote(request)
        if remote is not None:  # finished (aborted) before its blocks came: the producer may release
            assert request.kv_transfer_params is not None
            request.kv_transfer_params["do_remote_prefill"] = False
            self._next.abandon.append(remote)
            return False, None
        if not (self._settings.role.produces and wants_remote_decode(request.kv_transfer_params)):
            return False, None
        done = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not done or not any(block_ids):  # aborted, or nothing computed: nothing to hand over
            return False, None
        num_tokens = min(request.num_computed_tokens, len(request.prompt_token_ids or ()))
        key = key_of(request.request_id, request.kv_transfer_params)
        params = remote_params(key, self._settings.node_id, block_ids, num_tokens,
                               self._settings.engine.tensor_parallel_size)
        try:
            held = self._groups.held(block_ids, num_tokens)
        except ValueError as exc:  # the worker fails its entry: the consumer counts it and recomputes
            self._next.hold[request.request_id] = Hold([], num_tokens, error=str(exc), key=key)
            return False, params
        self._next.hold[request.request_id] = Hold(held, num_tokens, key=key, prompt=_prompt(request, num_tokens))
        return True, params

    def build_metadata(self, scheduled: Collection[str] = ()) -> KvwireMetadata:
        """The next step's metadata; `scheduled`: the ids of the requests that step computes."""
        self._shared.scheduled(scheduled)
        meta, self._next = self._next, KvwireMetadata()
        return meta

    def _loaded(self, prompt: int) -> int:
        """The tokens of a prompt of `prompt` whose KV (and state) a consumer loads: all but the backoff."""
        return prompt - self._groups.backoff if prompt > self._groups.backoff else prompt

    def _remote(self, request: Request) -> RemotePrefill | None:
        if not self._settings.role.consumes:
            return None
        return RemotePrefill.of(request.request_id, request.kv_transfer_params)


def _prompt(request: Request, num_tokens: int) -> str:
    """The fingerprint of `request`'s first `num_tokens` prompt tokens (connectors/prompt.py); "" for a prompt of
    embeddings, which has no token ids."""
    ids = request.prompt_token_ids
    return "" if ids is None else prompt_fingerprint(ids[:num_tokens])
