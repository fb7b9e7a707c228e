"""A checked request -> the `Plan` the router runs: its prompts' token ids, its choices, each choice's
`SamplingParams`, and what the answer shows (stop strings, logprobs, echo, usage).

Every parameter of router/schemas.py is applied here or refused with a 400 that names it.
Choice j of a prompt samples with seed + j, so choice 0 of a seeded request with n > 1 equals
the same request with n = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvwire.engine.validation import MAX_LOGPROBS, ParamError, check_params, prompt_problem
from kvwire.protocol.work import SamplingParams
from kvwire.router.schemas import APIError, ChatRequest, CompletionRequest, _Sampling

MAX_CHOICES = 128  # prompts x best_of in one request
MAX_STOP = 16
MAX_SEED = 2**63 - MAX_CHOICES


@dataclass(frozen=True)
class Limits:
    """What the served model allows."""

    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class Plan:
    """Attributes:
    prompts: each prompt's token ids.
    n: choices answered per prompt; best_of: choices generated per prompt (the n of highest total logprob win).
    sampling: choice 0's parameters; `sampling_for(j)` gives choice j's.
    stop: strings that end a choice (not in its text unless include_stop).
    logprobs: top logprobs per token the client gets; None: no logprobs.
    echo: the prompt's text leads each choice's text.
    token_ids_as_text: logprobs name tokens "token_id:N".
    """

    prompts: list[list[int]]
    n: int
    best_of: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    logprobs: int | None = None
    echo: bool = False
    token_ids_as_text: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    disaggregate: bool = True

    def sampling_for(self, choice: int) -> SamplingParams:
        seed = self.sampling.seed
        return msgspec.structs.replace(self.sampling, seed=None if seed is None else seed + choice)


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise APIError(400, message, param=param)


def _check_common(req: _Sampling, limits: Limits) -> None:
    """The request's own fields; the sampling parameters' ranges are the engine's (`check_params`, in _plan)."""
    _require(req.seed is None or 0 <= req.seed < MAX_SEED, "seed", f"seed must be in [0, {MAX_SEED})")
    _require(1 <= req.n <= MAX_CHOICES, "n", f"n must be in [1, {MAX_CHOICES}]")
    stops = _stops(req.stop)
    _require(len(stops) <= MAX_STOP and all(stops), "stop", f"stop takes at most {MAX_STOP} non-empty strings")
    ids = req.stop_token_ids or []
    _require(all(0 <= i < limits.vocab_size for i in ids), "stop_token_ids",
             f"stop_token_ids must be token ids in [0, {limits.vocab_size})")
    _require(not req.logit_bias, "logit_bias", "logit_bias is not supported")
    _require(req.skip_special_tokens, "skip_special_tokens", "skip_special_tokens=false is not supported")
    _require(req.stream_options is None or req.stream, "stream_options", "stream_options needs stream=true")
    _require(req.stream_options is None or not req.stream_options.continuous_usage_stats, "stream_options",
             "stream_options.continuous_usage_stats is not supported; include_usage is")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _max_tokens(asked: int | None, prompts: list[list[int]], limits: Limits, param: str) -> int:
    """The max_tokens asked, or (None) what the context leaves after the longest prompt."""
    room = limits.max_model_len - max(len(p) for p in prompts)
    if asked is None:
        _require(room >= 1, "prompt", f"the prompt leaves no room in the model's {limits.max_model_len} tokens")
        return room
    _require(1 <= asked < limits.max_model_len, param, f"{param} must be in [1, {limits.max_model_len})")
    return asked


def _plan(req: _Sampling, prompts: list[list[int]], max_tokens: int, logprobs: int | None, best_of: int,
          limits: Limits, echo: bool = False) -> Plan:
    _require(len(prompts) * best_of <= MAX_CHOICES, "n", f"prompts x choices must be at most {MAX_CHOICES}")
    for prompt in prompts:
        problem = prompt_problem(prompt, limits.vocab_size, limits.max_model_len, max_tokens)
        _require(problem is None, "prompt", problem or "")
    ranked = best_of > req.n  # choices are ranked by their total logprob, which needs the sampled ones'
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p,
        seed=req.seed, top_k=req.top_k, min_p=req.min_p, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        logprobs=logprobs if logprobs is not None else (0 if ranked else None))
    try:
        check_params(sampling)
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    options = req.stream_options
    return Plan(prompts=prompts, n=req.n, best_of=best_of, sampling=sampling, stop=_stops(req.stop),
                include_stop=req.include_stop_str_in_output, logprobs=logprobs, echo=echo,
                token_ids_as_text=req.return_tokens_as_token_ids, stream=req.stream,
                include_usage=bool(options and options.include_usage), return_token_ids=req.return_token_ids,
                disaggregate=req.disaggregate)


def completion_plan(req: CompletionRequest, prompts: list[list[int]], limits: Limits) -> Plan:
    """The plan of a /v1/completions request whose prompts are tokenized. Raises APIError(400)."""
    _check_common(req, limits)
    _require(not req.suffix, "suffix", "suffix is not supported")
    _require(not (req.echo and req.logprobs is not None), "echo",
             "echo with logprobs would need the prompt's logprobs, which kvwire does not compute")
    best_of = req.n if req.best_of is None else req.best_of
    _require(req.n <= best_of <= MAX_CHOICES, "best_of", f"best_of must be in [n, {MAX_CHOICES}]")
    _require(not (req.stream and best_of > req.n), "best_of", "best_of > n cannot be streamed")
    return _plan(req, prompts, _max_tokens(req.max_tokens, prompts, limits, "max_tokens"), req.logprobs, best_of,
                 limits, echo=req.echo)


def chat_plan(req: ChatRequest, prompt: list[int], limits: Limits) -> Plan:
    """The plan of a /v1/chat/completions request whose messages are rendered and tokenized. Raises APIError(400)."""
    _check_common(req, limits)
    _require(req.top_logprobs is None or req.logprobs, "top_logprobs", "top_logprobs needs logprobs=true")
    _require(req.top_logprobs is None or 0 <= req.top_logprobs <= MAX_LOGPROBS, "top_logprobs",
             f"top_logprobs must be in [0, {MAX_LOGPROBS}]")
    _require(req.response_format is None or req.response_format.type == "text", "response_format",
             "only response_format {\"type\": \"text\"} is supported")
    _require(not req.tools, "tools", "tools are not supported")
    _require(req.tool_choice in (None, "none", "auto"), "tool_choice", "tool_choice needs tools, which are not "
                                                                       "supported")
    _require(not req.echo, "echo", "echo is not supported for chat")
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _plan(req, [prompt], _max_tokens(asked, [prompt], limits, param), logprobs, req.n, limits)
