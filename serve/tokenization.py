"""vLLM's `POST /tokenize` and `POST /detokenize`: the tokens a prompt costs, and the text of
tokens, by the tokenizer the server generates with.

`/tokenize` takes a completion's `prompt` (one string) or a chat's `messages` (with `tools`,
`chat_template_kwargs`, `reasoning_effort`, `add_generation_prompt` and
`continue_final_message` as /v1/chat/completions reads them) and answers
`{"count", "max_model_len", "tokens", "token_strs"}`: for `messages`, exactly the
tokens /v1/chat/completions feeds the model; for a `prompt`, those /v1/completions feeds it
(what its tokenizer puts around a text included, Llama's bos, a translator's source frame),
or with `add_special_tokens` false the text's own; `token_strs`, with `return_token_strs`,
each token's string in the vocabulary (transformers' `convert_ids_to_tokens`), else null.
`max_model_len` is a slot's room, prompt and output together, as /v1/models lists it.
`/detokenize` takes `{"tokens": [...]}` and answers `{"prompt": text}`, special tokens left
out as the answers leave them out. A `model` may be named (the served model or one of its
adapters, which share its tokenizer). A chat's fields given with a `prompt` are a 400 naming
the field, never ignored.
"""

from __future__ import annotations

from typing import Any

from kvjax import text as T

from .fields import BOOL, APIError, get_field
from .prompts import chat_prompt, text_prompt
from .protocol import CHAT_ONLY_FIELDS, requested_model
from .tools import parse_tools


def tokenize(body: Any, loaded: T.LoadedModel, served: tuple[str | None, ...],
             capacity: int) -> dict:
    """The answer to a /tokenize request `body` (JSON-decoded) for a server of the model
    `loaded`, served under the names `served` (None for an empty adapter slot), whose slots
    hold `capacity` tokens."""
    requested_model(body, served)
    with_strings = get_field(body, "return_token_strs", BOOL, False)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise APIError(400, "a tokenize request takes a prompt or messages, one of them",
                       "messages" if has_messages else "prompt")
    if has_messages:
        if "add_special_tokens" in body:
            raise APIError(400, "add_special_tokens is for a prompt: messages are tokenized "
                                "as /v1/chat/completions tokenizes them", "add_special_tokens")
    elif given := [name for name, _, _ in CHAT_ONLY_FIELDS if body.get(name) is not None]:
        raise APIError(400, f"{given[0]} is for messages, not a prompt", given[0])
    elif not isinstance(body["prompt"], str):
        raise APIError(400, f"prompt must be a string, not {type(body['prompt']).__name__}",
                       "prompt")
    try:
        if has_messages:
            tokens, _ = chat_prompt(loaded, body, parse_tools(body))
        else:
            tokens = text_prompt(loaded, body["prompt"],
                                 get_field(body, "add_special_tokens", BOOL, True))
    except UnicodeError as error:  # a tokenizer refusing text: the client's
        raise APIError(400, f"the text cannot be tokenized: {error}",
                       "messages" if has_messages else "prompt") from None
    tokens = [int(t) for t in tokens]
    return {"count": len(tokens), "max_model_len": capacity, "tokens": tokens,
            "token_strs": loaded.tokenizer.pieces(tokens) if with_strings else None}


def detokenize(body: Any, loaded: T.LoadedModel, served: tuple[str | None, ...]) -> dict:
    """The answer to a /detokenize request `body` (see `tokenize`)."""
    requested_model(body, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError(400, "tokens must be a list of token ids", "tokens")
    try:
        return {"prompt": loaded.tokenizer.decode(tokens)}
    except ValueError as error:  # an id outside the vocabulary, named
        raise APIError(400, str(error), "tokens") from None
