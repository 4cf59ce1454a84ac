"""The decode loop with a fake model whose next token is previous + 1 (mod V)."""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.decode.loop import (
    StopConditions,
    StopReason,
    decode_loop,
    initial_state,
    record,
    take,
)
from kvjax.decode.sampling import SamplingParams, row_keys

VOCAB = 50


@flax.struct.dataclass
class FakeCache:
    """Counts fed tokens per row; `capacity` is static."""

    lengths: jax.Array
    calls: jax.Array
    capacity: int = flax.struct.field(pytree_node=False, default=100)


def next_is_previous_plus_one(tokens_B1, cache):
    logits = 10.0 * jax.nn.one_hot((tokens_B1 + 1) % VOCAB, VOCAB)
    return logits, cache.replace(lengths=cache.lengths + 1, calls=cache.calls + 1)


def run(first_tokens, *, max_new_tokens, eos_ids=(), buffer_len=16, capacity=100,
        prompt_lengths=None, forced_end_id=None, temperature=0.0, banned_ids=None):
    eos = np.full(8, -1, np.int32)
    eos[:len(eos_ids)] = eos_ids
    lengths = prompt_lengths if prompt_lengths is not None else [1] * len(first_tokens)
    stops = StopConditions(jnp.asarray(eos), jnp.asarray(max_new_tokens),
                           None if forced_end_id is None else jnp.asarray(forced_end_id),
                           None if banned_ids is None else jnp.asarray(banned_ids, jnp.int32))
    return _run(jnp.asarray(first_tokens), jnp.asarray(lengths), stops,
                jnp.asarray(temperature, jnp.float32), buffer_len, capacity)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _run(first_tokens_B, lengths_B, stops, temperature, buffer_len, capacity):
    """The first tokens recorded as a prefill's, then the loop: one compiled program."""
    batch = first_tokens_B.shape[0]
    cache = FakeCache(lengths_B, jnp.zeros((), jnp.int32), capacity)
    sampling = SamplingParams.make(temperature=temperature, batch=batch)
    state = initial_state(batch, buffer_len, cache, row_keys(jax.random.key(0), batch))
    first_logits, _ = next_is_previous_plus_one(first_tokens_B[:, None] - 1, cache)
    state = record(state, first_logits[:, 0], stops, sampling)
    return decode_loop(next_is_previous_plus_one, state, stops, sampling, stops.max_new_tokens)


def test_counts_up_exactly():
    state = run([3, 10], max_new_tokens=5)
    np.testing.assert_array_equal(state.tokens[:, :5], [[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]])
    np.testing.assert_array_equal(state.tokens[:, 5:], 0)
    np.testing.assert_array_equal(state.lengths, [5, 5])
    np.testing.assert_array_equal(state.stop_reason, [StopReason.MAX_NEW_TOKENS] * 2)
    assert int(state.cache.calls) == 4  # the first token came from the prefill


def test_each_row_stops_at_its_own_eos_and_pads_after():
    state = run([3, 10, 40], max_new_tokens=12, eos_ids=(6, 13))
    np.testing.assert_array_equal(state.tokens[0, :5], [3, 4, 5, 6, 0])
    np.testing.assert_array_equal(state.tokens[1, :5], [10, 11, 12, 13, 0])
    np.testing.assert_array_equal(state.tokens[2, :12], np.arange(40, 52) % VOCAB)
    np.testing.assert_array_equal(state.lengths, [4, 4, 12])
    np.testing.assert_array_equal(
        state.stop_reason, [StopReason.EOS, StopReason.EOS, StopReason.MAX_NEW_TOKENS])


def test_a_forced_end_is_the_last_token_of_each_row_that_reaches_its_budget():
    """transformers' `forced_eos_token_id`: the token a row makes at its budget, whatever it
    would draw (greedy or sampled), ending it by its budget; rows that end before keep
    their tokens."""
    for temperature in (0.0, 1.0):
        state = run([3, 10, 1], max_new_tokens=6, eos_ids=(6, 2), forced_end_id=2,
                    temperature=temperature)
        np.testing.assert_array_equal(state.tokens[:, :7], [[3, 4, 5, 6, 0, 0, 0],
                                                            [10, 11, 12, 13, 14, 2, 0],
                                                            [1, 2, 0, 0, 0, 0, 0]])
        np.testing.assert_array_equal(state.lengths, [4, 6, 2])
        np.testing.assert_array_equal(state.stop_reason, [StopReason.EOS,
                                                          StopReason.MAX_NEW_TOKENS,
                                                          StopReason.EOS])
    # A forced end need not be an eos id; a budget of one token forces the first.
    np.testing.assert_array_equal(run([3], max_new_tokens=4, forced_end_id=40).tokens[0, :5],
                                  [3, 4, 5, 40, 0])
    np.testing.assert_array_equal(run([3], max_new_tokens=1, forced_end_id=40).tokens[0, :2],
                                  [40, 0])


def test_banned_ids_are_never_made():
    """The fake model's next token is its previous + 1 with logit 10, all others 0: a banned
    id gives way to the likeliest other token, 0 (greedy: the first of the ties)."""
    state = run([3, 8], max_new_tokens=5, banned_ids=[5, -1, 9])
    np.testing.assert_array_equal(state.tokens[:, :5], [[3, 4, 0, 1, 2], [8, 0, 1, 2, 3]])
    # The first token (a prefill's) is banned too.
    np.testing.assert_array_equal(run([5], max_new_tokens=2, banned_ids=[5]).tokens[0, :2],
                                  [0, 1])


def test_loop_exits_as_soon_as_every_row_is_done():
    state = run([3, 4], max_new_tokens=16, eos_ids=(6,))
    assert int(state.step) == 4  # row 0 reaches 6 after 4 tokens; no step runs after
    assert int(state.cache.calls) == 3
    np.testing.assert_array_equal(state.stop_reason, [StopReason.EOS, StopReason.EOS])


def test_full_cache_stops_the_row_without_feeding_it():
    state = run([3, 3], max_new_tokens=10, capacity=6, prompt_lengths=[2, 4])
    # Row 0 has 4 free slots: 4 tokens fed, 5 generated; row 1 has 2 free: 3 generated.
    np.testing.assert_array_equal(state.lengths, [5, 3])
    np.testing.assert_array_equal(state.tokens[1, :4], [3, 4, 5, 0])
    np.testing.assert_array_equal(state.stop_reason, [StopReason.CACHE_FULL] * 2)
    assert int(state.step) == 6  # exits when both are done, not at max_new_tokens


def test_step_limit_runs_a_chunk_and_resumes_identically():
    whole = run([3], max_new_tokens=9)
    cache = FakeCache(jnp.asarray([1]), jnp.zeros((), jnp.int32))
    stops = StopConditions(jnp.full(8, -1, jnp.int32), jnp.asarray(9))
    sampling = SamplingParams.make()
    state = initial_state(1, 16, cache, row_keys(jax.random.key(0), 1))
    state = record(state, 10.0 * jax.nn.one_hot(jnp.asarray([3]), VOCAB), stops, sampling)
    run_loop = jax.jit(decode_loop, static_argnums=0)
    for limit in (4, 6, 9):
        state = run_loop(next_is_previous_plus_one, state, stops, sampling, jnp.asarray(limit))
        assert int(state.step) == limit
    np.testing.assert_array_equal(state.tokens, whole.tokens)


def fixed_preferences(tokens_B1, cache):
    """Whatever came before, the same logits: token 0 is liked most, then 1, 2, ..."""
    logits = jnp.broadcast_to(jnp.linspace(3.0, -3.0, VOCAB), (tokens_B1.shape[0], 1, VOCAB))
    return logits, cache.replace(lengths=cache.lengths + 1, calls=cache.calls + 1)


def test_penalties_steer_the_loop_exactly():
    """Greedy with each penalty against a NumPy replay of its formula: the CTRL penalty reads
    the prompt [1] too, the presence and frequency penalties only the tokens output (as
    OpenAI and vLLM count them); and a 1-gram ban makes every token new."""
    steps, penalty = 12, 4.0
    presence, frequency = [0.0, 0.0, 0.3, -0.1], [0.0, 0.0, 0.0, 0.2]
    rows = len(presence)
    cache = FakeCache(jnp.ones(rows, jnp.int32), jnp.zeros((), jnp.int32))
    stops = StopConditions(jnp.full(8, -1, jnp.int32), jnp.asarray(steps))
    sampling = SamplingParams.make(repetition_penalty=[penalty, 1.0, 1.0, 1.0],
                                   no_repeat_ngram_size=[0, 1, 0, 0],
                                   presence_penalty=presence, frequency_penalty=frequency,
                                   batch=rows)
    context = jnp.zeros((rows, 1 + 16), jnp.int32).at[:, 0].set(1)
    state = initial_state(rows, 16, cache, row_keys(jax.random.key(0), rows), context,
                          jnp.ones(rows, jnp.int32))
    first, _ = fixed_preferences(jnp.zeros((rows, 1), jnp.int32), cache)
    state = record(state, first[:, 0], stops, sampling)
    state = jax.jit(decode_loop, static_argnums=0)(fixed_preferences, state, stops, sampling,
                                                    stops.max_new_tokens)
    base = np.linspace(3.0, -3.0, VOCAB).astype(np.float32)
    seen, expected = {1}, []
    for _ in range(steps):
        logits = base.copy()
        for t in seen:
            logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        expected.append(int(np.argmax(logits)))
        seen.add(expected[-1])
    np.testing.assert_array_equal(state.tokens[0, :steps], expected)
    np.testing.assert_array_equal(state.tokens[1, :steps], [0] + list(range(2, steps + 1)))
    np.testing.assert_array_equal(state.context[0, :1 + steps], [1] + expected)
    np.testing.assert_array_equal(state.context_lengths, [1 + steps] * rows)
    for row in (2, 3):
        counts, output = np.zeros(VOCAB, np.float32), []
        for _ in range(steps):
            logits = (base - np.float32(frequency[row]) * counts
                      - np.float32(presence[row]) * (counts > 0))
            output.append(int(np.argmax(logits)))
            counts[output[-1]] += 1
        np.testing.assert_array_equal(state.tokens[row, :steps], output)
    assert state.tokens[2, 1] == 1 and state.tokens[3, 1] == 0  # the prompt's 1 not counted


def test_min_tokens_holds_back_the_stop_ids_until_that_many_are_out():
    """Token 0, the model's favourite, ends a row: a row with min_tokens 3 makes its second
    favourite three times first, one without stops at once."""
    cache = FakeCache(jnp.zeros(2, jnp.int32), jnp.zeros((), jnp.int32))
    stops = StopConditions(jnp.asarray([0] + [-1] * 7, jnp.int32), jnp.asarray(8))
    sampling = SamplingParams.make(min_tokens=[3, 0], batch=2)
    state = initial_state(2, 8, cache, row_keys(jax.random.key(0), 2))
    first, _ = fixed_preferences(jnp.zeros((2, 1), jnp.int32), cache)
    state = record(state, first[:, 0], stops, sampling)
    state = jax.jit(decode_loop, static_argnums=0)(fixed_preferences, state, stops, sampling,
                                                    stops.max_new_tokens)
    np.testing.assert_array_equal(state.lengths, [4, 1])
    np.testing.assert_array_equal(state.tokens[:, :4], [[1, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(state.stop_reason, [StopReason.EOS] * 2)


@flax.struct.dataclass
class Rows:
    last_tokens: jax.Array
    stop_reason: jax.Array
    context: jax.Array
    context_lengths: jax.Array


def test_take_ends_the_rows_that_hit_a_stop_id_or_their_budget_and_leaves_the_others():
    """The one place generate's loop and the engine's slots end rows."""
    rows = Rows(last_tokens=jnp.asarray([1, 2, 3, 4]),
                stop_reason=jnp.asarray([0, 0, 0, StopReason.EOS]),
                context=jnp.asarray([[5, 0, 0], [6, 7, 0], [8, 0, 0], [1, 0, 0]]),
                context_lengths=jnp.asarray([1, 2, 1, 1]))
    live = jnp.asarray([True, True, True, False])
    after, token, ends = take(rows, jnp.asarray([11, 42, 12, 13]), live,
                              jnp.asarray([[42, -1]] * 4), jnp.asarray([False, False, True, True]))
    np.testing.assert_array_equal(token, [11, 42, 12, 0])  # a row not live takes nothing
    np.testing.assert_array_equal(ends, [False, True, True, False])
    np.testing.assert_array_equal(after.stop_reason, [StopReason.RUNNING, StopReason.EOS,
                                                      StopReason.MAX_NEW_TOKENS, StopReason.EOS])
    np.testing.assert_array_equal(after.last_tokens, [11, 42, 12, 4])
    np.testing.assert_array_equal(after.context, [[5, 11, 0], [6, 7, 42], [8, 12, 0], [1, 0, 0]])
    np.testing.assert_array_equal(after.context_lengths, [2, 3, 2, 1])
