"""The answer to a Responses API request (`responses.py`): the chat answer to the messages it
became, as a response object whose output items come in order (a reasoning item with a
reasoning parser, a message unless the answer is only function calls, then the calls), or
streamed as the Responses API's events, which add up to that object.

`usage.input_tokens_details.cached_tokens` counts the prompt tokens the prefix cache served;
`cache_write_tokens` is 0: keeping a prompt's prefix costs a request nothing.
"""

from __future__ import annotations

import time
import uuid

from kvjax.tokenizer import TextTokenizer

from .answers import Answer, sse
from .protocol import APIError, Parsed
from .requests import Delta
from .response_items import input_items
from .response_store import ResponseStore


class ResponseAnswer:
    """One Responses request's answer, built from the chat `Answer` of `parsed` (one
    prompt, one sample); `body` is the request as sent, whose settings the response
    repeats. Finished, it is kept in `store` (unless the request says `store: false`) with
    the conversation it ends: `messages`, the chat's (its `instructions` left out), and its
    answer; and with its input items, those of the response it goes on from included. A
    `background` one is read while it runs (`current`) and may end cancelled or failed
    (`end`)."""

    scores_prompts = False  # a response reports no logprobs of its prompt

    def __init__(self, parsed: Parsed, tokenizer: TextTokenizer, body: dict,
                 messages: list[dict] | None = None, store: ResponseStore | None = None):
        self.chat, self.parsed, self.body = Answer(parsed, tokenizer), parsed, body
        self.store = store if body.get("store") is not False else None
        instructions = 1 if body.get("instructions") is not None else 0  # a system message
        self.messages = list(messages or [])[instructions:]
        earlier = (self.store.get(body["previous_response_id"])
                   if self.store is not None and body.get("previous_response_id") else None)
        self.items = [] if self.store is None else input_items(
            body, earlier.items if earlier else [], earlier.response["output"] if earlier else [])
        self.tokenizer = tokenizer
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self._sequence = 0
        self._open: dict | None = None  # the item being streamed: kind, id, index, text
        self._announced = 0  # output items whose "added" event has been sent
        self._finished: tuple[str, list[dict], dict] | None = None
        self._final: dict | None = None
        self._message: dict = {}  # the chat's message, read once by `_output`
        self.background = bool(body.get("background"))
        self._begun = False  # whether a token has come

    @property
    def done(self) -> bool:
        return self.chat.done

    @property
    def tickets(self) -> list:
        return self.chat.tickets

    @tickets.setter
    def tickets(self, tickets: list) -> None:
        self.chat.tickets = tickets

    def add(self, prompt: int, delta: Delta) -> None:
        self._begun = True
        self.chat.add(prompt, delta)

    def current(self) -> dict:
        """The response as it stands: final once finished (or ended), else queued until
        its first token comes, then in progress."""
        if self._final is not None:
            return self._final
        return self._response("in_progress" if self._begun else "queued", [], None)

    def end(self, status: str, error: dict | None = None) -> dict:
        """Ends an unfinished answer `status` ("cancelled", or "failed" with `error`, as
        OpenAI writes one: {"code", "message"}), kept without output."""
        if self._final is None:
            self._final = self._response(status, [], None) | {"error": error}
            if self.store is not None:
                self.store.put(self._final, [], self.items)
        return self._final

    # The whole answer -----------------------------------------------------------------------

    def final(self) -> dict:
        """The response (kept in the store, if the request is to be)."""
        if self._final is None:
            self._final = self._response(*self._output())
            if self.store is not None:
                message = self._message  # as `_output` read it: the calls' ids drawn once
                answer = {"role": "assistant", "content": message["content"] or ""} | {
                    key: message[key] for key in ("reasoning_content", "tool_calls")
                    if message.get(key)}
                self.store.put(self._final, self.messages + [answer], self.items)
        return self._final

    def _item_id(self, kind: str, index: int = 0) -> str:
        suffix = self.id.removeprefix("resp_")
        return {"reasoning": f"rs_{suffix}", "message": f"msg_{suffix}"}.get(
            kind, f"fc_{suffix}_{index}")

    def _output(self) -> tuple[str, list[dict], dict]:
        """(status, output items, usage) of the finished answer, made once (a call's id is
        drawn when it is read)."""
        if self._finished is None:
            self._finished = self._read_output()
        return self._finished

    def _read_output(self) -> tuple[str, list[dict], dict]:
        whole = self.chat.final()
        choice, usage = whole["choices"][0], whole["usage"]
        message = self._message = choice["message"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        items = []
        if message.get("reasoning"):
            items.append(_reasoning_item(self._item_id("reasoning"), message["reasoning"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            logprobs = (choice["logprobs"] or {}).get("content") or []
            items.append({"type": "message", "id": self._item_id("message"),
                          "role": "assistant", "status": status,
                          "content": [{"type": "output_text", "text": message["content"] or "",
                                       "annotations": [], "logprobs": logprobs}]})
        items += [{"type": "function_call", "id": self._item_id("call", i),
                   "call_id": call["id"], "name": call["function"]["name"],
                   "arguments": call["function"]["arguments"], "status": "completed"}
                  for i, call in enumerate(calls)]
        return status, items, {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
            "total_tokens": usage["total_tokens"]}

    def _reasoning_tokens(self) -> int:
        """The tokens before the first that begins the answer's content or calls (all of
        them if it has none after its reasoning); 0 without a reasoning parser."""
        parser, tokens = self.parsed.reasoning, self.chat.choices[0].tokens
        if parser is None or not tokens:
            return 0

        def answered(k: int) -> bool:  # grows with k: once begun, content stays begun
            parts = parser.split(self.tokenizer.decode(tokens[:k]), tokens[:k], finished=False)
            return bool(parts.content or parts.calls)

        if not answered(len(tokens)):
            reasoning = parser.split(self.chat.choices[0].text, tokens, finished=True).reasoning
            return len(tokens) if reasoning else 0
        low, high = 1, len(tokens)  # the first k that answers lies in [low, high]
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if answered(middle) else (middle + 1, high)
        return low - 1

    def _response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        request, body = self.parsed.requests[0], self.body
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "model": self.parsed.model, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
                "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "temperature": request.sampling.temperature, "top_p": request.sampling.top_p,
                "tool_choice": body.get("tool_choice") or "auto",
                "tools": body.get("tools") or [], "max_output_tokens": request.max_tokens,
                "previous_response_id": body.get("previous_response_id"),
                "reasoning": body.get("reasoning"),
                "text": body.get("text") or {"format": {"type": "text"}},
                "top_logprobs": body.get("top_logprobs") or 0,
                "truncation": body.get("truncation") or "disabled",
                "background": self.background, "usage": usage, "user": body.get("user")}

    # The stream ------------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> str:
        self._sequence += 1
        return sse({"type": kind, "sequence_number": self._sequence - 1, **fields}, event=kind)

    def stream_opening(self) -> list[str]:
        begun = self._response("in_progress", [], None)
        return [self._event("response.created", response=begun),
                self._event("response.in_progress", response=begun)]

    def stream_delta(self, prompt: int, delta: Delta) -> list[str]:
        """The events of `delta` (after `add`)."""
        chunk = self.chat.chunk(prompt, delta)
        if chunk is None:
            return []
        entry = chunk["choices"][0]
        events = []
        if entry["delta"].get("reasoning"):
            events += self._stream_text("reasoning", entry["delta"]["reasoning"], [])
        if entry["delta"].get("content"):
            events += self._stream_text("message", entry["delta"]["content"],
                                        (entry["logprobs"] or {}).get("content") or [])
        if entry["finish_reason"]:
            events += self._finish()
        return events

    def stream_closing(self) -> list[str]:
        return []  # the response's last event says it is complete: no end marker

    def stream_error(self, error: APIError) -> list[str]:
        body = error.body()["error"]
        return [self._event("error", code=body.get("code"), message=body["message"],
                            param=body.get("param"))]

    def _stream_text(self, kind: str, text: str, logprobs: list) -> list[str]:
        """Events for `text` added to the item of `kind` ("reasoning" or "message"), which
        opens (closing the one before it) if it is not the one being streamed."""
        events = []
        if self._open is None or self._open["kind"] != kind:
            events += self._close_open()
            index, item_id = self._announced, self._item_id(kind)
            self._announced += 1
            self._open = {"kind": kind, "id": item_id, "index": index, "text": "",
                          "logprobs": []}
            item, part = _begun_item(kind, item_id)
            events += [self._event("response.output_item.added", output_index=index, item=item),
                       self._event("response.content_part.added", item_id=item_id,
                                   output_index=index, content_index=0, part=part)]
        opened = self._open
        opened["text"] += text
        opened["logprobs"] += logprobs
        place = dict(item_id=opened["id"], output_index=opened["index"], content_index=0)
        if kind == "message":
            return events + [self._event("response.output_text.delta", delta=text,
                                         logprobs=logprobs, **place)]
        return events + [self._event("response.reasoning_text.delta", delta=text, **place)]

    def _close_open(self, item: dict | None = None) -> list[str]:
        """The events that end the item being streamed (`item`: as the response holds it)."""
        opened, self._open = self._open, None
        if opened is None:
            return []
        if item is None:  # the reasoning, ended by the message after it
            item = _reasoning_item(opened["id"], opened["text"])
        return self._ending(opened["index"], item)

    def _ending(self, index: int, item: dict) -> list[str]:
        """The events that end output item `index`, `item` as the response holds it."""
        place = dict(item_id=item["id"], output_index=index)
        if item["type"] == "function_call":
            return [self._event("response.function_call_arguments.done",
                                arguments=item["arguments"], name=item["name"], **place),
                    self._event("response.output_item.done", output_index=index, item=item)]
        part = item["content"][0]
        done = (self._event("response.output_text.done", text=part["text"], content_index=0,
                            logprobs=part["logprobs"], **place)
                if item["type"] == "message" else
                self._event("response.reasoning_text.done", text=part["text"], content_index=0,
                            **place))
        return [done, self._event("response.content_part.done", content_index=0, part=part,
                                  **place),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _finish(self) -> list[str]:
        """The events that end the stream: the open item's end, those of the items never
        streamed (the calls; a message without text), and the whole response."""
        status, output, usage = self._output()
        events = []
        for index, item in enumerate(output):
            if self._open is not None and index == self._open["index"]:
                events += self._close_open(item)
            elif index >= self._announced:
                events += self._announce(index, item)
        self._announced = len(output)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=self.final())]

    def _announce(self, index: int, item: dict) -> list[str]:
        """The events of an output item sent whole, from its start to its end."""
        if item["type"] == "function_call":
            begun = {**item, "arguments": "", "status": "in_progress"}
            return [self._event("response.output_item.added", output_index=index, item=begun),
                    self._event("response.function_call_arguments.delta",
                                delta=item["arguments"], item_id=item["id"],
                                output_index=index)] + self._ending(index, item)
        begun, part = _begun_item(item["type"], item["id"])
        return [self._event("response.output_item.added", output_index=index, item=begun),
                self._event("response.content_part.added", item_id=item["id"],
                            output_index=index, content_index=0, part=part)
                ] + self._ending(index, item)


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _begun_item(kind: str, item_id: str) -> tuple[dict, dict]:
    """(an item of `kind` as it starts, its first content part as it starts)."""
    if kind == "message":
        return ({"type": "message", "id": item_id, "role": "assistant",
                 "status": "in_progress", "content": []},
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    return ({"type": "reasoning", "id": item_id, "summary": [], "content": [],
             "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
