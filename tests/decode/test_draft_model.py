"""Speculative decoding with a draft model: greedy output equal to plain greedy decoding (fake
models whose drafts are controllable, and real ones of both variants), sampled output
distributed as the target's, one compilation, and the checks on the draft."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_cli
from test_speculative import (
    CYCLE,
    CYCLE_TABLE,
    FAKE_PROMPTS,
    PROMPTS,
    FakeCache,
    fake_model,
    fake_state,
    filtered_probs,
    first_tokens_histogram,
    stops_of,
)

from kvjax import decode
from kvjax import model as M
from kvjax.decode import draft_model
from kvjax.decode import speculative as spec
from kvjax.decode.loop import StopReason, decode_loop
from kvjax.decode.sampling import SamplingParams

# Fake models: the next token depends only on the fed one -----------------------------------


# Every fake test runs one compiled program: the same batch, vocabulary, buffers, caches and
# draft length k (short enough that the sampled tokens include a bonus token after k
# accepted drafts).
ROWS, NUM_DRAFT, CAPACITY = 4000, 2, 28


def fake_caches(prompts):
    """The state before any token (target capacity 28) and the draft's cache after the
    prompts, one slot smaller: like the target's, all but the newest token."""
    state = fake_state(prompts, capacity=CAPACITY, seed=3)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32) - 1
    return state, FakeCache(lengths, jnp.zeros(len(prompts), bool), CAPACITY - 1)


@jax.jit
def run_draft(table, draft_table, state, draft_cache, stops, sampling,
              min_tokens_per_call=0.0):
    carry = spec.SpeculativeState(state.replace(step=spec.settled(state)),
                                  spec.no_stats(state.lengths.shape[0]), draft_cache)
    return spec.draft_model_loop(fake_model(table), fake_model(draft_table), carry, stops,
                                 sampling, stops.max_new_tokens, NUM_DRAFT, min_tokens_per_call)


@jax.jit
def run_plain(table, state, stops, sampling):
    return decode_loop(fake_model(table), state, stops, sampling, stops.max_new_tokens)


# A draft right after tokens 0-3 and wrong after 4-6 (it skips one).
WRONG_AFTER_4 = 10.0 * jax.nn.one_hot((jnp.arange(CYCLE) + 1 + (jnp.arange(CYCLE) >= 4))
                                      % CYCLE, CYCLE)


@pytest.mark.parametrize("draft", ["copy", "wrong_after_4"])
@pytest.mark.parametrize("eos_ids, max_new_tokens, temperature", [
    ((), 24, 0.0),
    ((5,), 24, 0.0),     # eos inside an accepted draft of row 0 (and of others)
    ((), 11, 0.0),       # max_new_tokens inside a draft
    ((), 24, [0.0, 1.0, 0.0, 1.0]),  # greedy rows next to sampled ones
], ids=str)
def test_fake_draft_greedy_equals_plain_greedy(draft, eos_ids, max_new_tokens, temperature):
    # Rows 0 and 1 fill their caches before 24 tokens: drafts that would run past either
    # cache fall back to plain steps, and the rows stop with cache_full.
    prompts = FAKE_PROMPTS * (ROWS // len(FAKE_PROMPTS))
    stops = stops_of(eos_ids, max_new_tokens)
    sampling = SamplingParams.make(temperature=np.resize(temperature, ROWS), batch=ROWS)
    state, draft_cache = fake_caches(prompts)
    draft_table = CYCLE_TABLE if draft == "copy" else WRONG_AFTER_4
    plain = run_plain(CYCLE_TABLE, state, stops, sampling)
    fast = run_draft(CYCLE_TABLE, draft_table, state, draft_cache, stops, sampling)
    greedy = np.asarray(sampling.is_greedy)
    for name in ("tokens", "lengths", "stop_reason", "context", "context_lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(fast.decode, name))[greedy],
                                      np.asarray(getattr(plain, name))[greedy], err_msg=name)
    stats, target, draft_cache = fast.stats, fast.decode.cache, fast.draft_cache
    assert not np.asarray(target.overflow).any() and not np.asarray(draft_cache.overflow).any()
    # The draft holds a prefix of what the target holds: plain iterations (here, while rows 0
    # and 1 have no room for a draft) leave it behind, and the next verifying one catches
    # it up (`test_a_lagging_draft_catches_up`), or the copying draft would miss.
    lag = np.asarray(target.lengths - draft_cache.lengths)[greedy]
    assert (lag >= 0).all(), lag
    assert int(stats.steps) <= int(plain.lengths.max())  # never more model calls than plain
    missed = (stats.drafted - stats.accepted)[greedy]
    if draft == "copy":  # every draft is right; only a row's last one may be cut short
        assert (missed <= NUM_DRAFT).all(), missed
    else:
        assert missed.sum() > ROWS and stats.accepted[greedy].sum() > 0
    if eos_ids == (5,):
        assert fast.decode.stop_reason[0] == StopReason.EOS


def test_a_lagging_draft_catches_up():
    # Each row's draft cache lags its context; the catch-up feeds all but the last two
    # tokens, 16 per call while 16 slots are free, then one at a time up to its capacity.
    fed = []

    def draft_step(tokens_BT, cache, lengths_B):
        fed.append(tokens_BT.shape[1])
        return fake_model(CYCLE_TABLE)(tokens_BT, cache, lengths_B)

    context_lengths = jnp.array([40, 40, 3, 45, 30])
    cache = FakeCache(jnp.array([2, 38, 1, 0, 5]), jnp.zeros(5, bool), 40)
    running = jnp.array([True, True, True, True, False])
    context = jnp.zeros((5, 48), jnp.int32)
    caught_up = jax.jit(draft_model.catch_up, static_argnums=0)(
        draft_step, cache, context, context_lengths, running)
    np.testing.assert_array_equal(caught_up.lengths, [38, 38, 1, 40, 5])
    assert not caught_up.overflow.any() and sorted(set(fed)) == [1, 16]


# Always wrong: it skips one.
ALWAYS_WRONG = 10.0 * jax.nn.one_hot((jnp.arange(CYCLE) + 2) % CYCLE, CYCLE)


def test_drafting_turns_off_where_it_does_not_pay():
    # With drafting always on (threshold 0) row 2 verifies k drafts at every call that has
    # room for them. A draft that is always wrong makes the moving average of tokens per
    # call fall below 2 after 3 calls (3 -> 2.5 -> 2.1 -> 1.8); after that only every 8th
    # iteration verifies, a probe. A draft that is always right keeps it at 3, and drafting
    # on. The output is plain greedy's in every case.
    prompts = FAKE_PROMPTS * (ROWS // len(FAKE_PROMPTS))
    stops = stops_of((), 24)
    sampling = SamplingParams.make(batch=ROWS)
    state, draft_cache = fake_caches(prompts)
    plain = run_plain(CYCLE_TABLE, state, stops, sampling)
    verifying = {}
    for name, draft in [("wrong", ALWAYS_WRONG), ("right", CYCLE_TABLE)]:
        for threshold in (0.0, 2.0):
            fast = run_draft(CYCLE_TABLE, draft, state, draft_cache, stops, sampling,
                             threshold)
            np.testing.assert_array_equal(fast.decode.tokens, plain.tokens)
            verifying[name, threshold] = int(fast.stats.drafted[2]) // NUM_DRAFT
    assert verifying["wrong", 0.0] >= 16
    assert 3 + 1 <= verifying["wrong", 2.0] <= 3 + 24 // spec.PROBE_EVERY
    assert verifying["right", 2.0] == verifying["right", 0.0]


def test_probes_thin_out_while_drafting_does_not_pay():
    # Rows 0 and 1 of a batch of 3 run; row 0 always emits 1 token per verifying call,
    # row 1 always k + 1 = 3. Row 0 alone turns drafting off (the batch waits for its
    # slowest row), and the probes come every 8, 16, then 32 iterations. The first probe
    # in which row 0 emits 3 again turns drafting back on, and the gap returns to 8.
    threshold, running = 2.0, jnp.array([True, True, False])
    pacing = spec.Pacing.optimistic(2, 3)
    verified_at = []
    for iteration in range(140):
        if not pacing.pays(running, threshold):
            pacing = pacing.after_plain()
            continue
        verified_at.append(iteration)
        emitted = jnp.array([3 if iteration >= 100 else 1, 3, 0])
        pacing = pacing.after_verifying(emitted, running, threshold)
    np.testing.assert_allclose(pacing.tokens_per_call[1:], [3.0, 3.0])
    assert verified_at[:3] == [0, 1, 2]  # 3 -> 2.5 -> 2.125 -> 1.84: off
    assert verified_at[2:] == [2, 10, 26, 58, 90, 122, *range(123, 140)], verified_at
    assert bool(pacing.drafting_on(running, threshold)) and int(pacing.probe_gap) == 8
    assert not spec.Pacing.optimistic(2, 3).replace(
        tokens_per_call=jnp.array([1.0, 3.0, 3.0])).drafting_on(running, threshold)
    assert spec.Pacing.optimistic(2, 3).replace(
        tokens_per_call=jnp.array([3.0, 3.0, 1.0])).drafting_on(running, threshold)


# Sampling: the first tokens' distribution is the target's ----------------------------------

# q differs from p everywhere: a wrong residual or acceptance rule shifts the distribution.
TARGET_LOGITS, DRAFT_LOGITS = (
    np.asarray(jax.random.normal(jax.random.key(seed), (CYCLE, CYCLE))) * 1.5
    for seed in (7, 11))


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 2)])
def test_sampled_first_tokens_follow_the_target_distribution(temperature, top_k):
    emitted, prompt = 3, [0, 1, 2, 3, 0, 1]
    state, draft_cache = fake_caches([prompt] * ROWS)
    sampling = SamplingParams.make(temperature=temperature, top_k=top_k, batch=ROWS)
    out = run_draft(jnp.asarray(TARGET_LOGITS, jnp.float32),
                    jnp.asarray(DRAFT_LOGITS, jnp.float32), state, draft_cache,
                    stops_of((), emitted), sampling)
    accepted, drafted = int(out.stats.accepted.sum()), int(out.stats.drafted.sum())
    assert 0 < accepted < drafted, (accepted, drafted)  # both paths taken
    counts, expected = first_tokens_histogram(
        np.asarray(out.decode.tokens[:, :emitted]), CYCLE,
        filtered_probs(TARGET_LOGITS, temperature, top_k), prompt[-1])
    assert (counts[expected == 0] == 0).all(), "drew a token the filters exclude"
    statistic, limit = chi_square(counts, expected, ROWS)
    assert statistic < limit, (statistic, limit)


def chi_square(counts, probs, rows):
    """(Pearson's statistic, its upper 0.1% point) for `counts` of `rows` draws against
    `probs` over the cells of nonzero probability; those expected fewer than 5 times are
    pooled into one, as the test needs."""
    expected = rows * probs
    common, rare = expected >= 5, (expected > 0) & (expected < 5)
    observed = np.append(counts[common], counts[rare].sum())[:common.sum() + rare.any()]
    expected = np.append(expected[common], expected[rare].sum())[:common.sum() + rare.any()]
    statistic = np.sum((observed - expected) ** 2 / expected)
    dof = len(observed) - 1
    z = 3.090  # the standard normal's upper 0.1% point; Wilson-Hilferty's approximation:
    return statistic, dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


# Real models -------------------------------------------------------------------------------


def scaled(params, factor=3.0):
    """Random params scaled up: a tiny random model then writes varied tokens rather than
    one token over and over."""
    return jax.tree.map(lambda x: x * factor, params)


def draft_of(config, seed, **changes):
    draft_config = config.replace(**changes)
    return M.build_model(draft_config), M.init_params(draft_config, jax.random.key(seed))


def assert_same_as_plain(net, params, speculative, max_new_tokens, eos_ids=()):
    plain = decode.generate(net, params, PROMPTS, max_new_tokens=max_new_tokens,
                            eos_ids=eos_ids, return_logprobs=True)
    fast = decode.generate(net, params, PROMPTS, max_new_tokens=max_new_tokens,
                           eos_ids=eos_ids, return_logprobs=True, speculative=speculative)
    assert fast.token_lists() == plain.token_lists()
    assert fast.stop_reasons() == plain.stop_reasons()
    np.testing.assert_allclose(fast.logprobs, plain.logprobs, atol=1e-4)
    return plain, fast


def test_greedy_equals_plain_generate_with_a_truncated_draft(tiny_lm):
    """An unrolled target (the other tests' is scanned); its first layer as the draft,
    whose drafts are often wrong. Row 0 fills its cache to 2 slots of its capacity (40), so
    its last drafts would not fit: it finishes with plain steps. A call with other prompts,
    another draft of the same shape (the second layer), sampling or streaming compiles
    nothing new."""
    config, params = M.with_layer_layout(tiny_lm[0], scaled(tiny_lm[2]), scan_layers=False)
    net = M.build_model(config)
    draft_net, draft_params = draft_model.first_layers(config, params, 1)
    speculative = decode.Speculative("draft", 4, draft_model=draft_net,
                                     draft_params=draft_params, min_tokens_per_call=0)
    plain, fast = assert_same_as_plain(net, params, speculative, 30)
    stats = fast.speculation
    assert 0 < stats.accepted.sum() < 0.8 * stats.drafted.sum()  # a poor draft
    names = ("start", "draft_start", "speculative_draft")
    counts = [decode.trace_count(name) for name in names]
    # eos and max_new_tokens (traced) inside a draft.
    assert_same_as_plain(net, params, speculative, 30, eos_ids=(int(plain.tokens[1, 9]),))
    assert_same_as_plain(net, params, speculative, 26)
    both_layers = draft_model.first_layers(config, params, 2)[1]["layers"]
    second_layer = {**draft_params, "layers": {"0": both_layers["1"]}}
    other = decode.Speculative("draft", 4, draft_model=draft_net, draft_params=second_layer)
    sampled = decode.generate(net, params, [p[::-1] for p in PROMPTS], max_new_tokens=30,
                              sampling=decode.Sampling(temperature=0.8, top_p=0.9),
                              speculative=other,
                              rng=jax.random.key(2))
    assert (sampled.lengths == 30).all() and sampled.speculation.drafted.sum() > 0
    # Streamed a chunk at a time, the draft's cache carried between chunks.
    chunks = decode.stream(net, params, PROMPTS, max_new_tokens=30, chunk_size=8,
                           speculative=speculative)
    np.testing.assert_array_equal(np.concatenate(list(chunks), axis=1), plain.tokens)
    assert [decode.trace_count(name) for name in names] == counts


def test_a_draft_of_a_models_first_layers_takes_what_is_said_of_them():
    """A Gemma-like model whose second layer is global and a SmolLM3-like one whose third
    turns no RoPE give one- and two-layer drafts (before, the layer numbers past the draft
    made its config invalid)."""
    config = M.preset("tiny", num_decoder_layers=3, positional_encoding="rope",
                      sliding_window=4, full_attention_layers=(1,), unrotated_layers=(2,))
    params = jax.eval_shape(lambda key: M.init_params(config, key), jax.random.key(0))
    one, _ = draft_model.first_layers(config, params, 1)
    two, two_params = draft_model.first_layers(config, params, 2)
    assert (one.config.full_attention_layers, one.config.unrotated_layers) == ((), ())
    assert (two.config.full_attention_layers, two.config.unrotated_layers) == ((1,), ())
    assert sorted(two_params["layers"]) == ["0", "1"]


@pytest.fixture(scope="module")
def tiny_translator():
    config = M.preset("tiny", num_encoder_layers=1, num_decoder_layers=1,
                      positional_encoding="rope", num_kv_heads=2)
    return config, M.build_model(config), scaled(M.init_params(config, jax.random.key(1)))


def test_encoder_decoder_draft_keeps_up_with_the_target(tiny_translator):
    """The draft reads the same sources. As a copy of the target every draft is right,
    which holds only if its cache keeps up with the accepted tokens; another random draft of
    the same shape is mostly wrong, changes no token and runs the same program. (The
    verifying side of the loop is checked against plain decoding for this variant in
    test_speculative.py.)"""
    config, net, params = tiny_translator
    copy = decode.Speculative("draft", 4, draft_model=net, draft_params=params)
    fast = decode.generate(net, params, PROMPTS, max_new_tokens=16, speculative=copy)
    np.testing.assert_array_equal(fast.speculation.accepted, fast.speculation.drafted)
    assert fast.speculation.steps <= 3  # 15 tokens after the first, 5 per call
    assert len({tuple(row) for row in fast.tokens[:, :8]}) == len(PROMPTS)  # varied rows
    # A short output's cache holds fewer slots than the draft catches up by per call.
    short = decode.generate(net, params, PROMPTS, max_new_tokens=4, speculative=copy)
    assert short.token_lists() == [row[:4] for row in fast.token_lists()]
    count = decode.trace_count("speculative_draft")
    other = decode.Speculative("draft", 4, draft_model=net,
                               draft_params=scaled(M.init_params(config, jax.random.key(2))))
    again = decode.generate(net, params, PROMPTS, max_new_tokens=16, speculative=other)
    assert again.token_lists() == fast.token_lists()
    assert again.speculation.accepted.sum() < 0.5 * again.speculation.drafted.sum()
    assert decode.trace_count("speculative_draft") == count


def test_draft_models_that_cannot_draft_are_refused(tiny_lm):
    config, net, params = tiny_lm

    def refused(match, draft_net, draft_params, **kwargs):
        speculative = decode.Speculative("draft", draft_model=draft_net,
                                         draft_params=draft_params)
        with pytest.raises(ValueError, match=match):
            decode.generate(net, params, PROMPTS, max_new_tokens=4, speculative=speculative,
                            **kwargs)

    def model(**changes):
        return M.build_model(config.replace(**changes))

    # Refused before the params are read, or (the last two) with the target's, which fit.
    refused("draft model's vocab_size=96 differs from the target model's vocab_size=64",
            model(vocab_size=96), params)
    refused("draft model is an encoder-decoder and the target a decoder-only",
            model(num_encoder_layers=1), params)
    refused(r"draft model: params do not match the model: .*is missing", net, {})
    refused(r"draft model: prompt length 8 \+ max_new_tokens 1 needs 9", model(max_len=8),
            params)
    unread = decode.PromptState(config, params, None, None, None, None)
    refused("does not take a state", net, params, state=unread)
    with pytest.raises(ValueError, match="needs draft_model"):
        decode.Speculative("draft", 4)
    with pytest.raises(ValueError, match="'ngram' takes no draft model"):
        decode.Speculative("ngram", draft_model=net, draft_params=params)


def test_sample_refuses_a_draft_checkpoint_of_another_vocabulary(capsys):
    code, out, err = run_cli(capsys, "sample", "--checkpoint", "checkpoints/python-docs-lm",
                             "--prompt", "x", "--speculative", "draft", "--draft-checkpoint",
                             "checkpoints/numbers-to-words")
    assert code != 0 and "vocab" in err, (out, err)
