"""gpt-oss's answers in OpenAI's harmony format, read from their tokens:
`kvjax serve --reasoning-parser harmony` (`openai_gptoss`, vLLM's name).

gpt-oss writes each answer as messages, each `<|channel|>CHANNEL<|message|>TEXT` closed by
`<|end|>` (more to come, the next opening with `<|start|>assistant`), `<|return|>` (the last)
or `<|call|>` (a tool call): its thinking in the `analysis` channel, its answer in `final`,
its tool calls in `commentary` with a recipient (`to=functions.NAME`, before or after the
channel) and JSON arguments as the text. The markers are special tokens, which the text
of a choice leaves out, so the parser reads the choice's token ids: the analysis messages
become the message's `reasoning`, the final ones its `content`, a call of a request's tool
a `tool_calls` entry; a message of any other channel goes to the content. The chat template
ends the prompt with `<|start|>assistant`, so a choice starts in a message's header.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

from .reasoning import Split
from .tools import tool_call

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
           "<|constrain|>")
_CLOSING = ("<|end|>", "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"\bto=(\S+)")


def marker_ids(tokenizer) -> dict[int, str]:
    """The id of each harmony marker in `tokenizer`; a ValueError if one is not a token of
    its own (a tokenizer that is not gpt-oss's)."""
    ids = {}
    for marker in MARKERS:
        encoded = list(tokenizer.encode(marker))
        if len(encoded) != 1:
            raise ValueError(f"the harmony parser reads gpt-oss's answers, whose tokenizer has "
                             f"{marker} as one token; this one encodes it as {len(encoded)}")
        ids[encoded[0]] = marker
    return ids


@dataclasses.dataclass
class Message:
    channel: str = ""
    recipient: str | None = None
    body: list[int] = dataclasses.field(default_factory=list)
    closed: bool = False


def messages(tokens: list[int], markers: dict[int, str], decode) -> list[Message]:
    """The messages of a choice's `tokens`, the last one still open unless it was closed.
    A header's parts (the role with any recipient, after `<|channel|>` the channel with any
    recipient, after `<|constrain|>` the arguments' type) are decoded apart with `decode`."""
    out, current, in_body = [], Message(), False
    header: list[tuple[str | None, list[int]]] = [(None, [])]  # (the marker before, ids)

    def read_header() -> None:
        texts = {marker: decode(ids) for marker, ids in header}
        words = (texts.get("<|channel|>") or "").split()
        current.channel = words[0] if words else ""
        found = _RECIPIENT.search(" ".join(texts.values()))
        current.recipient = None if found is None else found.group(1)

    for token in tokens:
        marker = markers.get(token)
        if in_body:
            if marker in _CLOSING:
                current.closed = True
                out.append(current)
                current, in_body, header = Message(), False, [(None, [])]
            else:
                current.body.append(token)
        elif marker == "<|message|>":
            read_header()
            in_body = True
        elif marker in ("<|channel|>", "<|constrain|>"):
            header.append((marker, []))
        elif marker != "<|start|>":
            header[-1][1].append(token)
    if in_body:
        out.append(current)
    return out


@dataclasses.dataclass(frozen=True)
class Harmony:
    """The harmony parser of one request: the tokenizer's `markers` (`marker_ids`) and
    `decode`, and the names of the request's `tools`."""

    markers: dict[int, str]
    decode: Callable[[list[int]], str]
    tools: frozenset[str] = frozenset()

    def split(self, text: str, tokens: list[int], finished: bool) -> Split:
        """A choice's reasoning, content and calls of the request's tools. Before it has
        `finished`, an open message's text leaves out a last character that is not whole
        yet, and an open call is not read."""
        return _split(tokens, self.markers, self.decode, finished, self.tools)


def _split(tokens, markers, decode, finished, tools) -> Split:
    reasoning, content, calls = [], [], []
    for message in messages(tokens, markers, decode):
        text = decode(message.body)
        if not (finished or message.closed) and text.endswith("\ufffd"):
            text = text[:-1]
        recipient = message.recipient or ""
        name = recipient.removeprefix("functions.")
        if recipient.startswith("functions.") and name in tools:
            if message.closed or finished:
                calls.append(tool_call(name, _arguments(text)))
        elif message.channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)
    return Split("".join(reasoning) if reasoning else None,
                 "".join(content) if content else None, tuple(calls))


def _arguments(text: str) -> str:
    """A call's arguments as the other calls' are written, or as the model wrote them where
    they are not JSON: the client sees what it got."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text
