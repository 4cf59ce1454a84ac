"""Sampling: greedy, and the empirical frequencies of temperature / top-k / top-p draws
against the exactly computed filtered distribution (chi-square at a fixed seed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvjax.decode.sampling import SamplingParams, filter_logits, sample

LOGITS = np.array([2.0, 1.5, 1.2, 0.4, 0.1, -0.3, -1.0, -2.5], np.float32)
# Upper 0.1% points of the chi-square distribution by degrees of freedom.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def reference_distribution(logits, temperature, top_k, top_p):
    """Softmax(logits / T) restricted to the top k, then to the smallest prefix (by
    probability) whose mass reaches p, the crossing token included; renormalised."""
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    order = np.argsort(-probs)
    keep = np.zeros(len(logits), bool)
    if top_k > 0:
        order = order[:top_k]
    restricted = probs[order] / probs[order].sum()
    mass = 0.0
    for token, p in zip(order, restricted, strict=True):
        if mass >= top_p:
            break
        keep[token] = True
        mass += p
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0),
    dict(temperature=0.6, top_k=0, top_p=1.0),
    dict(temperature=1.0, top_k=3, top_p=1.0),
    dict(temperature=1.0, top_k=0, top_p=0.6),
    dict(temperature=1.7, top_k=5, top_p=0.8),
    dict(temperature=1.0, top_k=0, top_p=0.05),  # only the argmax survives
]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_sample_frequencies_match_filtered_distribution(settings):
    expected = reference_distribution(LOGITS, **settings)
    draws = 20_000
    params = SamplingParams.make(**settings)
    keys = jax.random.split(jax.random.key(1234), draws)
    tokens = jax.jit(jax.vmap(lambda k: sample(jnp.asarray(LOGITS)[None], k, params)[0]))(keys)
    counts = np.bincount(np.asarray(tokens), minlength=len(LOGITS))
    assert (counts[expected == 0] == 0).all(), "drew a token the filters exclude"
    support = expected > 0
    if support.sum() == 1:
        return
    chi2 = np.sum((counts[support] - draws * expected[support]) ** 2 / (draws * expected[support]))
    assert chi2 < CHI2_999[int(support.sum()) - 1], (chi2, counts, expected * draws)


def test_filter_keeps_exactly_the_reference_support():
    for settings in SETTINGS:
        filtered = filter_logits(jnp.asarray(LOGITS)[None], SamplingParams.make(**settings))
        expected = reference_distribution(LOGITS, **settings)
        np.testing.assert_array_equal(np.isfinite(filtered[0]), expected > 0)
        probs = jax.nn.softmax(filtered[0])
        np.testing.assert_allclose(probs, expected, atol=1e-6)


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=2.0, top_k=1)])
def test_greedy_settings_take_the_argmax(settings):
    logits = jax.random.normal(jax.random.key(0), (16, 100))
    tokens = sample(logits, jax.random.key(1), SamplingParams.make(**settings))
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, axis=-1))


def test_rows_are_sampled_independently():
    logits = jnp.zeros((4, 1000))
    tokens = sample(logits, jax.random.key(0), SamplingParams.make(temperature=1.0))
    assert len(set(np.asarray(tokens).tolist())) == 4
