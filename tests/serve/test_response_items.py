"""serve/response_items.py: a response's input items are the items it went on from, that
response's output, then its own input, each with an id and in the shape of the official
`openai` client's item types; pages follow OpenAI's order, limit and cursors, and a bad
parameter is a 400 naming it."""

import pytest
from starlette.datastructures import QueryParams

from kvjax.serve.protocol import APIError
from kvjax.serve.response_items import input_items, page

responses_types = pytest.importorskip("openai.types.responses")


def test_each_kind_of_input_becomes_an_item_of_the_clients_types():
    call = {"type": "function_call", "call_id": "call_1", "name": "is_even",
            "arguments": '{"n": 4}'}
    body = {"input": [
        {"role": "user", "content": "4?"},
        {"type": "reasoning", "id": "rs_given", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Hmm"}]},
        {"type": "message", "role": "assistant", "content": "Let me see."}, call,
        {"type": "function_call_output", "call_id": "call_1", "output": "true"},
        {"role": "user", "content": [{"type": "input_text", "text": "And 5?"}]}]}
    items = input_items(body, [], [])
    assert [item["type"] for item in items] == [
        "message", "reasoning", "message", "function_call", "function_call_output", "message"]
    assert [item["id"].split("_")[0] for item in items] == ["msg", "rs", "msg", "fc", "fco",
                                                            "msg"]
    assert items[1]["id"] == "rs_given" and len({item["id"] for item in items}) == 6
    assert items[0]["content"] == [{"type": "input_text", "text": "4?"}]
    assert items[2]["content"] == [{"type": "output_text", "text": "Let me see.",
                                    "annotations": []}]
    assert {k: items[3][k] for k in call} == call
    for item in items:
        assert responses_types.ResponseItemList.model_validate(
            {"object": "list", "data": [item], "first_id": item["id"], "last_id": item["id"],
             "has_more": False}).data[0].type == item["type"]


def test_a_request_that_goes_on_lists_the_earlier_items_and_answer_first():
    earlier = input_items({"input": "Hi."}, [], [])
    answer = [{"id": "msg_answer", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]}]
    items = input_items({"input": "Go"}, earlier, answer)
    assert items[:2] == earlier + answer
    assert items[2]["content"] == [{"type": "input_text", "text": "Go"}]


ITEMS = [{"id": f"msg_{i}", "type": "message", "role": "user", "status": "completed",
          "content": [{"type": "input_text", "text": str(i)}]} for i in range(5)]


def ids(listed: dict) -> list[str]:
    return [item["id"].removeprefix("msg_") for item in listed["data"]]


def test_pages_run_newest_first_unless_asked_and_cursors_move_through_them():
    whole = page(ITEMS, QueryParams(""))
    assert ids(whole) == ["4", "3", "2", "1", "0"] and not whole["has_more"]
    assert (whole["first_id"], whole["last_id"]) == ("msg_4", "msg_0")
    responses_types.ResponseItemList.model_validate(whole)
    first = page(ITEMS, QueryParams("order=asc&limit=2"))
    assert ids(first) == ["0", "1"] and first["has_more"]
    second = page(ITEMS, QueryParams(f"order=asc&limit=2&after={first['last_id']}"))
    assert ids(second) == ["2", "3"] and second["has_more"]
    assert ids(page(ITEMS, QueryParams("order=asc&limit=2&after=msg_3"))) == ["4"]
    assert not page(ITEMS, QueryParams("order=asc&limit=2&after=msg_3"))["has_more"]
    # Before a cursor: the nearest items, in the order asked for.
    before = page(ITEMS, QueryParams("limit=2&before=msg_1"))
    assert ids(before) == ["3", "2"] and before["has_more"]
    assert ids(page(ITEMS, QueryParams("after=msg_3&before=msg_0"))) == ["2", "1"]
    empty = page(ITEMS, QueryParams("after=msg_0"))
    assert empty["data"] == [] and empty["first_id"] is None and not empty["has_more"]
    assert ids(page(ITEMS, QueryParams("include=message.output_text.logprobs"))) == ids(whole)


@pytest.mark.parametrize("query, param, message", [
    ("limit=0", "limit", "limit='0' must be an integer from 1 to 100"),
    ("limit=101", "limit", "limit='101'"),
    ("limit=two", "limit", "limit='two'"),
    ("order=newest", "order", "order='newest' must be 'asc' or 'desc'"),
    ("after=msg_9", "after", "after='msg_9' is not an input item of this response"),
    ("before=x", "before", "before='x'"),
    ("include=file_search_call.results", "include", "'file_search_call.results'"),
])
def test_a_bad_parameter_is_a_400_naming_it(query, param, message):
    with pytest.raises(APIError, match=message) as error:
        page(ITEMS, QueryParams(query))
    assert (error.value.status, error.value.param) == (400, param)
