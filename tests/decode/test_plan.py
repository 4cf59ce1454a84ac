"""decode/plan.py: the loop planned on the host (several steps per check for the end, no
`lax.cond`) gives exactly what the default loop (one step per check, every decision a
`lax.cond` on the device) gives, for every setting, stop and way of calling it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import drain

from kvjax import decode
from kvjax import model as M
from kvjax.decode.loop import StopConditions, StopReason, decode_loop, initial_state, record
from kvjax.decode.plan import ON_DEVICE, LoopPlan, default_plan, planned_by
from kvjax.decode.sampling import SamplingParams, row_keys

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3], [20, 21, 22, 23]]
# Sampled and greedy rows (top_k = 1 is greedy), every filter and every built-in processor;
# the all-greedy plan is compared in the cache test below.
SETTINGS = dict(sampling=decode.Sampling(
    temperature=[0.0, 1.5, 0.7, 1.0], top_k=[0, 5, 0, 1], top_p=[1.0, 0.9, 0.8, 1.0],
    min_p=[0.0, 0.0, 0.1, 0.0], repetition_penalty=[1.0, 1.3, 2.0, 1.0],
    no_repeat_ngram_size=[0, 2, 3, 1], presence_penalty=[0.0, 0.5, 0.0, 0.0],
    frequency_penalty=[0.0, 0.0, 1.0, 0.0]))


def host_plan(rows):
    """Planned on the host, with 3 steps per check (a number that divides none of the
    budgets below)."""
    return LoopPlan.for_rows(rows, steps_per_check=3)


def _run_both(call):
    on_device = call()
    with planned_by(host_plan):
        return on_device, call()


def _assert_same(a: decode.GenerateOutput, b: decode.GenerateOutput):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.stop_reason, b.stop_reason)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_generate_gives_the_same_output_with_either_plan(tiny_lm):
    # A plan decides which parts of the loop's step run: the same for both variants.
    _, net, params = tiny_lm

    def run(**kwargs):  # 10 tokens: not a multiple of the 3 steps per check
        return decode.generate(net, params, PROMPTS, max_new_tokens=10, rng=jax.random.key(3),
                               return_logprobs=True, **SETTINGS, **kwargs)

    eos = int(run().tokens[3, 4])  # stops row 3 early, and maybe others
    on_device, on_host = _run_both(lambda: run(eos_ids=(eos,)))
    _assert_same(on_device, on_host)
    assert StopReason.EOS in on_device.stop_reason


def test_stream_chunks_and_a_continued_state_are_the_same_with_either_plan(tiny_lm):
    _, net, params = tiny_lm
    settings = SETTINGS

    def run():
        pieces, first = drain(decode.stream(net, params, PROMPTS, max_new_tokens=11,
                                            chunk_size=4, rng=jax.random.key(1),
                                            return_state=True, **settings))
        later = decode.generate(net, params, [[8], [], [30, 31], [2]], state=first.state,
                                max_new_tokens=5, rng=jax.random.key(2), return_logprobs=True,
                                **settings)
        return [p.tolist() for p in pieces], first, later

    (chunks_a, first_a, later_a), (chunks_b, first_b, later_b) = _run_both(run)
    assert chunks_a == chunks_b and [len(c[0]) for c in chunks_a] == [1, 4, 4, 2]
    np.testing.assert_array_equal(first_a.tokens, first_b.tokens)
    _assert_same(later_a, later_b)


def test_rows_that_fill_their_cache_stop_at_the_same_step_with_either_plan(tiny_lm):
    config, _, params = tiny_lm
    prompts = jnp.asarray([[4, 5, 6, 7, 8, 9], [4, 5, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([6, 2], jnp.int32)
    stops = StopConditions(jnp.full((8,), -1, jnp.int32), jnp.asarray(32, jnp.int32))
    sampling = SamplingParams.make(batch=2)

    @functools.partial(jax.jit, static_argnums=0)
    def run(plan):
        logits_BV, cache = M.prefill(config, params, prompts, lengths, 12)
        state = initial_state(2, 32, cache, row_keys(jax.random.key(0), 2))
        state = record(state, logits_BV, stops, sampling)
        return decode_loop(M.step_fn(config, params), state, stops, sampling,
                           jnp.asarray(32), plan=plan)

    on_device = run(ON_DEVICE)
    on_host = run(LoopPlan.for_rows({}, steps_per_check=4))
    assert on_device.stop_reason.tolist() == [StopReason.CACHE_FULL] * 2
    for name in ("step", "tokens", "lengths", "logprobs", "stop_reason", "context_lengths"):
        np.testing.assert_array_equal(getattr(on_device, name), getattr(on_host, name))
    np.testing.assert_array_equal(on_device.cache.lengths, on_host.cache.lengths)
    np.testing.assert_array_equal(on_device.cache.overflow, on_host.cache.overflow)


def test_the_host_decides_only_what_the_rows_use():
    def rows(**settings):
        return {name: np.asarray(value) for name, value in settings.items()}

    assert LoopPlan.for_rows(rows(temperature=[0.0, 0.0])) == LoopPlan(
        steps_per_check=8, sampled=False, penalty=False, ngram_bound=0)
    # top_k = 1 is greedy whatever the temperature
    assert not LoopPlan.for_rows(rows(temperature=[1.0, 0.0], top_k=[1, 0])).sampled
    assert LoopPlan.for_rows(rows(temperature=[0.0, 0.5])).sampled
    assert LoopPlan.for_rows(rows(repetition_penalty=[1.0, 1.1])).penalty
    assert LoopPlan.for_rows(rows(presence_penalty=[0.0, -0.1])).penalty
    assert LoopPlan.for_rows(rows(frequency_penalty=[0.2, 0.0])).penalty
    assert not LoopPlan.for_rows(rows(presence_penalty=[0.0], frequency_penalty=[0.0])).penalty
    assert [LoopPlan.for_rows(rows(no_repeat_ngram_size=[n, 0])).ngram_bound
            for n in (0, 1, 2, 3, 5, 8)] == [0, 1, 2, 4, 8, 8]


def test_generate_decides_on_the_device_unless_planned_otherwise():
    rows = {"temperature": np.asarray([0.5])}
    assert default_plan(rows) == ON_DEVICE
    with planned_by(host_plan):
        assert default_plan(rows) == LoopPlan(3, sampled=True, penalty=False, ngram_bound=0)
    assert default_plan(rows) == ON_DEVICE


def test_each_plan_compiles_once(tiny_lm):
    _, net, params = tiny_lm
    # 25 to 32 new tokens: a bucket no other test here compiles
    calls = [dict(sampling=decode.Sampling(temperature=0.0)),
             dict(sampling=decode.Sampling(temperature=0.0), max_new_tokens=25),
             dict(sampling=decode.Sampling(temperature=[0.0, 0.9, 1.0, 0.3]))]
    before = decode.trace_count("continue")
    with planned_by(host_plan):
        for kwargs in calls:
            decode.generate(net, params, PROMPTS, **{"max_new_tokens": 30, **kwargs})
    assert decode.trace_count("continue") == before + 2  # greedy, then sampled
