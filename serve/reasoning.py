"""A thinking model's reasoning apart from its answer: `kvjax serve --reasoning-parser think`.

Qwen3, QwQ, DeepSeek-R1 and their distills, SmolLM3 and others think inside
`<think> ... </think>` before they answer. With a parser, a chat choice's text is split
there: what the model thought goes to the message's `reasoning` (and `reasoning_content`, the
name DeepSeek's API and older vLLM releases use), the rest to its `content`, with its
leading newlines dropped; streamed, each delta goes to the field its text belongs to.

Where a choice starts is read off its prompt, as the model's chat template left it: a prompt
that ends inside an open `<think>` (DeepSeek-R1's template, Qwen3.5's) starts the choice
in reasoning; one that closed it (Qwen3 with `chat_template_kwargs: {"enable_thinking":
false}`) starts it in the answer; otherwise the choice is reasoning from a `<think>` it
opens itself (after any whitespace) to its `</think>`, and answer throughout if it opens
none (a `<think>` it writes where its prompt opened one already is dropped). A choice that
ends before its `</think>` is reasoning alone, its content null.

Streaming never sends text that could still turn out to be a tag: a choice's text that ends
in the beginning of the tag it waits for is held back until the next delta tells. So the
deltas of each field always add up to the whole answer's.
"""

from __future__ import annotations

import dataclasses

START, END = "<think>", "</think>"
# The names `--reasoning-parser` takes: the `<think>` rule, under vLLM's names of its parsers
# for these models too, so that a vLLM command line keeps working; and gpt-oss's harmony
# format (`harmony.py`).
THINK_PARSERS = ("think", "qwen3", "deepseek_r1")
HARMONY_PARSERS = ("harmony", "openai_gptoss")
PARSERS = THINK_PARSERS + HARMONY_PARSERS


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether a prompt leaves its choice inside a thought: its last `<think>` comes after
    its last `</think>`."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


@dataclasses.dataclass(frozen=True)
class Split:
    """A choice's text as reasoning and content: what can be sent now (all of it once the
    choice has finished). None: the choice has none of that field. `calls`: tool calls a
    parser read apart from the content (OpenAI's `tool_calls` entries; `harmony.py`)."""

    reasoning: str | None
    content: str | None
    calls: tuple[dict, ...] = ()


@dataclasses.dataclass(frozen=True)
class Think:
    """The `<think>` parser of one request: whether its prompt left it in a thought."""

    in_reasoning: bool

    def split(self, text: str, tokens: list[int], finished: bool) -> Split:
        return split(text, self.in_reasoning, finished)


def split(text: str, in_reasoning: bool, finished: bool) -> Split:
    """`text`, a choice's text so far, as reasoning and content; `in_reasoning`: whether
    its prompt left it inside a thought (`starts_in_reasoning`). Before the choice has
    `finished`, a tail that may be the start of the tag it waits for is left out."""
    opened = text.lstrip()
    if opened.startswith(START):  # (a model whose prompt opened one may write it again)
        return _thought(opened[len(START):], finished)
    if not finished and (not opened or START.startswith(opened)):
        return Split(None, None)  # nothing yet, or a `<think>` under way
    return _thought(text, finished) if in_reasoning else Split(None, text)


def _thought(text: str, finished: bool) -> Split:
    """`text` that starts inside a thought: reasoning up to `</think>`, content after it."""
    end = text.find(END)
    if end >= 0:
        return Split(text[:end], text[end + len(END):].lstrip("\n"))
    if finished:
        return Split(text, None)
    return Split(text[:len(text) - _tag_start_at_end(text, END)], None)


def _tag_start_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (shorter than it)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


@dataclasses.dataclass
class Stream:
    """How much of a streamed choice's reasoning and content has been sent; `parser` is
    `Think` or `harmony.Harmony`."""

    parser: Think | object
    reasoning_sent: int = 0
    content_sent: int = 0

    def delta(self, text: str, tokens: list[int], finished: bool) -> dict[str, str]:
        """The new reasoning and content of a choice whose text and tokens are now these,
        as a chat chunk's delta fields (those with nothing new left out)."""
        parts = self.parser.split(text, tokens, finished)
        out = {}
        if parts.reasoning is not None and len(parts.reasoning) > self.reasoning_sent:
            new = parts.reasoning[self.reasoning_sent:]
            out["reasoning"] = out["reasoning_content"] = new
            self.reasoning_sent = len(parts.reasoning)
        if parts.content is not None and len(parts.content) > self.content_sent:
            out["content"] = parts.content[self.content_sent:]
            self.content_sent = len(parts.content)
        return out
