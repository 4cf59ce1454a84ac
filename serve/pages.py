"""The slots' paged cache: one pool of pages that the slots take from as samples start and
give back as they end, so the slots hold memory for their samples' tokens rather than
`max_slots × max_len` positions.

A sample takes a slot only with every page it can fill: its prompt and the tokens its
`max_tokens` still allows (a request's budget fits `max_len`, `GenerationRequest.checked`),
so no sample ever runs out of pages mid-stream, and none waits on another to end once it
runs. While the oldest staged sample's pages are not free it waits for them, as it waits
for a free slot; samples behind it wait too, so a long request is never passed over
forever. Its prompt's K/V are copied from its staged row into its pages page by page. A
slot that stops (its sample ended, was cancelled or filled its pages) gives its pages back
before the next step. Pages are taken and given back on the device, inside the engine's
programs: the host never picks one, and learns only how many are held (`/metrics`).

State: `EngineState.free_pages` [pages] bool, which pages no slot holds, beside the slots'
paged cache (`model/paged.py`). Shape letters as in `slots.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import model as M
from kvjax.model.paged import copy_row_into_pages

from .slots import EngineState, SlotState


def choose_pages(page_size: int | None, num_pages: int | None, capacity: int,
                 max_slots: int, on_mesh: bool, model_max_len: int) -> tuple[int, int] | None:
    """(num_pages, page_size) of an engine's paged cache, or None for contiguous slots
    (`page_size` None). `num_pages` defaults to `max_slots` full slots' worth. Raises
    ValueError naming a setting that cannot be served."""
    if page_size is None:
        if num_pages is not None:
            raise ValueError(f"num_pages={num_pages} needs a paged cache, but page_size is "
                             f"None" + (" (on a mesh)" if on_mesh else ""))
        return None
    if on_mesh:
        raise ValueError(f"page_size={page_size!r}: a paged cache serves on one device, this "
                         f"engine on a mesh")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} must be an int >= 1")
    per_row = -(-capacity // page_size)
    if per_row * page_size > model_max_len:
        raise ValueError(f"page_size={page_size}: the {per_row} pages a slot of max_len="
                         f"{capacity} takes hold {per_row * page_size} positions, more than "
                         f"the model's max_len {model_max_len}")
    num_pages = per_row * max_slots if num_pages is None else num_pages
    if not isinstance(num_pages, int) or num_pages < per_row:
        raise ValueError(f"num_pages={num_pages!r} must be an int >= {per_row}: a request "
                         f"may need all {per_row} pages of {page_size} positions that "
                         f"max_len={capacity} takes")
    return num_pages, page_size


def pages_needed(state: EngineState, row) -> jax.Array:
    """Pages the sample in staged row `row` can fill: its cache's length and the tokens it
    may still feed (one fewer than it may still make: the last is never fed back)."""
    staged, cache = state.staged, state.slots.cache
    positions = staged.cache.lengths[row] + staged.max_tokens[row] - staged.generated[row]
    pages = (positions + cache.page_size - 1) // cache.page_size
    return jnp.minimum(pages, cache.pages.shape[1])


def pages_free_for(state: EngineState, row) -> jax.Array:
    """Whether the pool has the pages the sample in staged row `row` needs."""
    return jnp.sum(state.free_pages, dtype=jnp.int32) >= pages_needed(state, row)


def admit_into_pages(state: EngineState, row, slot) -> tuple[M.KVCache, jax.Array]:
    """The slots' cache with staged row `row`'s sample given its pages in slot `slot` and
    its prompt's K/V copied into them, and the pages left free. The pages must be free
    (`pages_free_for`), and the slot must hold none."""
    cache, free = state.slots.cache, state.free_pages  # free: [pages] bool
    count = pages_needed(state, row)
    rank = jnp.cumsum(free, dtype=jnp.int32) - 1  # each free page's rank among them
    taken = free & (rank < count)
    per_row = cache.pages.shape[1]
    table = jnp.full((per_row,), M.NO_PAGE, jnp.int32).at[  # the slot's [pages per row]
        jnp.where(taken, rank, per_row)].set(jnp.arange(free.shape[0], dtype=jnp.int32),
                                             mode="drop")
    cache = cache.replace(pages=cache.pages.at[slot].set(table))
    return copy_row_into_pages(cache, state.staged.cache, row, slot), free & ~taken


def release_stopped(state: EngineState) -> EngineState:
    """Every slot that is not running gives its pages back to the pool."""
    slots = state.slots
    tables = slots.cache.pages  # [B, pages per row]
    stopped = ~slots.running[:, None] & (tables >= 0)
    num_pages = state.free_pages.shape[0]
    free = state.free_pages.at[jnp.where(stopped, tables, num_pages)].set(True, mode="drop")
    cache = slots.cache.replace(pages=jnp.where(stopped, M.NO_PAGE, tables))
    return state.replace(slots=slots.replace(cache=cache), free_pages=free)


def held_positions(rows: SlotState) -> jax.Array:
    """[B] the positions each slot's pages hold."""
    return jnp.sum(rows.cache.pages >= 0, axis=1, dtype=jnp.int32) * rows.cache.page_size
