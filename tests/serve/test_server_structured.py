"""Structured output and tool calls through the server, with the official `openai` client, on
the shipped python-docs-lm (a real BPE vocabulary, whose free text is noise): every answer
that ends parses and validates (`jsonschema`), greedy answers equal `decode.generate` alone
under the same automaton, tool calls come back as OpenAI's `tool_calls`, and what cannot be
enforced is a 400 naming it."""

import copy
import dataclasses
import json
from pathlib import Path

import httpx
import jsonschema
import pytest
from conftest import openai_client, serve_app

from kvjax import decode, text
from kvjax.serve import chat
from kvjax.serve.server import build_app

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "python-docs-lm"
MODEL, TIMEOUT = "python-docs-lm", 60.0
ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "kind": {"enum": ["list", "dict", "set"]},
    "sizes": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["name", "kind"]}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "is_even", "parameters": {
             "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]


# The model's prompt window is short: its template names the tools (the plain template,
# which lists them whole, is checked on its own below).
TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
            "{{ '\\n' }}{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")


@pytest.fixture(scope="module")
def loaded():
    loaded = text.load(CHECKPOINT)
    tokenizer = copy.copy(loaded.tokenizer)
    tokenizer.chat_template = TEMPLATE
    return dataclasses.replace(loaded, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def url(loaded):
    app = build_app(loaded, max_slots=4, max_len=256, chunk_size=8, prefill_batch=4)
    base, stop = serve_app(app, TIMEOUT)
    yield base
    stop()


@pytest.fixture(scope="module")
def client(url):
    return openai_client(url, TIMEOUT)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}


def test_greedy_structured_answers_equal_generate_alone(client, loaded):
    automaton = decode.compile_constraint(decode.JsonSchema(ITEM), loaded.tokenizer)
    answer = client.completions.create(model=MODEL, prompt="The list type", max_tokens=80,
                                       temperature=0,
                                       extra_body={"response_format": schema_format(ITEM)})
    alone = decode.generate(loaded.net, loaded.params,
                            [text.prompt_tokens(loaded, "The list type")], max_new_tokens=80,
                            eos_ids=loaded.tokenizer.stop_ids, constraint=automaton)
    tokens = [t for t in alone.token_lists()[0] if t not in loaded.tokenizer.stop_ids]
    assert answer.choices[0].text == loaded.tokenizer.decode(tokens)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].text), ITEM)


def test_special_tokens_are_in_the_text_only_when_not_skipped(client, loaded):
    """vLLM's skip_special_tokens=false: BOS, which a logit bias makes at every step, is
    written as the tokenizer writes it, streamed or not; by default the text leaves it out."""
    bos = loaded.tokenizer.bos_id
    asked = dict(model=MODEL, prompt="The list type", max_tokens=3, temperature=0,
                 logit_bias={str(bos): 100})
    kept = dict(extra_body={"skip_special_tokens": False})
    written = loaded.tokenizer.decode([bos] * 3, skip_special_tokens=False)
    assert written == "<s><s><s>"
    assert client.completions.create(**asked).choices[0].text == ""
    assert client.completions.create(**asked, **kept).choices[0].text == written
    streamed = client.completions.create(**asked, **kept, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == written


def test_sampled_json_answers_that_end_validate(client):
    ended = total = 0
    for seed in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a type"}], n=4,
            seed=seed, temperature=1.0, max_tokens=120, response_format=schema_format(ITEM))
        for choice in answer.choices:
            total += 1
            if choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.message.content), ITEM)
                ended += 1
    assert ended >= total - 2  # a sample may run out of tokens inside a long number
    anything = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "An object"}], max_tokens=60,
        temperature=0, response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_the_regex_choice_and_allowed_tokens_extensions(client, loaded):
    answer = client.completions.create(
        model=MODEL, prompt="x = ", max_tokens=12, temperature=1.0, seed=1, n=3,
        extra_body={"structured_outputs": {"regex": "0x[0-9a-f]{4}"}})
    for choice in answer.choices:
        assert choice.finish_reason == "stop" and len(choice.text) == 6
        int(choice.text, 16)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Which loop?"}], max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["for", "while", "async for"]}})
    assert answer.choices[0].message.content in ("for", "while", "async for")
    # vLLM's allowed_token_ids: those ids alone, read back through return_tokens_as_token_ids.
    allowed = sorted(set(loaded.tokenizer.encode("0123456789 abc")))
    answer = client.completions.create(
        model=MODEL, prompt="x = ", max_tokens=6, temperature=1.0, seed=2, n=2, logprobs=0,
        extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True})
    for choice in answer.choices:
        made = [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]
        assert len(made) == 6 and set(made) <= set(allowed), made
        assert choice.finish_reason == "length"  # the end id is not among them


def test_required_and_named_tool_choices_answer_with_valid_tool_calls(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            tool_choice="required", max_tokens=120,
                                            temperature=1.0, seed=4, n=3)
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    called = 0
    for choice in answer.choices:
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None and choice.message.tool_calls
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments),
                                    parameters[call.function.name])
                assert call.type == "function" and call.id.startswith("call_")
            called += 1
    assert called >= 2
    named = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**named)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(client.chat.completions.create(**named, stream=True))
    calls = [c for chunk in chunks for choice in chunk.choices
             for c in choice.delta.tool_calls or ()]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"




def test_the_plain_template_shows_the_tools_and_the_calls_made(loaded):
    messages = [{"role": "user", "content": "Is 4 even?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "is_even", "arguments": '{"n": 4}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "true"}]
    rendered, templated = chat.render(text.load(CHECKPOINT).tokenizer, messages, TOOLS[1:])
    assert not templated and rendered == (
        'tools: [{"type":"function","function":{"name":"is_even","parameters":{"type":"object",'
        '"properties":{"n":{"type":"integer"}},"required":["n"]}}}]\n'
        "user: Is 4 even?\n"
        'assistant: <tool_call>{"name": "is_even", "arguments": {"n": 4}}</tool_call>\n'
        "tool: true\nassistant:")
    shown, _ = chat.render(loaded.tokenizer, messages[:1], TOOLS)
    assert shown == "tools: get_weather is_even\nuser: Is 4 even?\nassistant:"


@pytest.mark.parametrize("path, fields, param, message", [
    ("chat", {"response_format": schema_format({"type": "integer", "minimum": 3})},
     "response_format", "'minimum'"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "oneOf": []}}}]}, "tools", "'oneOf'"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "'g', which is not among the tools"),
    ("chat", {"response_format": {"type": "json_object"},
              "structured_outputs": {"regex": "a"}}, "structured_outputs", "a request takes one"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
    ("completions", {"tools": TOOLS}, "tools", "tools are for /v1/chat/completions"),
    ("completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs",
     "cannot compile"),
])
def test_what_cannot_be_enforced_is_a_400_naming_it(url, path, fields, param, message):
    body = {"model": MODEL, "max_tokens": 4, **fields,
            **({"messages": [{"role": "user", "content": "hi"}]} if path == "chat"
               else {"prompt": "hi"})}
    route = "chat/completions" if path == "chat" else "completions"
    response = httpx.post(f"{url}/v1/{route}", json=body, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
