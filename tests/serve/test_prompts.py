"""serve/prompts.py: vLLM's `truncate_prompt_tokens` keeps a prompt's last tokens, a
completion's and a chat's alike: the request is the one its kept tokens make sent as token
ids, an echo shows what the model reads, and a bad count is a 400 naming the field."""

import re

import pytest
from conftest import FakeTokenizer

from kvjax import model as M
from kvjax.serve.fields import APIError
from kvjax.serve.prompts import chat_prompt, truncated
from kvjax.serve.protocol import parse
from kvjax.text import LoadedModel

MODEL, CAPACITY = "tiny", 64
LOADED = LoadedModel(M.preset("tiny"), FakeTokenizer(), None, f"/checkpoints/{MODEL}")
TEXT = "a prompt longer than what is kept"


def completion(**fields):
    return parse({"model": MODEL, **fields}, LOADED, MODEL, CAPACITY, chat_api=False)


def test_a_cut_prompt_is_the_request_its_last_tokens_make():
    whole = completion(prompt=TEXT, max_tokens=4).requests[0].prompt
    cut = completion(prompt=TEXT, max_tokens=4, truncate_prompt_tokens=5)
    assert cut.requests == completion(prompt=list(whole[-5:]), max_tokens=4).requests
    assert len(cut.requests[0].prompt) == 5 < len(whole)
    # An echo shows the text the model reads; a prompt shorter than the cut is whole.
    echoed = completion(prompt=[TEXT, "ab"], max_tokens=4, echo=True, truncate_prompt_tokens=5)
    assert echoed.echo == (FakeTokenizer.decode(whole[-5:]), "ab")
    assert completion(prompt=TEXT, truncate_prompt_tokens=-1).requests[0].prompt == whole
    messages = [{"role": "user", "content": TEXT}]
    chat = parse({"model": MODEL, "messages": messages, "truncate_prompt_tokens": 6},
                 LOADED, MODEL, CAPACITY, chat_api=True)
    assert chat.requests[0].prompt == chat_prompt(LOADED, {"messages": messages}, None)[0][-6:]


@pytest.mark.parametrize("keep, message", [
    (0, "truncate_prompt_tokens=0 must be -1 (a slot's capacity) or from 1 to a slot's "
        "capacity of 64"),
    (65, "truncate_prompt_tokens=65"), (-2, "truncate_prompt_tokens=-2"),
    ("5", "truncate_prompt_tokens='5' must be an integer")])
def test_a_bad_count_is_refused_by_name(keep, message):
    with pytest.raises(APIError, match=re.escape(message)) as error:
        truncated({"truncate_prompt_tokens": keep}, [(1, 2, 3)], CAPACITY)
    assert (error.value.status, error.value.param) == (400, "truncate_prompt_tokens")
    assert truncated({}, [(1, 2, 3)], CAPACITY) is None
