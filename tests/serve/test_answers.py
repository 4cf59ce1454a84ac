"""serve/answers.py: the engine's deltas become OpenAI's JSON, checked by the official `openai`
client's own types; a stream's chunks add up to the whole answer; choices are numbered prompt
by prompt, sample by sample; usage counts every token; a chat choice that calls a tool says
so in its last chunk alone."""

import json

import pytest
from conftest import FakeTokenizer

from kvjax import model as M
from kvjax.serve.answers import Answer
from kvjax.serve.protocol import parse
from kvjax.serve.requests import Delta
from kvjax.text import LoadedModel

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")

MODEL = "tiny"
LOADED = LoadedModel(M.preset("tiny"), FakeTokenizer(), None, f"/checkpoints/{MODEL}")


def answer_to(body: dict, chat: bool) -> Answer:
    return Answer(parse({"model": MODEL, **body}, LOADED, MODEL, capacity=512, chat_api=chat),
                  LOADED.tokenizer)


def deltas_of(tokens: list[int], finish: str, top: int):
    """The deltas of one sample whose tokens arrive two at a time."""
    for start in range(0, len(tokens), 2):
        ids = tokens[start:start + 2]
        yield Delta(index=0, token_ids=ids, text=FakeTokenizer.decode(ids),
                    logprobs=[-0.5 - t / 100 for t in ids],
                    top_logprobs=[[(t, -0.5), (t + 1, -1.5)][:top] for t in ids],
                    finish_reason=finish if start + 2 >= len(tokens) else None)


def stream(answer: Answer, samples: dict[tuple[int, int], list[int]], finish: dict) -> list:
    """Every chunk a stream sends, the samples' deltas interleaved, then the usage chunk."""
    chunks = list(answer.opening_chunks())
    pending = {key: list(deltas_of(tokens, finish[key], 2)) for key, tokens in samples.items()}
    while any(pending.values()):
        for (prompt, sample), deltas in pending.items():
            if deltas:
                delta = deltas.pop(0)
                delta = Delta(sample, delta.token_ids, delta.text, delta.logprobs,
                              delta.top_logprobs, delta.finish_reason)
                answer.add(prompt, delta)
                if (chunk := answer.chunk(prompt, delta)) is not None:
                    chunks.append(chunk)
    return chunks


SAMPLES = {(0, 0): [5, 6, 7], (0, 1): [8], (1, 0): [9, 10, 11, 12], (1, 1): [13, 14]}
FINISH = {(0, 0): "stop", (0, 1): "length", (1, 0): "cancelled", (1, 1): "stop"}


def test_completions_streamed_add_up_to_the_whole_answer_choice_by_choice():
    answer = answer_to({"prompt": ["AB", "CDE"], "n": 2, "max_tokens": 8, "logprobs": 2,
                        "stream": True, "stream_options": {"include_usage": True}}, chat=False)
    chunks = stream(answer, SAMPLES, FINISH) + [answer.usage_chunk()]
    final = answer.final()
    whole = openai_types.Completion.model_validate(final)
    for chunk in chunks:  # OpenAI streams a choice's chunks with finish_reason null
        # before its last one, which openai's `Completion` type does not take.
        if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
            chunk = {**chunk, "choices": [{**chunk["choices"][0], "finish_reason": "stop"}]}
        openai_types.Completion.model_validate(chunk)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    for (prompt, sample), tokens in SAMPLES.items():
        choice = whole.choices[prompt * 2 + sample]
        assert choice.text == FakeTokenizer.decode(tokens)
        assert choice.finish_reason == ("length" if FINISH[prompt, sample] == "length"
                                        else "stop")
        assert choice.logprobs.tokens == [FakeTokenizer.decode([t]) for t in tokens]
        assert choice.logprobs.text_offset == list(range(len(tokens)))  # one letter a token
        assert choice.logprobs.top_logprobs[0] == {FakeTokenizer.decode([tokens[0]]): -0.5,
                                                   FakeTokenizer.decode([tokens[0] + 1]): -1.5}
        streamed = [c["choices"][0] for c in chunks
                    if c["choices"] and c["choices"][0]["index"] == prompt * 2 + sample]
        assert "".join(c["text"] for c in streamed) == choice.text
        assert [c["finish_reason"] for c in streamed][-1] == choice.finish_reason
        assert all(c["finish_reason"] is None for c in streamed[:-1])
        offsets = sum((c["logprobs"]["text_offset"] for c in streamed), [])
        assert offsets == choice.logprobs.text_offset
    prompts = [(*FakeTokenizer.document_prefix, *FakeTokenizer.encode(t)) for t in ("AB", "CDE")]
    assert [r.prompt for r in answer.parsed.requests] == prompts
    prompt_tokens = sum(map(len, prompts))
    completion_tokens = sum(map(len, SAMPLES.values()))
    assert final["usage"] == chunks[-1]["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0}}  # no engine tickets here
    assert answer.done


def test_a_chat_stream_opens_with_the_role_and_its_logprobs_carry_bytes():
    answer = answer_to({"messages": [{"role": "user", "content": "hi"}], "n": 2,
                        "logprobs": True, "top_logprobs": 1, "stream": True}, chat=True)
    samples = {(0, 0): [5, 6, 7], (0, 1): [20, 21]}
    chunks = stream(answer, samples, {(0, 0): "stop", (0, 1): "length"})
    for chunk in chunks:
        chat_types.ChatCompletionChunk.model_validate(chunk)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant",
                                                               "content": ""}] * 2
    whole = chat_types.ChatCompletion.model_validate(answer.final())
    for index, tokens in enumerate(samples.values()):
        choice = whole.choices[index]
        text = FakeTokenizer.decode(tokens)
        assert choice.message.role == "assistant" and choice.message.content == text
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"][0]["index"] == index) == text
        assert [e.token for e in choice.logprobs.content] == list(text)
        assert [e.bytes for e in choice.logprobs.content] == [list(ch.encode()) for ch in text]
    assert "usage" not in chunks[-1]  # only when the stream options ask for it


def test_tokens_asked_for_as_ids_are_written_token_id_colon_id():
    for chat in (True, False):
        body = ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                 "top_logprobs": 2} if chat else {"prompt": "hi", "logprobs": 2})
        answer = answer_to({**body, "return_tokens_as_token_ids": True}, chat)
        for delta in deltas_of([5, 6, 7], "stop", 2):
            answer.add(0, delta)
        logprobs = answer.final()["choices"][0]["logprobs"]
        if chat:
            whole = chat_types.ChatCompletion.model_validate(answer.final())
            entries = whole.choices[0].logprobs.content
            assert [e.token for e in entries] == ["token_id:5", "token_id:6", "token_id:7"]
            assert entries[0].bytes == list(b"token_id:5")
            assert [t.token for t in entries[0].top_logprobs] == ["token_id:5", "token_id:6"]
        else:
            assert logprobs["tokens"] == ["token_id:5", "token_id:6", "token_id:7"]
            assert logprobs["top_logprobs"][2] == {"token_id:7": -0.5, "token_id:8": -1.5}
            assert logprobs["text_offset"] == [0, 10, 20]


def test_a_chats_echo_opens_its_content_streamed_or_whole_and_costs_no_tokens():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for extra in ({}, {"tools": tools}):  # with tools a choice is sent whole at its end
        answer = answer_to({"messages": messages, "n": 2, "echo": True, "stream": True,
                            "add_generation_prompt": False, "continue_final_message": True,
                            "stream_options": {"include_usage": True}, **extra}, chat=True)
        samples = {(0, 0): [5, 6, 7], (0, 1): [20, 21]}
        chunks = stream(answer, samples, {(0, 0): "stop", (0, 1): "length"})
        whole = chat_types.ChatCompletion.model_validate(answer.final())
        for index, tokens in enumerate(samples.values()):
            text = "Sure, " + FakeTokenizer.decode(tokens)
            mine = [c["choices"][0]["delta"] for c in chunks if c["choices"]
                    and c["choices"][0]["index"] == index]
            assert mine[:2] == [{"role": "assistant", "content": ""}, {"content": "Sure, "}]
            assert "".join(d.get("content") or "" for d in mine) == text
            assert whole.choices[index].message.content == text
        assert whole.usage.completion_tokens == 5  # the echo is not the answer's tokens


def test_a_tool_call_is_sent_whole_in_its_choices_last_chunk():
    tools = [{"type": "function", "function": {"name": "is_even", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}]
    answer = answer_to({"messages": [{"role": "user", "content": "4?"}], "tools": tools,
                        "stream": True}, chat=True)
    call = '<tool_call>{"name": "is_even", "arguments": {"n": 4}}</tool_call>'
    held = answer.chunk(0, Delta(0, [5], "Let me see. ", [-0.1], [[]]))
    answer.add(0, Delta(0, [5], "Let me see. ", [-0.1], [[]]))
    assert held is None  # the text could still turn out to be a call
    last = Delta(0, [6], call, [-0.2], [[]], finish_reason="stop")
    answer.add(0, last)
    chunk = chat_types.ChatCompletionChunk.model_validate(answer.chunk(0, last))
    assert chunk.choices[0].finish_reason == "tool_calls"
    assert chunk.choices[0].delta.content == "Let me see."
    [streamed] = chunk.choices[0].delta.tool_calls
    assert streamed.index == 0 and streamed.function.name == "is_even"
    assert json.loads(streamed.function.arguments) == {"n": 4}
    whole = chat_types.ChatCompletion.model_validate(answer.final())
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.tool_calls[0].function.name == "is_even"
