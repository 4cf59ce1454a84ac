"""What a request holds its output to, and that constraint compiled for the served model.

  response_format {"type": "text"}                    nothing (OpenAI's default);
  response_format {"type": "json_object"}             a JSON object;
  response_format {"type": "json_schema",
                   "json_schema": {"schema": {...}}}  JSON valid for the schema;
  structured_outputs {"regex": "..."}                 (an extension, as vLLM names it) text
                     {"choice": ["...", ...]}         matching the regex, one of the strings,
                     {"json": {...}}                  JSON valid for the schema;
  guided_regex, guided_choice, guided_json            the same, by vLLM's earlier names
                                                      (guided_json also as JSON text);
  allowed_token_ids [id, ...]                         (vLLM's) those ids alone, at every
                                                      step (the end id only if listed);
  tools with tool_choice "required" or a function     the calls (`tools.py`);
  target_language "fra_Latn"                          (an extension, a translator's) a
                                                      target that starts with the language's
                                                      token, as transformers' generate forces
                                                      NLLB's and M2M100's `forced_bos_token_id`.

One request takes one of these; a server's default target language (`kvjax serve
--target-language`) starts a translator's requests that take none. The constraint is
compiled (`decode.compile_constraint`, cached per model and constraint) while the request is
parsed, off the event loop; a schema keyword the automaton cannot enforce is a 400 naming
it. The output ends with the model's end-of-text id, which the automaton allows only where
the text is complete (or, for allowed_token_ids, where the list has it).
"""

from __future__ import annotations

import json
from typing import Any

from kvjax.decode.checks import InvalidValue
from kvjax.decode.constraints import (
    AllowedTokens,
    Choice,
    Constraint,
    JsonSchema,
    Regex,
    StartsWith,
    TokenAutomaton,
    compile_constraint,
)

from .tools import Tools

ANY_OBJECT = {"type": "object"}
# vLLM's earlier fields for structured_outputs' keys, which many clients still send.
GUIDED = {"guided_regex": "regex", "guided_choice": "choice", "guided_json": "json"}


def requested(body: dict, tools: Tools | None) -> tuple[Constraint | None, str | None]:
    """(constraint, the field that asked for it) of a request body; an `InvalidValue`
    names a malformed or conflicting field."""
    asked = []
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise InvalidValue("response_format", "response_format must be an object")
        kind = response_format.get("type")
        if kind == "json_object":
            asked.append((_made("response_format", JsonSchema, ANY_OBJECT), "response_format"))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict | bool):
                raise InvalidValue("response_format", "response_format json_schema needs "
                                                      "{'json_schema': {'name': ..., 'schema':"
                                                      " {...}}}")
            asked.append((_made("response_format", JsonSchema, schema), "response_format"))
        elif kind != "text":
            raise InvalidValue("response_format", f"response_format type={kind!r} must be "
                                                  f"'text', 'json_object' or 'json_schema'")
    structured = body.get("structured_outputs")
    if structured is not None:
        asked.append((_extension(structured), "structured_outputs"))
    for field, key in GUIDED.items():
        if body.get(field) is not None:
            value = body[field]
            if key == "json" and isinstance(value, str):  # vLLM takes the schema as text too
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as error:
                    raise InvalidValue(field, f"{field} is not valid JSON: {error}") from None
            asked.append((_constraint_of(field, field, key, value), field))
    if body.get("guided_grammar") is not None:
        raise InvalidValue("guided_grammar", "guided_grammar (a context-free grammar) is not "
                                             "supported: guided_regex, guided_choice and "
                                             "guided_json are")
    if body.get("allowed_token_ids") is not None:  # vLLM's
        asked.append((_made("allowed_token_ids", AllowedTokens, body["allowed_token_ids"]),
                      "allowed_token_ids"))
    if tools is not None and tools.constraint() is not None:
        asked.append((tools.constraint(), "tool_choice"))
    if len(asked) > 1:
        raise InvalidValue(asked[1][1], f"{asked[0][1]} and {asked[1][1]} both hold the "
                                        f"output: a request takes one")
    return asked[0] if asked else (None, None)


def target_language(body: dict, tokenizer, is_translation: bool) -> StartsWith | None:
    """The target language a request names (None: none), for a translator's `tokenizer`; an
    `InvalidValue` for a code that is not one of its tokens, or asked of a model that
    continues text."""
    code = body.get("target_language")
    if code is None:
        return None
    if not isinstance(code, str):
        raise InvalidValue("target_language", "target_language must be a string: a language's "
                                              "token, such as NLLB's fra_Latn")
    return language(code, tokenizer, is_translation, "target_language")


def language(code: str, tokenizer, is_translation: bool, name: str) -> StartsWith:
    """`code`, one token of `tokenizer`, as what starts a translator's target; an
    `InvalidValue` naming `name` otherwise."""
    if not is_translation:
        raise InvalidValue(name, f"{name} is a translator's (an encoder-decoder's): this model "
                                 f"continues text")
    try:
        return StartsWith.from_text(tokenizer, code, name)
    except ValueError as error:
        raise InvalidValue(name, str(error)) from None


def _extension(structured: Any) -> Constraint:
    if not isinstance(structured, dict) or len(
            [k for k in ("regex", "choice", "json") if structured.get(k) is not None]) != 1:
        raise InvalidValue("structured_outputs", "structured_outputs must be an object with "
                                                 "one of 'regex', 'choice' or 'json'")
    key = next(k for k in ("regex", "choice", "json") if structured.get(k) is not None)
    return _constraint_of("structured_outputs", f"structured_outputs.{key}", key,
                          structured[key])


def _constraint_of(field: str, label: str, key: str, value: Any) -> Constraint:
    """The constraint `value` asks for as a regex, a choice or a JSON Schema (`key`); an
    `InvalidValue` names `field`, `label` the value in its message."""
    if key == "regex":
        if not isinstance(value, str):
            raise InvalidValue(field, f"{label} must be a string")
        return _made(field, Regex, value)
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(o, str) for o in value)):
            raise InvalidValue(field, f"{label} must be a non-empty list of strings")
        return _made(field, Choice, value)
    if not isinstance(value, dict | bool):
        raise InvalidValue(field, f"{label} must be a JSON Schema object")
    return _made(field, JsonSchema, value)


def _made(field: str, kind: type, value: Any) -> Constraint:
    try:
        return kind(value)
    except ValueError as error:
        raise InvalidValue(field, str(error)) from None


def compiled(constraint: Constraint, field: str, tokenizer) -> TokenAutomaton:
    """`constraint` for `tokenizer`'s vocabulary, ended by its end-of-text id; an
    `InvalidValue` naming `field` if it cannot be compiled."""
    try:
        return compile_constraint(constraint, tokenizer)
    except ValueError as error:
        raise InvalidValue(field, str(error)) from None
