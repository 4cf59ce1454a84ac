"""OpenAI's Responses API, `POST /v1/responses`, served through the chat path: a request's
`instructions` and `input` items become a chat's messages and its settings the chat's
(`chat_body`); the chat's answer becomes the response's output items, a reasoning item (with
a reasoning parser), a message and function calls, or, streamed, the Responses API's events
(`response_answers.py`).

A request goes on from a kept response (`previous_response_id`, `response_store.py`) or
sends the whole conversation back as `input`: earlier messages, reasoning, function calls
and their outputs. A `background` request is answered at once with the response queued; the
client polls it (`GET /v1/responses/{id}`) or cancels it. What kvjax does not have is a 400
naming the field: conversations (`conversation`), streaming a background response, prompt
templates, built-in tools (web or file search, code interpreter, ...), input other than
text and reasoning summaries. With `truncation: "auto"` a conversation too long for a slot
loses its earliest turns (`fitted`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .protocol import APIError
from .response_store import ResponseStore

# Settings a Responses request shares with a chat request (OpenAI's and vLLM's extensions),
# passed on unchanged; the chat path checks them.
SHARED_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "min_tokens", "logit_bias", "cache_salt", "chat_template_kwargs",
                 "parallel_tool_calls", "stream", "priority")
# What needs state or a capability kvjax does not have: (field, its no-op values, why).
_REFUSED = [("conversation", (None,), "send the conversation as input, or go on from a "
                                      "response with previous_response_id"),
            ("prompt", (None,), "prompt templates are not stored here"),
            ("max_tool_calls", (None,), ""), ("context_management", (None,), "")]
# The statuses of an answer a request may go on from.
FINISHED = ("completed", "incomplete")
LOGPROBS = "message.output_text.logprobs"  # what `include` may ask for, and:
# a reasoning item's own text, for a client that sends it back unstored: its `content` holds
# it (kvjax encrypts nothing), so asking for it changes nothing.
REASONING_TEXT = "reasoning.encrypted_content"
# The Responses request's field that became each chat field (`chat_body`).
_FIELD_OF = {"messages": "input", "max_completion_tokens": "max_output_tokens",
             "max_tokens": "max_output_tokens", "response_format": "text",
             "reasoning_effort": "reasoning", "logprobs": "include"}


def renamed(error: APIError) -> APIError:
    """`error`, raised for the chat request `chat_body` made, naming the Responses
    request's field instead."""
    error.param = _FIELD_OF.get(error.param, error.param)
    return error


def chat_body(body: Any, store: ResponseStore | None = None) -> dict:
    """The /v1/chat/completions request that a Responses request `body` (JSON-decoded)
    asks for, after the conversation of the response it goes on from (in `store`); an
    APIError 400 names what it cannot honour, a 404 a response not kept."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, off, why in _REFUSED:
        if body.get(name, None) not in off:
            raise APIError(400, f"{name} is not supported by this server"
                                + (f": {why}" if why else ""), name)
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise APIError(400, f"truncation={body['truncation']!r} must be 'disabled' or 'auto'",
                       "truncation")
    if body.get("background") not in (None, False, True):
        raise APIError(400, f"background={body['background']!r} must be a boolean", "background")
    if body.get("background") and (body.get("stream") or body.get("store") is False
                                   or store is None or store.capacity == 0):
        raise APIError(400, "a background response is kept for the client to poll: it takes "
                            "neither stream nor store false, on a server that keeps "
                            "responses (--max-stored-responses > 0)", "background")
    chat = {name: body[name] for name in SHARED_FIELDS if name in body}
    messages = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise APIError(400, "instructions must be a string", "instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    if body.get("input") is None:
        raise APIError(400, "input is required", "input")
    chat["messages"] = messages + _earlier(body, store) + _messages(body["input"])
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    include = body.get("include") or []
    if not isinstance(include, list) or any(e not in (LOGPROBS, REASONING_TEXT) for e in include):
        raise APIError(400, f"include={include!r}: this server can include only {LOGPROBS!r} "
                            f"(and {REASONING_TEXT!r}, which reasoning items' content holds)",
                       "include")
    if LOGPROBS in include:
        chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs") or 0
    elif body.get("top_logprobs"):
        raise APIError(400, f"top_logprobs needs include: [{LOGPROBS!r}]", "top_logprobs")
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(_list(body, "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    chat.update(_text_format(body.get("text")))
    chat.update(_reasoning(body.get("reasoning")))
    return chat


def fitted(chat: dict, body: dict, prompt_length: Callable[[dict], int], capacity: int) -> dict:
    """`chat` (what `chat_body` made of `body`) with its earliest turns dropped, each a user
    message and what answered it, until its prompt (`prompt_length` tokens) and output fit
    a slot of `capacity` tokens, where `body` asks for `truncation: "auto"`. The system
    message stays; so does the last turn, which the chat path refuses if it still does not
    fit."""
    if body.get("truncation") != "auto":
        return chat
    room = chat.get("max_completion_tokens") or 1
    messages = chat["messages"]
    kept = 1 if messages and messages[0].get("role") in ("system", "developer") else 0
    system, turns = messages[:kept], messages[kept:]
    while prompt_length({**chat, "messages": system + turns}) + room > capacity:
        later = next((i for i in range(1, len(turns)) if turns[i].get("role") == "user"), None)
        if later is None:
            break
        turns = turns[later:]
    return {**chat, "messages": system + turns}


def _earlier(body: dict, store: ResponseStore | None) -> list[dict]:
    """The conversation of the response `previous_response_id` names, if any."""
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    kept = None if store is None or not isinstance(previous, str) else store.get(previous)
    if kept is None:
        raise APIError(404, f"Previous response with id {previous!r} not found: this server "
                            f"keeps the most recent {store.capacity if store else 0} it "
                            "answered with store true", "previous_response_id",
                       kind="not_found_error")
    status = kept.response["status"]
    if status not in FINISHED:  # a background one running, cancelled or failed
        why = "has not ended" if status in ("queued", "in_progress") else f"is {status}"
        raise APIError(400, f"Previous response {previous!r} {why}: a request goes on from "
                            f"a {' or '.join(FINISHED)} one", "previous_response_id")
    return [dict(message) for message in kept.conversation]


def _list(body: dict, name: str) -> list:
    if not isinstance(body[name], list):
        raise APIError(400, f"{name} must be a list", name)
    return body[name]


def _messages(items: Any) -> list[dict]:
    """A chat's messages from a Responses `input`: a string (one user message) or items:
    messages (with text parts), function calls (the assistant's) and their outputs."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input must be a string or a non-empty list of items", "input")
    messages: list[dict] = []
    reasoning = None  # a reasoning item's text, for the assistant message it led to
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if reasoning is not None and not (kind == "function_call" or kind == "message"
                                          and item.get("role") == "assistant"):
            raise APIError(400, f"input[{i - 1}] is a reasoning item: it goes right before "
                                "the assistant's message or calls it led to", "input")
        if kind == "reasoning":
            reasoning = "".join(part.get("text", "") for part in item.get("content") or []
                                if isinstance(part, dict))
        elif kind == "message":
            messages.append({"role": item.get("role"),
                             "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and reasoning is None:
                messages[-1].setdefault("tool_calls", []).append(call)  # one turn's calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("output"), str):
                raise APIError(400, f"input[{i}].output must be a string", "input")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": item["output"]})
        else:
            raise APIError(400, f"input[{i}].type={kind!r} is not supported by this server: "
                                "it takes messages, reasoning, function calls and their "
                                "outputs", "input")
        if reasoning is not None and kind != "reasoning":
            messages[-1]["reasoning_content"], reasoning = reasoning, None
    if reasoning is not None:
        raise APIError(400, f"input[{len(items) - 1}] is a reasoning item: it goes right "
                            "before the assistant's message or calls it led to", "input")
    return messages


def _text(content: Any, index: int) -> Any:
    """A message's content as a chat's: a string, or its text parts (`input_text`, or
    `output_text` in an earlier answer)."""
    if not isinstance(content, list):
        return content  # a string, or what the chat path refuses by name
    parts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"input[{index}].content[{j}] is {kind!r}: this model reads "
                                "text only", "input")
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def _chat_tool(tool: Any, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise APIError(400, f"tools[{index}] is {kind!r}: this server calls functions only "
                            "(built-in tools are OpenAI's)", "tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none", "auto", "required", or what the chat path refuses by name


def _text_format(text: Any) -> dict:
    """The chat's `response_format` for a Responses `text` setting."""
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise APIError(400, "text must be an object", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise APIError(400, f"text.verbosity={text['verbosity']!r} is not supported by this "
                            "server", "text")
    form = text.get("format") or {"type": "text"}
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_object",
                                                              "json_schema"):
        raise APIError(400, f"text.format={form!r} must be of type text, json_object or "
                            "json_schema", "text")
    if form["type"] == "text":
        return {}
    if form["type"] == "json_object":
        return {"response_format": {"type": "json_object"}}
    schema = {k: v for k, v in form.items() if k != "type"}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _reasoning(reasoning: Any) -> dict:
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise APIError(400, "reasoning must be an object", "reasoning")
    if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
        raise APIError(400, "reasoning summaries are not supported by this server: with a "
                            "reasoning parser the reasoning itself is an output item",
                       "reasoning")
    return {} if reasoning.get("effort") is None else {"reasoning_effort": reasoning["effort"]}
