"""serve/reasoning.py: a thinking model's text split into reasoning and content, where its
prompt leaves it; streamed deltas, cut anywhere, add up to the whole answer's fields and
never send part of a tag; the answers carry them as OpenAI's types take them; templates get
`chat_template_kwargs` (Qwen3's `enable_thinking`) and say where the choice starts."""

import json

import pytest
from conftest import FakeTokenizer

from kvjax import model as M
from kvjax.serve import chat, reasoning
from kvjax.serve.answers import Answer
from kvjax.serve.protocol import APIError, parse
from kvjax.serve.requests import Delta
from kvjax.text import LoadedModel

MODEL = "tiny"

# (text, whether the prompt left it in a thought) -> (reasoning, content) once finished.
CASES = [
    ("<think>\nsix is even\n</think>\n\nYes.", False, ("\nsix is even\n", "Yes.")),  # Qwen3
    ("six is even\n</think>\n\nYes.", True, ("six is even\n", "Yes.")),  # DeepSeek-R1
    ("<think>x</think>y", True, ("x", "y")),  # R1 writing its own <think> again
    ("\n <think>x</think>\ny", False, ("x", "y")),
    ("Yes.", False, (None, "Yes.")),  # no thought: enable_thinking false, or no template
    ("Yes.</think>", False, (None, "Yes.</think>")),
    ("I think <think> is a tag", False, (None, "I think <think> is a tag")),
    ("<think>cut short by max_toke", False, ("cut short by max_toke", None)),
    ("cut short </thi", True, ("cut short </thi", None)),
    ("", False, (None, "")),
    ("<think></think>", False, ("", "")),
]


@pytest.mark.parametrize("text, in_reasoning, want", CASES)
def test_a_finished_choice_splits_at_its_thought(text, in_reasoning, want):
    got = reasoning.split(text, in_reasoning, finished=True)
    assert (got.reasoning, got.content) == want


@pytest.mark.parametrize("text, in_reasoning, want", CASES)
def test_streamed_deltas_cut_anywhere_add_up_and_never_send_part_of_a_tag(text, in_reasoning,
                                                                         want):
    for cut in (1, 2, 3, 5):
        stream = reasoning.Stream(reasoning.Think(in_reasoning))
        sent = {"reasoning": "", "content": ""}
        for end in [*range(cut, len(text), cut), len(text)]:
            delta = stream.delta(text[:end], [], finished=end == len(text))
            assert delta.get("reasoning") == delta.get("reasoning_content")
            for field in sent:
                sent[field] += delta.get(field, "")
            # Reasoning waits for its </think>: no part of it is sent before the choice ends.
            assert end == len(text) or not sent["reasoning"].endswith(("<", "</", "</thi"))
        assert sent["reasoning"] == (want[0] or "") and sent["content"] == (want[1] or "")


def test_the_prompt_says_whether_the_choice_starts_in_a_thought():
    assert reasoning.starts_in_reasoning("<|im_start|>assistant\n<think>\n")  # R1, Qwen3.5
    assert not reasoning.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.starts_in_reasoning("<|im_start|>assistant\n")
    assert not reasoning.starts_in_reasoning("")


# Qwen3's switch, as its chat template writes it after the generation prompt.
QWEN3_TAIL = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
              "{%- if enable_thinking is defined and enable_thinking is false %}"
              "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


class ThinkingTokenizer(FakeTokenizer):
    chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}" + QWEN3_TAIL


LOADED = LoadedModel(M.preset("tiny"), ThinkingTokenizer(), None, f"/checkpoints/{MODEL}")
MESSAGES = [{"role": "user", "content": "Is six even?"}]


def parsed(reasoning_parser="think", **body):
    return parse({"model": MODEL, "messages": MESSAGES, **body}, LOADED, MODEL, capacity=512,
                 chat_api=True, reasoning_parser=reasoning_parser)


def test_chat_template_kwargs_reach_the_template_and_set_where_choices_start():
    text, templated = chat.render(ThinkingTokenizer(), MESSAGES,
                                  template_kwargs={"enable_thinking": False})
    assert templated and text == "Is six even?\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert chat.render(ThinkingTokenizer(), MESSAGES)[0] == \
        "Is six even?\n<|im_start|>assistant\n"
    off = parsed(chat_template_kwargs={"enable_thinking": False})
    assert off.requests[0].prompt == tuple(ThinkingTokenizer.encode(text))
    assert off.reasoning == parsed().reasoning == reasoning.Think(False)
    assert parsed(reasoning_parser=None).reasoning is None


def test_openais_reasoning_effort_reaches_the_template_as_gpt_oss_reads_it():
    class Effort(FakeTokenizer):  # gpt-oss's system message, as its template writes it
        chat_template = ("{%- if reasoning_effort is not defined %}{%- set reasoning_effort = "
                         "'medium' %}{%- endif %}Reasoning: {{ reasoning_effort }}")

    loaded = LoadedModel(M.preset("tiny"), Effort(), None, f"/checkpoints/{MODEL}")

    def prompt(**body):
        request = parse({"model": MODEL, "messages": MESSAGES, **body}, loaded, MODEL,
                        capacity=512, chat_api=True).requests[0]
        return request.prompt

    assert prompt() == tuple(Effort.encode("Reasoning: medium"))
    assert prompt(reasoning_effort="high") == tuple(Effort.encode("Reasoning: high"))
    assert prompt(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}) \
        == tuple(Effort.encode("Reasoning: low"))


@pytest.mark.parametrize("body, chat_api, message", [
    (dict(chat_template_kwargs={"messages": []}), True,
     "chat_template_kwargs may not set messages"),
    (dict(chat_template_kwargs=["enable_thinking"]), True,
     "chat_template_kwargs=['enable_thinking'] must be an object"),
    (dict(prompt="hi", chat_template_kwargs={"enable_thinking": False}), False,
     "chat_template_kwargs={'enable_thinking': False} is not supported by this server (they "
     "are for /v1/chat/completions)"),
    (dict(reasoning_effort=3), True, "reasoning_effort=3 must be a string"),
    (dict(prompt="hi", reasoning_effort="high"), False,
     "reasoning_effort='high' is not supported by this server (it is for "
     "/v1/chat/completions)"),
])
def test_template_variables_that_cannot_apply_are_a_400_naming_them(body, chat_api, message):
    body = {"model": MODEL, **({"messages": MESSAGES} if chat_api else {}), **body}
    with pytest.raises(APIError) as error:
        parse(body, LOADED, MODEL, capacity=512, chat_api=chat_api)
    assert error.value.status == 400
    assert error.value.param == ("reasoning_effort" if "reasoning_effort" in body
                                 else "chat_template_kwargs")
    assert message in error.value.message


def deliver(answer, pieces, finish="stop"):
    """Each piece of text as a delta of one token, the last finishing; the stream's chunks."""
    chunks = []
    for i, piece in enumerate(pieces):
        delta = Delta(0, [5 + i], piece, [-0.1], [[]],
                      finish_reason=finish if i == len(pieces) - 1 else None)
        answer.add(0, delta)
        if (chunk := answer.chunk(0, delta)) is not None:
            chunks.append(chunk)
    return chunks


PIECES = ["<th", "ink>\nsix", " is even", "\n</", "think>", "\n\nYes", "."]


def test_an_answer_and_its_stream_carry_the_reasoning_apart_from_the_content():
    chat_types = pytest.importorskip("openai.types.chat")
    answer = Answer(parsed(stream=True), LOADED.tokenizer)
    chunks = deliver(answer, PIECES)
    for chunk in chunks:
        chat_types.ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nsix is even\n"
    assert "".join(d.get("content", "") for d in deltas) == "Yes."
    assert deltas[0] == {"reasoning": "\nsix", "reasoning_content": "\nsix"}  # "<th" held
    message = answer.final()["choices"][0]["message"]
    chat_types.ChatCompletion.model_validate(answer.final())
    assert message == {"role": "assistant", "reasoning": "\nsix is even\n",
                       "reasoning_content": "\nsix is even\n", "content": "Yes."}
    plain = Answer(parsed(reasoning_parser=None, stream=True), LOADED.tokenizer)
    deliver(plain, PIECES)
    assert plain.final()["choices"][0]["message"] == {"role": "assistant",
                                                      "content": "".join(PIECES)}


def test_tool_calls_are_read_from_the_content_after_the_thought():
    tools = [{"type": "function", "function": {"name": "is_even", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}]
    answer = Answer(parsed(tools=tools, stream=True), LOADED.tokenizer)
    call = '<tool_call>{"name": "is_even", "arguments": {"n": 6}}</tool_call>'
    [chunk] = deliver(answer, ["<think>ask the tool", "</think>\n", call])
    delta = chunk["choices"][0]["delta"]
    assert chunk["choices"][0]["finish_reason"] == "tool_calls"
    assert delta["reasoning"] == "ask the tool" and "content" not in delta
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {"n": 6}


def test_a_parser_of_another_name_is_refused_before_the_server_starts():
    pytest.importorskip("starlette")
    from kvjax.serve.server import build_app

    with pytest.raises(ValueError, match="reasoning_parser='r1' is not one of think, qwen3, "
                                         "deepseek_r1, harmony, openai_gptoss"):
        build_app(LOADED, reasoning_parser="r1")
