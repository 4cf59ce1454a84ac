"""What the server takes from a client before it does any work for it.

A request body is read only up to `Limits.max_body_bytes` and within `read_timeout` seconds;
it must be JSON sent as `application/json` (a browser page cannot send that to another
origin without a CORS preflight, which this server never answers), nested at most
`max_json_depth` deep, with no string that is not Unicode (a lone surrogate such as
"\\ud800", which JSON allows and UTF-8 cannot encode). Every refusal is an `APIError` with
the status that says whose fault it is and, where one field is at fault, that field as its
`param`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
from typing import Any

from starlette.requests import Request

from .protocol import APIError


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds a request must keep. `max_prompts` None: the queue's length, since the
    prompts of a request are queued together."""

    max_body_bytes: int = 16 << 20
    max_json_depth: int = 32
    max_prompts: int | None = None
    max_stop_strings: int = 16
    max_stop_chars: int = 1024
    read_timeout: float = 30.0  # seconds for the body, once the headers are in
    # Responses API answers kept for previous_response_id and GET (`response_store.py`).
    max_stored_responses: int = 256
    header_timeout: float = 10.0  # seconds for a new connection's first request's headers


async def read_json(request: Request, limits: Limits) -> Any:
    """The request's JSON body, checked as the module says."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(415, f"the body must be JSON sent with Content-Type: application/json, "
                            f"not {kind or 'none'!r}")
    try:
        raw = await asyncio.wait_for(_read(request, limits.max_body_bytes),
                                     limits.read_timeout)
    except TimeoutError:
        raise APIError(408, f"the body did not arrive within {limits.read_timeout:g} s") from None
    # Off the event loop: decoding and walking megabytes of JSON must not stall other
    # requests' streams, nor /health.
    return await asyncio.to_thread(_decode, raw, limits.max_json_depth)


def _decode(raw: bytes, max_depth: int) -> Any:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise APIError(400, f"the JSON body is nested more than {max_depth} levels "
                            "deep") from None
    _check_tree(body, max_depth)
    return body


async def _read(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the body has {int(declared)} bytes, more than the "
                            f"{max_bytes} bytes this server takes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the body is longer than the {max_bytes} bytes this server "
                                "takes")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_tree(body: Any, max_depth: int) -> None:
    """Depth and Unicode of every value, without recursion (a deep body must not be able to
    exhaust the stack); `param` is the top-level field the bad value is in."""
    pending = [(body, 1, None)]
    while pending:
        value, depth, field = pending.pop()
        if depth > max_depth:
            raise APIError(400, f"the JSON body is nested more than {max_depth} levels deep",
                           field)
        if isinstance(value, dict):
            for key, item in value.items():
                where = key if field is None else field
                _check_text(key, where)
                pending.append((item, depth + 1, where))
        elif isinstance(value, list):
            pending.extend((item, depth + 1, field) for item in value)
        elif isinstance(value, str):
            _check_text(value, field)


def _check_text(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = "" if field is None else f" in {_printable(field)}"
        raise APIError(400, f"invalid Unicode{where}: a lone surrogate "
                            f"({text[error.start]!a}) at character {error.start}",
                       None if field is None else _printable(field)) from None


def _printable(text: str) -> str:
    """`text` with anything UTF-8 cannot hold escaped, so that an error message about it
    can always be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def authorized(request: Request, api_key: str | None) -> None:
    """Nothing if no key is set or the request carries it as OpenAI's clients send it
    (`Authorization: Bearer KEY`); else a 401."""
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                             api_key.encode()):
        raise APIError(401, "a valid API key is required: send Authorization: Bearer <key>",
                       kind="invalid_request_error", code="invalid_api_key")


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol, closing a connection whose first request's headers have not
    all arrived `seconds` after it opened (idle or half-sent connections would otherwise be
    held until the client lets go; uvicorn's keep-alive timeout covers the time between
    requests)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._header_deadline = self.loop.call_later(seconds, self._close_if_no_request)

        def _close_if_no_request(self):
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            self._header_deadline.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
