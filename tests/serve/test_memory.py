"""The engine refuses a cache larger than its device's free memory before allocating it,
naming the sizes and the longest max_len that fits."""

import re
import sys

import jax
import pytest

from kvjax import model as M
from kvjax.model.cache_size import format_bytes
from kvjax.serve import Engine, memory


def test_bytes_per_position_is_what_the_engine_allocates(tiny_lm):
    config, _, params = tiny_lm
    engine = Engine(config, params, max_slots=2, max_staged=1, max_len=32, prefix_cache_rows=2)
    rows = engine.state.slots, engine.state.staged
    allocated = sum(leaf.nbytes for r in rows for leaf in jax.tree.leaves((r.cache.k, r.cache.v)))
    allocated += sum(r.context.nbytes for r in rows)
    assert allocated == memory.bytes_per_position(config) * 3 * 32
    # The prefix cache's rows hold K/V and no context: the check counts them as rows.
    store = engine._prefixes.store
    assert store.nbytes == (memory.bytes_per_position(config) - memory.CONTEXT_BYTES) * 2 * 32


def test_a_translators_rows_are_counted_with_their_own_source_length():
    """An encoder-decoder's slots hold `max_source_len` source positions beside `max_len`
    target positions: the check counts what the engine allocates, and its advice keeps the
    sources' length."""
    config = M.preset("tiny", num_encoder_layers=2)
    params = M.init_params(config, jax.random.key(0))
    engine = Engine(config, params, max_slots=2, max_staged=1, max_len=32, max_source_len=12)
    rows = engine.state.slots, engine.state.staged
    allocated = sum(leaf.nbytes for r in rows for leaf in jax.tree.leaves(
        (r.cache.k, r.cache.v, r.cache.cross_k, r.cache.cross_v, r.context)))
    target = memory.bytes_per_position(config) - memory.source_bytes_per_position(config)
    sources = memory.source_bytes_per_position(config)

    def need(max_len):
        return 3 * (target * max_len + sources * 12)

    assert sources > 0 and allocated == need(32)
    free = int(need(128) / memory.CACHE_SHARE) + 1
    memory.check_cache_fits(config, 3, 128, free=free, source_capacity=12)
    with pytest.raises(ValueError, match=r"3 rows x max_len=200 positions and "
                                         r"max_source_len=12 source positions takes .*: "
                                         r"lower max_len \(128 at most for 3 rows\)"):
        memory.check_cache_fits(config, 3, 200, free=free, source_capacity=12)
    # Sources sized apart are not counted at max_len: the same memory is too little for them.
    with pytest.raises(ValueError, match="lower max_len"):
        memory.check_cache_fits(config, 3, 128, free=free)


def test_a_cache_that_does_not_fit_is_refused_with_the_longest_that_does():
    config = M.preset("gpt-mini")
    per_row = memory.bytes_per_position(config)  # 2 x 6 layers x 6 heads x 64 x 4 + 4
    assert per_row == 2 * 6 * 6 * 64 * 4 + 4
    free = int(32 * per_row * 1000 / memory.CACHE_SHARE) + 1  # 32 rows of 1,000 positions
    memory.check_cache_fits(config, 32, 1000, free=free)
    with pytest.raises(ValueError, match=r"32 rows x max_len=1024 positions takes 576.1 MiB "
                                         r"on .*, more than 90% of its 625.1 MiB free: lower "
                                         r"max_len \(960 at most for 32 rows\) or max_slots "
                                         r"\+ max_staged \(31 at most for max_len=1024\)"):
        memory.check_cache_fits(config, 32, 1024, free=free)
    memory.check_cache_fits(config, 32, 960, free=free)  # what it suggests fits
    memory.check_cache_fits(config, 31, 1024, free=free)
    with pytest.raises(ValueError, match=r"none is small enough for 100000 rows\) or max_slots "
                                         r"\+ max_staged \(31 at most"):
        memory.check_cache_fits(config, 100_000, 1024, free=free)


def test_the_engine_checks_before_allocating(tiny_lm, monkeypatch):
    config, _, params = tiny_lm
    monkeypatch.setattr(memory, "free_bytes", lambda device: 10_000)
    with pytest.raises(ValueError, match="lower max_len"):
        Engine(config, params, max_slots=2, max_len=64)
    monkeypatch.setattr(memory, "free_bytes", lambda device: None)  # unknown: no check
    Engine(config, params, max_slots=2, max_len=64)


@pytest.mark.skipif(sys.platform != "linux", reason="MemAvailable is Linux's")
def test_a_cpu_reports_the_hosts_available_memory():
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo
                     if line.startswith("MemTotal:"))
    assert 0 < memory.free_bytes(jax.devices("cpu")[0]) <= total


def test_a_windowed_model_is_told_a_slot_needs_only_its_window():
    """Where every layer reads only its last 64 positions, contiguous slots are counted
    with rings of 64 (16 slots beside 16 rows of every position fit where 32 such rows do
    not), and the paged check asks a slot for its window's 5 pages of 16, not a full
    slot's 64; a model that reads everything is told neither."""
    windowed, plain = M.preset("gpt-mini", sliding_window=64), M.preset("gpt-mini")
    per_row = memory.bytes_per_position(windowed)
    free = int(32 * per_row * 1000 / memory.CACHE_SHARE) + 1
    ring_row = (M.generate_cache_bytes(windowed, 1, 1024)
                + memory.CONTEXT_BYTES * 1024)  # the K/V of 64 positions and 1,024 tokens
    assert ring_row < per_row * 1024 / 10
    memory.check_cache_fits(windowed, 32, 1024, free=free, ring_rows=16)
    for config, rings in ((windowed, 0), (plain, 16)):
        with pytest.raises(ValueError, match=r"\(31 at most for max_len=1024\)$"):
            memory.check_cache_fits(config, 32, 1024, free=free, ring_rows=rings)
    need = 16 * per_row * 1024 + 16 * ring_row  # what it counts, just more than fits
    with pytest.raises(ValueError, match=f"takes {re.escape(format_bytes(int(need)))} on"):
        memory.check_cache_fits(windowed, 32, 1024, ring_rows=16,
                                free=int(need / memory.CACHE_SHARE) - 1)
    fixed = per_row * 1024 + memory.CONTEXT_BYTES * 4 * 1024  # a staged row, 4 slots' context
    kv = per_row - memory.CONTEXT_BYTES
    free = int((fixed + kv * 16 * 10.5) / memory.CACHE_SHARE)  # 10 pages of 16 fit
    with pytest.raises(ValueError, match=r"lower num_pages \(10 at most\)"):
        memory.check_paged_cache_fits(windowed, 1, 1024, 4, 100, 16, free=free)
    with pytest.raises(ValueError, match=r"a slot's 64 pages do not fit"):
        memory.check_paged_cache_fits(plain, 1, 1024, 4, 100, 16, free=free)


def test_the_paged_check_counts_a_hybrid_models_global_layer_in_pages_and_rings_per_slot():
    """Gemma's kind of model (windowed layers beside a global one): a page holds the global
    layer alone, and each slot keeps rings of 64 positions for the other five."""
    hybrid = M.preset("gpt-mini", sliding_window=64, full_attention_layers=(5,),
                      scan_layers=False)
    layer = M.cache_size_bytes(hybrid, 1, 1).total // 6  # a position of one layer
    fixed = (memory.bytes_per_position(hybrid) * 1024  # a staged row of every position
             + 4 * (memory.CONTEXT_BYTES * 1024 + 5 * 64 * layer))  # 4 slots' context, rings
    free = int((fixed + layer * 16 * 100.5) / memory.CACHE_SHARE)
    memory.check_paged_cache_fits(hybrid, 1, 1024, 4, 100, 16, free=free)
    with pytest.raises(ValueError, match=r"lower num_pages \(100 at most\)"):
        memory.check_paged_cache_fits(hybrid, 1, 1024, 4, 101, 16, free=free)
    assert memory.pages_in(hybrid, 4 * 5 * 64 * layer + 100 * 16 * layer, 16, 4, 1024) == 100



def fits(config, slots, staged, prefix, capacity, pages, free):
    try:
        memory.check_engine_fits(config, slots, staged, prefix, capacity, pages=pages,
                                 free=free)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("pages", [None, (400, 16)], ids=["contiguous", "paged"])
def test_staged_rows_default_to_the_most_that_fit_beside_the_slots(pages):
    """Gemma's kind of model (windowed layers beside a global one) with 16 slots of 1,024
    positions: a staged row holds every position, a slot rings for its windowed layers. Where
    16 staged rows (and their 4 kept prefixes) would not fit, the default is the most that
    do, with a quarter of them kept prefixes; given ones are kept as they are."""
    hybrid = M.preset("gpt-mini", sliding_window=64, full_attention_layers=(5,),
                      scan_layers=False)
    row = memory.bytes_per_position(hybrid) * 1024  # a staged or kept row
    slot = M.generate_cache_bytes(hybrid, 1, 1024) + memory.CONTEXT_BYTES * 1024
    free = int((16 * slot + 12.5 * row) / memory.CACHE_SHARE)  # 10 staged + 2 kept fit
    if pages is None:
        assert memory.staged_and_prefix_rows(hybrid, 16, None, None, 1024, free=free) == (10, 2)
    staged, prefix = memory.staged_and_prefix_rows(hybrid, 16, None, None, 1024, pages=pages,
                                                   free=free)
    assert prefix == max(1, staged // 4) and 1 < staged < 16
    assert fits(hybrid, 16, staged, prefix, 1024, pages, free)
    assert not fits(hybrid, 16, staged + 1, max(1, (staged + 1) // 4), 1024, pages, free)
    assert memory.staged_and_prefix_rows(hybrid, 16, None, None, 1024, pages=pages,
                                         free=100 * free) == (16, 4)
    assert memory.staged_and_prefix_rows(hybrid, 16, 16, 0, 1024, pages=pages,
                                         free=free) == (16, 0)


def test_an_engine_lowers_its_default_staged_rows_to_fit_and_says_so(tiny_lm, monkeypatch,
                                                                       caplog):
    config, _, params = tiny_lm
    row = memory.bytes_per_position(config) * 64
    free = int(22.5 * row / memory.CACHE_SHARE)  # 16 slots, 5 staged rows, 1 kept prefix
    monkeypatch.setattr(memory, "free_bytes", lambda device: free)
    engine = Engine(config, params, max_slots=16, max_len=64)
    assert (engine.num_staged, engine.prefix_cache_rows) == (5, 1)
    assert "max_staged=5: 16 staged rows of max_len=64 beside the 16 slots" in caplog.text
    with pytest.raises(ValueError, match=r"or max_slots \+ max_staged \+ prefix_cache_rows"):
        Engine(config, params, max_slots=16, max_staged=16, max_len=64)
