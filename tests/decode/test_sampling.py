"""Sampling: greedy, and the empirical frequencies of temperature / top-k / top-p / min-p
draws against the exactly computed filtered distribution (chi-square at a fixed seed), one
setting at a time and all at once with one setting per row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.decode import sampling
from kvjax.decode.sampling import (
    SamplingParams,
    as_keys,
    filter_logits,
    row_keys,
    sample,
    seed_key,
)

LOGITS = np.array([2.0, 1.5, 1.2, 0.4, 0.1, -0.3, -1.0, -2.5], np.float32)
# Upper 0.1% points of the chi-square distribution by degrees of freedom.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def reference_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Softmax(logits / T) restricted to the top k, then to the smallest prefix (by
    probability) whose mass reaches p, the crossing token included, and to the tokens with
    at least min_p times the largest probability; renormalised."""
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
    keep &= probs >= min_p * probs.max()
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0),
    dict(temperature=0.6, top_k=0, top_p=1.0),
    dict(temperature=1.0, top_k=3, top_p=1.0),
    dict(temperature=1.0, top_k=0, top_p=0.6),
    dict(temperature=1.7, top_k=5, top_p=0.8),
    dict(temperature=1.0, top_k=0, top_p=0.05),  # only the argmax survives
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.5, min_p=0.3),
    dict(temperature=1.0, top_k=6, top_p=0.95, min_p=0.1),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_sample_frequencies_match_filtered_distribution(settings):
    expected = reference_distribution(LOGITS, **settings)
    draws = 20_000
    params = SamplingParams.make(**settings)
    keys = jax.random.split(jax.random.key(1234), draws)
    tokens = jax.jit(jax.vmap(
        lambda k: sample(jnp.asarray(LOGITS)[None], k[None], params)[0]))(keys)
    counts = np.bincount(np.asarray(tokens), minlength=len(LOGITS))
    assert (counts[expected == 0] == 0).all(), "drew a token the filters exclude"
    support = expected > 0
    if support.sum() == 1:
        return
    chi2 = np.sum((counts[support] - draws * expected[support]) ** 2 / (draws * expected[support]))
    assert chi2 < CHI2_999[int(support.sum()) - 1], (chi2, counts, expected * draws)


def test_filter_keeps_exactly_the_reference_support():
    for settings in SETTINGS:
        filtered = jax.jit(filter_logits)(jnp.asarray(LOGITS)[None],
                                          SamplingParams.make(**settings))
        expected = reference_distribution(LOGITS, **settings)
        np.testing.assert_array_equal(np.isfinite(filtered[0]), expected > 0)
        probs = jax.nn.softmax(filtered[0])
        np.testing.assert_allclose(probs, expected, atol=1e-6)


def kept_by_value(row, top_k, top_p, min_p):
    """NumPy, in float64: which tokens of `row` the filters keep, ties at a threshold kept."""
    row = row.astype(np.float64)
    ranked = np.sort(row)[::-1]
    kth = ranked[min(top_k, len(row)) - 1] if top_k > 0 else -np.inf
    survivors = ranked[ranked >= kth]
    probs = np.exp(survivors - survivors[0])
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    smallest = survivors[mass_before < top_p].min() if top_p < 1 else -np.inf
    with np.errstate(divide="ignore"):
        floor = row.max() + np.log(min_p)
    return row >= max(kth, smallest, floor)


@pytest.mark.parametrize("threshold", [sampling._threshold_by_sort,
                                       sampling._threshold_by_search], ids=["sort", "search"])
def test_both_ways_of_finding_thresholds_keep_the_reference_tokens(threshold):
    """`filter_logits` searches on a CPU and sorts elsewhere: each keeps what the formula
    keeps, on rows with banned tokens and, rounded to bfloat16, with many ties."""
    logits = random_rows(rows=300, vocab=257, seed=3)
    logits[::7, :5] = -np.inf
    logits[1::2] = logits[1::2].astype(jnp.bfloat16).astype(np.float32)
    rng = np.random.default_rng(4)
    top_k = rng.choice([0, 0, 1, 5, 40, 300], 300)
    top_p = rng.choice([1.0, 1.0, 0.5, 0.9, 0.05], 300)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], 300)
    params = SamplingParams.make(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p,
                                 batch=300)
    found = np.asarray(jax.jit(threshold)(jnp.asarray(logits), params))
    for row in range(300):
        np.testing.assert_array_equal(
            logits[row] >= found[row],
            kept_by_value(logits[row], top_k[row], top_p[row], min_p[row]),
            err_msg=f"row {row}: top_k {top_k[row]}, top_p {top_p[row]}, min_p {min_p[row]}")


def test_filter_logits_searches_on_a_cpu():
    """What `filter_logits` lowers to on this machine: no sort on a CPU."""
    text = jax.jit(filter_logits).lower(jnp.zeros((2, 64)), SamplingParams.make(
        temperature=1.0, batch=2)).as_text()
    assert ("sort" in text) == (jax.default_backend() != "cpu")


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=2.0, top_k=1)])
def test_greedy_settings_take_the_argmax(settings):
    logits = jax.random.normal(jax.random.key(0), (16, 100))
    tokens = sample(logits, jax.random.split(jax.random.key(1), 16),
                    SamplingParams.make(**settings))
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, axis=-1))


def test_each_row_draws_with_its_own_key_alone():
    """A row's token depends on its key, logits and settings, not on the other rows: rows
    drawn in a batch equal each drawn alone, and rows with distinct keys differ."""
    logits = jax.random.normal(jax.random.key(3), (4, 1000))
    keys = jax.random.split(jax.random.key(0), 4)
    params = SamplingParams.make(temperature=1.0, batch=4)
    together = np.asarray(sample(logits, keys, params))
    alone = [int(sample(logits[b:b + 1], keys[b:b + 1], SamplingParams.make(temperature=1.0))[0])
             for b in range(4)]
    assert together.tolist() == alone
    flat = np.asarray(sample(jnp.zeros((4, 1000)), keys, params))
    assert len(set(flat.tolist())) == 4


def test_row_keys_give_each_prompt_and_sample_its_own_key():
    """One key for the batch: prompt p draws with fold_in(rng, p); one key per prompt: with
    that key. Sample n of a prompt folds n in. Keys of distinct rows differ."""
    rng = jax.random.key(7)
    data = np.asarray(jax.random.key_data(row_keys(rng, 2, 3)))
    prompt_1 = jax.random.fold_in(rng, 1)
    np.testing.assert_array_equal(data[4], jax.random.key_data(jax.random.fold_in(prompt_1, 1)))
    assert len({tuple(row) for row in data.tolist()}) == 6
    per_prompt = row_keys(jnp.stack([prompt_1, rng]), 2, 3)
    np.testing.assert_array_equal(jax.random.key_data(per_prompt[:3]), data[3:])
    np.testing.assert_array_equal(seed_key(5), jax.random.key_data(jax.random.key(5)))
    assert seed_key(2**32 + 5).tolist() == [1, 5]


@pytest.mark.parametrize(("rng", "message"), [
    (np.zeros(3, np.float32), "rng must be a jax.random key.*float32 with shape \\(3,\\)"),
    (jax.random.split(jax.random.key(0), 3), "keys of shape \\(3,\\): give one key, or one "
                                              "per prompt \\(2,\\)"),
])
def test_keys_of_the_wrong_kind_or_number_are_refused(rng, message):
    with pytest.raises(ValueError, match=message):
        as_keys(rng, 2)


def test_one_setting_per_row_draws_each_rows_distribution():
    """All SETTINGS at once, one per row, plus a greedy row: each row's frequencies match its
    own reference distribution, and the greedy row always takes the argmax."""
    rows = SETTINGS + [dict(temperature=0.0)]
    per_row = {name: [r.get(name, default) for r in rows] for name, default in
               dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0).items()}
    params = SamplingParams.make(**per_row, batch=len(rows))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (len(rows), len(LOGITS)))
    draws = 4_000
    keys = jax.random.split(jax.random.key(99), draws)
    tokens = np.asarray(jax.jit(jax.vmap(
        lambda k: sample(logits, jax.random.split(k, len(rows)), params)))(keys))
    for row, settings in enumerate(SETTINGS):
        expected = reference_distribution(LOGITS, **settings)
        counts = np.bincount(tokens[:, row], minlength=len(LOGITS))
        assert (counts[expected == 0] == 0).all(), (row, counts)
        support = expected > 0
        if support.sum() > 1:
            chi2 = np.sum((counts[support] - draws * expected[support]) ** 2
                          / (draws * expected[support]))
            assert chi2 < CHI2_999[int(support.sum()) - 1], (row, chi2, counts)
    assert (tokens[:, -1] == np.argmax(LOGITS)).all()


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    probs = np.asarray(jax.nn.softmax(jnp.asarray(LOGITS)))
    for min_p in (0.0, 0.05, 0.3, 0.61, 1.0):
        filtered = filter_logits(jnp.asarray(LOGITS)[None], SamplingParams.make(
            temperature=1.0, min_p=min_p))
        np.testing.assert_array_equal(np.isfinite(filtered[0]), probs >= min_p * probs.max())


def random_rows(rows=200, vocab=300, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 6, (rows, 1))).astype(
        np.float32)


def test_every_filter_off_keeps_every_token():
    logits = random_rows()
    logits[::7, :5] = -np.inf  # already banned tokens stay banned, and nothing else is
    kept = jax.jit(filter_logits)(jnp.asarray(logits),
                                  SamplingParams.make(temperature=1.0, batch=200))
    np.testing.assert_array_equal(np.isfinite(kept), np.isfinite(logits))


def test_kept_tokens_equal_transformers_warpers():
    torch = pytest.importorskip("torch")
    warpers = pytest.importorskip("transformers.generation.logits_process")
    logits = random_rows(seed=1)
    rng = np.random.default_rng(2)
    top_k = rng.choice([0, 0, 5, 40], 200)
    top_p = rng.choice([1.0, 1.0, 0.5, 0.9], 200)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], 200)
    kept = filter_logits(jnp.asarray(logits), SamplingParams.make(
        temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, batch=200))
    for row in range(200):
        scores = torch.from_numpy(logits[row:row + 1].copy())
        if top_k[row]:
            scores = warpers.TopKLogitsWarper(int(top_k[row]))(None, scores)
        if top_p[row] < 1:
            scores = warpers.TopPLogitsWarper(float(top_p[row]))(None, scores)
        if min_p[row] > 0:
            scores = warpers.MinPLogitsWarper(float(min_p[row]))(None, scores)
        np.testing.assert_array_equal(np.isfinite(kept[row]), np.isfinite(scores[0].numpy()),
                                      err_msg=f"row {row}")
