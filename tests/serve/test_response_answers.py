"""serve/response_answers.py: the engine's deltas become a Responses API response and its
events, checked by the official `openai` client's own types; the stream's events add up, item
by item, to the response its last event carries, which is the whole answer; output items come
in order (reasoning, message, calls) and usage counts the reasoning's tokens; a kept answer
holds its conversation and input items."""

import json
import typing

import pytest
from conftest import FakeTokenizer

from kvjax import model as M
from kvjax.serve.protocol import APIError, parse
from kvjax.serve.requests import Delta
from kvjax.serve.response_answers import ResponseAnswer
from kvjax.serve.response_store import ResponseStore
from kvjax.serve.responses import chat_body
from kvjax.text import LoadedModel

responses_types = pytest.importorskip("openai.types.responses")
# Each event type's own model (the stream event union, keyed by its `type` literal).
EVENTS = {cls.model_fields["type"].annotation.__args__[0]: cls
          for cls in typing.get_args(typing.get_args(responses_types.ResponseStreamEvent)[0])}

MODEL = "tiny"


class WordTokenizer(FakeTokenizer):
    """Ids 5.. are the words below (a thought's tags among them); the special ones below 5
    decode to nothing."""

    WORDS = ["<think>", "Hmm", ", four", "</think>", "Yes", ", even", "<tool_call>",
             '{"name": "is_even", "arguments": {"n": 4}}', "</tool_call>"]

    @classmethod
    def decode(cls, ids):
        return "".join(cls.WORDS[i - 5] for i in ids if i >= 5)


def answer_to(body: dict, reasoning_parser: str | None = None,
              store: ResponseStore | None = None) -> ResponseAnswer:
    loaded = LoadedModel(M.preset("tiny"), WordTokenizer(), None, f"/checkpoints/{MODEL}")
    body = {"model": MODEL, **body}
    chat = chat_body(body, store)
    parsed = parse(chat, loaded, MODEL, capacity=512, chat_api=True,
                   reasoning_parser=reasoning_parser)
    return ResponseAnswer(parsed, loaded.tokenizer, body, chat["messages"], store)


def run(answer: ResponseAnswer, tokens: list[int], finish: str) -> list[dict]:
    """Every event a stream sends, the tokens arriving one at a time."""
    events = [e for e in answer.stream_opening()]
    for i, token in enumerate(tokens):
        delta = Delta(0, [token], WordTokenizer.decode([token]), [-0.1 * (i + 1)],
                      [[(token, -0.1 * (i + 1))]],
                      finish_reason=finish if i == len(tokens) - 1 else None)
        answer.add(0, delta)
        events += answer.stream_delta(0, delta)
    events += answer.stream_closing()
    parsed = []
    for text in events:
        head, data, blank = text.split("\n", 2)
        assert head.startswith("event: ") and data.startswith("data: ") and blank == "\n"
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        EVENTS[event["type"]].model_validate(event)
        parsed.append(event)
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    return parsed


def streamed_output(events: list[dict]) -> list[dict]:
    """The output items as the events build them: added, grown by deltas, then done."""
    items, texts = {}, {}
    for event in events:
        kind, index = event["type"], event.get("output_index")
        if kind == "response.output_item.added":
            items[index] = event["item"]
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta"):
            texts[index] = texts.get(index, "") + event["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert event["text"] == texts.get(index, "")
        elif kind == "response.function_call_arguments.done":
            assert event["arguments"] == texts[index]
        elif kind == "response.output_item.done":
            assert event["item"]["id"] == items[index]["id"]
            items[index] = event["item"]
    return [items[i] for i in sorted(items)]


def test_a_message_streams_as_events_that_add_up_to_the_whole_response():
    answer = answer_to({"input": "4?", "max_output_tokens": 3, "stream": True,
                        "include": ["message.output_text.logprobs"], "top_logprobs": 1,
                        "metadata": {"run": "1"}, "instructions": "Be brief."})
    events = run(answer, [9, 10, 9], "length")
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[-1]["type"] == "response.incomplete"
    whole = answer.final()
    responses_types.Response.model_validate(whole)
    assert events[-1]["response"] == whole
    assert streamed_output(events) == whole["output"]
    [message] = whole["output"]
    assert message["status"] == "incomplete" and message["role"] == "assistant"
    assert message["content"][0]["text"] == "Yes, evenYes"
    assert [p["logprob"] for p in message["content"][0]["logprobs"]] == pytest.approx(
        [-0.1, -0.2, -0.3])
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp for e in deltas for lp in e["logprobs"]] == message["content"][0]["logprobs"]
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["usage"]["output_tokens"] == 3 and whole["max_output_tokens"] == 3
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    assert (whole["metadata"], whole["instructions"]) == ({"run": "1"}, "Be brief.")


def test_reasoning_comes_first_and_its_tokens_are_counted():
    answer = answer_to({"input": "4?"}, reasoning_parser="qwen3")
    tokens = [5, 6, 7, 8, 9, 10, 2]  # <think>Hmm, four</think>Yes, even<eos>
    events = run(answer, tokens, "stop")
    whole = answer.final()
    responses_types.Response.model_validate(whole)
    assert events[-1]["type"] == "response.completed" and events[-1]["response"] == whole
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Hmm, four"}]
    assert message["content"][0]["text"] == "Yes, even"
    assert streamed_output(events) == whole["output"]
    # The thought's tokens, its tags included, before the answer's first.
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}
    assert whole["usage"]["output_tokens"] == 7
    # A thought that never ends is reasoning only, and all its tokens are.
    unfinished = answer_to({"input": "4?"}, reasoning_parser="qwen3")
    run(unfinished, [5, 6, 7], "length")
    assert [i["type"] for i in unfinished.final()["output"]] == ["reasoning", "message"]
    assert unfinished.final()["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_function_calls_follow_the_message_as_items_of_their_own():
    tool = {"type": "function", "name": "is_even",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    answer = answer_to({"input": "4?", "tools": [tool], "stream": True})
    events = run(answer, [9, 11, 12, 13, 2], "stop")  # Yes<tool_call>{...}</tool_call>
    whole = answer.final()
    responses_types.Response.model_validate(whole)
    message, call = whole["output"]
    assert message["content"][0]["text"] == "Yes"
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call", "is_even", {"n": 4})
    assert call["call_id"] and call["id"] != message["id"]
    assert streamed_output(events) == whole["output"]
    assert whole["tools"] == [tool] and whole["tool_choice"] == "auto"
    # Only a call: no message item.
    only = answer_to({"input": "4?", "tools": [tool]})
    run(only, [11, 12, 13, 2], "stop")
    assert [i["type"] for i in only.final()["output"]] == ["function_call"]


def test_a_finished_answer_is_kept_with_the_conversation_it_ends_unless_asked_not_to():
    store = ResponseStore(capacity=4)
    tool = {"type": "function", "name": "is_even", "parameters": {}}
    first = answer_to({"input": "4?", "instructions": "Be brief.", "tools": [tool]},
                      reasoning_parser="qwen3", store=store)
    run(first, [5, 6, 8, 9, 11, 12, 13, 2], "stop")  # <think>Hmm</think>Yes<tool_call>...
    kept, conversation = store.get(first.id).response, store.get(first.id).conversation
    assert kept == first.final()
    [call] = [item for item in kept["output"] if item["type"] == "function_call"]
    assert conversation == [  # its instructions are not carried over
        {"role": "user", "content": "4?"},
        {"role": "assistant", "content": "Yes", "reasoning_content": "Hmm",
         "tool_calls": [{"id": call["call_id"], "type": "function",
                         "function": {"name": "is_even", "arguments": '{"n": 4}'}}]}]
    # The next request goes on from it, and says so.
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "true"}
    second = answer_to({"previous_response_id": first.id, "input": [output]}, store=store)
    run(second, [9, 2], "stop")
    assert second.final()["previous_response_id"] == first.id
    assert store.get(second.id).conversation == conversation + [
        {"role": "tool", "tool_call_id": call["call_id"], "content": "true"},
        {"role": "assistant", "content": "Yes"}]
    # Its input items: the first's (its instructions are a setting, not an item), the
    # first's output, then its own input.
    [asked] = store.get(first.id).items
    assert asked["content"] == [{"type": "input_text", "text": "4?"}]
    items = store.get(second.id).items
    assert items[:-1] == [asked, *kept["output"]]
    assert {key: items[-1][key] for key in output} == output
    unkept = answer_to({"input": "4?", "store": False}, store=store)
    run(unkept, [9, 2], "stop")
    assert store.get(unkept.id) is None


def test_an_engine_failure_mid_stream_is_an_error_event():
    answer = answer_to({"input": "4?", "stream": True})
    answer.stream_opening()
    [text] = answer.stream_error(APIError(500, "generation failed: boom", kind="server_error"))
    event = json.loads(text.split("\n")[1].removeprefix("data: "))
    EVENTS[event["type"]].model_validate(event)
    assert event["type"] == "error" and event["sequence_number"] == 2
    assert event["message"] == "generation failed: boom"
