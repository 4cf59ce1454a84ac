"""Per-row sampling settings and num_samples through `generate` on a real tiny model: exact
properties and references (the built-in processors' are in test_processors.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import run_full

from kvjax import decode
from kvjax import model as M

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3], [20, 21, 22, 23]]


def test_greedy_rows_of_a_mixed_batch_equal_an_all_greedy_batch(tiny_lm):
    _, net, params = tiny_lm
    greedy = decode.generate(net, params, PROMPTS, max_new_tokens=8)
    mixed = decode.generate(net, params, PROMPTS, max_new_tokens=8, rng=jax.random.key(5),
                            sampling=decode.Sampling(temperature=[0.0, 2.0, 0.0, 2.0],
                                                     top_k=[0, 0, 0, 1]))
    np.testing.assert_array_equal(mixed.tokens[[0, 2, 3]], greedy.tokens[[0, 2, 3]])
    assert not np.array_equal(mixed.tokens[1], greedy.tokens[1])  # sampled at T=2


def test_num_samples_prefills_each_prompt_once(tiny_lm, monkeypatch):
    config, _, params = tiny_lm
    config = config.replace(max_len=48)  # a config of its own, so that `_start` traces here
    net = M.build_model(config)
    prefill_batches = []

    def counting_prefill(config, params, prompts_BP, *args, **kwargs):
        prefill_batches.append(prompts_BP.shape[0])
        return real_prefill(config, params, prompts_BP, *args, **kwargs)

    real_prefill = M.prefill
    monkeypatch.setattr(M, "prefill", counting_prefill)
    sampled = decode.generate(net, params, PROMPTS[:2], max_new_tokens=8, num_samples=3,
                              sampling=decode.Sampling(temperature=1.5),
                              rng=jax.random.key(0))
    greedy = decode.generate(net, params, PROMPTS[:2], max_new_tokens=8, num_samples=3)
    assert prefill_batches == [2]  # one program, one prefill of the 2 prompts, for 6 rows
    alone = decode.generate(net, params, PROMPTS[:2], max_new_tokens=8)
    np.testing.assert_array_equal(greedy.tokens, np.repeat(alone.tokens, 3, axis=0))
    assert sampled.tokens.shape == (6, 8)
    for prompt in range(2):
        rows = sampled.tokens[3 * prompt:3 * prompt + 3]
        assert len({tuple(r) for r in rows}) == 3  # the samples are drawn independently


def test_samples_of_one_prompt_follow_the_models_distribution(tiny_lm):
    """n samples of one token from one prompt: chi-square against softmax(logits / T) over
    the most likely tokens (the rest pooled)."""
    config, net, params = tiny_lm
    draws = 2_000
    out = decode.generate(net, params, [PROMPTS[0]], max_new_tokens=1, num_samples=draws,
                          sampling=decode.Sampling(temperature=0.5),
                          rng=jax.random.key(4))
    logits = np.asarray(run_full(config, params, jnp.asarray([PROMPTS[0]]))[0, -1]) / 0.5
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    top = np.argsort(-probs)[:4]
    expected = np.append(probs[top], 1 - probs[top].sum()) * draws
    counts = np.bincount(out.tokens[:, 0], minlength=config.vocab_size)
    observed = np.append(counts[top], draws - counts[top].sum())
    chi2 = np.sum((observed - expected) ** 2 / expected)
    assert chi2 < 18.467, (observed, expected)  # 4 degrees of freedom, upper 0.1%
