"""The slots' paged cache: samples take pages as they grow, wait while none are free, are
preempted and go on later when the pool runs short, give them back as they end, and make
the tokens they make alone."""

import re

import numpy as np
import pytest
from test_engine import Collector, alone, prompt

from kvjax import model as M
from kvjax.decode import Sampling
from kvjax.serve import Engine, GenerationRequest, memory
from kvjax.serve.metrics import ServeMetrics

PAGE = 4


def all_pages_free(engine):
    state = engine.state
    return bool(np.all(state.free_pages)) and bool(np.all(state.slots.cache.pages < 0))


def preemptions(metrics) -> float:
    return float(re.search(r"^kvjax_preemptions_total (\S+)$",
                           metrics.exposition().decode(), re.M).group(1))


def test_preempted_samples_go_on_with_the_tokens_they_make_with_pages_to_spare(tiny_lm):
    """Four slots grow in a pool of one full slot's pages (slots of 30 take 8 pages of 4,
    the last one filled in part): the slots admitted last give theirs back and are queued
    again, prefilled from their prompt and the tokens they made. Greedy and seeded samples
    alike make what they make in a pool that never runs short (the same key positions,
    penalty context and budgets), every page is held or free at every turn, and all are
    free at the end."""
    config, _, params = tiny_lm
    warm = Sampling(temperature=1.0, top_k=20, repetition_penalty=1.3,
                    presence_penalty=0.4, frequency_penalty=0.6)
    requests = [GenerationRequest(prompt(60 + i, 3 + i), max_tokens=26 - 2 * i, seed=i, n=n,
                                  sampling=warm if i % 2 else Sampling())
                for i, n in enumerate((1, 2, 1, 1))]

    def serve(num_pages):
        metrics = ServeMetrics()
        engine = Engine(config, params, max_slots=4, max_len=30, chunk_size=4,
                        page_size=PAGE, num_pages=num_pages, prefill_batch=4, metrics=metrics)
        collectors = [Collector() for _ in requests]
        for request, collector in zip(requests, collectors, strict=True):
            engine.submit(request, collector)
        for _ in range(200):  # turns: a page never given back would leave requests waiting
            if not engine.step():
                break
            tables = np.asarray(engine.state.slots.cache.pages)
            held = np.sum((tables >= 0) & (tables < num_pages))  # no prefix row's pages
            assert held + np.sum(np.asarray(engine.state.free_pages)) == num_pages
            assert f"kvjax_cache_pages_used {held:.1f}" in metrics.exposition().decode()
        else:
            pytest.fail("the requests were not served in 200 turns")
        assert all_pages_free(engine) and engine.outputs.pages_used == 0
        return [[c.tokens(i) for i in range(r.n)] + [c.finish(i) for i in range(r.n)]
                for c, r in zip(collectors, requests, strict=True)], preemptions(metrics)

    tight, preempted = serve(8)
    roomy, none = serve(64)
    assert preempted > 0 and none == 0
    assert tight == roomy
    assert [tight[i][0] for i in (0, 2)] == [alone(tiny_lm, requests[i]) for i in (0, 2)]


def test_a_windowed_model_holds_only_the_pages_its_window_reads(tiny_lm):
    """Every layer attends over the last 5 positions: a slot holds only the pages its next
    token reads, at most 2 of 4 positions, taking none for a prompt's positions behind them
    and giving back those its window leaves. So three samples, one of a prompt longer than
    the window, run together in the default pool of 9 pages, less than one slot of 40
    takes, with no preemption; each makes the tokens `generate` makes alone, and every page
    is free at the end. A pool that cannot hold one window is refused."""
    config = tiny_lm[0].replace(sliding_window=5)
    assert config.attention_reach == 5  # not where a layer reads everything:
    assert tiny_lm[0].attention_reach is None
    assert config.replace(full_attention_layers=(1,)).attention_reach is None
    windowed = (config, M.build_model(config), tiny_lm[2])
    requests = [GenerationRequest(prompt(80 + i, n), max_tokens=m)
                for i, (n, m) in enumerate(((4, 30), (9, 24), (17, 20)))]
    metrics = ServeMetrics()
    settings = dict(max_slots=3, max_len=40, page_size=PAGE, prefill_batch=4)
    with pytest.raises(ValueError, match="num_pages=1 must be an int >= 2: a request may need "
                                         "2 pages of 4 positions for the 5 positions"):
        Engine(config, windowed[2], num_pages=1, **settings)
    engine = Engine(config, windowed[2], chunk_size=4, metrics=metrics, **settings)
    assert engine.pages == (9, PAGE)  # by default: each slot's window's pages and one more
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        engine.submit(request, collector)
    most_live = 0
    for _ in range(100):
        if not engine.step():
            break
        tables = np.asarray(engine.state.slots.cache.pages)
        assert np.max(np.sum(tables >= 0, axis=1)) <= 2
        assert np.sum(tables >= 0) + np.sum(np.asarray(engine.state.free_pages)) == 9
        most_live = max(most_live, engine.live_slots)
    else:
        pytest.fail("the requests were not served in 100 turns")
    assert preemptions(metrics) == 0 and all_pages_free(engine) and most_live == 3
    assert [c.tokens() for c in collectors] == [alone(windowed, r) for r in requests]


def test_a_sample_cancelled_while_preempted_ends_once_and_frees_everything(tiny_lm):
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=3, max_len=30, chunk_size=4, page_size=PAGE,
                    num_pages=8, prefill_batch=4)
    collectors = [Collector() for _ in range(3)]
    tickets = [engine.submit(GenerationRequest(prompt(70 + i, 4), max_tokens=24), c)
               for i, c in enumerate(collectors)]
    for _ in range(20):  # until a preempted sample waits to go on
        engine.step()
        waiting = [t for t in engine._pending if t.origin is not t]  # noqa: SLF001
        if waiting:
            break
    else:
        pytest.fail("no sample was preempted")
    cancelled = tickets.index(waiting[0].origin)
    waiting[0].origin.cancel()
    engine.run_until_idle()
    assert collectors[cancelled].finish() == "cancelled"
    assert [c.finish() for i, c in enumerate(collectors) if i != cancelled] == ["length"] * 2
    assert all_pages_free(engine) and engine.queue_length == 0


def test_the_samples_of_the_highest_priority_value_are_preempted_first(tiny_lm):
    """A sample admitted first but of priority 5 gives its pages to two of priority 0
    admitted after it (a pool of 8 pages holds one sample's 28 positions whole), then the
    one of those admitted last to the other; each goes on later, and makes what it makes
    alone."""
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=3, max_len=30, chunk_size=4, page_size=PAGE,
                    num_pages=8, prefill_batch=4)
    requests = [GenerationRequest(prompt(80 + i, 4), max_tokens=24, priority=p)
                for i, p in enumerate((5, 0, 0))]
    collectors = [Collector() for _ in requests]
    tickets = [engine.submit(requests[0], collectors[0])]
    engine.step()  # the first takes a slot before the others arrive
    tickets += [engine.submit(r, c) for r, c in zip(requests[1:], collectors[1:], strict=True)]
    preempted = []
    for _ in range(200):
        preempted += [tickets.index(t.origin) for t in engine._pending  # noqa: SLF001
                      if t.origin is not t and tickets.index(t.origin) not in preempted]
        if not engine.step():
            break
    assert preempted == [0, 2]
    assert [c.tokens() for c in collectors] == [alone(tiny_lm, r) for r in requests]
    assert all_pages_free(engine)


def test_cancelled_and_stopped_samples_give_their_pages_back(tiny_lm):
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=2, max_len=32, chunk_size=2, page_size=PAGE)
    long = Collector()
    ticket = engine.submit(GenerationRequest(prompt(50, 6), max_tokens=24), long)
    free_run = alone(tiny_lm, GenerationRequest(prompt(51, 5), max_tokens=12))
    stopped = Collector()
    engine.submit(GenerationRequest(prompt(51, 5), max_tokens=12, stop_ids=(free_run[1],)),
                  stopped)
    engine.step()
    engine.step()
    ticket.cancel()
    engine.run_until_idle()
    assert long.finish() == "cancelled" and stopped.finish() == "stop"
    assert all_pages_free(engine)


@pytest.mark.parametrize("settings, message", [
    (dict(page_size=0), "page_size=0 must be an int >= 1"),
    (dict(page_size=PAGE, num_pages=7), "num_pages=7 must be an int >= 8"),
    (dict(page_size=None, num_pages=8), "num_pages=8 needs a paged cache"),
    (dict(page_size=65), "the 1 pages a slot of max_len=32 takes hold 65 positions, more "
                         "than the model's max_len 64"),
])
def test_bad_page_settings_are_refused_naming_them(tiny_lm, settings, message):
    config, _, params = tiny_lm
    with pytest.raises(ValueError, match=message):
        Engine(config, params, max_slots=2, max_len=32, **settings)


def test_the_memory_check_counts_pages_and_names_how_many_fit():
    config = M.preset("gpt-mini")
    kv = M.cache_size_bytes(config, 1, 1).total  # per position
    rows = memory.bytes_per_position(config) * 4 * 1024  # 4 staged rows of 1,024
    context = memory.CONTEXT_BYTES * 64 * 1024  # 64 slots' context
    free = int((rows + context + kv * 1000 * 16) / memory.CACHE_SHARE) + 1
    memory.check_paged_cache_fits(config, 4, 1024, 64, 1000, 16, free=free)
    with pytest.raises(ValueError, match=r"1001 pages of 16 positions for 64 slots and 4 rows "
                                         r"x max_len=1024 .* lower num_pages \(1000 at most\)"):
        memory.check_paged_cache_fits(config, 4, 1024, 64, 1001, 16, free=free)


@pytest.mark.parametrize("hybrid", [False, True], ids=["every-layer-paged", "windowed-in-rings"])
def test_cache_memory_in_pages_is_what_the_pool_allocates(tiny_lm, hybrid):
    """--cache-memory's pages and, for a model whose layer 0 reads a window of 5 and layer 1
    everything, each slot's ring of 5 beside them: a page then holds layer 1 alone."""
    config, _, params = tiny_lm
    if hybrid:
        config = config.replace(sliding_window=5, full_attention_layers=(1,), scan_layers=False)
        params = M.with_layer_layout(tiny_lm[0], params, scan_layers=False)[1]
    budget = 100_000
    num_pages = memory.pages_in(config, budget, PAGE, 4, 32)
    engine = Engine(config, params, max_slots=4, max_len=32, page_size=PAGE,
                    num_pages=num_pages)
    layer = (memory.bytes_per_position(config) - memory.CONTEXT_BYTES) // 2  # of one layer
    per_page = layer * (1 if hybrid else 2)  # per position
    slot_bytes = num_pages * PAGE * per_page + (4 * 5 * layer if hybrid else 0)
    assert slot_bytes <= budget < slot_bytes + PAGE * per_page
    # After the slots' pages, the prefix cache's rows in pages of their own, to be shared.
    assert engine.state.slots.cache.nbytes == (slot_bytes
                                               + engine.prefix_cache_rows * 32 * per_page)
