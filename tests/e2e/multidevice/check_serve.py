"""The serving engine on a mesh: slots split over `data`, heads over `model`; every request
gets the tokens the one-device engine gives it."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from kvjax import model as M
from kvjax import parallel
from kvjax.decode import Sampling
from kvjax.serve import Engine, GenerationRequest, memory
from kvjax.serve.metrics import ServeMetrics

SLOTS, CHUNK = 4, 4
CONFIG = M.preset("tiny", positional_encoding="rope", num_kv_heads=2)
SHIPPED_LM = Path(__file__).resolve().parents[3] / "checkpoints" / "python-docs-lm"


def prompt(seed, length):
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, 64, length))


# Greedy requests of mixed lengths (one stopping at an id), two seeded samples, n=2: more
# than the slots, so some wait for others to leave.
REQUESTS = [GenerationRequest(prompt(i, 2 + i % 5), max_tokens=3 + 2 * i) for i in range(5)]
REQUESTS[1] = GenerationRequest(REQUESTS[1].prompt, max_tokens=9, stop_ids=(7, 9, 11))
REQUESTS += [GenerationRequest(prompt(9, 4), max_tokens=6,
                               sampling=Sampling(temperature=0.9, top_k=10), seed=3, n=2)]


# Prompts that share a preamble of a kept block, after the first has kept it.
PREAMBLE = prompt(10, 20)
SHARING = [GenerationRequest(PREAMBLE + (5 + i,) * (1 + i), max_tokens=6 + i)
           for i in range(4)]


def serve(engine, requests=REQUESTS):
    """Every request's tokens, by sample, submitted in two waves."""
    deltas = [[] for _ in requests]
    for i, request in enumerate(requests):
        engine.submit(request, deltas[i].append)
        if i in (0, 2):
            engine.run_until_idle() if requests is SHARING else engine.step()
    engine.run_until_idle()
    assert engine.live_slots == 0
    return [[[t for d in ds if d.index == k for t in d.token_ids] for k in range(r.n)]
            for r, ds in zip(requests, deltas, strict=True)]


def test_a_mesh_engine_gives_every_request_the_one_device_tokens():
    params = M.init_params(CONFIG, jax.random.key(1))
    want = serve(Engine(CONFIG, params, max_slots=SLOTS, chunk_size=CHUNK, prefill_batch=1))
    mesh = parallel.make_mesh("data=2,model=2", jax.devices()[:4])
    engine = Engine(CONFIG, params, max_slots=SLOTS, chunk_size=CHUNK, prefill_batch=1,
                    mesh=mesh)
    assert serve(engine) == want
    assert sum(len(t) for ts in want for t in ts) > 30
    # The slots and staged rows stayed split: each data shard holds its own half of them.
    for rows in (engine.state.slots, engine.state.staged):
        stack = rows.cache.k[0]
        assert stack.sharding.spec == PartitionSpec(None, parallel.DATA, parallel.MODEL)
        assert rows.running.sharding.spec == PartitionSpec(parallel.DATA)
    # The memory check counts what one device holds: its rows' K/V of its kv heads, and
    # their context.
    first = mesh.devices.flat[0]
    held = sum(shard.data.nbytes for rows in (engine.state.slots, engine.state.staged)
               for leaf in (*rows.cache.k, *rows.cache.v, rows.context)
               for shard in leaf.addressable_shards if shard.device == first)
    per_row = memory.bytes_per_position(CONFIG, mesh) * engine.capacity
    assert held == per_row * 2 * SLOTS // 2
    memory.check_cache_fits(CONFIG, 2 * SLOTS, engine.capacity, mesh,
                            free=int(held / memory.CACHE_SHARE) + 1)
    with pytest.raises(ValueError, match="on each device"):
        memory.check_cache_fits(CONFIG, 2 * SLOTS, engine.capacity, mesh,
                                free=int(held / memory.CACHE_SHARE) - 1)


@pytest.mark.parametrize("config", [
    CONFIG, CONFIG.replace(sliding_window=3, full_attention_layers=(1,), scan_layers=False)],
    ids=["every-layer-paged", "windowed-layer-in-rings"])
def test_a_paged_engine_on_a_mesh_gives_every_request_the_one_device_tokens(config):
    """Pages split by kv heads over `model`, whole on each `data` shard, in a pool tight
    enough that samples are preempted: the one-device engine's tokens all the same. A
    windowed layer's rings (beside the global layer's pool) go with their slots' rows."""
    params = M.init_params(config, jax.random.key(1))
    one = Engine(config, params, max_slots=SLOTS, chunk_size=CHUNK, prefill_batch=1)
    want = [serve(one), serve(one, SHARING)]
    mesh = parallel.make_mesh("data=2,model=2", jax.devices()[:4])
    metrics = ServeMetrics()
    engine = Engine(config, params, max_slots=SLOTS, chunk_size=CHUNK, prefill_batch=1,
                    mesh=mesh, max_len=40, page_size=2, num_pages=20, metrics=metrics)
    assert [serve(engine), serve(engine, SHARING)] == want
    exposition = metrics.exposition().decode()
    assert "kvjax_preemptions_total 0.0" not in exposition
    assert "kvjax_prefix_cache_hits_total 3.0" in exposition  # read in place, on a mesh
    cache = engine.state.slots.cache
    rings = cache.rings or (False,) * len(cache.k)
    assert rings == ((False, False) if config is CONFIG else (True, False))
    for stack, ring in zip(cache.k, rings, strict=True):
        assert stack.sharding.spec == PartitionSpec(None, parallel.DATA if ring else None,
                                                    parallel.MODEL)
    assert cache.pages.sharding.spec == PartitionSpec(parallel.DATA)
    # The memory check counts one device's share: the whole pool of its kv heads, and its
    # data shard's staged and prefix rows and slots' context.
    first = mesh.devices.flat[0]
    held = sum(shard.data.nbytes
               for leaf in (*cache.k, *cache.v, *engine.state.staged.cache.k,
                            *engine.state.staged.cache.v, engine.state.staged.context,
                            engine.state.slots.context, *engine._prefixes.store.k,  # noqa: SLF001
                            *engine._prefixes.store.v)  # noqa: SLF001
               for shard in leaf.addressable_shards if shard.device == first)
    fits = dict(config=config, rows=SLOTS,  # staged rows
                capacity=engine.capacity, slots=SLOTS, num_pages=20, page_size=2, mesh=mesh,
                prefix_rows=engine.prefix_cache_rows)
    # Within less than one position's K/V.
    slack = memory.bytes_per_position(config, mesh) - memory.CONTEXT_BYTES
    memory.check_paged_cache_fits(**fits, free=int((held + slack) / memory.CACHE_SHARE))
    with pytest.raises(ValueError, match="lower"):
        memory.check_paged_cache_fits(**fits, free=int((held - slack) / memory.CACHE_SHARE))


def test_a_translator_on_a_mesh_gives_every_source_the_one_device_tokens():
    """An encoder-decoder's slots hold their sources' cross-attention K/V beside their
    targets' pages, split over the mesh as a contiguous cache's rows are; the one-device
    engine's contiguous slots give the same tokens, and the memory check counts one
    device's share of the pool, the sources and the staged rows. Constrained requests (a
    target language forced first, a choice) follow their automata there too: each device
    holds the tables whole."""
    from kvjax import decode, text

    tokenizer = text.load(SHIPPED_LM).tokenizer  # a real vocabulary, for the automata
    config = M.preset("tiny", num_encoder_layers=1, num_kv_heads=2,
                      vocab_size=tokenizer.vocab_size)
    params = M.init_params(config, jax.random.key(2))
    constraints = [decode.compile_constraint(c, tokenizer) for c in (
        decode.StartsWith((7, 9)), decode.Choice(["yes", "no", "maybe not"]))] + [None]
    requests = [dataclasses.replace(r, constraint=constraints[i % 3],
                                    stop_ids=(tokenizer.eos_id,))
                for i, r in enumerate(REQUESTS)]
    sizes = dict(max_slots=SLOTS, chunk_size=CHUNK, prefill_batch=1, max_len=24,
                 max_source_len=8)
    want = serve(Engine(config, params, **sizes), requests)
    mesh = parallel.make_mesh("data=2,model=2", jax.devices()[:4])
    engine = Engine(config, params, mesh=mesh, page_size=4, num_pages=10, **sizes)
    assert serve(engine, requests) == want
    assert sum(len(t) for ts in want for t in ts) > 30
    assert want[0][0][:2] == [7, 9]
    rows = (engine.state.slots, engine.state.staged)
    for cache in (r.cache for r in rows):
        assert cache.cross_k[0].sharding.spec == PartitionSpec(None, parallel.DATA,
                                                               parallel.MODEL)
    assert engine.state.slots.cache.k[0].sharding.spec == PartitionSpec(None, None,
                                                                        parallel.MODEL)
    first = mesh.devices.flat[0]
    held = sum(shard.data.nbytes for r in rows
               for leaf in (*r.cache.k, *r.cache.v, *r.cache.cross_k, *r.cache.cross_v,
                            r.context)
               for shard in leaf.addressable_shards if shard.device == first)
    fits = dict(config=config, rows=SLOTS, capacity=24, slots=SLOTS, num_pages=10,
                page_size=4, mesh=mesh, source_capacity=8)
    memory.check_paged_cache_fits(**fits, free=int(held / memory.CACHE_SHARE) + 1)
    with pytest.raises(ValueError, match="lower"):
        memory.check_paged_cache_fits(**fits, free=int(held / memory.CACHE_SHARE) - 1)


def test_slots_and_staged_rows_must_divide_over_data():
    mesh = parallel.make_mesh("data=4,model=2")
    with pytest.raises(ValueError, match="max_slots=6 must be a multiple of the mesh's data=4"):
        Engine(CONFIG, M.init_params(CONFIG, jax.random.key(1)), max_slots=6, mesh=mesh)
    with pytest.raises(ValueError, match="max_staged=2 must be a multiple of the mesh's data=4"):
        Engine(CONFIG, M.init_params(CONFIG, jax.random.key(1)), max_slots=8, max_staged=2,
               mesh=mesh)


def test_default_staged_rows_lowered_to_fit_stay_a_multiple_of_data(monkeypatch):
    """16 slots over data=4 (4 a device) and room on each device for 3 more rows: 8 staged
    rows (2 a device) and 4 kept prefixes (1 a device), each a multiple of data."""
    mesh = parallel.make_mesh("data=4,model=2")
    row = memory.bytes_per_position(CONFIG, mesh) * 64
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(
        (4 + 3.5) * row / memory.CACHE_SHARE))
    engine = Engine(CONFIG, M.init_params(CONFIG, jax.random.key(1)), max_slots=16,
                    max_len=64, mesh=mesh)
    assert (engine.num_staged, engine.prefix_cache_rows) == (8, 4)
