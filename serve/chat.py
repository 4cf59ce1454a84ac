"""Chat messages as one prompt text.

A tokenizer that brings a chat template (a Jinja2 string in `chat_template`, as Hugging Face
tokenizers carry) renders the messages its own way, as transformers' `apply_chat_template`
does (by default with `add_generation_prompt=True`; `continue_final_message` as it cuts
the text inside the final message): the same sandboxed environment and helpers, the
tokenizer's named special tokens (`bos_token`, `eos_token`, ...) as variables, and the
request's `tools` (`tools.py`). Each message reaches the template as {"role", "content"},
its content as one string, with an assistant's `tool_calls` (their JSON arguments as
objects, as templates read them) and its earlier reasoning (`reasoning_content`, which
Qwen3's template shows in the turns after the last question; `reasoning`, vLLM's newer
name, passed on as given), and a tool message's `tool_call_id` and `name`.
kvjax's own models were trained on plain text, so they get the plain template: the tools
as one JSON line, each message on its own line as `role: content` (an assistant's calls
after its content, each as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`), then
`assistant:` for the model to continue (or, continuing the final message, nothing after its
content),

    system: You answer in one line.
    user: What is a KV cache?
    assistant:

"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(message: Any, index: int) -> tuple[str, str]:
    """(role, content) of an OpenAI chat message; a ValueError names what is wrong with it.
    Content is a string or a list of text parts, joined by newlines as vLLM joins them."""
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
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return role, content


def plain_prompt(messages: Sequence[tuple[str, str]] | Sequence[dict],
                 tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """The plain template (see the module docstring) of (role, content) pairs or of
    messages as templates get them; without `add_generation_prompt`, no `assistant:` at
    the end."""
    listed = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
    lines = [] if not tools else [f"tools: {listed}\n"]
    for message in messages:
        if isinstance(message, tuple):
            message = {"role": message[0], "content": message[1]}
        calls = "".join("<tool_call>" + json.dumps(
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
            ensure_ascii=False) + "</tool_call>" for c in message.get("tool_calls", ()))
        lines.append(f"{message['role']}: {message['content']}{calls}\n")
    return "".join(lines) + "assistant:" * add_generation_prompt


def template_message(message: dict, index: int) -> dict:
    """A checked chat message as a template reads it (see the module docstring)."""
    role, content = message_text(message, index)
    entry = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise ValueError(f"messages[{index}].tool_calls must be a list, on an assistant "
                             f"message")
        entry["tool_calls"] = [_template_call(call, index, j) for j, call in enumerate(calls)]
    for name in ("tool_call_id", "name") + (("reasoning_content", "reasoning")
                                            if role == "assistant" else ()):
        if isinstance(message.get(name), str):
            entry[name] = message[name]
    return entry


def _template_call(call: Any, index: int, j: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise ValueError(f"messages[{index}].tool_calls[{j}] must be {{'type': 'function', "
                         f"'function': {{'name': ..., 'arguments': ...}}}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"messages[{index}].tool_calls[{j}].function.arguments is not "
                             f"JSON") from None
    return {**call, "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def answer_role(messages: Sequence[Any], add_generation_prompt: bool = True
                ) -> tuple[str, str]:
    """(the role an answer to `messages` speaks in, the final message's content where the
    answer goes on in that message's role, else ""), as vLLM names them: after a generation
    prompt the assistant speaks; without one the text goes on in the final message's role.
    `messages` are checked already (`render`)."""
    role, content = message_text(messages[-1], len(messages) - 1)
    if not add_generation_prompt:
        return role, content
    return "assistant", content if role == "assistant" else ""


# What a template reads that a request's `chat_template_kwargs` may not replace.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


def prompt_ids(loaded: Any, messages: Sequence[Any], tools: list[dict] | None = None,
               template_kwargs: dict[str, Any] | None = None, **ends: bool
               ) -> tuple[list[int], str]:
    """(the token ids a chat's `messages` feed the model, their text): rendered as `render`
    renders them (`ends`: its `add_generation_prompt`, `continue_final_message`), a
    template's text read as it stands, the plain template's framed as a prompt text is
    (`text.prompt_tokens`). `loaded`: a `text.LoadedModel`."""
    from kvjax.text import prompt_tokens

    text, templated = render(loaded.tokenizer, messages, tools, template_kwargs, **ends)
    return (loaded.tokenizer.encode(text) if templated else prompt_tokens(loaded, text)), text


def render(tokenizer: Any, messages: Sequence[Any], tools: list[dict] | None = None,
           template_kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
           continue_final_message: bool = False) -> tuple[str, bool]:
    """(prompt text, whether it came from the tokenizer's own template), with `tools`
    (OpenAI's, or None) shown to the model. A template's text already holds the special
    tokens it wants, so it is encoded with no prefix added. `template_kwargs` are more
    variables for the template (vLLM's `chat_template_kwargs`, such as Qwen3's
    `enable_thinking`); a template reads those it knows, the plain template none.
    `add_generation_prompt` ends the text with what starts the assistant's answer;
    `continue_final_message` (not with it) ends the text inside the final message, after
    its content, for the model to go on with it (a reply begun by the client), as
    transformers ends it: the text up to a tag put after that content, less the
    whitespace the template trims around the content."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of chat messages")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message both set: a text "
                         "ends with a new answer's start or inside the final message, not "
                         "both")
    entries = [template_message(m, i) for i, m in enumerate(messages)]
    if continue_final_message:
        entries[-1] = {**entries[-1], "content": entries[-1]["content"] + CONTINUE_TAG}
    text, templated = _rendered(tokenizer, entries, tools, template_kwargs,
                                add_generation_prompt)
    return (_cut_at_tag(text) if continue_final_message else text), templated


# What marks the end of the final message's content while it is rendered (transformers' own
# tag, so that a template treats it as transformers has it treated).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_tag(text: str) -> str:
    mark = CONTINUE_TAG.strip()
    if mark not in text:
        raise ValueError("continue_final_message: the model's chat template leaves out the "
                         "final message's content, so there is nothing to continue")
    at = text.rindex(mark)
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _rendered(tokenizer: Any, entries: list[dict], tools: list[dict] | None,
              template_kwargs: dict[str, Any] | None,
              add_generation_prompt: bool) -> tuple[str, bool]:
    template = getattr(tokenizer, "chat_template", None)
    if tools:  # as transformers picks it: a template named "tool_use" renders tools
        template = getattr(tokenizer, "tool_chat_template", None) or template
    if not template:
        return plain_prompt(entries, tools, add_generation_prompt), False
    special = getattr(tokenizer, "special_tokens", None)
    if special is None:
        special = {name: getattr(tokenizer, name, "") or "" for name in ("bos_token", "eos_token")}
    import jinja2

    try:
        text = _compiled(template).render(**{**special, **(template_kwargs or {})},
                                          messages=entries, tools=tools or None,
                                          documents=None,
                                          add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as error:  # raise_exception's message included
        raise ValueError(f"the model's chat template refused these messages: {error}") from None
    return text, True


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """`template` compiled in the environment transformers renders chat templates in: a
    sandbox (templates come with downloaded models), blocks trimmed, loop controls,
    `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and a
    `{% generation %}` block that renders its body."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_generation_block(), jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"the model's chat template does not parse: {error}") from None


def _generation_block():
    """The `{% generation %}...{% endgeneration %}` tag (transformers marks the assistant's
    tokens with it, for training masks): here it renders what it holds."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [],
                                          body).set_lineno(line)

        def _body(self, caller):
            return caller()

    return GenerationBlock
