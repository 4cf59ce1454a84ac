"""serve/prompt_logprobs.py: each prompt token's logprob, the likeliest tokens before it and
its rank among them all are NumPy's log-softmax of the uncached model's logits, whatever
padding its bucket adds."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_full

from kvjax.serve.prompt_logprobs import prompt_logprobs


def numpy_log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.mark.parametrize("length", [2, 11])
def test_prompt_tokens_score_as_the_models_log_softmax(tiny_lm, length):
    config, _, params = tiny_lm
    prompt = tuple(int(t) for t in np.random.default_rng(length).integers(3, 64, length))
    chosen, tops, ranks = prompt_logprobs(config, params, prompt, top=3)
    want = numpy_log_softmax(run_full(config, params, jnp.asarray([prompt]))[0])
    assert chosen[0] is None and tops[0] is None and ranks[0] is None
    assert len(chosen) == len(tops) == len(ranks) == length
    for t in range(1, length):
        np.testing.assert_allclose(chosen[t], want[t - 1, prompt[t]], atol=2e-5)
        ids = [i for i, _ in tops[t]]
        assert ids == list(np.argsort(-want[t - 1], kind="stable")[:3])
        np.testing.assert_allclose([lp for _, lp in tops[t]], want[t - 1, ids], atol=2e-5)
        own, others = want[t - 1, prompt[t]], np.delete(want[t - 1], prompt[t])
        # others within float32's reach of it may count either way
        assert 1 + np.sum(others > own + 2e-5) <= ranks[t] <= 1 + np.sum(others > own - 2e-5)
