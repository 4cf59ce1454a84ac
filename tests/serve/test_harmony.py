"""serve/harmony.py: gpt-oss's harmony messages read from their tokens: the analysis channel
is the reasoning, the final channel the content, a commentary message to one of the
request's functions a tool call; streamed token by token, the deltas add up to the whole
answer and never carry a marker."""

import json

import pytest
from conftest import FakeTokenizer

from kvjax import model as M
from kvjax.serve import harmony, reasoning
from kvjax.serve.answers import Answer
from kvjax.serve.protocol import parse
from kvjax.serve.requests import Delta
from kvjax.text import LoadedModel

MODEL = "tiny"
MARKER_BASE = 200  # the markers' ids, past every character's


class HarmonyTokenizer(FakeTokenizer):
    """A character a token (its code point), each harmony marker one special token that
    decoding leaves out, as gpt-oss's tokenizer does."""

    @staticmethod
    def encode(text):
        if text in harmony.MARKERS:
            return [MARKER_BASE + harmony.MARKERS.index(text)]
        return [ord(c) for c in text]

    @staticmethod
    def decode(ids):
        return "".join(chr(i) for i in ids if i < MARKER_BASE)


def tokens_of(*pieces):
    out = []
    for piece in pieces:
        out += HarmonyTokenizer.encode(piece)
    return out


ANSWER = tokens_of("<|channel|>", "analysis", "<|message|>", "Six is 2·3.", "<|end|>",
                   "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Yes, even.",
                   "<|return|>")
CALL = tokens_of("<|channel|>", "analysis", "<|message|>", "Ask the tool.", "<|end|>",
                 "<|start|>", "assistant to=functions.is_even", "<|channel|>", "commentary ",
                 "<|constrain|>", "json", "<|message|>", '{"n": 6}', "<|call|>")
MARKERS = harmony.marker_ids(HarmonyTokenizer())


def split(tokens, finished=True, tools=frozenset()):
    return harmony.Harmony(MARKERS, HarmonyTokenizer.decode, tools).split("", tokens, finished)


def test_the_analysis_is_the_reasoning_and_the_final_message_the_content():
    assert split(ANSWER) == reasoning.Split("Six is 2·3.", "Yes, even.")
    assert split(ANSWER[:13], finished=False) == reasoning.Split("Six", None)
    assert split(tokens_of("<|channel|>", "final", "<|message|>", "Hi")) == \
        reasoning.Split(None, "Hi")  # cut short: what it wrote so far


def test_a_commentary_message_to_a_requested_function_is_a_tool_call():
    parts = split(CALL, tools=frozenset({"is_even"}))
    assert parts.reasoning == "Ask the tool." and parts.content is None
    [call] = parts.calls
    assert call["function"]["name"] == "is_even"
    assert json.loads(call["function"]["arguments"]) == {"n": 6}
    # Not a tool of this request: the text is content, as the model wrote it.
    assert split(CALL) == reasoning.Split("Ask the tool.", '{"n": 6}')


def test_a_tokenizer_without_the_markers_is_refused_by_name():
    with pytest.raises(ValueError, match=r"has <\|start\|> as one token; this one encodes it "
                                         r"as 9"):
        harmony.marker_ids(FakeTokenizer())


def answer(**body):
    loaded = LoadedModel(M.preset("tiny"), HarmonyTokenizer(), None, f"/checkpoints/{MODEL}")
    parsed = parse({"model": MODEL, "messages": [{"role": "user", "content": "Is 6 even?"}],
                    **body}, loaded, MODEL, capacity=512, chat_api=True,
                   reasoning_parser="openai_gptoss")
    return Answer(parsed, loaded.tokenizer)


def deliver(answer, tokens):
    """One delta a token, as the engine hands them out; the stream's chunks."""
    chunks = []
    for i, token in enumerate(tokens):
        delta = Delta(0, [token], HarmonyTokenizer.decode([token]), [-0.1], [[]],
                      finish_reason="stop" if i == len(tokens) - 1 else None)
        answer.add(0, delta)
        if (chunk := answer.chunk(0, delta)) is not None:
            chunks.append(chunk)
    return chunks


def test_a_stream_token_by_token_adds_up_to_the_whole_answer():
    chat_types = pytest.importorskip("openai.types.chat")
    streamed = answer(stream=True)
    deltas = [c["choices"][0]["delta"] for c in deliver(streamed, ANSWER)]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Six is 2·3."
    assert "".join(d.get("content", "") for d in deltas) == "Yes, even."
    assert not any("analysis" in d.get("reasoning", "") or "assistant" in d.get("content", "")
                   for d in deltas)  # headers are not text of the answer
    whole = chat_types.ChatCompletion.model_validate(streamed.final())
    message = whole.choices[0].message
    assert message.content == "Yes, even." and message.model_extra["reasoning"] == "Six is 2·3."


def test_a_streamed_call_comes_whole_in_the_last_chunk():
    tools = [{"type": "function", "function": {"name": "is_even", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}]
    streamed = answer(tools=tools, stream=True)
    [chunk] = deliver(streamed, CALL)
    choice = chunk["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["delta"]["reasoning"] == "Ask the tool." and "content" not in choice["delta"]
    assert json.loads(choice["delta"]["tool_calls"][0]["function"]["arguments"]) == {"n": 6}
