"""The engine's `Delta`s as OpenAI's JSON: whole answers, stream chunks and usage.

One `Answer` gathers a request's choices as deltas arrive; `final` gives the whole answer,
`chunk` one server-sent event's object for one delta. A chat request with tools that the
model may call has its choices' text read for calls (`tools.Tools.calls`) when they finish:
its stream holds each choice's text back and sends it, or its calls, in the choice's last
chunk. With a reasoning parser a chat choice's text is its reasoning and its content
(`reasoning.py`, `harmony.py`), tool calls read from the content alone (or, in gpt-oss's
harmony format, from their own messages).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from kvjax.tokenizer import TextTokenizer

from . import reasoning
from .protocol import Parsed
from .requests import Delta

if TYPE_CHECKING:
    from .prompt_logprobs import PromptScores


@dataclasses.dataclass
class Choice:
    text: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    # The echoed prompt's tokens, their logprobs and top logprobs (None for the first).
    prompt: tuple[list, list, list] = dataclasses.field(default_factory=lambda: ([], [], []))
    # vLLM's prompt_logprobs: per prompt token None (the first) or {id: its logprob and rank}.
    prompt_scores: list | None = None
    streamed: reasoning.Stream | None = None  # with a reasoning parser: what was sent


class Answer:
    """The choices of one parsed request; choice `prompt * n + sample`."""

    def __init__(self, parsed: Parsed, tokenizer: TextTokenizer):
        self.parsed, self.tokenizer = parsed, tokenizer
        self.n = parsed.requests[0].n
        # A completion's echoed prompt is its text's start; a chat's echo comes before the
        # content its reasoning and calls are parsed from (`_message`).
        self.choices = [Choice(text="" if parsed.chat else parsed.echo[i // self.n])
                        for i in range(len(parsed.requests) * self.n)]
        if parsed.reasoning is not None:
            for choice in self.choices:
                choice.streamed = reasoning.Stream(parsed.reasoning)
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tickets: list = []  # the engine's tickets of its prompts (`output.Ticket`)

    @property
    def _echoes_logprobs(self) -> bool:
        return self.parsed.echo_prompt and self.parsed.logprobs

    @property
    def scores_prompts(self) -> bool:
        """Whether the answer reports its prompts' logprobs (`set_prompt_logprobs`)."""
        return self._echoes_logprobs or self.parsed.prompt_top is not None

    def set_prompt_logprobs(self, prompt: int, scores: PromptScores) -> None:
        """The logprobs of prompt `prompt`'s own tokens: with `echo`, reported before its
        choices' as theirs are; with vLLM's `prompt_logprobs`, each token's with its rank,
        beside the likeliest tokens and theirs (ranks 1, 2, ...)."""
        request, top = self.parsed.requests[prompt], self.parsed.prompt_top
        tokens = list(request.prompt)
        echoed = None if not self._echoes_logprobs else (
            tokens, scores.logprobs,
            [None if pairs is None else pairs[:request.logprobs] for pairs in scores.top])
        ranked = None if top is None else [None] + [
            self._ranked_place(own, scores.logprobs[t], scores.ranks[t], scores.top[t][:top])
            for t, own in enumerate(tokens) if t > 0]
        for choice in self.choices[prompt * self.n:(prompt + 1) * self.n]:
            if echoed is not None:
                choice.prompt = echoed
            choice.prompt_scores = ranked

    def _ranked_place(self, own: int, logprob: float, rank: int, likeliest) -> dict:
        """One prompt position of vLLM's prompt_logprobs: the prompt's token, then the
        likeliest others ((id, logprob) pairs, ranks 1, 2, ...), each under its id."""
        place = {str(own): self._ranked(own, logprob, rank)}
        for likeliest_rank, (token, token_logprob) in enumerate(likeliest, 1):
            place.setdefault(str(token), self._ranked(token, token_logprob, likeliest_rank))
        return place

    def _ranked(self, token: int, logprob: float, rank: int) -> dict:
        """One token of vLLM's prompt_logprobs (a logprob of -inf written -9999, as it does)."""
        return {"logprob": max(logprob, -9999.0), "rank": rank,
                "decoded_token": self.tokenizer.decode([token])}

    def index(self, prompt: int, delta: Delta) -> int:
        return prompt * self.n + delta.index

    def add(self, prompt: int, delta: Delta) -> None:
        choice = self.choices[self.index(prompt, delta)]
        choice.text += delta.text
        choice.tokens += delta.token_ids
        choice.logprobs += delta.logprobs
        choice.top_logprobs += delta.top_logprobs
        if delta.finish_reason:
            choice.finish_reason = "length" if delta.finish_reason == "length" else "stop"

    @property
    def done(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    def usage(self) -> dict:
        """The tokens of its prompts and choices; `prompt_tokens_details.cached_tokens`: the
        prompt tokens the prefix cache served, as far as the engine has staged them."""
        prompt = sum(len(r.prompt) for r in self.parsed.requests)
        completion = sum(len(c.tokens) for c in self.choices)
        cached = sum(t.cached_tokens or 0 for t in self.tickets)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _token(self, token: int) -> str:
        """A logprob's token: its text, or as vLLM's return_tokens_as_token_ids writes it
        (for a client that must tell tokens decoding to the same text apart)."""
        return f"token_id:{token}" if self.parsed.tokens_as_ids else self.tokenizer.decode(
            [token])

    def _logprobs(self, tokens, logprobs, top, offset: int = 0) -> Any:
        """The `logprobs` of a choice or of a delta, in the API's format (None if off)."""
        if not self.parsed.logprobs:
            return None
        strings = [self._token(t) for t in tokens]
        tops = [None if pairs is None else [(self._token(t), lp) for t, lp in pairs]
                for pairs in top]
        if self.parsed.chat:
            def entry(text, logprob):
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [
                {**entry(s, lp), "top_logprobs": [entry(t, tlp) for t, tlp in pairs]}
                for s, lp, pairs in zip(strings, logprobs, tops, strict=True)]}
        offsets = []
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": strings, "token_logprobs": logprobs,
                "top_logprobs": [None if pairs is None else dict(pairs) for pairs in tops],
                "text_offset": offsets}

    def final(self) -> dict:
        """The whole answer (no streaming)."""
        choices = []
        for i, c in enumerate(self.choices):
            tokens, logprobs, top = c.prompt
            logprobs = self._logprobs(tokens + c.tokens, logprobs + c.logprobs,
                                      top + c.top_logprobs)
            if self.parsed.chat:
                message, finish = self._message(c)
                choices.append({"index": i, "message": {"role": self.parsed.role, **message},
                                "logprobs": logprobs, "finish_reason": finish})
            else:
                choices.append({"index": i, "text": c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
                if self.parsed.prompt_top is not None:  # vLLM's: each choice its prompt's
                    choices[-1]["prompt_logprobs"] = c.prompt_scores
        answer = {"id": self.id, "object": "chat.completion" if self.parsed.chat
                  else "text_completion", "created": self.created, "model": self.parsed.model,
                  "choices": choices, "usage": self.usage()}
        if self.parsed.chat and self.parsed.prompt_top is not None:  # vLLM's: the answer's
            answer["prompt_logprobs"] = self.choices[0].prompt_scores
        return answer

    @property
    def _reads_calls(self) -> bool:
        return self.parsed.tools is not None and self.parsed.tools.choice != "none"

    def _message(self, choice: Choice, echoed: bool = True) -> tuple[dict, str | None]:
        """(the message's reasoning, content and calls, its finish reason) of a finished
        chat choice; its content after the echoed final message if `echoed` (vLLM's
        `echo`)."""
        message, finish = self._parsed_message(choice)
        if echoed and self.parsed.echo[0]:
            message = {**message, "content": self.parsed.echo[0] + (message["content"] or "")}
        return message, finish

    def _parsed_message(self, choice: Choice) -> tuple[dict, str | None]:
        message, text = {}, choice.text
        if self.parsed.reasoning is not None:
            parts = self.parsed.reasoning.split(text, choice.tokens, finished=True)
            message = {"reasoning": parts.reasoning, "reasoning_content": parts.reasoning}
            text = parts.content
            if parts.calls:
                return {**message, "content": text, "tool_calls": list(parts.calls)}, \
                    "tool_calls"
        if not self._reads_calls or text is None:
            return {**message, "content": text}, choice.finish_reason
        content, calls = self.parsed.tools.calls(text)
        if not calls:
            return {**message, "content": content}, choice.finish_reason
        return {**message, "content": content, "tool_calls": calls}, "tool_calls"

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.parsed.chat
                 else "text_completion", "created": self.created, "model": self.parsed.model,
                 "choices": choices}
        if self.parsed.include_usage:  # the usage so far in every chunk, if asked; else last
            chunk["usage"] = (self.usage() if usage is None and self.parsed.continuous_usage
                              else usage)
        return chunk

    def opening_chunks(self) -> list[dict]:
        """What a stream starts with: each chat choice's role (and the final message it
        continues, with echo), each completion choice's echoed prompt (with echo)."""
        if self.parsed.chat:
            echoed = [{"content": self.parsed.echo[0]}] if self.parsed.echo[0] else []
            return [self._chunk([{"index": i, "delta": delta, "logprobs": None,
                                  "finish_reason": None}])
                    for i in range(len(self.choices))
                    for delta in [{"role": self.parsed.role, "content": ""}, *echoed]]
        return [self._chunk([{"index": i, "text": c.text,
                              "logprobs": self._logprobs(*c.prompt) if c.prompt[0] else None,
                              "finish_reason": None}])
                for i, c in enumerate(self.choices) if c.text or c.prompt[0]]

    def chunk(self, prompt: int, delta: Delta) -> dict | None:
        """The stream chunk of `delta` (after `add`), or None if it carries nothing."""
        if not (delta.text or delta.finish_reason or (self.parsed.logprobs and delta.token_ids)):
            return None
        index = self.index(prompt, delta)
        choice = self.choices[index]
        if self.parsed.chat and self._reads_calls:
            return self._whole_choice_chunk(index) if delta.finish_reason else None
        finish = choice.finish_reason if delta.finish_reason else None
        offset = len(choice.text) - len(delta.text)
        logprobs = self._logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs, offset)
        if self.parsed.chat:
            if choice.streamed is not None:
                content = choice.streamed.delta(choice.text, choice.tokens,
                                                finished=finish is not None)
                if not (content or finish or logprobs):
                    return None  # held back: it may be the start of a tag
            else:
                content = {"content": delta.text} if delta.text else {}
            entry = {"index": index, "delta": content, "logprobs": logprobs,
                     "finish_reason": finish}
        else:
            entry = {"index": index, "text": delta.text, "logprobs": logprobs,
                     "finish_reason": finish}
        return self._chunk([entry])

    def _whole_choice_chunk(self, index: int) -> dict:
        """A finished choice's text or calls in one chunk (OpenAI's delta format: each call
        with its `index`)."""
        choice = self.choices[index]
        message, finish = self._message(choice, echoed=False)  # sent when the stream opened
        delta = {key: message[key] for key in ("reasoning", "reasoning_content", "content")
                 if message.get(key) is not None}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": i, **call}
                                   for i, call in enumerate(message["tool_calls"])]
        logprobs = self._logprobs(choice.tokens, choice.logprobs, choice.top_logprobs)
        return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish}])

    def usage_chunk(self) -> dict:
        return self._chunk([], self.usage())

    # The stream as the server sends it: server-sent events (`response_answers.py` has its own).
    def stream_opening(self) -> list[str]:
        return [sse(chunk) for chunk in self.opening_chunks()]

    def stream_delta(self, prompt: int, delta: Delta) -> list[str]:
        chunk = self.chunk(prompt, delta)
        return [] if chunk is None else [sse(chunk)]

    def stream_closing(self) -> list[str]:
        usage = [sse(self.usage_chunk())] if self.parsed.include_usage else []
        return usage + ["data: [DONE]\n\n"]

    def stream_error(self, error) -> list[str]:  # error: a `protocol.APIError`
        return [sse(error.body())]


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event carrying `data` as JSON, named `event` if given."""
    return ("" if event is None else f"event: {event}\n") + f"data: {json.dumps(data)}\n\n"
