"""decode/prepare.py, before anything compiles: prompts padded to their bucket with nothing
of the caller's padding left, the buffer and cache sized from the buckets, eos ids and
settings laid out as the compiled loop reads them (a prompt's value once per sample), and
each constraint checked against the model and the call (the refusals a caller meets through
`generate` are in test_checks.py)."""

import jax
import numpy as np
import pytest
from conftest import end_only_automaton

from kvjax import model as M
from kvjax.decode import Sampling
from kvjax.decode.buckets import bucket
from kvjax.decode.plan import ON_DEVICE
from kvjax.decode.prepare import MAX_EOS_IDS, pad_prompts, prepare, row_automata

CONFIG = M.preset("tiny")
PARAMS = jax.eval_shape(lambda: M.init_params(CONFIG, jax.random.key(0)))  # shapes suffice


def test_padding_keeps_each_rows_tokens_and_zeros_the_rest():
    tokens = np.array([[5, 6, 7, 99], [8, 99, 99, 99]])  # 99: the caller's padding
    lengths = np.array([3, 1])
    np.testing.assert_array_equal(pad_prompts(tokens, lengths, 6),
                                  [[5, 6, 7, 0, 0, 0], [8, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(pad_prompts(tokens, lengths, 2), [[5, 6], [8, 0]])
    assert pad_prompts(tokens, lengths, 2).dtype == np.int32


def test_a_call_is_laid_out_as_the_compiled_loop_reads_it():
    prompts = [[5, 6, 7, 9, 10, 11, 12, 13, 14], [8]]
    prepared = prepare(M.build_model(CONFIG), PARAMS, prompts, None, max_new_tokens=5,
                       eos_ids=(2, 9), num_beams=1, rng=jax.random.key(0), num_samples=2,
                       sampling=Sampling(temperature=[0.5, 0.0], top_k=3))
    padded = bucket(9, CONFIG.max_len)
    assert padded > 9 and prepared.tokens.shape == (2, padded)
    np.testing.assert_array_equal(prepared.tokens[0, :9], prompts[0])
    assert not np.asarray(prepared.tokens[0, 9:]).any() and not np.asarray(
        prepared.tokens[1, 1:]).any()
    np.testing.assert_array_equal(prepared.lengths, [9, 1])
    assert prepared.buffer_len == bucket(5, CONFIG.max_len)
    assert prepared.capacity == min(M.prompt_slots(CONFIG, padded) + prepared.buffer_len,
                                    CONFIG.max_len)
    np.testing.assert_array_equal(prepared.stops.eos_ids, [2, 9] + [-1] * (MAX_EOS_IDS - 2))
    assert int(prepared.stops.max_new_tokens) == 5
    assert prepared.rows == 4 and prepared.batch == 2 and prepared.num_samples == 2
    np.testing.assert_allclose(prepared.sampling.temperature, [0.5, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(prepared.sampling.top_k, [3, 3, 3, 3])
    assert prepared.plan == ON_DEVICE and prepared.mesh is None
    assert prepared.constraints is None and prepared.state is None


def test_a_constraint_is_given_to_every_row_or_row_by_row_and_checked():
    one = end_only_automaton(CONFIG.vocab_size, 2)
    assert row_automata(None, 3, CONFIG.vocab_size, (2,)) == [None] * 3
    assert row_automata(one, 2, CONFIG.vocab_size, (2,)) == [one, one]
    assert row_automata([None, one], 2, CONFIG.vocab_size, (2,)) == [None, one]
    for constraint, eos, message in (
            ([one], (2,), "constraint has 1 entries for 2 prompts"),
            ([one, "x"], (2,), "constraint 1 must be a TokenAutomaton .* got str"),
            ([end_only_automaton(CONFIG.vocab_size + 1, 2), None], (2,),
             f"compiled for {CONFIG.vocab_size + 1} token ids; the model has"),
            ([None, one], (3,), r"constraint 1 ends with id 2, which is not among eos_ids \(3,\)")):
        with pytest.raises(ValueError, match=message):
            row_automata(constraint, 2, CONFIG.vocab_size, eos)


def test_a_batch_is_filled_up_to_its_bucket_with_copies_of_its_last_prompt():
    prompts, net = [[5, 6, 7], [8], [9, 10]], M.build_model(CONFIG)
    keys = jax.random.split(jax.random.key(0), 3)
    prepared = prepare(net, PARAMS, prompts, None, max_new_tokens=5, eos_ids=(2,),
                       num_beams=1, rng=keys, num_samples=2,
                       sampling=Sampling(temperature=[0.5, 0.0, 0.7]),
                       constraint=[None, None, end_only_automaton(CONFIG.vocab_size, 2)])
    assert prepared.tokens.shape[0] == 4 and prepared.batch == 3 and prepared.rows == 6
    np.testing.assert_array_equal(prepared.tokens[3], prepared.tokens[2])
    np.testing.assert_array_equal(prepared.lengths, [3, 1, 2, 2])
    np.testing.assert_allclose(prepared.sampling.temperature, [0.5, 0.5, 0, 0, 0.7, 0.7,
                                                                0.7, 0.7])
    np.testing.assert_array_equal(jax.random.key_data(prepared.rng)[3],
                                  jax.random.key_data(keys)[2])
    assert prepared.constraints.state.shape[0] == 8  # every sample of every row
    # A kept state holds the caller's rows alone, so nothing fills them.
    kept = prepare(net, PARAMS, prompts, None, max_new_tokens=5, eos_ids=(), num_beams=1,
                   rng=None, fill_rows=False)
    assert kept.tokens.shape[0] == 3 and kept.rows == 3
