"""vLLM's `prompt_logprobs` through the official `openai` client: each prompt token's logprob
and rank, and the likeliest tokens at its position with theirs, are NumPy's log-softmax of the
uncached model's logits; a completion's choices each carry their prompt's, a chat answer its
own; asking for them changes nothing else in the answer."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SERVED_MODEL, FakeTokenizer, openai_client, run_full, serve_app

from kvjax.serve.prompts import chat_prompt
from kvjax.serve.server import build_app

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def client(tiny_loaded):
    # test_server.py's settings: its programs, in the suite's shared compilation cache.
    app = build_app(tiny_loaded, max_slots=4, max_queue=64, chunk_size=4, prefill_batch=4)
    url, stop = serve_app(app, TIMEOUT)
    yield openai_client(url, TIMEOUT)
    stop()


def log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def check_ranked(ranked, prompt, loaded, top):
    """`ranked` (vLLM's prompt_logprobs of `prompt`) against the model's own logits."""
    want = log_softmax(run_full(loaded.config, loaded.params, jnp.asarray([prompt]))[0])
    assert ranked[0] is None and len(ranked) == len(prompt)
    for t in range(1, len(prompt)):
        entries = {int(token): entry for token, entry in ranked[t].items()}
        own, expected = prompt[t], want[t - 1]
        assert list(entries)[0] == own  # the prompt's token first, as vLLM lists it
        for token, entry in entries.items():
            np.testing.assert_allclose(entry["logprob"], expected[token], atol=2e-5)
            assert entry["decoded_token"] == FakeTokenizer.decode([token])
        others = np.delete(expected, own)  # within float32's reach of it: either way
        rank = entries[own]["rank"]
        assert 1 + np.sum(others > expected[own] + 2e-5) <= rank <= 1 + np.sum(
            others > expected[own] - 2e-5)
        likeliest = [int(i) for i in np.argsort(-expected, kind="stable")[:top]]
        listed = {token: e["rank"] for token, e in entries.items() if token != own}
        assert set(listed) == set(likeliest) - {own}
        assert all(listed[token] == likeliest.index(token) + 1 for token in listed)


@pytest.mark.parametrize("top", [0, 3])
def test_a_completions_prompt_tokens_are_ranked_by_the_models_log_softmax(client, tiny_loaded,
                                                                          top):
    prompts = [[5, 9, 30, 9, 41, 7, 12, 3], [8, 8, 8]]
    answer = client.completions.create(
        model=SERVED_MODEL, prompt=prompts, max_tokens=0, n=2,
        extra_body={"prompt_logprobs": top})
    assert [c.text for c in answer.choices] == [""] * 4
    for choice in answer.choices:  # choice prompt * n + sample
        check_ranked(choice.prompt_logprobs, prompts[choice.index // 2], tiny_loaded, top)


def test_echo_and_prompt_logprobs_report_the_same_scores_each_its_own_way(client,
                                                                        tiny_loaded):
    prompt = [5, 9, 30, 9, 41, 7]
    answer = client.completions.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
        extra_body={"prompt_logprobs": 4})
    choice = answer.choices[0]
    check_ranked(choice.prompt_logprobs, prompt, tiny_loaded, 4)
    echoed = choice.logprobs
    assert echoed.token_logprobs[0] is None and echoed.top_logprobs[0] is None
    for t in range(1, len(prompt)):
        entries = {int(token): entry for token, entry in choice.prompt_logprobs[t].items()}
        assert echoed.token_logprobs[t] == entries[prompt[t]]["logprob"]
        (best,) = [e for e in entries.values() if e["rank"] == 1] or [None]
        assert len(echoed.top_logprobs[t]) == 1  # echo's own count, not prompt_logprobs'
        if best is not None:
            assert echoed.top_logprobs[t] == {best["decoded_token"]: best["logprob"]}


def test_a_chat_answer_carries_its_prompts_logprobs_and_answers_as_without(client,
                                                                         tiny_loaded):
    messages = [{"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model=SERVED_MODEL, messages=messages,
                                           max_completion_tokens=3, temperature=0)
    ranked = client.chat.completions.create(model=SERVED_MODEL, messages=messages,
                                            max_completion_tokens=3, temperature=0,
                                            extra_body={"prompt_logprobs": 2})
    assert ranked.choices[0].message.content == plain.choices[0].message.content
    assert (ranked.usage.prompt_tokens, ranked.usage.completion_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens)
    assert getattr(plain, "prompt_logprobs", None) is None
    prompt, _ = chat_prompt(tiny_loaded, {"messages": messages}, None)
    check_ranked(ranked.prompt_logprobs, list(prompt), tiny_loaded, 2)
    assert not hasattr(ranked.choices[0], "prompt_logprobs")
