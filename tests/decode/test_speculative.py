"""Speculative decoding by prompt lookup: greedy output equal to plain greedy decoding (real
models and a fake one whose drafts are controllable), sampled output distributed as the
target, one compilation."""

import functools
import importlib
import re

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import drain, with_sampling

from kvjax import decode
from kvjax import model as M
from kvjax.decode import speculative as spec
from kvjax.decode.loop import StopConditions, StopReason, decode_loop, initial_state
from kvjax.decode.prepare import prepare
from kvjax.decode.sampling import SamplingParams, row_keys

generate_module = importlib.import_module("kvjax.decode.generate")

# Settings ------------------------------------------------------------------------------


def test_speculative_settings_are_checked():
    with pytest.raises(ValueError, match="num_draft_tokens=0"):
        decode.Speculative(num_draft_tokens=0)
    with pytest.raises(ValueError, match="'tree'"):
        decode.Speculative(method="tree")
    with pytest.raises(ValueError, match="ngram_size=9"):
        decode.Speculative(ngram_size=9)
    with pytest.raises(ValueError, match=r"min_tokens_per_call=6 .* \+ 1 = 5\]"):
        decode.Speculative(min_tokens_per_call=6)
    with pytest.raises(ValueError, match="min_tokens_per_call='2'"):
        decode.Speculative(min_tokens_per_call="2")


# A fake model: the next token depends only on the fed one ----------------------------------


@flax.struct.dataclass
class FakeCache:
    lengths: jax.Array
    overflow: jax.Array
    capacity: int = flax.struct.field(pytree_node=False)


def fake_model(table_VV):
    """tokens_to_logits with logits table[token]; writes as `model.step` does: all T
    tokens or (past the capacity) none."""

    def tokens_to_logits(tokens_BT, cache, lengths_B=None):
        valid_B = tokens_BT.shape[1] if lengths_B is None else lengths_B
        fits_B = cache.lengths + tokens_BT.shape[1] <= cache.capacity
        return table_VV[tokens_BT], cache.replace(
            lengths=jnp.where(fits_B, cache.lengths + valid_B, cache.lengths),
            overflow=cache.overflow | (~fits_B & (valid_B > 0)))

    return tokens_to_logits


CYCLE = 7  # greedy fake: the token after t is t + 1 (mod CYCLE)
CYCLE_TABLE = 10.0 * jax.nn.one_hot((jnp.arange(CYCLE) + 1) % CYCLE, CYCLE)


def fake_state(prompts, capacity, buffer_len=32, seed=0):
    """The state before any token: each prompt's last token is the newest, not yet fed."""
    batch = len(prompts)
    context = np.zeros((batch, 16 + buffer_len), np.int32)
    for row, prompt in enumerate(prompts):
        context[row, :len(prompt)] = prompt
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    cache = FakeCache(lengths - 1, jnp.zeros(batch, bool), capacity)
    state = initial_state(batch, buffer_len, cache, row_keys(jax.random.key(seed), batch),
                          jnp.asarray(context), lengths)
    return state.replace(last_tokens=jnp.asarray([p[-1] for p in prompts], jnp.int32))


def stops_of(eos_ids, max_new_tokens, forced_end_id=None, banned_ids=None):
    eos = np.full(8, -1, np.int32)
    eos[:len(eos_ids)] = eos_ids
    return StopConditions(jnp.asarray(eos), jnp.asarray(max_new_tokens, jnp.int32),
                          None if forced_end_id is None else jnp.asarray(forced_end_id),
                          None if banned_ids is None else jnp.asarray(banned_ids, jnp.int32))


@functools.partial(jax.jit, static_argnums=5)
def run_speculative(table, state, stops, sampling, ngram_size, num_draft):
    stats = spec.no_stats(state.lengths.shape[0])
    return spec.speculative_loop(fake_model(table), state.replace(step=spec.settled(state)),
                                 stats, stops, sampling, stops.max_new_tokens, num_draft,
                                 ngram_size)


@jax.jit
def run_plain(table, state, stops, sampling):
    return decode_loop(fake_model(table), state, stops, sampling, stops.max_new_tokens)


# Rows: a cycle the lookup predicts in full; a prompt whose lookup is right once, then
# wrong; a short row with nothing to look up at first; a row of repeats.
FAKE_PROMPTS = [[0, 1, 2, 3, 4, 5, 6, 0, 1], [3, 4, 0, 6, 6, 3, 4], [2], [5, 6, 0, 5, 6]]


@pytest.mark.parametrize("eos_ids, max_new_tokens, forced_end_id, banned", [
    ((), 24, None, None),
    ((5,), 24, None, None),     # eos inside an accepted draft of row 0 (and of others)
    ((1, 4), 24, None, None),
    ((), 11, None, None),       # max_new_tokens inside a draft
    ((), 11, 3, None),          # ... where a forced end replaces an accepted draft
    ((), 24, None, [4]),        # a banned id, which drafts hold: rejected
], ids=str)
def test_fake_model_speculative_equals_plain_greedy(eos_ids, max_new_tokens, forced_end_id,
                                                    banned):
    # With 28 cache slots rows 0 and 1 fill their caches before 24 tokens: drafts that would
    # run past the capacity fall back to plain steps, and the rows stop with cache_full.
    stops = stops_of(eos_ids, max_new_tokens, forced_end_id, banned)
    sampling = SamplingParams.make(batch=len(FAKE_PROMPTS))
    state = fake_state(FAKE_PROMPTS, capacity=28)
    plain = run_plain(CYCLE_TABLE, state, stops, sampling)
    fast = run_speculative(CYCLE_TABLE, state, stops, sampling, jnp.asarray(2), 4)
    np.testing.assert_array_equal(fast.decode.tokens, plain.tokens)
    np.testing.assert_array_equal(fast.decode.lengths, plain.lengths)
    np.testing.assert_array_equal(fast.decode.stop_reason, plain.stop_reason)
    np.testing.assert_array_equal(fast.decode.context, plain.context)
    np.testing.assert_array_equal(fast.decode.context_lengths, plain.context_lengths)
    stats = fast.stats
    assert not np.asarray(fast.decode.cache.overflow).any()
    # Every fed token was accepted: the cache holds each row's context but its newest token.
    np.testing.assert_array_equal(fast.decode.cache.lengths, plain.context_lengths - 1)
    assert int(stats.steps) <= int(plain.lengths.max())  # never more model calls than plain
    if banned:
        assert 4 not in np.asarray(plain.tokens) and 0 in np.asarray(plain.tokens)
    elif max_new_tokens == 24 and not eos_ids:
        assert int(stats.steps) <= 16  # 24 tokens in fewer calls
        np.testing.assert_array_equal(fast.decode.stop_reason, [StopReason.CACHE_FULL] * 2 +
                                      [StopReason.MAX_NEW_TOKENS] * 2)
    assert 0 < int(stats.accepted[0]) <= int(stats.drafted[0])
    assert int(stats.accepted[1]) < int(stats.drafted[1])  # and some rejected
    if eos_ids == (5,):
        assert fast.decode.stop_reason[0] == StopReason.EOS
    if forced_end_id is not None:  # every row reaches its budget, its last token forced
        np.testing.assert_array_equal(fast.decode.stop_reason, StopReason.MAX_NEW_TOKENS)
        np.testing.assert_array_equal(fast.decode.tokens[:, max_new_tokens - 1], forced_end_id)


# Sampling: the first tokens' distribution is the target's ----------------------------------

SAMPLE_VOCAB = 4
SAMPLE_LOGITS = np.asarray(jax.random.normal(jax.random.key(7), (SAMPLE_VOCAB,) * 2)) * 1.5


def filtered_probs(logits, temperature, top_k):
    """[V, V] float64: p(next | previous) after temperature and top-k."""
    logits = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(logits, axis=1)[:, -top_k][:, None]
        logits = np.where(logits >= kth, logits, -np.inf)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    return probs / probs.sum(axis=1, keepdims=True)


def first_tokens_histogram(tokens, vocab, probs, last_prompt_token):
    """(counts, probabilities) of the rows' first three generated tokens [rows, 3] over the
    vocab ** 3 cells of (x1, x2, x3), x1 fastest: observed, and exact for a chain of
    next-token distributions `probs` [V, V] (float64) after `last_prompt_token`."""
    cells = (tokens * vocab ** np.arange(3)).sum(axis=1)
    counts = np.bincount(cells, minlength=vocab ** 3)
    joint = np.einsum("a,ab,bc->abc", probs[last_prompt_token], probs, probs)
    return counts, joint.transpose(2, 1, 0).ravel()


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 3)])
def test_sampled_first_tokens_follow_the_target_distribution(temperature, top_k):
    rows, emitted = 6000, 3
    prompt = [0, 1, 2, 3, 0, 1]  # the lookup drafts 2, 3, 0 after the last 1
    state = fake_state([prompt] * rows, capacity=64, buffer_len=8, seed=3)
    sampling = SamplingParams.make(temperature=temperature, top_k=top_k, batch=rows)
    out = run_speculative(jnp.asarray(SAMPLE_LOGITS, jnp.float32), state,
                          stops_of((), emitted), sampling, jnp.asarray(2), 3)
    assert int(out.stats.accepted.sum()) > 0 and int(out.stats.drafted.sum()) > rows
    counts, expected = first_tokens_histogram(
        np.asarray(out.decode.tokens[:, :emitted]), SAMPLE_VOCAB,
        filtered_probs(SAMPLE_LOGITS, temperature, top_k), prompt[-1])
    assert (counts[expected == 0] == 0).all(), "drew a token the filters exclude"
    support = expected > 0
    chi2 = np.sum((counts[support] - rows * expected[support]) ** 2 /
                  (rows * expected[support]))
    # Upper 0.1% points of chi-square with 63 and 26 degrees of freedom (4**3 and 3**3 cells).
    limit = {64: 103.4, 27: 54.05}[int(support.sum())]
    assert chi2 < limit, (chi2, counts, expected * rows)


# Real models -----------------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 13, 14, 15], [3], [20, 21, 22, 20, 21]]
DRAFTS = decode.Speculative(num_draft_tokens=4, ngram_size=2)


def test_greedy_equals_plain_generate(tiny):
    config, net, params = tiny
    plain = decode.generate(net, params, PROMPTS, max_new_tokens=30)
    fast = decode.generate(net, params, PROMPTS, max_new_tokens=30, speculative=DRAFTS)
    np.testing.assert_array_equal(fast.tokens, plain.tokens)
    assert fast.speculation.accepted.sum() > 0
    assert fast.speculation.steps < 29  # fewer model calls than tokens
    # eos and max_new_tokens are traced: ending inside drafts compiles nothing new.
    counts = decode.trace_count("speculative"), decode.trace_count("continue")
    for eos_at, max_new_tokens, ngram_size, forced in ((5, 30, 3, None), (12, 27, 1, None),
                                                      (None, 25, 2, None)):
        eos = () if eos_at is None else (int(plain.tokens[0, eos_at]),)
        plain = decode.generate(net, params, PROMPTS, max_new_tokens=max_new_tokens,
                                eos_ids=eos, return_logprobs=True, forced_end_id=forced)
        fast = decode.generate(net, params, PROMPTS, max_new_tokens=max_new_tokens,
                               eos_ids=eos, return_logprobs=True, forced_end_id=forced,
                               speculative=decode.Speculative(ngram_size=ngram_size))
        assert fast.token_lists() == plain.token_lists()
        assert fast.stop_reasons() == plain.stop_reasons()
        np.testing.assert_allclose(fast.logprobs, plain.logprobs, atol=1e-4)
    assert (decode.trace_count("speculative"), decode.trace_count("continue")) == counts
    # A forced end (transformers' `forced_eos_token_id`) where drafts are accepted.
    plain, fast = (decode.generate(net, params, PROMPTS, max_new_tokens=25, forced_end_id=7,
                                   speculative=speculative)
                   for speculative in (None, decode.Speculative(ngram_size=2)))
    assert fast.token_lists() == plain.token_lists() and plain.tokens[0, 24] == 7
    assert fast.stop_reasons() == plain.stop_reasons() and "max_new_tokens" in plain.stop_reasons()


def test_unrolled_layers_and_streaming(tiny_lm):
    config, net, params = tiny_lm
    unrolled, params_unrolled = M.with_layer_layout(config, params, scan_layers=False)
    assert config.scan_layers  # the fixture's layout, which `plain` decodes in
    # Row 0 fills its cache to 3 slots of the capacity (40): its last tokens come from
    # plain steps, since a draft would not fit.
    plain = decode.generate(net, params, PROMPTS, max_new_tokens=30)
    pieces, streamed = drain(decode.stream(M.build_model(unrolled), params_unrolled, PROMPTS,
                                           max_new_tokens=30, chunk_size=8,
                                           speculative=DRAFTS))
    assert all(piece.shape[1] <= 8 for piece in pieces)
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), plain.tokens)
    np.testing.assert_array_equal(streamed.tokens, plain.tokens)
    assert streamed.speculation.accepted.sum() > 0


def test_compiled_loop_writes_the_cache_in_place(tiny_lm):
    """The verifying and the plain iteration, and the verifying and the one-token call, are
    chosen between without a `lax.cond`, through which XLA would copy every cache buffer at
    every step."""
    config, net, params = tiny_lm
    prepared = prepare(net, params, PROMPTS, None, max_new_tokens=30, eos_ids=(), num_beams=1,
                       rng=None, speculative=DRAFTS)
    state = generate_module._begin(config, params, prepared)
    hlo = spec.continue_speculative.lower(
        config, params, state, spec.no_stats(len(PROMPTS)), prepared.stops, prepared.sampling,
        prepared.stops.max_new_tokens, 4, jnp.asarray(2), spec.Pacing.optimistic(4, len(PROMPTS)),
        jnp.float32(2)).compile().as_text()
    shapes = {"f32[" + ",".join(map(str, b.shape)) + "]" for b in state.cache.k}
    copies = [m for m in re.finditer(r"= (f32\[[\d,]+\])\{[^}]*\} copy\(", hlo)
              if m.group(1) in shapes]
    assert "while" in hlo and not copies


def test_settings_speculation_cannot_take_are_refused(tiny_lm):
    _, net, params = tiny_lm
    for bad, match in ((dict(repetition_penalty=1.2), "repetition_penalty"),
                       (dict(frequency_penalty=0.5), "frequency_penalty"),
                       (dict(logit_processors=[decode.forbid_tokens([3])]), "logit_proc"),
                       (dict(), "decode.Speculative")):
        speculative = "ngram" if match == "decode.Speculative" else DRAFTS
        with pytest.raises(ValueError, match=match):
            decode.generate(net, params, PROMPTS, max_new_tokens=4, speculative=speculative,
                            **with_sampling(**bad))
