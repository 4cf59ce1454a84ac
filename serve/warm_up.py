"""Compiling every program an engine can need before it serves, so that no request waits for
a compilation (`Engine.warm_up`, `kvjax serve --warm-up`).

The programs: at every row count of a prefill (powers of two up to `prefill_batch`), the
prefill of every bucket of the prompt lengths and its insert into staged rows; with a
prefix cache, the same after a kept prefix for every bucket of a rest up to the longest
prompt, the copies into the cache's rows (one per bucket of the kept length, and with pages
into the rows' pages), and the first part of a long prompt; then the decode chunk. Each runs
once on zeros and stages nothing (row `num_staged` is past the staged rows): the engine is
reset after.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvjax.decode.buckets import bucket
from kvjax.decode.prompt_state import prefill_state

from . import chunk, pages, slots
from .prefix_cache import prefill_after_nothing
from .requests import GenerationRequest, row_settings


def compile_programs(engine, prompt_lengths: Iterable[int] | None = None) -> None:
    """Runs each program `engine` can need once; `prompt_lengths` default to every length
    a slot holds. Leaves the engine's state to be reset."""
    capacity, prefixes = engine.prompt_capacity, engine._prefixes
    lengths = list(range(1, capacity) if prompt_lengths is None else prompt_lengths)
    buckets = sorted({bucket(n, capacity) for n in lengths})
    rests = sorted({bucket(n, capacity) for n in range(1, max(lengths, default=0) + 1)})
    rows = sorted({min(1 << k, engine.prefill_batch)
                   for k in range(engine.prefill_batch.bit_length() + 1)})
    adapters = engine.adapters

    def base_rows(count):  # each row's adapter index, where the engine serves adapters
        return None if adapters is None else np.zeros(count, np.int32)

    def insert(prefilled, count):
        staged = (np.zeros(count, np.int32), np.full(count, engine.num_staged, np.int32),
                  np.zeros(count, np.int32),
                  row_settings([(GenerationRequest((0,), seed=0), 0)] * count))
        engine.state, _ = slots.insert(engine.state, *prefilled, *staged, mesh=engine.mesh)

    for count in rows:
        for length in buckets:
            insert(prefill_state(engine.config, engine.params, np.zeros((count, length),
                                                                        np.int32),
                                 np.ones(count, np.int32), length, adapters, base_rows(count)),
                   count)
        for length in rests if prefixes is not None else ():
            if length < capacity:  # a longer rest leaves no room for a prefix
                insert(prefixes.prefill(engine.params, np.zeros((count, 1), np.int32),
                                        np.ones(count, np.int32), [(0, 0)] * count,
                                        np.zeros((count, length), np.int32), adapters,
                                        base_rows(count)), count)
    longest = max(lengths, default=0)
    if prefixes is not None:  # the copies from staged rows, and from a long prompt's parts
        prefixes.warm_up(engine.state.staged.cache, engine.prefill_batch, longest)
    if prefixes is not None and longest > engine.prefill_part:
        part = np.zeros((1, engine.prefill_part), np.int32)
        prefixes.warm_up(prefill_after_nothing(engine.config, engine.params, part,
                                               bucket(engine.prefill_part, capacity),
                                               adapters, base_rows(1))[0],
                         longest=longest)
        prefixes.warm_up(prefixes.prefill(engine.params, part[:, :1], np.ones(1, np.int32),
                                          [(0, 0)], part, adapters, base_rows(1))[0],
                         longest=longest)
    if prefixes is not None and engine.pages is not None:  # kept prefixes into pages
        engine.state = pages.mirror_prefixes(engine.state, prefixes.store,
                                             np.zeros(prefixes.index.rows, np.int32))
    stop_ids = engine.outputs.take_stop_ids(engine.max_slots + engine.num_staged)
    engine.state, _ = chunk.decode_chunk(engine.config, engine.params, engine.state, stop_ids,
                                         np.bool_(False), np.bool_(False), engine.chunk_size,
                                         mesh=engine.mesh, steps_per_check=engine.steps_per_check,
                                         adapters=adapters)
