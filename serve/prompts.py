"""The tokens a request feeds the model: a completion's prompts (strings framed as the model's
prompts are, or token ids), a chat's messages through the model's chat template, and vLLM's
`truncate_prompt_tokens`, which keeps a prompt's last tokens.
"""

from __future__ import annotations

from typing import Any

from kvjax import text as T

from . import chat
from .fields import BOOL, INT, OBJECT, STR, APIError, get_field
from .tools import Tools


def completion_prompts(loaded: T.LoadedModel, prompt: Any, max_prompts: int,
                        framed: bool = True) -> tuple[list[tuple], list[str]]:
    """(token ids, text) of each prompt: a string, a list of strings, a list of token ids
    or a list of such lists; at most `max_prompts` of them. A string is `framed` as the
    model's prompts are (`text.prompt_tokens`), or else its tokens alone."""
    def is_ids(value):
        return (isinstance(value, list) and bool(value)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in value))

    if isinstance(prompt, str):
        prompt = [prompt]
    elif is_ids(prompt):
        prompt = [prompt]
    if isinstance(prompt, list) and len(prompt) > max_prompts:
        raise APIError(400, f"prompt holds {len(prompt)} prompts: at most {max_prompts}, "
                            "the requests this server queues at once", "prompt")
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(p, str) or is_ids(p) for p in prompt):
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids "
                            "or a list of such lists", "prompt")
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            ids.append(text_prompt(loaded, p, framed))
            texts.append(p)
        else:
            ids.append(tuple(p))
            texts.append(decode_prompt(loaded, p))
    return ids, texts


def text_prompt(loaded: T.LoadedModel, text: str, framed: bool = True) -> tuple[int, ...]:
    """The tokens a completion's `text` feeds the model: `framed` as the model's prompts are
    (`text.prompt_tokens`: Llama's bos in front, a translator's source frame), or else the
    text's own alone."""
    return tuple(T.prompt_tokens(loaded, text) if framed else loaded.tokenizer.encode(text))


def decode_prompt(loaded: T.LoadedModel, ids) -> str:
    try:
        return loaded.tokenizer.decode(ids)
    except ValueError as error:
        raise APIError(400, str(error), "prompt") from None


def chat_prompt(loaded: T.LoadedModel, body: dict, tools: Tools | None
                ) -> tuple[tuple[int, ...], str]:
    """(the tokens a chat request's messages feed the model, their text), with `tools`, the
    template's variables (`_template_kwargs`), and ending as its `add_generation_prompt`
    (default true) and `continue_final_message` (default false) ask (`chat.render`). A
    translator has no chat: a 400."""
    if loaded.is_translation:
        raise APIError(400, "this model translates the prompt of /v1/completions; it has no "
                            "chat", "messages")
    ends = {name: get_field(body, name, BOOL, default) for name, default in (
        ("add_generation_prompt", True), ("continue_final_message", False))}
    if all(ends.values()):
        raise APIError(400, "continue_final_message=true needs add_generation_prompt=false: "
                            "the text ends inside the final message, not with a new answer's "
                            "start", "continue_final_message")
    try:
        ids, text = chat.prompt_ids(loaded, body.get("messages"),
                                    None if tools is None else tools.for_template(),
                                    _template_kwargs(body), **ends)
    except ValueError as error:
        raise APIError(400, str(error), "messages") from None
    return tuple(ids), text


def _template_kwargs(body: dict) -> dict[str, Any]:
    """The variables a chat request adds to its chat template (`chat_template_kwargs`, and
    `reasoning_effort`)."""
    kwargs = get_field(body, "chat_template_kwargs", OBJECT, {})
    effort = get_field(body, "reasoning_effort", STR)
    if effort is not None:
        kwargs = {"reasoning_effort": effort, **kwargs}
    reserved = sorted(set(kwargs) & set(chat.RESERVED_TEMPLATE_VARIABLES))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the "
                            "request's own fields give them", "chat_template_kwargs")
    return kwargs


def truncated(body: dict, prompts: list[tuple[int, ...]], capacity: int
              ) -> list[tuple[int, ...]] | None:
    """`prompts` (token ids) each cut to its last `truncate_prompt_tokens` tokens, as vLLM
    cuts them (-1: a slot's `capacity`); None if the request asks for no cut."""
    keep = get_field(body, "truncate_prompt_tokens", INT)
    if keep is None:
        return None
    if keep == -1:
        keep = capacity
    if not 1 <= keep <= capacity:
        raise APIError(400, f"truncate_prompt_tokens={keep} must be -1 (a slot's capacity) or "
                            f"from 1 to a slot's capacity of {capacity}",
                       "truncate_prompt_tokens")
    return [ids[-keep:] for ids in prompts]
