"""Beam search: a hand-built model whose best sequence greedy misses, greedy equivalence
with one beam, and hypothesis scores that match the model's own log-probabilities."""

import functools
import itertools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from conftest import run_full

from kvjax import decode
from kvjax import model as M
from kvjax.decode.beam import beam_loop
from kvjax.decode.loop import StopConditions, decode_loop, initial_state, record
from kvjax.decode.sampling import SamplingParams, row_keys

A, B, C, EOS = 0, 1, 2, 3
START = np.log([0.5, 0.4, 0.05, 0.05])
# Next-token probabilities by previous token. Greedy follows A (0.5, then 0.35 ...), but
# B then EOS (0.4 * 0.9 = 0.36) beats every sequence through A.
TRANSITIONS = np.log([
    [0.35, 0.30, 0.15, 0.20],
    [0.04, 0.03, 0.03, 0.90],
    [0.01, 0.01, 0.01, 0.97],
    [0.25, 0.25, 0.25, 0.25],
])


@flax.struct.dataclass
class MarkovCache:
    lengths: jax.Array
    capacity: int = flax.struct.field(pytree_node=False, default=64)

    def take_rows(self, rows):
        return self.replace(lengths=self.lengths[rows])


def markov(tokens_B1, cache):
    return jnp.asarray(TRANSITIONS, jnp.float32)[tokens_B1], cache.replace(
        lengths=cache.lengths + 1)


def stops(eos_ids, max_new_tokens):
    eos = np.full(8, -1, np.int32)
    eos[:len(eos_ids)] = eos_ids
    return StopConditions(jnp.asarray(eos), jnp.asarray(max_new_tokens))


def markov_beam(num_beams, eos_ids=(EOS,), max_new_tokens=5, length_penalty=0.0,
                num_return=1):
    return _markov_beam(num_beams, tuple(eos_ids), max_new_tokens,
                        jnp.asarray(length_penalty, jnp.float32), num_return)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 4))
def _markov_beam(num_beams, eos_ids, max_new_tokens, length_penalty, num_return):
    first = jnp.asarray([START], jnp.float32)
    cache = MarkovCache(jnp.ones((num_beams,), jnp.int32))
    return beam_loop(markov, first, cache, num_beams, 8, stops(eos_ids, max_new_tokens),
                     length_penalty, num_return=num_return)


def markov_logprob(tokens):
    return START[tokens[0]] + sum(TRANSITIONS[a, b] for a, b in itertools.pairwise(tokens))


def test_beam_search_finds_the_best_sequence_greedy_misses():
    result = markov_beam(num_beams=2)
    assert result.tokens[0, :int(result.lengths[0])].tolist() == [B, EOS]
    np.testing.assert_allclose(result.scores[0], np.log(0.4 * 0.9), rtol=1e-6)
    assert decode.StopReason(int(result.stop_reason[0])).name == "EOS"
    np.testing.assert_allclose(result.logprobs[0, :2], np.log([0.4, 0.9]), rtol=1e-6)


def test_every_returned_hypothesis_is_ranked_best_first_with_its_own_score():
    best = markov_beam(num_beams=3, max_new_tokens=3)
    every = markov_beam(num_beams=3, max_new_tokens=3, num_return=3)
    hypotheses = [every.tokens[j, :int(every.lengths[j])].tolist() for j in range(3)]
    assert hypotheses[0] == best.tokens[0, :int(best.lengths[0])].tolist()
    # By hand: B EOS (0.36), A B EOS (0.135), A C EOS (0.0728) finish; A EOS (0.1) ranks
    # fourth among its step's candidates, past the best 3, so it finishes no hypothesis (as
    # in transformers); the beams still alive after three tokens (A A A: 0.061 ...) score less.
    assert hypotheses == [[B, EOS], [A, B, EOS], [A, C, EOS]]
    np.testing.assert_allclose(every.scores, [markov_logprob(h) for h in hypotheses],
                               rtol=1e-6)


def test_one_beam_equals_greedy():
    result = markov_beam(num_beams=1, eos_ids=(), max_new_tokens=6)

    @jax.jit
    def greedy():
        sampling = SamplingParams.make()
        state = initial_state(1, 8, MarkovCache(jnp.ones((1,), jnp.int32)),
                              row_keys(jax.random.key(0), 1))
        state = record(state, jnp.asarray([START], jnp.float32), stops((), 6), sampling)
        return decode_loop(markov, state, stops((), 6), sampling, jnp.asarray(6))

    state = greedy()
    assert result.tokens[0, :6].tolist() == state.tokens[0, :6].tolist() == [A] * 6
    assert int(result.lengths[0]) == 6


def test_length_penalty_prefers_longer_hypotheses():
    # With a strong length penalty the longer sequences through A win over [B, EOS].
    short = markov_beam(num_beams=4, length_penalty=0.0)
    long = markov_beam(num_beams=4, length_penalty=3.0)
    assert int(long.lengths[0]) > int(short.lengths[0]) == 2


def test_real_model_beam_scores_are_model_logprobs():
    # A score is the same sum whatever the variant: the encoder-decoder's beams are held to
    # the LM's in both layouts (test_generate.py) and to transformers' (tests/hf).
    config = M.preset("tiny")
    net, params = M.build_model(config), M.init_params(config, jax.random.key(3))
    prompts = [[4, 5, 6], [7, 8, 9, 10, 11]]
    alpha = 0.6
    out = decode.beam_search(net, params, prompts, max_new_tokens=6, num_beams=3,
                             eos_ids=(2,), length_penalty=alpha, return_logprobs=True)
    greedy = decode.generate(net, params, prompts, max_new_tokens=6, eos_ids=(2,),
                             return_logprobs=True)
    single = decode.beam_search(net, params, prompts, max_new_tokens=6, eos_ids=(2,),
                                num_beams=1)
    np.testing.assert_array_equal(single.tokens, greedy.tokens)
    for row, prompt in enumerate(prompts):
        tokens = out.token_lists()[row]
        logits = run_full(config, params, jnp.asarray([(prompt + tokens)[:-1]]))
        logprobs = jax.nn.log_softmax(logits[0, -len(tokens):])
        total = sum(float(logprobs[i, t]) for i, t in enumerate(tokens))
        np.testing.assert_allclose(out.logprobs[row, :len(tokens)],
                                   [float(logprobs[i, t]) for i, t in enumerate(tokens)],
                                   atol=1e-4)
        np.testing.assert_allclose(out.scores[row], total / len(tokens) ** alpha, atol=1e-4)
        n = greedy.lengths[row]
        greedy_score = greedy.logprobs[row, :n].sum() / n**alpha
        assert out.scores[row] >= greedy_score - 1e-5
