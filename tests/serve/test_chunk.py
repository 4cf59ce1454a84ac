"""serve/chunk.py: the decode chunk's admission: the next staged sample (of the lowest
priority, the oldest) takes a free slot, with its whole prompt's cache, however the sample
ids wrap, into a windowed layer's ring where the slot keeps one; what such slots serve."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_full
from test_engine import CHUNK, SLOTS, Collector, alone, prompt
from test_pages import all_pages_free, preemptions

from kvjax import model as M
from kvjax.decode import Sampling
from kvjax.serve import Engine, GenerationRequest, chunk, slots
from kvjax.serve.metrics import ServeMetrics


def staged_state(config, ids, lengths, rng):
    """Three free slots; staged rows holding `ids` (waiting) with random cache values."""
    state = slots.empty_state(config, 3, len(ids), config.max_len)
    cache = state.staged.cache

    def noise(stack):
        return jnp.asarray(rng.normal(size=stack.shape), stack.dtype)

    cache = cache.replace(k=tuple(map(noise, cache.k)), v=tuple(map(noise, cache.v)),
                          lengths=jnp.asarray(lengths, jnp.int32))
    staged = state.staged.replace(cache=cache, owner=jnp.asarray(ids, jnp.int32),
                                  running=jnp.ones(len(ids), bool),
                                  last_tokens=jnp.arange(len(ids), dtype=jnp.int32) + 10)
    return state.replace(staged=staged)


TOP = slots.ID_SPACE - 1


@pytest.mark.parametrize("priorities, expected", [
    ([0, 0, 0, 0], [TOP, 0, 1]),  # by age: TOP, 0, 1, 2
    ([0, 1, 0, -1], [2, 0, 1]),  # the lowest priority first, then by age
    ([3, -5, 3, 3], [TOP, 0, 1]),
])
def test_the_next_staged_sample_is_of_the_lowest_priority_the_oldest_across_the_ids_wrap(
        monkeypatch, priorities, expected):
    config = M.preset("tiny")
    monkeypatch.setattr(chunk, "COPY_BLOCK", 24)  # 50 positions: blocks at 0, 24 and 40
    ids, lengths = [1, TOP, 0, 2], [7, 50, 3, 12]
    state = staged_state(config, ids, lengths, np.random.default_rng(0))
    state = state.replace(last_admitted=jnp.asarray(TOP - 1, jnp.int32),
                          staged=state.staged.replace(priority=jnp.asarray(priorities,
                                                                           jnp.int32)))
    admit = jax.jit(chunk.admit)
    order = []
    for slot in range(3):
        state = admit(state)
        assert int(state.last_admitted) == int(state.slots.owner[slot])
        order.append(int(state.slots.owner[slot]))
        row = ids.index(order[-1])
        length = lengths[row]
        assert int(state.slots.cache.lengths[slot]) == length
        assert int(state.slots.last_tokens[slot]) == 10 + row
        assert bool(state.slots.running[slot]) and not bool(state.staged.running[row])
        for taken, source in zip(state.slots.cache.k + state.slots.cache.v,
                                 state.staged.cache.k + state.staged.cache.v, strict=True):
            np.testing.assert_array_equal(taken[:, slot, :, :length],
                                          source[:, row, :, :length])
    assert order == expected
    assert [bool(r) for r in state.slots.running] == [True] * 3
    left = [i for i in ids if i not in expected]
    assert np.asarray(state.staged.running).tolist() == [i in left for i in ids]
    np.testing.assert_array_equal(state.slots.priority,
                                  [priorities[ids.index(i)] for i in expected])


def test_a_staged_row_enters_a_windowed_slots_ring_at_its_last_positions():
    """Layer 0 attends over a window of 5, layer 1 over everything: a slot holds layer 0 in
    a ring of 5 (`model/ring.py`), into which admission copies the row's last 5 positions,
    position p at slot p mod 5 (a row shorter than the ring leaves the rest as it was), and
    layer 1 whole."""
    config = M.preset("tiny", sliding_window=5, full_attention_layers=(1,), scan_layers=False)
    ids, lengths = [0, 1], [13, 3]
    state = staged_state(config, ids, lengths, np.random.default_rng(1))
    assert [k.shape[3] for k in state.slots.cache.k] == [5, config.max_len]
    before = [np.asarray(k) for k in state.slots.cache.k]
    state = jax.jit(chunk.admit)(jax.jit(chunk.admit)(state))
    for slot, (row, length) in enumerate(zip(ids, lengths, strict=True)):
        assert int(state.slots.cache.lengths[slot]) == length
        for ring, source in ((state.slots.cache.k[0], state.staged.cache.k[0]),
                             (state.slots.cache.v[0], state.staged.cache.v[0])):
            for position in range(max(0, length - 5), length):
                np.testing.assert_array_equal(ring[:, slot, :, position % 5],
                                              source[:, row, :, position])
        for untouched in range(length, 5):
            np.testing.assert_array_equal(state.slots.cache.k[0][:, slot, :, untouched],
                                          before[0][:, slot, :, untouched])
        np.testing.assert_array_equal(state.slots.cache.k[1][:, slot, :, :length],
                                      state.staged.cache.k[1][:, row, :, :length])


@pytest.mark.parametrize("page_size", [None, 4], ids=["contiguous", "paged"])
def test_a_windowed_models_slots_serve_what_generate_makes_alone(tiny_lm, page_size):
    """Requests longer than the window, two of them sharing a kept prefix, through slots
    whose windowed layers keep rings: each makes the tokens `generate` makes alone. Paged,
    the rings lie beside the global layer's pool, whose pages the kept prefix shares and
    which run short (samples preempted and resumed), all of them free at the end."""
    config = tiny_lm[0].replace(sliding_window=5, full_attention_layers=(1,),
                                scan_layers=False)
    params = M.with_layer_layout(tiny_lm[0], tiny_lm[2], scan_layers=False)[1]
    windowed = (config, M.build_model(config), params)
    shared = prompt(90, 16)
    requests = [GenerationRequest(p, max_tokens=m) for p, m in (
        (prompt(91, 9), 20), (shared + prompt(92, 3), 12), (shared + prompt(93, 5), 9),
        (prompt(94, 2), 16))]
    metrics = ServeMetrics()
    engine = Engine(config, params, max_slots=2, max_len=48, chunk_size=4, prefill_batch=2,
                    page_size=page_size, num_pages=page_size and 12, metrics=metrics)
    cache = engine.state.slots.cache
    assert cache.ring_slots == 5 and cache.rings == (True, False)
    if page_size:  # layer 0: a ring per slot; layer 1: the pool's pages (and the prefix rows')
        assert cache.k[0].shape[1:4] == (2, config.kv_heads, 5)
        assert cache.k[1].shape[3] == page_size and cache.k[1].shape[1] > 12
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        engine.submit(request, collector)
        engine.step()
    engine.run_until_idle()
    assert engine._prefixes.hits >= 1  # noqa: SLF001
    assert [c.tokens() for c in collectors] == [alone(windowed, r) for r in requests]
    if page_size:
        assert preemptions(metrics) >= 1 and all_pages_free(engine)


def greedy_without_bad_words(tiny_lm, request):
    """`request`'s greedy tokens from the uncached model, the repetition penalty applied
    (transformers': over the prompt and the tokens made) and each step's bad words banned
    as vLLM's rule reads them."""
    config, _, params = tiny_lm
    tokens, penalty = list(request.prompt), request.sampling.repetition_penalty
    for _ in range(request.max_tokens):
        padded = np.zeros((1, config.max_len), np.int32)  # one compiled forward for all
        padded[0, :len(tokens)] = tokens
        logits = np.array(run_full(config, params, padded))[0, len(tokens) - 1]
        seen = sorted(set(tokens))
        logits[seen] = np.where(logits[seen] < 0, logits[seen] * penalty,
                                logits[seen] / penalty)
        made = tokens[len(request.prompt):]
        for word in request.bad_words:  # its last id, after the others made just now
            if len(word) - 1 <= len(made) and made[len(made) + 1 - len(word):] == list(
                    word[:-1]):
                logits[word[-1]] = -np.inf
        tokens.append(int(np.argmax(logits)))
    return tokens[len(request.prompt):]


def test_a_slot_never_completes_a_bad_word_from_the_tokens_it_made(tiny_lm):
    """Words drawn from what each request makes freely (a repetition penalty keeps the
    tiny model from repeating one token): one ending its prompt and starting its output
    (the prompt's token does not count, as in vLLM), two of its own tokens, one token
    alone; through the first-token program and the chunk alike."""
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=SLOTS, chunk_size=CHUNK, max_queue=8,
                    prefill_batch=4)
    free = [GenerationRequest(prompt(150 + i, 5), max_tokens=10,
                              sampling=Sampling(repetition_penalty=3.0)) for i in range(3)]
    made = [alone(tiny_lm, r) for r in free]
    words = [((free[0].prompt[-1], made[0][0]), (made[0][3], made[0][4])),
             ((made[1][0],),),
             ((made[2][1], made[2][2]), (made[2][6],), (made[2][2],) * 3)]
    requests = [dataclasses.replace(r, bad_words=w) for r, w in zip(free, words, strict=True)]
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        engine.submit(request, collector)
    engine.run_until_idle()
    tokens = [c.tokens() for c in collectors]
    assert tokens == [greedy_without_bad_words(tiny_lm, r) for r in requests]
    assert tokens[0][:4] == made[0][:4] and tokens[0][4] != made[0][4]
    assert tokens[1][0] != made[1][0] and tokens[2][:2] == made[2][:2]
    assert tokens[2][2] != made[2][2]
