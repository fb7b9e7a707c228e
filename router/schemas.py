"""OpenAI completions request / response shapes, and OpenAI-style errors."""

from __future__ import annotations

import msgspec


class CompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str | list[int]
    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    n: int = 1
    return_token_ids: bool = False
    disaggregate: bool = True  # False: the decode node computes the prompt itself (no prefill node, no transfer)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def parse_request(body: bytes, max_model_len: int) -> CompletionRequest:
    """Decode and check a completions request. Raises APIError(400)."""
    try:
        req = msgspec.json.decode(body, type=CompletionRequest)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"body is not valid JSON: {exc}") from None
    checks = [
        (req.n == 1, "n", "only n=1 is supported"),
        (1 <= req.max_tokens < max_model_len, "max_tokens", f"max_tokens must be in [1, {max_model_len})"),
        (0.0 <= req.temperature <= 100.0, "temperature", "temperature must be in [0, 100]"),
        (0.0 < req.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
        (req.seed is None or 0 <= req.seed < 2**63, "seed", "seed must be in [0, 2**63)"),
        (len(req.prompt) > 0, "prompt", "prompt must not be empty"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise APIError(400, message, param=param)
    return req
