"""generate/stream on real models: equal to recomputing without a cache, batch == alone,
compile once, and every bad input rejected before compiling."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_full, with_sampling

from kvjax import decode
from kvjax import model as M

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3], [20, 21, 22, 23]]
def greedy_without_cache(config, params, prompt, steps):
    """The textbook loop: recompute the whole sequence each step and take the argmax.

    The sequence is zero-padded to a fixed width so that every step reuses one compiled
    forward; causality makes the padding after the last real token irrelevant."""
    width = 32
    if config.is_encoder_decoder:
        source = np.zeros((1, 8), np.int32)
        source[0, :len(prompt)] = prompt
        source_lengths = jnp.asarray([len(prompt)])
        sequence = [config.bos_id]
    else:
        source = source_lengths = None
        sequence = list(prompt)
    generated = []
    for _ in range(steps):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(sequence)] = sequence
        logits = run_full(config, params, jnp.asarray(padded), source=source,
                          source_lengths=source_lengths)
        generated.append(int(jnp.argmax(logits[0, len(sequence) - 1])))
        sequence.append(generated[-1])
    return generated


def test_greedy_equals_recomputing_without_cache(tiny):
    config, net, params = tiny
    out = decode.generate(net, params, PROMPTS, max_new_tokens=9)
    for row, prompt in enumerate(PROMPTS):
        assert out.tokens[row].tolist() == greedy_without_cache(config, params, prompt, 9)
    np.testing.assert_array_equal(out.lengths, 9)
    assert out.stop_reasons() == ["max_new_tokens"] * len(PROMPTS)


def test_a_windowed_model_decodes_through_rings_as_without_a_cache():
    """A Gemma-like model (a window of 3 in layer 0, layer 1 global) whose rows outgrow the
    window: plain and beam steps through rings of 3 slots, speculative steps (a copy of the
    model as the draft: every draft accepted, 4 tokens a call) through rings of 6, the
    draft's own cache in rings of 18 (it catches up 16 tokens a call), a state kept to
    continue, through every position (`model/ring.py`), and its continuation, through rings
    again, all give what recomputing without a cache gives."""
    config = M.preset("tiny", positional_encoding="rope", num_kv_heads=2, sliding_window=3,
                      full_attention_layers=(1,), scan_layers=False)
    net = M.build_model(config)
    params = jax.tree.map(lambda x: 3 * x, M.init_params(config, jax.random.key(3)))
    plain = decode.generate(net, params, PROMPTS, max_new_tokens=12)
    expected = [greedy_without_cache(config, params, prompt, 12) for prompt in PROMPTS]
    assert plain.token_lists() == expected
    assert len({tuple(row) for row in expected}) == len(PROMPTS)  # varied rows
    copy = decode.Speculative("draft", 3, draft_model=net, draft_params=params)
    fast = decode.generate(net, params, PROMPTS, max_new_tokens=12, speculative=copy)
    assert fast.token_lists() == expected and fast.speculation.steps <= 4
    kept = decode.generate(net, params, PROMPTS, max_new_tokens=12, return_state=True)
    assert kept.token_lists() == expected
    one_beam = decode.beam_search(net, params, PROMPTS, max_new_tokens=12, num_beams=1)
    assert one_beam.token_lists() == expected
    # Continued with new tokens, two samples a row: the loop's cache holds the kept rows in
    # rings again.
    more = [[5, 6], [7], [8, 9], [11]]
    continued = decode.generate(net, params, more, state=kept.state, max_new_tokens=4,
                                num_samples=2)
    for row, (prompt, made, new) in enumerate(zip(PROMPTS, expected, more, strict=True)):
        want = greedy_without_cache(config, params, prompt + made + new, 4)
        assert continued.token_lists()[2 * row:2 * row + 2] == [want, want]
    rows = jnp.asarray([3, 3, 0])
    in_rings = M.rows_in_rings(config, kept.state.cache, rows, 1)
    assert in_rings.ring_slots == 3 and in_rings.capacity == kept.state.cache.capacity
    np.testing.assert_array_equal(in_rings.lengths, kept.state.cache.lengths[rows])
    np.testing.assert_array_equal(in_rings.k[1][:, 1], kept.state.cache.k[1][:, 3])


def test_scanned_and_unrolled_layers_find_the_same_beams(tiny):
    config, net, params = tiny
    other, other_params = M.with_layer_layout(config, params, scan_layers=not config.scan_layers)
    # Sampling draws from the same logits whatever the layout. Beam search prefills, steps
    # and reorders the cache's rows, all that a layout changes (the decode loops see the
    # model only through its prefill and step, whose layouts tests/model/test_layers.py compares).
    out = decode.beam_search(net, params, PROMPTS, max_new_tokens=6, num_beams=3)
    other_out = decode.beam_search(M.build_model(other), other_params, PROMPTS,
                                   max_new_tokens=6, num_beams=3)
    np.testing.assert_array_equal(other_out.tokens, out.tokens)
    np.testing.assert_allclose(other_out.scores, out.scores, rtol=1e-5)


def test_a_beam_search_in_chunks_finds_what_one_call_finds(tiny):
    _, net, params = tiny
    whole = decode.beam_search(net, params, PROMPTS, max_new_tokens=6, num_beams=3,
                               num_return_sequences=2, return_logprobs=True)
    traced = decode.trace_count("beam_advance")
    search = decode.beam_search_chunks(net, params, PROMPTS, chunk_size=2, max_new_tokens=6,
                                       num_beams=3, num_return_sequences=2,
                                       return_logprobs=True)
    steps = []
    while True:
        try:
            steps.append(next(search))
        except StopIteration as done:
            out = done.value
            break
    assert steps == [3, 5]  # the first token with the prefill, then 2 a chunk; no EOS
    assert out.token_lists() == whole.token_lists()
    np.testing.assert_array_equal(out.scores, whole.scores)
    np.testing.assert_array_equal(out.logprobs, whole.logprobs)
    assert decode.trace_count("beam_advance") == traced  # the step limit is traced
    with pytest.raises(ValueError, match="chunk_size=0 must be >= 1"):
        decode.beam_search_chunks(net, params, PROMPTS, chunk_size=0, max_new_tokens=6,
                                  num_beams=3)


def test_each_row_equals_the_prompt_alone(tiny):
    _, net, params = tiny
    eos = decode.generate(net, params, PROMPTS[:1], max_new_tokens=3).tokens[0, 2]
    together = decode.generate(net, params, PROMPTS, max_new_tokens=7, eos_ids=(int(eos),))
    for row, prompt in enumerate(PROMPTS):
        alone = decode.generate(net, params, [prompt], max_new_tokens=7, eos_ids=(int(eos),))
        assert alone.token_lists()[0] == together.token_lists()[row]
        assert alone.stop_reasons()[0] == together.stop_reasons()[row]
    assert together.stop_reasons()[0] == "eos" and together.lengths[0] <= 3


def test_rows_filled_up_to_the_bucket_change_no_row_and_are_not_returned(tiny):
    """Three prompts run as four rows, the fourth a copy of the third: the three rows are
    what they are beside any fourth prompt, sampled with one key for the batch."""
    _, net, params = tiny
    kwargs = dict(max_new_tokens=6, sampling=decode.Sampling(temperature=1.3),
                  rng=jax.random.key(3), return_logprobs=True)
    three = decode.generate(net, params, PROMPTS[:3], **kwargs)
    four = decode.generate(net, params, PROMPTS, **kwargs)
    assert three.tokens.shape[0] == three.lengths.shape[0] == three.logprobs.shape[0] == 3
    np.testing.assert_array_equal(three.tokens, four.tokens[:3])
    np.testing.assert_array_equal(three.lengths, four.lengths[:3])
    np.testing.assert_allclose(three.logprobs, four.logprobs[:3], rtol=1e-6, atol=1e-6)
    kept = decode.generate(net, params, PROMPTS[:3], max_new_tokens=2, return_state=True)
    assert kept.state.batch_size == 3


def test_array_prompts_with_lengths_equal_token_lists(tiny):
    _, net, params = tiny
    padded = np.zeros((len(PROMPTS), 7), np.int32)
    for i, p in enumerate(PROMPTS):
        padded[i, :len(p)] = p
    lengths = [len(p) for p in PROMPTS]
    a = decode.generate(net, params, padded, lengths=lengths, max_new_tokens=5)
    b = decode.generate(net, params, PROMPTS, max_new_tokens=5)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_same_rng_same_output_different_rng_different(tiny_lm):
    # Keys are drawn and folded in the decode loop alone, the same for both variants.
    _, net, params = tiny_lm
    kwargs = dict(max_new_tokens=12, sampling=decode.Sampling(temperature=1.5))
    a = decode.generate(net, params, PROMPTS, rng=jax.random.key(7), **kwargs)
    b = decode.generate(net, params, PROMPTS, rng=jax.random.key(7), **kwargs)
    c = decode.generate(net, params, PROMPTS, rng=jax.random.key(8), **kwargs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    # One key per prompt: a prompt samples the same tokens in any batch and at any place.
    keys = jax.random.split(jax.random.key(9), len(PROMPTS))
    together = decode.generate(net, params, PROMPTS, rng=keys, **kwargs).token_lists()
    reversed_rows = decode.generate(net, params, PROMPTS[::-1], rng=keys[::-1], **kwargs)
    assert reversed_rows.token_lists()[::-1] == together
    alone = decode.generate(net, params, PROMPTS[1:2], rng=keys[1:2], **kwargs).token_lists()
    assert alone == together[1:2]


def test_logprobs_are_those_of_the_model(tiny):
    config, net, params = tiny
    out = decode.generate(net, params, PROMPTS[:1], max_new_tokens=4, return_logprobs=True)
    generated = out.tokens[0].tolist()
    if config.is_encoder_decoder:
        source, sequence = jnp.asarray([PROMPTS[0]]), [config.bos_id] + generated
    else:
        source, sequence = None, PROMPTS[0] + generated
    logits = run_full(config, params, jnp.asarray([sequence[:-1]]), source=source)
    logprobs = jax.nn.log_softmax(logits[0, -4:])
    expected = [float(logprobs[i, t]) for i, t in enumerate(generated)]
    np.testing.assert_allclose(out.logprobs[0], expected, atol=1e-5)


def test_stream_equals_generate(tiny):
    _, net, params = tiny
    kwargs = dict(max_new_tokens=11, sampling=decode.Sampling(temperature=1.0, top_p=0.9),
                  rng=jax.random.key(2))
    full = decode.generate(net, params, PROMPTS, **kwargs)
    for chunk_size in (1, 4, 32):
        chunks = list(decode.stream(net, params, PROMPTS, chunk_size=chunk_size, **kwargs))
        assert all(c.shape[1] <= chunk_size for c in chunks)
        np.testing.assert_array_equal(np.concatenate(chunks, axis=1), full.tokens)


def test_stream_stops_early_when_every_row_hits_eos(tiny):
    _, net, params = tiny
    first = decode.generate(net, params, PROMPTS, max_new_tokens=1).tokens[:, 0]
    chunks = list(decode.stream(net, params, PROMPTS, max_new_tokens=30,
                                eos_ids=tuple(set(first.tolist()))))
    assert sum(c.shape[1] for c in chunks) == 1


def _setting(rng, i, low, high, integer=False, rows=3):
    """A scalar on even calls, one value per row on odd ones."""
    draw = rng.integers if integer else rng.uniform
    values = draw(low, high, size=rows)
    values = [int(v) for v in values] if integer else values.tolist()
    return values if i % 2 else values[0]


def test_twenty_calls_in_one_bucket_compile_once():
    """Prompt lengths, batch sizes, token budgets and settings that vary within their
    buckets: one program."""
    config = M.preset("tiny", num_kv_heads=1)
    net, params = M.build_model(config), M.init_params(config, jax.random.key(0))
    before = {name: decode.trace_count(name) for name in ("start", "continue")}
    rng = np.random.default_rng(0)
    for i in range(20):
        batch = 3 + i % 2  # one bucket of rows: 3 and 4 run as 4
        prompt_lengths = rng.integers(9, 17, size=batch)  # one bucket: 9..16 pads to 16
        prompts = [rng.integers(0, 64, size=n).tolist() for n in prompt_lengths]
        temperature = _setting(rng, i, 0, 2, rows=batch)
        if i % 4 == 1:
            temperature[0] = 0.0  # a greedy row among sampled ones
        decode.generate(net, params, prompts, max_new_tokens=int(rng.integers(25, 33)),
                        sampling=decode.Sampling(
                            temperature=temperature,
                            top_k=_setting(rng, i, 0, 20, True, batch),
                            top_p=_setting(rng, i, 0.1, 1, rows=batch),
                            min_p=_setting(rng, i, 0, 0.5, rows=batch),
                            repetition_penalty=_setting(rng, i, 0.5, 2, rows=batch),
                            no_repeat_ngram_size=_setting(rng, i, 0, 4, True, batch)),
                        eos_ids=tuple(rng.integers(0, 64, size=i % 3)),
                        rng=jax.random.key(i))
    after = {name: decode.trace_count(name) for name in ("start", "continue")}
    assert after == {name: count + 1 for name, count in before.items()}


def _rejects(net, params, match, prompts=PROMPTS, **kwargs):
    counts = [decode.trace_count(n) for n in ("start", "continue", "beam")]
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=match):
        decode.generate(net, params, prompts, **with_sampling(**kwargs))
    assert counts == [decode.trace_count(n) for n in ("start", "continue", "beam")]


def test_bad_inputs_raise_before_compiling(tiny):
    config, net, params = tiny
    _rejects(net, params, r"temperature=-0.5 must be >= 0", temperature=-0.5)
    _rejects(net, params, r"top_p=0.0 must be in \(0, 1\]", top_p=0.0)
    _rejects(net, params, r"top_p=1.5", top_p=1.5)
    _rejects(net, params, r"top_k=-1", top_k=-1)
    _rejects(net, params, r"top_k=2.5 must be an int, not a float", top_k=2.5)
    _rejects(net, params, r"min_p=1.5 must be in \[0, 1\]", min_p=1.5)
    _rejects(net, params, r"min_p\[1\]=-0.1 must be in \[0, 1\]", min_p=[0, -0.1, 0, 0])
    _rejects(net, params, r"repetition_penalty=0.0 must be > 0", repetition_penalty=0.0)
    _rejects(net, params, r"no_repeat_ngram_size=-1", no_repeat_ngram_size=-1)
    _rejects(net, params, r"temperature has 3 values \[0.0, 1.0, 1.0\] for 4 prompts",
             temperature=[0.0, 1.0, 1.0])
    _rejects(net, params, r"temperature\[2\]=-1.0 must be >= 0", temperature=[0, 1, -1, 1])
    _rejects(net, params, r"num_samples=0 must be an integer >= 1", num_samples=0)
    _rejects(net, params, r"logit processor 3 is not callable", logit_processors=[3])
    _rejects(net, params, r"max_new_tokens=0", max_new_tokens=0)
    _rejects(net, params, r"token id 64 \(prompt 1, position 2\)", prompts=[[1], [2, 3, 64]])
    _rejects(net, params, r"token id -1", prompts=[[-1]])
    _rejects(net, params, r"prompt 1 is empty", prompts=[[1], []])
    _rejects(net, params, r"prompts is empty", prompts=[])
    _rejects(net, params, r"eos id 99 is outside", eos_ids=(2, 99))
    _rejects(net, params, r"at most 8 eos ids, got 9", eos_ids=tuple(range(9)))
    _rejects(net, params, r"banned id 64 is outside the vocabulary \[0, 64\)",
             banned_ids=(3, 64))
    _rejects(net, params, r"at most 8 banned ids, got 9", banned_ids=tuple(range(9)))
    _rejects(net, params, r"forced_end_id 64 is outside the vocabulary", forced_end_id=64)
    _rejects(net, params, r"forced_end_id=-1 must be >= 0", forced_end_id=-1)
    _rejects(net, params, r"max_len 64", max_new_tokens=64)
    bad = jax.tree_util.tree_map(lambda x: x, params)
    bad["embedder"]["embedding"]["embedding"] = jnp.zeros((65, config.d_model))
    _rejects(net, bad, r"\['embedder'\]\['embedding'\]\['embedding'\] has shape \(65, 32\)",
             prompts=[[1]])
    missing = {k: v for k, v in params.items() if k != "embedder"}
    _rejects(net, missing, r"is missing", prompts=[[1]])
