"""serve/responses.py without a server: a Responses API request becomes the chat request it
asks for, item by item and setting by setting, and what it cannot honour is refused naming
the field (the answers and their events are in test_response_answers.py, the endpoint in
test_server.py)."""

import json

import pytest
from conftest import FakeTokenizer

from kvjax import model as M
from kvjax.serve.protocol import APIError, parse
from kvjax.serve.response_store import ResponseStore
from kvjax.serve.responses import chat_body, fitted
from kvjax.text import LoadedModel

MODEL = "tiny"
LOADED = LoadedModel(M.preset("tiny"), FakeTokenizer(), None, f"/checkpoints/{MODEL}")
TOOL = {"type": "function", "name": "is_even", "description": "Whether n is even",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}


def test_a_string_input_and_instructions_are_a_system_and_a_user_message():
    body = {"model": MODEL, "instructions": "Be brief.", "input": "hi", "temperature": 0.5,
            "top_p": 0.9, "max_output_tokens": 7, "seed": 3, "cache_salt": "s", "stream": True,
            "metadata": {"k": "v"}, "store": True, "user": "u", "priority": -2}
    assert chat_body(body) == {
        "model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hi"}],
        "temperature": 0.5, "top_p": 0.9, "max_completion_tokens": 7, "seed": 3,
        "cache_salt": "s", "stream": True, "priority": -2}
    parsed = parse(chat_body(body), LOADED, MODEL, 64, chat_api=True)
    request = parsed.requests[0]
    assert (request.max_tokens, request.seed, request.sampling.temperature) == (7, 3, 0.5)
    assert request.priority == -2


def test_items_become_the_conversation_a_chat_sends():
    call = {"type": "function_call", "call_id": "call_1", "name": "is_even",
            "arguments": json.dumps({"n": 4})}
    items = [{"role": "user", "content": [{"type": "input_text", "text": "4"},
                                          {"type": "input_text", "text": "even?"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Let me see."}]},
             call, {**call, "call_id": "call_2", "arguments": "{\"n\": 6}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "true"},
             {"role": "developer", "content": "Answer in one word."}]
    messages = chat_body({"model": MODEL, "input": items})["messages"]
    assert messages == [
        {"role": "user", "content": [{"type": "text", "text": "4"},
                                     {"type": "text", "text": "even?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}],
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "is_even", "arguments": "{\"n\": 4}"}},
                        {"id": "call_2", "type": "function",
                         "function": {"name": "is_even", "arguments": "{\"n\": 6}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "true"},
        {"role": "developer", "content": "Answer in one word."}]
    # A call with no assistant text before it is a turn of its own.
    assert chat_body({"model": MODEL, "input": [items[0], call]})["messages"][1] == {
        "role": "assistant", "content": "", "tool_calls": messages[1]["tool_calls"][:1]}


def test_a_reasoning_item_is_the_reasoning_of_the_assistant_turn_it_led_to():
    """A conversation sent back as the output items it was given: each reasoning item
    becomes the `reasoning_content` of the assistant message or calls after it."""
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Four is even."}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "is_even",
            "arguments": "{}"}
    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Yes", "annotations": []}]}
    user = {"role": "user", "content": "4?"}
    messages = chat_body({"model": MODEL, "input": [user, thought, answer, call]})["messages"]
    assert messages[1] == {"role": "assistant", "content": [{"type": "text", "text": "Yes"}],
                           "reasoning_content": "Four is even.",
                           "tool_calls": [{"id": "call_1", "type": "function",
                                           "function": {"name": "is_even", "arguments": "{}"}}]}
    # Calls alone after a thought, following an earlier answer: a turn of their own.
    messages = chat_body({"model": MODEL, "input": [user, answer, thought, call]})["messages"]
    assert [m.get("reasoning_content") for m in messages] == [None, None, "Four is even."]
    assert messages[2]["tool_calls"][0]["id"] == "call_1"


def test_a_request_goes_on_from_the_conversation_of_a_kept_response():
    store = ResponseStore(capacity=4)
    earlier = [{"role": "user", "content": "4?"}, {"role": "assistant", "content": "Even."}]
    store.put({"id": "resp_1", "status": "completed"}, earlier)
    body = {"model": MODEL, "previous_response_id": "resp_1", "instructions": "Be brief.",
            "input": "And 5?"}
    assert chat_body(body, store)["messages"] == [
        {"role": "system", "content": "Be brief."}, *earlier,
        {"role": "user", "content": "And 5?"}]
    for missing in ("resp_2", 7):
        with pytest.raises(APIError) as error:
            chat_body({**body, "previous_response_id": missing}, store)
        assert (error.value.status, error.value.param) == (404, "previous_response_id")
        assert "not found: this server keeps the most recent 4" in error.value.message
    with pytest.raises(APIError, match="keeps the most recent 0"):
        chat_body(body)  # a server keeping none
    # An answer cancelled or failed is no conversation to go on from.
    store.put({"id": "resp_3", "status": "cancelled"}, [])
    with pytest.raises(APIError, match="'resp_3' is cancelled: a request goes on from a "
                                       "completed or incomplete one") as error:
        chat_body({**body, "previous_response_id": "resp_3"}, store)
    assert (error.value.status, error.value.param) == (400, "previous_response_id")


def test_tools_formats_reasoning_and_logprobs_are_the_chats():
    body = chat_body({"model": MODEL, "input": "n?", "tools": [TOOL],
                      "tool_choice": {"type": "function", "name": "is_even"},
                      "text": {"format": {"type": "json_schema", "name": "answer",
                                          "schema": {"type": "object"}, "strict": True}},
                      "reasoning": {"effort": "low"},
                      "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    assert body["tools"] == [{"type": "function", "function": {
        k: v for k, v in TOOL.items() if k != "type"}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "is_even"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object"}, "strict": True}}
    assert body["reasoning_effort"] == "low"
    assert (body["logprobs"], body["top_logprobs"]) == (True, 2)
    assert chat_body({"model": MODEL, "input": "x", "text": {"format": {
        "type": "json_object"}}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in chat_body({"model": MODEL, "input": "x",
                                               "text": {"format": {"type": "text"}}})
    # A client that keeps no state asks for reasoning it can send back: its items hold it.
    unstored = chat_body({"model": MODEL, "input": "x", "store": False,
                          "include": ["reasoning.encrypted_content"]})
    assert "logprobs" not in unstored


@pytest.mark.parametrize("fields, param, message", [
    (dict(conversation="conv_1"), "conversation", "go on from a response with "
                                                  "previous_response_id"),
    (dict(background=True, stream=True), "background", "neither stream nor store false"),
    (dict(background=True, store=False), "background", "neither stream nor store false"),
    (dict(background="yes"), "background", "background='yes' must be a boolean"),
    (dict(background=True), "background", "on a server that keeps responses"),
    (dict(prompt={"id": "p"}), "prompt", "prompt templates"),
    (dict(truncation="middle"), "truncation", "truncation='middle' must be 'disabled' or"),
    (dict(input=None), "input", "input is required"),
    (dict(input=[]), "input", "a non-empty list of items"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input",
     "input[0].type='item_reference' is not supported"),
    (dict(input=["hi", {"type": "reasoning", "summary": []}]), "input",
     "input[0] must be an object"),
    (dict(input=[{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}]),
     "input", "input[1] is a reasoning item: it goes right before the assistant's"),
    (dict(input=[{"type": "reasoning", "summary": []}, {"role": "user", "content": "hi"}]),
     "input", "input[0] is a reasoning item"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input", "input[0].content[0] is 'input_image': this model reads text only"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": 1}]), "input",
     "input[0].output must be a string"),
    (dict(instructions=["x"]), "instructions", "instructions must be a string"),
    (dict(tools=[{"type": "web_search"}]), "tools", "tools[0] is 'web_search'"),
    (dict(include=["file_search_call.results"]), "include", "can include only"),
    (dict(top_logprobs=2), "top_logprobs", "top_logprobs needs include"),
    (dict(text={"format": {"type": "grammar"}}), "text", "must be of type text"),
    (dict(text={"verbosity": "low"}), "text", "text.verbosity='low'"),
    (dict(reasoning={"summary": "auto"}), "reasoning", "reasoning summaries"),
])
def test_what_the_server_cannot_honour_is_refused_naming_the_field(fields, param, message):
    with pytest.raises(APIError) as error:
        chat_body({"model": MODEL, "input": "hi", **fields})
    assert (error.value.status, error.value.param) == (400, param)
    assert message in error.value.message


def test_what_the_chat_path_refuses_it_refuses_for_responses_too():
    with pytest.raises(APIError, match=r"messages\[0\].role='robot'"):
        parse(chat_body({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}),
              LOADED, MODEL, 64, chat_api=True)
    with pytest.raises(APIError, match="The model `gpt-4` does not exist"):
        parse(chat_body({"model": "gpt-4", "input": "x"}), LOADED, MODEL, 64, chat_api=True)


def test_auto_truncation_drops_the_earliest_turns_until_the_prompt_and_output_fit():
    turns = [{"role": "user", "content": "1" * 10}, {"role": "assistant", "content": "2" * 10},
             {"role": "user", "content": "3" * 10}, {"role": "assistant", "content": "",
                                                    "tool_calls": [{"id": "c"}]},
             {"role": "tool", "content": "4" * 10}, {"role": "user", "content": "5" * 10}]
    chat = {"messages": [{"role": "system", "content": "S"}, *turns],
            "max_completion_tokens": 8}

    def length(c):  # a prompt's tokens: a character each
        return sum(len(m["content"]) for m in c["messages"])

    def kept(capacity, truncation="auto"):
        return fitted(chat, {"truncation": truncation}, length, capacity)["messages"]

    assert kept(59) == chat["messages"]  # 51 + 8 fit
    assert kept(58) == [chat["messages"][0], *turns[2:]]  # a whole turn goes
    assert kept(39) == [chat["messages"][0], *turns[2:]]
    assert kept(38) == [chat["messages"][0], turns[-1]]  # a call goes with its output
    assert kept(5) == [chat["messages"][0], turns[-1]]  # the last turn stays: then refused
    assert kept(5, "disabled") == kept(5, None) == chat["messages"]
