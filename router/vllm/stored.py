"""Which decode instance holds which stored Responses API answer, and the calls that must reach it.

vLLM keeps a stored answer (the Responses API's `store`, where the server runs with
VLLM_ENABLE_RESPONSES_API_STORE=1) in the memory of the server that gave it. A later turn naming it
(`previous_response_id`), GET /v1/responses/{id} and POST /v1/responses/{id}/cancel must reach that server:

1. The router remembers the decode instance of each Responses answer it relays (the id from a whole answer's
   body, or from a stream's first event that names one), the latest `limit` of them.
2. A later turn goes decode-only (PathReason.PREVIOUS_RESPONSE) to the instance remembered, while it is up.
3. GET and cancel go there too; an id the router does not know (it restarted, or another router relayed the
   answer) is asked of each decode instance up in turn until one does not answer 404.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from kvwire.router.vllm.bodies import Endpoint

# a Responses answer's id as vLLM (and OpenAI) make them, as the first "id" of a body or of a stream's events
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,200})"')


def response_id_of(content: bytes) -> str | None:
    """The first Responses answer id in `content` (a whole answer, or a piece of a stream); None if there is none."""
    found = _RESPONSE_ID.search(content)
    return found.group(1).decode() if found else None


class StoredResponses:
    """Response id -> the decode instance that answered it, the latest `limit` ids."""

    def __init__(self, limit: int = 65_536):
        self.limit = limit
        self._homes: OrderedDict[str, str] = OrderedDict()

    def remember(self, response_id: str, url: str) -> None:
        self._homes[response_id] = url
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)

    def home(self, response_id: str) -> str | None:
        """The decode instance that answered `response_id`; None if the router does not know it."""
        return self._homes.get(response_id)

    def home_of(self, body: dict[str, Any]) -> str | None:
        """The decode instance that answered the earlier turn a Responses body names (`previous_response_id`)."""
        earlier = body.get("previous_response_id")
        return self.home(earlier) if isinstance(earlier, str) else None

    def remember_from(self, endpoint: Endpoint, url: str, content: bytes) -> bool:
        """Whether `content` (decode instance `url`'s answer to a request to `endpoint`, or a piece of its stream)
        named a Responses answer's id, then remembered as `url`'s."""
        if endpoint != Endpoint.RESPONSES or (response_id := response_id_of(content)) is None:
            return False
        self.remember(response_id, url)
        return True

    def __len__(self) -> int:
        return len(self._homes)
