"""decode/processors.py through `generate` on a real tiny model: the repetition, presence and
frequency penalties equal a reference, no-repeat n-grams leave no n-gram twice, a logit
processor reads the state and forbids tokens, and equal logit biases share one compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_full
from test_generate_options import PROMPTS

from kvjax import decode


def penalised_greedy_reference(config, params, prompt, steps, repetition=1.0, presence=0.0,
                               frequency=0.0, stop=None, min_tokens=0):
    """Greedy decoding without a cache, the penalties applied in NumPy: the CTRL penalty to
    every token of the prompt and the output so far, the presence and frequency penalties to
    the output's tokens, by their counts; `stop` ends the output, and cannot be drawn before
    `min_tokens` are out."""
    sequence = list(prompt)
    for _ in range(steps):
        if stop is not None and sequence[-1] == stop and len(sequence) > len(prompt):
            break
        padded = np.zeros((1, 32), np.int32)
        padded[0, :len(sequence)] = sequence
        logits = np.asarray(run_full(config, params, jnp.asarray(padded))[0, len(sequence) - 1])
        seen = np.zeros(config.vocab_size, bool)
        seen[sequence] = True
        logits = np.where(seen, np.where(logits > 0, logits / repetition,
                                         logits * repetition), logits)
        counts = np.bincount(sequence[len(prompt):], minlength=config.vocab_size)
        logits = logits - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)
        if stop is not None and len(sequence) - len(prompt) < min_tokens:
            logits[stop] = -np.inf
        sequence.append(int(np.argmax(logits)))
    return sequence[len(prompt):]


def test_penalties_equal_the_reference(tiny_lm):
    config, net, params = tiny_lm
    settings = dict(repetition=[3.0, 1.0, 1.0, 1.0], presence=[0.0, 0.0, 1.5, -0.5],
                    frequency=[0.0, 0.0, 0.0, 1.0])
    plain = decode.generate(net, params, PROMPTS, max_new_tokens=8)
    out = decode.generate(net, params, PROMPTS, max_new_tokens=8, sampling=decode.Sampling(
        repetition_penalty=settings["repetition"], presence_penalty=settings["presence"],
        frequency_penalty=settings["frequency"]))
    for row in (0, 2, 3):
        assert out.tokens[row].tolist() == penalised_greedy_reference(
            config, params, PROMPTS[row], 8, *(settings[k][row] for k in settings))
        assert not np.array_equal(out.tokens[row], plain.tokens[row])
    np.testing.assert_array_equal(out.tokens[1], plain.tokens[1])  # every penalty off


def test_min_tokens_holds_back_the_stop_ids_as_the_reference_does(tiny_lm):
    config, net, params = tiny_lm
    plain = decode.generate(net, params, PROMPTS, max_new_tokens=8)
    stop = int(plain.tokens[0, 0])  # row 0 would stop at once
    min_tokens = [4, 0, 2, 8]
    out = decode.generate(net, params, PROMPTS, max_new_tokens=8, eos_ids=(stop,),
                          sampling=decode.Sampling(min_tokens=min_tokens))
    for row, prompt in enumerate(PROMPTS):
        assert out.token_lists()[row] == penalised_greedy_reference(
            config, params, prompt, 8, stop=stop, min_tokens=min_tokens[row])
    assert len(out.token_lists()[0]) >= 4 and stop not in out.token_lists()[0][:4]


def test_no_repeat_ngram_size_one_never_repeats_a_context_token(tiny_lm):
    _, net, params = tiny_lm
    out = decode.generate(net, params, PROMPTS, max_new_tokens=12, rng=jax.random.key(3),
                          sampling=decode.Sampling(temperature=1.0, no_repeat_ngram_size=1))
    for prompt, generated in zip(PROMPTS, out.token_lists(), strict=True):
        assert len(set(prompt + generated)) == len(prompt) + len(generated)


def ngrams(tokens, n):
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


@pytest.mark.parametrize("n", [2, 3])
def test_no_repeat_ngram_leaves_no_ngram_twice(tiny_lm, n):
    _, net, params = tiny_lm
    loop = [[7, 8] * 6, [1, 2, 3] * 4]  # prompts that invite repeating them
    plain = decode.generate(net, params, loop, max_new_tokens=24)
    out = decode.generate(net, params, loop, max_new_tokens=24,
                          sampling=decode.Sampling(no_repeat_ngram_size=n))
    assert any(len(set(ngrams(p + g, n))) < len(ngrams(p + g, n))
               for p, g in zip(loop, plain.token_lists(), strict=True))
    for prompt, generated in zip(loop, out.token_lists(), strict=True):
        grams = ngrams(prompt + generated, n)
        new = grams[len(prompt) - n + 1:]  # the n-grams that end in a generated token
        assert all(grams.count(g) == 1 for g in new), (prompt, generated)


def test_logit_processor_forbids_tokens_and_reads_the_state(tiny_lm):
    _, net, params = tiny_lm
    plain = decode.generate(net, params, PROMPTS, max_new_tokens=6)
    banned = sorted(set(plain.tokens.ravel().tolist()))[:3]
    out = decode.generate(net, params, PROMPTS, max_new_tokens=6,
                          logit_processors=[decode.forbid_tokens(banned)])
    assert not set(out.tokens.ravel().tolist()) & set(banned)

    def echo_last(logits, state):  # always choose the row's newest context token
        last = jnp.take_along_axis(state.context, state.context_lengths[:, None] - 1, axis=1)
        return jnp.where(jnp.arange(logits.shape[1]) == last, 100.0, logits)

    echoed = decode.generate(net, params, PROMPTS, max_new_tokens=4,
                             logit_processors=(echo_last,))
    assert echoed.token_lists() == [[p[-1]] * 4 for p in PROMPTS]


def test_equal_logit_biases_share_one_compilation(tiny_lm):
    _, net, params = tiny_lm
    decode.generate(net, params, PROMPTS, max_new_tokens=4,
                    logit_processors=[decode.LogitBias.of({3: 2.0, 9: -1.0})])
    before = decode.trace_count("continue")
    decode.generate(net, params, PROMPTS, max_new_tokens=4,
                    logit_processors=[decode.LogitBias.of({9: -1.0, 3: 2.0})])
    assert decode.trace_count("continue") == before


def test_a_row_logit_bias_adds_each_rows_own_and_nothing_where_all_are_zero():
    logits = np.random.default_rng(0).normal(size=(3, 10)).astype(np.float32)
    ids = np.array([[1, 4, 0], [2, 0, 0], [0, 0, 0]], np.int32)
    values = np.array([[2.0, -100.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    expected = logits.copy()
    for row in range(3):
        for token, value in zip(ids[row], values[row], strict=True):
            expected[row, token] += value
    biased = decode.processors.RowLogitBias(jnp.asarray(ids), jnp.asarray(values))(
        jnp.asarray(logits), None)
    np.testing.assert_array_equal(biased, expected)
    unbiased = decode.processors.RowLogitBias.empty(3, 4)(jnp.asarray(logits), None)
    np.testing.assert_array_equal(unbiased, logits)
