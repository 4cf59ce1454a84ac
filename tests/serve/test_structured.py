"""serve/structured.py: which constraint each way of asking for structured output holds a
request to, that a request takes one, and each malformed field refused by name (served
answers under these constraints are in test_server_structured.py)."""

import pytest

from kvjax.decode import AllowedTokens, Choice, JsonSchema, Regex
from kvjax.decode.checks import InvalidValue
from kvjax.serve.structured import ANY_OBJECT, compiled, requested
from kvjax.serve.tools import Tools

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body, expected, field", [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, JsonSchema(ANY_OBJECT), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     JsonSchema(SCHEMA), "response_format"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, Regex("[0-9]+"), "structured_outputs"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Choice(["yes", "no"]),
     "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA}}, JsonSchema(SCHEMA), "structured_outputs"),
    ({"guided_regex": "[0-9]+"}, Regex("[0-9]+"), "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, Choice(["yes", "no"]), "guided_choice"),
    ({"guided_json": SCHEMA}, JsonSchema(SCHEMA), "guided_json"),
    ({"guided_json": '{"type": "object"}'}, JsonSchema(ANY_OBJECT), "guided_json"),
    ({"allowed_token_ids": [7, 3, 7]}, AllowedTokens((3, 7)), "allowed_token_ids"),
])
def test_each_way_of_asking_holds_the_output_to_its_constraint(body, expected, field):
    assert requested(body, None) == (expected, field)


def test_a_required_tool_call_is_the_constraint_and_auto_is_none():
    tool = {"name": "f", "parameters": SCHEMA}
    required = Tools((tool,), "required")
    assert requested({}, required) == (required.constraint(), "tool_choice")
    assert requested({}, Tools((tool,), "auto")) == (None, None)


@pytest.mark.parametrize("body, field, message", [
    ({"response_format": "json"}, "response_format", "response_format must be an object"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type='yaml' must be 'text', "
                                                               "'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs {'json_schema': {'name': ..., 'schema': {...}}}"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"oneOf": []}}}},
     "response_format", "'oneOf'"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "one of 'regex', 'choice' or 'json'"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", "regex must be a string"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs",
     "choice must be a non-empty list of strings"),
    ({"structured_outputs": {"json": "{}"}}, "structured_outputs", "must be a JSON Schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "response_format and structured_outputs both hold the output"),
    ({"guided_regex": 5}, "guided_regex", "guided_regex must be a string"),
    ({"guided_json": "{x"}, "guided_json", "guided_json is not valid JSON"),
    ({"guided_choice": "yes"}, "guided_choice", "must be a non-empty list of strings"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", r"grammar\) is not supported"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json",
     "structured_outputs and guided_json both hold the output"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "a non-empty list of token ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids", "a non-empty list of token ids"),
    ({"guided_regex": "a", "allowed_token_ids": [5]}, "allowed_token_ids",
     "guided_regex and allowed_token_ids both hold the output"),
])
def test_a_malformed_or_second_request_for_structure_is_refused_by_name(body, field, message):
    with pytest.raises(InvalidValue, match=message) as error:
        requested(body, None)
    assert error.value.name == field


def test_a_constraint_the_vocabulary_cannot_spell_is_refused_naming_the_field():
    class NoBytes:  # a tokenizer whose tokens spell nothing
        eos_id, vocab_size, stop_ids = 2, 8, (2,)

        def token_bytes(self):
            return [None] * 8

    with pytest.raises(InvalidValue, match="cannot compile Regex for this vocabulary") as error:
        compiled(Regex("ab"), "structured_outputs", NoBytes())
    assert error.value.name == "structured_outputs"
