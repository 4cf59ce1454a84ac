"""serve/tools.py: `auto` reads the tool calls a model writes and keeps its other text."""

import json

from kvjax.serve.tools import Tools


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
