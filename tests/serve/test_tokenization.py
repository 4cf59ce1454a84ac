"""vLLM's /tokenize and /detokenize: a prompt's tokens are transformers' ids for a Hugging Face
tokenizer and the very tokens the completion and chat endpoints feed the model; tokens
detokenize to transformers' text; what kvjax does not implement is refused by name."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import FakeTokenizer

from kvjax import text
from kvjax.serve.protocol import APIError, parse
from kvjax.serve.tokenization import detokenize, tokenize
from kvjax.tokenizer.huggingface import load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SERVED = ("lm", "adapter", None)  # the model, an adapter, an empty adapter slot
CAPACITY = 48


def loaded_model(tokenizer, translation: bool = False) -> text.LoadedModel:
    config = SimpleNamespace(is_encoder_decoder=translation)
    return text.LoadedModel(config, tokenizer, params=None, directory="")


def expected(name: str) -> dict:
    return json.loads((FIXTURES / "hf_tokenizers" / name / "expected.json").read_text("utf-8"))


@pytest.mark.parametrize("name, translation", [("byte_bpe_bos", False), ("marian", True)])
def test_a_prompts_tokens_are_transformers_ids_and_detokenize_to_its_text(name, translation):
    """With special tokens (as /v1/completions frames a prompt: Llama-style bos in front, a
    translator's source eos behind) and without; every text of the fixture, as transformers
    tokenized and decoded it."""
    if name != "marian":
        pytest.importorskip("tokenizers")
    loaded = loaded_model(load_tokenizer(FIXTURES / "hf_tokenizers" / name), translation)
    theirs = expected(name)
    for i, prompt in enumerate(theirs["texts"]):
        framed = tokenize({"prompt": prompt}, loaded, SERVED, CAPACITY)
        assert framed == {"count": len(theirs["ids_with_special_tokens"][i]),
                          "max_model_len": CAPACITY,
                          "tokens": theirs["ids_with_special_tokens"][i], "token_strs": None}
        bare = tokenize({"prompt": prompt, "add_special_tokens": False, "model": "adapter",
                         "return_token_strs": True}, loaded, SERVED, CAPACITY)
        assert bare["tokens"] == theirs["ids"][i]
        # Each token's string, as transformers' convert_ids_to_tokens gives it.
        assert tokenize({"prompt": prompt, "return_token_strs": True}, loaded, SERVED,
                        CAPACITY)["token_strs"] == theirs["pieces"][i]
        start = len(loaded.tokenizer.source_prefix if translation else
                    loaded.tokenizer.document_prefix)
        assert bare["token_strs"] == theirs["pieces"][i][start:start + len(bare["tokens"])]
        assert detokenize({"tokens": theirs["ids"][i]}, loaded, SERVED) == {
            "prompt": theirs["decoded"][i]}
        assert framed["tokens"] == list(parse({"model": "lm", "prompt": prompt}, loaded, "lm",
                                              CAPACITY, chat_api=False).requests[0].prompt)


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A Hugging Face tokenizer with Gemma 3's chat template, and kvjax's plain one."""
    pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("templated")
    shutil.copytree(FIXTURES / "hf_tokenizers" / "byte_bpe_bos", directory, dirs_exist_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    template = (FIXTURES / "chat_templates" / "gemma3.jinja").read_text()
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template}))
    return loaded_model(load_tokenizer(directory))


@pytest.mark.parametrize("which", ["template", "plain"])
@pytest.mark.parametrize("ending", [{}, {"add_generation_prompt": False,
                                         "continue_final_message": True}])
def test_messages_tokenize_as_the_chat_endpoint_feeds_them_to_the_model(templated, which,
                                                                        ending):
    """With a new answer's start (the default), or ending inside the final message."""
    loaded = templated if which == "template" else loaded_model(FakeTokenizer())
    body = {"messages": [{"role": "system", "content": "Answer in one line."},
                         {"role": "user", "content": "What is a KV cache?"},
                         {"role": "assistant", "content": "A store of"}],
            "chat_template_kwargs": {"enable_thinking": False},
            "tools": [{"type": "function", "function": {
                "name": "lookup", "parameters": {"type": "object", "properties": {}}}}],
            **ending}
    fed = parse({**body, "model": "lm"}, loaded, "lm", 512, chat_api=True)
    answer = tokenize(body, loaded, SERVED, CAPACITY)
    assert answer["tokens"] == list(fed.requests[0].prompt)
    assert answer["count"] == len(fed.requests[0].prompt) > 10
    ends_inside = loaded.tokenizer.encode(" of")
    assert (answer["tokens"][-len(ends_inside):] == ends_inside) == bool(ending)
    if which == "template":  # the template's own bos, not one more in front of it
        bos = loaded.tokenizer.bos_id
        assert answer["tokens"][0] == bos and answer["tokens"][1] != bos


def refused(call, *args) -> APIError:
    with pytest.raises(APIError) as excinfo:
        call(*args)
    return excinfo.value


@pytest.mark.parametrize("body, status, param, message", [
    ({"prompt": "a", "model": "other"}, 404, "model", "`other` does not exist"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "messages",
     "a prompt or messages, one of them"),
    ({}, 400, "prompt", "a prompt or messages, one of them"),
    ({"prompt": ["a", "b"]}, 400, "prompt", "prompt must be a string, not list"),
    ({"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens",
     "add_special_tokens='yes' must be a boolean"),
    ({"prompt": "a", "return_token_strs": "yes"}, 400, "return_token_strs", "boolean"),
    ({"prompt": "a", "add_generation_prompt": False}, 400, "add_generation_prompt",
     "add_generation_prompt is for messages, not a prompt"),
    ({"prompt": "a", "tools": []}, 400, "tools", "tools is for messages"),
    ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True}, 400,
     "continue_final_message", "needs add_generation_prompt=false"),
    ({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}, 400,
     "add_special_tokens", "add_special_tokens is for a prompt"),
    ({"messages": [{"role": "robot", "content": "a"}]}, 400, "messages", "'robot'"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"tools": 1}},
     400, "chat_template_kwargs", "may not set tools"),
    (["a"], 400, None, "must be a JSON object"),
])
def test_a_bad_tokenize_request_is_refused_by_name(body, status, param, message):
    error = refused(tokenize, body, loaded_model(FakeTokenizer()), SERVED, CAPACITY)
    assert (error.status, error.param) == (status, param)
    assert message in error.message


def test_a_translator_tokenizes_no_messages():
    error = refused(tokenize, {"messages": [{"role": "user", "content": "a"}]},
                    loaded_model(FakeTokenizer(), translation=True), SERVED, CAPACITY)
    assert (error.status, error.param) == (400, "messages") and "no chat" in error.message


def test_detokenizing_ids_outside_the_vocabulary_or_not_ids_is_refused_by_name():
    pytest.importorskip("tokenizers")
    loaded = loaded_model(load_tokenizer(FIXTURES / "hf_tokenizers" / "byte_bpe_bos"))
    size = loaded.tokenizer.vocab_size
    error = refused(detokenize, {"tokens": [3, size]}, loaded, SERVED)
    assert (error.status, error.param) == (400, "tokens") and str(size) in error.message
    for tokens in ("3 4", [3, "4"], [True], None):
        error = refused(detokenize, {"tokens": tokens}, loaded, SERVED)
        assert (error.status, error.param) == (400, "tokens")
    assert refused(detokenize, {"tokens": [3], "model": "x"}, loaded, SERVED).status == 404
