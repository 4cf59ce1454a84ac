"""Staging: an engine's waiting requests prefilled and written into its staged rows, each
sample with its first token, ready for a slot (`Engine`'s turn, step 1)."""

from __future__ import annotations

import numpy as np

from kvjax.decode.buckets import padded_to_bucket, power_of_two
from kvjax.decode.prompt_state import prefill_state

from . import pages, slots
from .output import Continuation, Dispatched, Ticket
from .prefix_cache import origin_of
from .requests import row_settings


def stage(engine, tickets: list[Ticket]) -> None:
    """Prefills the tickets' prompts and writes each into a staged row per sample: those
    with a kept prefix (`prefix_cache`) only the rest, in a call of their own. Of prompts
    sharing a first block no row keeps, the first is prefilled and kept first."""
    in_use = [s.ticket.request.constraint for s in engine.outputs.samples.values()]
    engine.state, initial = engine._tables.place_all(tickets, in_use, engine.state)
    prompts = [t.request.prompt for t in tickets]
    origins = [origin_of(t.request) for t in tickets]
    first = [] if engine._prefixes is None else engine._prefixes.leaders(prompts, origins)
    for part in (first, [i for i in range(len(tickets)) if i not in first]):
        hits = engine._prefixes.lookup([prompts[i] for i in part],
                                       [origins[i] for i in part]) if engine._prefixes \
            else [(-1, 0)] * len(part)
        for reused in (True, False):  # hits read their rows before misses are kept
            group = [i for i, (_, n) in zip(part, hits, strict=True) if (n > 0) == reused]
            if group:
                _stage_group(engine, [tickets[i] for i in group],
                             [hits[part.index(i)] for i in group],
                             [initial[i] for i in group])


def _stage_group(engine, tickets: list[Ticket], hits: list[tuple[int, int]],
                 initial: list[int]) -> None:
    """One prefill of the tickets' prompts (rows and length bucketed; spare rows repeat
    the first), all plain or all after a kept prefix, then their samples' inserts."""
    prompts = [ticket.request.prompt for ticket in tickets]
    rows = min(power_of_two(len(prompts)), engine.prefill_batch)
    spare = rows - len(prompts)
    filled = prompts + [prompts[0]] * spare
    padded = padded_to_bucket(filled, engine.prompt_capacity)
    lengths = np.array([len(p) for p in filled], np.int32)
    adapters = [t.request.adapter for t in tickets]
    adapter_B = None if engine.adapters is None else np.array(
        adapters + adapters[:1] * spare, np.int32)
    if hits[0][1] == 0:
        # The prompts' cache holds only them: the insert writes it into the staged rows.
        prefilled = engine._dispatch_prefill(prefill_state, engine.config, engine.params,
                                             padded, lengths, padded.shape[1],
                                             engine.adapters, adapter_B)
    else:
        rests = [p[n:] for p, (_, n) in zip(prompts, hits, strict=True)]
        prefilled = engine._prefixes.prefill(
            engine.params, padded, lengths, hits + [hits[0]] * spare,
            padded_to_bucket(rests + [rests[0]] * spare, engine.capacity), engine.adapters,
            adapter_B)
        engine._prefixes.count_hits(hits, engine.metrics)
    entries = [(row, ticket, index) for row, ticket in enumerate(tickets)
               for index in ticket.indices()]
    shared = [(-1, 0)] * len(entries) if engine.pages is None or not hits[0][1] else \
        engine._prefixes.borrow([hits[r] for r, _, _ in entries], engine.pages[1])
    held = {}  # prompt: the staged row of its first sample, which the store copies
    for start in range(0, len(entries), rows):  # `rows` samples per insert
        group = entries[start:start + rows]
        staged = [engine._free_staged.pop(0) for _ in group]
        ids = []
        own = shared[start:start + rows] + [(-1, 0)] * (rows - len(group))
        for (r, ticket, index), (prefix_row, _) in zip(group, own, strict=False):
            if ticket.origin.cached_tokens is None:  # its first staging
                ticket.origin.cached_tokens = max(0, hits[r][1] - ticket.origin.fed_in_parts)
                if engine.metrics is not None:
                    engine.metrics.count_prompt_tokens(len(ticket.request.prompt))
            if isinstance(ticket, Continuation):
                engine.outputs.resume(ticket.sample, engine._next_id, prefix_row)
            else:
                engine.outputs.add(ticket, index, engine._next_id, prefix_row)
            ids.append(engine._next_id)
            engine._next_id = (engine._next_id + 1) % slots.ID_SPACE
        spare = rows - len(group)  # padding: row `num_staged` stages nothing
        samples = group + group[:1] * spare
        settings = row_settings([(t.request, i) for _, t, i in samples],
                                [initial[r] for r, _, _ in samples],
                                [t.generated for _, t, _ in samples], own)
        engine.state, first = slots.insert(
            engine.state, *prefilled,
            np.array([r for r, _, _ in group] + [0] * spare, np.int32),
            np.array(staged + [engine.num_staged] * spare, np.int32),
            np.array(ids + [0] * spare, np.int32), settings, mesh=engine.mesh)
        engine._dispatched.append(Dispatched(first, staged, is_chunk=False))
        engine._waiting += len(group)
        for (r, _, _), row in zip(group, staged, strict=True):
            held.setdefault(r, row)
    if engine._prefixes is not None:
        engine._prefixes.keep(prompts, engine.state.staged.cache,
                              [held[r] for r in range(len(prompts))], engine.prefill_batch,
                              [origin_of(t.request) for t in tickets])
        engine.state = pages.share_kept(engine.state, engine._prefixes)
