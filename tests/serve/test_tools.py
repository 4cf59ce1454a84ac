"""serve/tools.py: `auto` reads the tool calls a model writes and keeps its other text;
without parallel calls an answer makes at most one."""

import json

import pytest

from kvjax.serve.tools import Tools, parse_tools


def test_auto_reads_calls_the_model_writes_and_keeps_other_text():
    tools = Tools(({"name": "is_even", "parameters": {}},), "auto")
    content, calls = tools.calls('Let me check. <tool_call>{"name": "is_even", '
                                 '"arguments": {"n": 4}}</tool_call>')
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("is_even", {"n": 4})]
    for text_only in ("no call", '<tool_call>{"name": "other", "arguments": {}}</tool_call>',
                      "<tool_call>{not json</tool_call>"):
        assert tools.calls(text_only) == (text_only, [])


def test_without_parallel_calls_an_answer_makes_at_most_one():
    """OpenAI's `parallel_tool_calls: false`: "required" is held to one call, "auto" keeps
    the first call the model writes."""
    body = {"tools": [{"type": "function", "function": {"name": "is_even"}}],
            "tool_choice": "required", "parallel_tool_calls": False}
    held = parse_tools(body)
    assert json.loads(held.constraint().schema)["maxItems"] == 1
    assert "maxItems" not in json.loads(parse_tools({**body, "parallel_tool_calls": True}
                                                    ).constraint().schema)
    two = ('<tool_call>{"name": "is_even", "arguments": {"n": 4}}</tool_call>'
           '<tool_call>{"name": "is_even", "arguments": {"n": 5}}</tool_call>')
    auto = parse_tools({**body, "tool_choice": "auto"})
    _, calls = auto.calls(two)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"n": 4}]
    _, calls = parse_tools({**body, "tool_choice": "auto", "parallel_tool_calls": None}
                           ).calls(two)
    assert len(calls) == 2  # the default: every call
    with pytest.raises(ValueError, match="parallel_tool_calls='no' must be a boolean"):
        parse_tools({**body, "parallel_tool_calls": "no"})
