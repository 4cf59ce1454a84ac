"""Chat messages as one prompt text.

A tokenizer that brings a chat template (a Jinja2 string in `chat_template`, as Hugging Face
tokenizers carry) renders the messages its own way, with `add_generation_prompt=True`.
kvjax's own models were trained on plain text, so they get the plain template: each message
on its own line as `role: content`, then `assistant:` for the model to continue,

    system: You answer in one line.
    user: What is a KV cache?
    assistant:

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(message: Any, index: int) -> tuple[str, str]:
    """(role, content) of an OpenAI chat message; a ValueError names what is wrong with it.
    Content is a string or a list of text parts."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object with a role and a content")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise ValueError(f"messages[{index}].role={role!r} must be one of {', '.join(ROLES)}")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{index}].content[{j}] must be a text part "
                                 f"({{'type': 'text', 'text': ...}}): this model reads text only")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return role, content


def plain_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The plain template (see the module docstring)."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


def render(tokenizer: Any, messages: Sequence[Any]) -> tuple[str, bool]:
    """(prompt text, whether it came from the tokenizer's own template). A template's text
    already holds the special tokens it wants, so it is encoded with no prefix added."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of chat messages")
    pairs = [message_text(m, i) for i, m in enumerate(messages)]
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return plain_prompt(pairs), False
    import jinja2.sandbox

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                               lstrip_blocks=True)
    text = environment.from_string(template).render(
        messages=[{"role": r, "content": c} for r, c in pairs], add_generation_prompt=True,
        bos_token=getattr(tokenizer, "bos_token", "") or "",
        eos_token=getattr(tokenizer, "eos_token", "") or "")
    return text, True
