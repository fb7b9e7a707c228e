"""What a router answers for a path it does not serve (404) or a method a path does not take (405): OpenAI's error
shape (what its clients read), naming the routes it serves, instead of the framework's {"detail": "Not Found"}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from kvwire.router.schemas import APIError


def answer_not_served(app: FastAPI) -> None:
    """Answer `app`'s 404 and 405 (and any other HTTP error the framework raises) in OpenAI's shape."""

    async def handler(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)  # the handler of HTTPException only
        if exc.status_code in (404, 405):
            served = sorted(f"{method} {route.path}" for route in app.routes if isinstance(route, APIRoute)
                            for method in route.methods or ())
            what = f"{request.method} {request.url.path} is not served" if exc.status_code == 404 else \
                f"{request.url.path} does not take {request.method}"
            message = f"{what} here; this router serves {', '.join(served)}"
            err = APIError(exc.status_code, message, type_="not_found" if exc.status_code == 404 else
                           "method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=err.status, headers=getattr(exc, "headers", None))

    app.add_exception_handler(HTTPException, handler)
