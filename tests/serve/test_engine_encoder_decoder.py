"""The engine serving an encoder-decoder (a translator): each request's prompt is its source,
and its tokens are those `generate` makes for that source alone, whatever sources of other
lengths share the slots, join or leave them; what it cannot serve is refused by name."""

from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import trained_adapters
from test_engine import Collector, prompt
from test_pages import all_pages_free, preemptions

from kvjax import decode, text
from kvjax import model as M
from kvjax.decode import Sampling
from kvjax.decode.sampling import seed_key
from kvjax.decode.tracing import trace_count
from kvjax.model import lora as L
from kvjax.serve import Engine, GenerationRequest, memory
from kvjax.serve.metrics import ServeMetrics
from kvjax.serve.prompt_logprobs import prompt_logprobs

SLOTS, CHUNK, CAPACITY, SOURCES = 2, 4, 24, 16


@pytest.fixture(scope="module")
def translator():
    """(config, model, params) of a tiny encoder-decoder, layers scanned (as conftest's)."""
    config = M.preset("tiny", num_encoder_layers=2, positional_encoding="rope",
                      num_kv_heads=2, scan_layers=True)
    return config, M.build_model(config), M.init_params(config, jax.random.key(3))


@pytest.fixture(scope="module")
def numbers():
    return text.load(Path(__file__).resolve().parents[2] / "checkpoints" / "numbers-to-words")


@pytest.fixture(scope="module")
def engine(translator):
    config, _, params = translator
    return Engine(config, params, max_slots=SLOTS, chunk_size=CHUNK, max_len=CAPACITY,
                  prefill_batch=2, max_source_len=SOURCES)


def test_greedy_translations_equal_generate_alone_while_others_join_and_leave(numbers):
    """The shipped translator, sources of 1 to 7 digits (prefilled two at a time, in two
    length buckets), more requests than slots: each slot answers its own source. Two end
    at their budgets with a forced end (transformers' `forced_eos_token_id`), as
    `generate` forces it: an eos id after three tokens, another token as the first; one
    never makes the ids it bans (`bad_words_ids`), as `generate` bans them."""
    sources = ["4021", "7", "880017", "35", "1000001", "612", "59"]
    eos, word = numbers.tokenizer.eos_id, numbers.tokenizer.encode("nine")[0]
    budgets, forced = (30, 30, 4, 30, 30, 30, 1), (None,) * 2 + (eos,) + (None,) * 3 + (word,)
    hundred = numbers.tokenizer.encode(" hundred")  # which "612" makes unbanned
    banned = [(), (), (), (), (), tuple(hundred[:1]), ()]
    requests = [GenerationRequest(tuple(text.prompt_tokens(numbers, s)), max_tokens=m,
                                  stop_ids=numbers.tokenizer.stop_ids, forced_end_id=f,
                                  banned_ids=b)
                for s, m, f, b in zip(sources, budgets, forced, banned, strict=True)]
    made = decode.generate(numbers.net, numbers.params, [list(r.prompt) for r in requests],
                           max_new_tokens=30, eos_ids=numbers.tokenizer.stop_ids)
    expected = [tokens[:r.max_tokens]
                for tokens, r in zip(made.token_lists(), requests, strict=True)]
    for row in (2, 6):
        (expected[row],) = decode.generate(
            numbers.net, numbers.params, [list(requests[row].prompt)],
            max_new_tokens=budgets[row], eos_ids=numbers.tokenizer.stop_ids,
            forced_end_id=forced[row]).token_lists()
        assert expected[row][-1] == forced[row] != made.token_lists()[row][budgets[row] - 1]
    (expected[5],) = decode.generate(
        numbers.net, numbers.params, [list(requests[5].prompt)], max_new_tokens=30,
        eos_ids=numbers.tokenizer.stop_ids, banned_ids=banned[5]).token_lists()
    assert banned[5][0] in made.token_lists()[5] and banned[5][0] not in expected[5]
    # Targets in pages: a slot takes its budget's pages at once (8 of 4 positions for 30
    # tokens after the start) from a pool of 10, so the long requests wait for each other's
    # pages, never preempted.
    metrics = ServeMetrics()
    engine = Engine(numbers.config, numbers.params, tokenizer=numbers.tokenizer,
                    max_slots=SLOTS, chunk_size=CHUNK, max_len=32, prefill_batch=2,
                    max_source_len=12, page_size=4, num_pages=10, metrics=metrics)
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests[:3], collectors[:3], strict=True):
        engine.submit(request, collector)
    engine.step()
    for request, collector in zip(requests[3:], collectors[3:], strict=True):
        engine.submit(request, collector)
    most_held = 0
    while engine.step():
        held = np.sum(np.asarray(engine.state.slots.cache.pages) >= 0)
        assert held + np.sum(np.asarray(engine.state.free_pages)) == 10
        most_held = max(most_held, held)
    assert most_held >= 8 and all_pages_free(engine) and preemptions(metrics) == 0
    assert [c.tokens() for c in collectors] == expected
    assert collectors[0].text() == "four thousand twenty-one"
    assert [c.finish() for c in collectors] == ["stop", "stop", "length", "stop", "stop", "stop",
                                                "length"]
    assert engine.live_slots == 0 and engine.queue_length == 0


def test_each_translation_gets_its_own_adapters_tokens_in_a_mixed_batch(numbers):
    """Two LoRA adapters of the shipped translator (its encoder's layers adapted too) served
    beside it: each request's tokens are those `generate` makes with its adapter merged."""
    config, params = numbers.config, numbers.params
    loras = (L.LoRA(4, 8.0, ("q", "v", "wi")), L.LoRA(2, None, ("k", "wo")))
    adapters = [(trained_adapters(config, params, lora, 20 + i), lora)
                for i, lora in enumerate(loras)]
    merged = [params] + [L.merge(config, params, a, lora) for a, lora in adapters]
    sources = [text.prompt_tokens(numbers, s) for s in ("4021", "35", "880017")]
    made = [decode.generate(numbers.net, p, sources, max_new_tokens=12).token_lists()
            for p in merged]
    assert made[1] != made[0] and made[2] != made[0] and made[1] != made[2]
    engine = Engine(config, params, max_slots=SLOTS, chunk_size=CHUNK, max_len=32,
                    prefill_batch=2, adapters=adapters)
    asked = [(i, a) for i in range(len(sources)) for a in range(3)]
    collectors = [Collector() for _ in asked]
    for (i, adapter), collector in zip(asked, collectors, strict=True):
        engine.submit(GenerationRequest(tuple(sources[i]), max_tokens=12, adapter=adapter),
                      collector)
    engine.run_until_idle()
    assert [c.tokens() for c in collectors] == [made[a][i] for i, a in asked]


def test_a_seeded_sample_draws_what_generate_draws_with_its_key(engine, translator):
    _, net, params = translator
    sampling = Sampling(temperature=1.0, top_k=20, repetition_penalty=1.3)
    source = prompt(60, 9)
    crowd = [Collector() for _ in range(2)]
    for i, collector in enumerate(crowd):
        engine.submit(GenerationRequest(prompt(61 + i, 4 + 7 * i), max_tokens=5,
                                        sampling=Sampling(temperature=0.7), seed=i), collector)
    sampled = Collector()
    engine.submit(GenerationRequest(source, max_tokens=8, sampling=sampling, seed=7, n=2),
                  sampled)
    engine.run_until_idle()
    made = decode.generate(net, params, [list(source)], max_new_tokens=8, sampling=sampling,
                           num_samples=2, rng=jax.random.wrap_key_data(seed_key(7)[None]))
    assert made.token_lists() == [sampled.tokens(0), sampled.tokens(1)]


def test_what_an_encoder_decoder_is_not_served_with_is_refused(engine, translator):
    config, _, params = translator
    with pytest.raises(ValueError, match=r"served with no prefix cache \(its prompts are "
                                         r"sources\); prefix_cache_rows=2 given"):
        Engine(config, params, max_slots=SLOTS, max_len=CAPACITY, prefix_cache_rows=2)
    with pytest.raises(ValueError, match=r"the source has 17 tokens, more than a slot holds "
                                         r"\(16\)"):
        engine.submit(GenerationRequest(prompt(0, 17), max_tokens=1), Collector())
    # The longest source a slot holds: its target is BOS and the new tokens.
    with pytest.raises(ValueError, match=r"max_tokens is 24 after the target's start \(1 "
                                         r"filled\): 25 target slots do not fit"):
        engine.submit(GenerationRequest(prompt(0, 16), max_tokens=24), Collector())
    lm = M.preset("tiny")
    with pytest.raises(ValueError, match="max_source_len=8 sizes an encoder-decoder's sources"):
        Engine(lm, M.init_params(lm, jax.random.key(0)), max_source_len=8)
    with pytest.raises(ValueError, match="its tokens have no logprobs"):
        prompt_logprobs(config, params, prompt(0, 5), top=1)


def test_a_translators_pages_are_counted_beside_each_slots_and_rows_source(translator):
    """`--cache-memory`'s pages for a translator are what its slots' pool allocates beside
    their sources' K/V (`max_source_len` positions a slot); the memory check counts the
    staged rows' and slots' sources and names the pages that fit beside them."""
    config, _, params = translator
    page, budget = 4, 20_000
    num_pages = memory.pages_in(config, budget, page, SLOTS, CAPACITY, SOURCES)
    engine = Engine(config, params, max_slots=SLOTS, max_len=CAPACITY, max_source_len=SOURCES,
                    page_size=page, num_pages=num_pages)
    page_bytes = M.paged_cache_bytes(config, CAPACITY)[0] * page
    sources = SLOTS * SOURCES * memory.source_bytes_per_position(config)
    assert engine.state.slots.cache.nbytes == num_pages * page_bytes + sources
    assert engine.state.slots.cache.nbytes <= budget < engine.state.slots.cache.nbytes + page_bytes
    per_position = memory.bytes_per_position(config) - memory.source_bytes_per_position(config)
    staged = SLOTS * (per_position * CAPACITY + SOURCES * memory.source_bytes_per_position(config))
    context = SLOTS * memory.CONTEXT_BYTES * CAPACITY
    free = int((staged + context + sources + num_pages * page_bytes) / memory.CACHE_SHARE) + 1
    fits = dict(free=free, source_capacity=SOURCES)
    memory.check_paged_cache_fits(config, SLOTS, CAPACITY, SLOTS, num_pages, page, **fits)
    with pytest.raises(ValueError, match=f"lower num_pages \\({num_pages} at most\\)"):
        memory.check_paged_cache_fits(config, SLOTS, CAPACITY, SLOTS, num_pages + 1, page,
                                      **fits)


def test_after_warming_up_translating_compiles_nothing_new(engine):
    engine.warm_up(prompt_lengths=range(1, 9))  # every row count, one source bucket
    before = {name: trace_count(name)
              for name in ("serve_insert", "serve_first_tokens", "serve_chunk", "prefill")}
    collectors = [Collector() for _ in range(SLOTS + 2)]
    for i, collector in enumerate(collectors):
        engine.submit(GenerationRequest(prompt(70 + i, 3 + i), max_tokens=2 + i,
                                        sampling=Sampling(temperature=0.5 * (i % 2)), seed=i),
                      collector)
    engine.run_until_idle()
    assert [len(c.tokens()) for c in collectors] == [2 + i for i in range(len(collectors))]
    assert {name: trace_count(name) for name in before} == before
