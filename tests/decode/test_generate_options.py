"""Per-row sampling settings, repetition penalty, no-repeat n-grams, logit processors and
num_samples through `generate` on a real tiny model: exact properties and references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


def penalised_greedy_reference(config, params, prompt, steps, penalty):
    """Greedy decoding without a cache, with the CTRL penalty applied in NumPy to every
    token of the prompt and the output so far."""
    sequence = list(prompt)
    for _ in range(steps):
        padded = np.zeros((1, 32), np.int32)
        padded[0, :len(sequence)] = sequence
        logits = np.asarray(run_full(config, params, jnp.asarray(padded))[0, len(sequence) - 1])
        seen = np.zeros(config.vocab_size, bool)
        seen[sequence] = True
        logits = np.where(seen, np.where(logits > 0, logits / penalty, logits * penalty), logits)
        sequence.append(int(np.argmax(logits)))
    return sequence[len(prompt):]


def test_repetition_penalty_equals_the_reference(tiny_lm):
    config, net, params = tiny_lm
    plain = decode.generate(net, params, PROMPTS[:2], max_new_tokens=10)
    out = decode.generate(net, params, PROMPTS[:2], max_new_tokens=10,
                          sampling=decode.Sampling(repetition_penalty=[3.0, 1.0]))
    assert out.tokens[0].tolist() == penalised_greedy_reference(
        config, params, PROMPTS[0], 10, 3.0)
    np.testing.assert_array_equal(out.tokens[1], plain.tokens[1])  # penalty 1 is off
    assert not np.array_equal(out.tokens[0], plain.tokens[0])


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


def test_num_samples_prefills_each_prompt_once(tiny_lm, monkeypatch):
    config, _, params = tiny_lm
    config = config.replace(max_len=48)  # a config of its own, so that `_start` traces here
    net = M.build_model(config)
    prefill_batches = []

    def counting_prefill(config, params, prompts_BP, *args):
        prefill_batches.append(prompts_BP.shape[0])
        return real_prefill(config, params, prompts_BP, *args)

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
