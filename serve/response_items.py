"""A kept response's input items, as `GET /v1/responses/{id}/input_items` lists them.

A response's input items are the items its answer was made from: those of the response it
went on from (`previous_response_id`) and that response's output, then its own `input`, each
as an item with an `id` (a string input is one user message). `instructions` are a setting,
not an item, as OpenAI has it. The list is paged as OpenAI's lists are: newest first unless
`order=asc`, at most `limit` (1 to 100, default 20) items after (or before) the item a
cursor names, and `has_more` when the order holds more past the page.
"""

from __future__ import annotations

import uuid
from typing import Any

from .protocol import APIError
from .responses import LOGPROBS, REASONING_TEXT

MAX_LIMIT = 100
DEFAULT_LIMIT = 20
# The prefix of the id an item is given if it came without one, by its type.
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


def input_items(body: dict, earlier_items: list[dict], earlier_output: list[dict]) -> list[dict]:
    """The input items of the response a Responses request `body` asks for, after the
    items (`earlier_items`) and output of the response it goes on from; `body` is one that
    `responses.chat_body` took."""
    given = body["input"]
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    return [*earlier_items, *earlier_output, *(_item(item) for item in given)]


def _item(item: dict) -> dict:
    kind = item.get("type", "message")
    made = {"id": item.get("id") or f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}", "type": kind}
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        part = "output_text" if role == "assistant" else "input_text"
        if isinstance(content, str):
            content = [{"type": part, "text": content}]
        content = [{"type": p["type"], "text": p.get("text")}
                   | ({"annotations": p.get("annotations") or []} if p["type"] == "output_text"
                      else {}) for p in content]
        return made | {"role": role, "content": content, "status": "completed"}
    if kind == "reasoning":
        return made | {"summary": item.get("summary") or [],
                       "content": [{"type": "reasoning_text", "text": p.get("text", "")}
                                   for p in item.get("content") or []]}
    keys = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
    return made | {key: item.get(key) for key in keys} | {"status": "completed"}


def page(items: list[dict], query: Any) -> dict:
    """The list object of the page of `items` (in input order) that `query` (the request's
    query parameters: limit, order, after, before, include) asks for; an APIError 400 names
    a bad parameter."""
    limit = query.get("limit", str(DEFAULT_LIMIT))
    if not (limit.isdigit() and 1 <= int(limit) <= MAX_LIMIT):
        raise APIError(400, f"limit={limit!r} must be an integer from 1 to {MAX_LIMIT}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order={order!r} must be 'asc' or 'desc'", "order")
    include = query.getlist("include") if hasattr(query, "getlist") else []
    if any(entry not in (LOGPROBS, REASONING_TEXT) for entry in include):
        raise APIError(400, f"include={include!r}: this server can include only {LOGPROBS!r} "
                            f"and {REASONING_TEXT!r}", "include")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start, stop = 0, len(ordered)
    for cursor in ("after", "before"):
        if query.get(cursor) is None:
            continue
        if query[cursor] not in ids:
            raise APIError(400, f"{cursor}={query[cursor]!r} is not an input item of this "
                                "response", cursor)
        if cursor == "after":
            start = ids.index(query[cursor]) + 1
        else:
            stop = ids.index(query[cursor])
    # After a cursor (or from the start) the first `limit`; before one, the `limit` nearest.
    window = ordered[start:stop]
    chosen = window[-int(limit):] if query.get("before") is not None and \
        query.get("after") is None else window[:int(limit)]
    return {"object": "list", "data": chosen,
            "first_id": chosen[0]["id"] if chosen else None,
            "last_id": chosen[-1]["id"] if chosen else None,
            "has_more": len(chosen) < len(window)}
