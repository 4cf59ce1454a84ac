"""The slots' paged cache: one pool of pages that the slots take from as their samples grow
and give back as they end, so the slots hold memory for their samples' tokens rather than
`max_slots × max_len` positions.

A staged sample takes a slot with the pages its prompt fills and one more position, if the
pool keeps one page free for every other running slot after it (so that slots admitted
together do not preempt each other at once). Its prompt's K/V are copied from its staged
row into its pages page by page. Before each step a slot about to write past its pages
takes one more page. When the pool has too few for every such slot, the slots of the
highest priority value (`GenerationRequest.priority`), of those the ones admitted last, are
preempted, as few as give the others their pages: each stops with `StopReason.PREEMPTED`
and gives its pages back, and the host queues it again, first in line among its priority,
to be prefilled anew from its prompt and the tokens it made and to go on from there
(`engine.py`). The slot first in that order never waits on another, so every sample ends. A
sample that reads a source (a translator's) takes the pages of its whole budget with its
slot instead, and is never preempted (`holds_sources`); its source's K/V lie in its slot,
beside the pool, as long as the engine's longest source (`max_source_len`). A slot
that stops (its sample ended, was cancelled, filled its pages or was preempted) gives its
pages back before the next step. Where every layer of the model reads only a sliding window
(`TransformerConfig.attention_reach`), a slot holds only the pages its next token reads: a
staged sample takes none for its prompt's positions behind them, and a running slot gives
back, before each step, those its window leaves (`release_behind`). Pages are taken
and given back on the device, inside the engine's programs: the host never picks one, and
learns only how many are held (`/metrics`).

After the slots' pages the pool holds the prefix cache's rows, a row's worth of pages each
(`share_kept` copies each prefix kept there): a sample whose prompt starts with a kept prefix
takes that row's whole pages at the head of its table (`SlotState.prefix_row`,
`prefix_pages`) and reads them in place, so a preamble shared by every running sample is
held once. Those pages are never free and never written by a slot (a row is written only
from its length on), and the host gives the row to no other prefix while a sample reads it
(`prefix_cache.PrefixIndex.borrowed`).

State: `EngineState.free_pages` [pages] bool, which of the slots' pages no slot holds,
beside the slots' paged cache (`model/paged.py`). Shape letters as in `slots.py`; K here is
B + 1 choices of how many slots to preempt.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax import model as M
from kvjax.decode.loop import StopReason
from kvjax.decode.tracing import count_trace
from kvjax.model.paged import copy_row_into_pages, most_pages_a_row_holds

from .slots import ID_SPACE, PRIORITY_BOUND, EngineState


def choose_pages(page_size: int | None, num_pages: int | None, capacity: int,
                 max_slots: int, model_max_len: int, reach: int | None = None
                 ) -> tuple[int, int] | None:
    """(num_pages, page_size) of an engine's paged cache, or None for contiguous slots
    (`page_size` None). `num_pages` must hold one request's pages: a full slot's, or with
    `reach` (the model's `attention_reach`) the most a window takes. It defaults to
    `max_slots` full slots' worth, or with `reach` to `max_slots` times a window's pages and
    one more, so that every slot can run at once without preempting another. Raises
    ValueError naming a setting that cannot be served."""
    if page_size is None:
        if num_pages is not None:
            raise ValueError(f"num_pages={num_pages} needs a paged cache, but page_size is "
                             f"None")
        return None
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} must be an int >= 1")
    per_row = -(-capacity // page_size)
    if per_row * page_size > model_max_len:
        raise ValueError(f"page_size={page_size}: the {per_row} pages a slot of max_len="
                         f"{capacity} takes hold {per_row * page_size} positions, more than "
                         f"the model's max_len {model_max_len}")
    least = most_pages_a_row_holds(per_row, reach, page_size)
    if num_pages is None:
        num_pages = max_slots * (per_row if least == per_row else least + 1)
    if not isinstance(num_pages, int) or num_pages < least:
        needs = (f"all {per_row} pages of {page_size} positions that max_len={capacity} takes"
                 if least == per_row else f"{least} pages of {page_size} positions for the "
                 f"{reach} positions its next token reads")
        raise ValueError(f"num_pages={num_pages!r} must be an int >= {least}: a request "
                         f"may need {needs}")
    return num_pages, page_size


def pages_behind(lengths, reach: int | None, page_size: int):
    """How many leading pages of a row of `lengths` positions lie wholly behind what its
    next token reads (0 without `reach`)."""
    if reach is None:
        return jnp.zeros_like(lengths)
    return jnp.maximum(lengths - reach + 1, 0) // page_size


def _first_own_page(state: EngineState, row, reach: int | None) -> jax.Array:
    """The first page of staged row `row`'s table that the sample takes from the pool: after
    the prefix pages it shares and the pages behind what its next token reads."""
    staged = state.staged
    return jnp.maximum(staged.prefix_pages[row], pages_behind(
        staged.cache.lengths[row], reach, state.slots.cache.page_size))


def pages_needed(state: EngineState, row, reach: int | None = None) -> jax.Array:
    """Pages the sample in staged row `row` takes from the pool with a slot: its prompt's and
    room for the token it feeds next (for a sample that reads a source: for every token its
    budget lets it feed, see `holds_sources`), less the prefix pages it shares and, with
    `reach`, those wholly behind what its next token reads."""
    cache, staged = state.slots.cache, state.staged
    positions = staged.cache.lengths[row] + 1
    if holds_sources(state):
        positions += jnp.maximum(staged.max_tokens[row] - staged.generated[row] - 1, 0)
    pages = jnp.minimum((positions + cache.page_size - 1) // cache.page_size,
                        cache.pages.shape[1])
    return pages - _first_own_page(state, row, reach)


def pages_free_for(state: EngineState, row, reach: int | None = None) -> jax.Array:
    """Whether the pool has the pages the sample in staged row `row` takes, and after them
    one free page for every slot running that may grow."""
    spare = jnp.sum(state.free_pages, dtype=jnp.int32) - pages_needed(state, row, reach)
    if holds_sources(state):  # its slots never grow
        return spare >= 0
    return spare >= jnp.sum(state.slots.running, dtype=jnp.int32)


def holds_sources(state: EngineState) -> bool:
    """Whether the slots read sources (an encoder-decoder's). Such a sample cannot be
    preempted and resumed (its tokens continue a target, not its prompt), so it takes the
    pages of its whole budget with its slot and never grows: memory follows each request's
    budget, given back whole when it ends."""
    return state.slots.cache.source_lengths is not None


def admit_into_pages(state: EngineState, row, slot, reach: int | None = None
                     ) -> tuple[M.KVCache, jax.Array]:
    """The slots' cache with staged row `row`'s sample given its first pages in slot `slot`:
    the prefix row's pages it shares, then pages of the pool (with `reach`, only from the
    first that its next token reads), into which the rest of its prompt's K/V is copied;
    and the pages left free. The pages must be free (`pages_free_for`), and the slot must
    hold none."""
    cache, free, staged = state.slots.cache, state.free_pages, state.staged  # free: [pages]
    count, shared = pages_needed(state, row, reach), staged.prefix_pages[row]
    first = _first_own_page(state, row, reach)
    rank = jnp.cumsum(free, dtype=jnp.int32) - 1  # each free page's rank among them
    taken = free & (rank < count)
    per_row = cache.pages.shape[1]
    table = jnp.full((per_row,), M.NO_PAGE, jnp.int32).at[  # the slot's [pages per row]
        jnp.where(taken, first + rank, per_row)].set(
            jnp.arange(free.shape[0], dtype=jnp.int32), mode="drop")
    first_X = prefix_page(state, staged.prefix_row[row]) + jnp.arange(per_row)
    table = jnp.where(jnp.arange(per_row) < shared, first_X, table)
    cache = cache.replace(pages=cache.pages.at[slot].set(table))
    return (copy_row_into_pages(cache, staged.cache, row, slot, first_page=first),
            free & ~taken)


def prefix_page(state: EngineState, prefix_row) -> jax.Array:
    """The pool's page that holds the first positions of the prefix cache's row
    `prefix_row` (its others follow it)."""
    return state.free_pages.shape[0] + prefix_row * state.slots.cache.pages.shape[1]


def _own(tables_BX: jax.Array, free_pages: jax.Array) -> jax.Array:
    """[B, pages per row] bool: which table entries are the slot's own pages of the pool
    (not unassigned, not a prefix row's shared pages, which lie after the slots')."""
    return (tables_BX >= 0) & (tables_BX < free_pages.shape[0])


def grow(state: EngineState, active, reach: int | None = None
         ) -> tuple[EngineState, jax.Array]:
    """(state, preempted [B] bool): every running slot whose next token falls past its pages
    takes one more page (when `active`); if the pool has too few, the fewest slots that leave
    enough are preempted, of the highest priority value and admitted last first, and their
    pages given back. With `reach` (the model's `attention_reach`: every layer reads only
    that many positions back), each running slot first gives back its own pages that lie
    wholly behind what its next token reads (`release_behind`), so a long sample holds about
    a window's pages."""
    if reach is not None:
        state = release_behind(state, reach, active)
    slots, free = state.slots, state.free_pages
    cache = slots.cache
    tables_BX = cache.pages
    per_row = tables_BX.shape[1]
    own_B = jnp.sum(_own(tables_BX, free), axis=1, dtype=jnp.int32)
    # The page of each slot's next position (the entries before it may have been given back).
    column_B = cache.lengths // cache.page_size
    next_page_B = jnp.take_along_axis(tables_BX, jnp.minimum(column_B, per_row - 1)[:, None],
                                      axis=1)[:, 0]
    need_B = active & slots.running & (column_B < per_row) & (next_page_B < 0)
    # The running slots in the order they are preempted: of the highest priority value
    # first, then the most recently admitted (ids grow in the order samples stage).
    youth_B = jnp.where(slots.running, (state.last_admitted - slots.owner) & (ID_SPACE - 1),
                        ID_SPACE)
    order_B = jnp.lexsort((youth_B, jnp.where(slots.running, -slots.priority, PRIORITY_BOUND + 1)))

    def after_each(x_B):  # [K]: the sum over the k youngest slots, for k = 0 .. B
        return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(x_B[order_B])])

    freed_K = after_each(jnp.where(slots.running, own_B, 0))  # shared pages stay
    needed_K = jnp.sum(need_B, dtype=jnp.int32) - after_each(need_B.astype(jnp.int32))
    enough_K = jnp.sum(free, dtype=jnp.int32) + freed_K >= needed_K
    preempt = jnp.argmax(enough_K)  # k = B (all) always has enough: num_pages >= a row's
    preempted_B = jnp.zeros_like(slots.running).at[order_B].set(
        jnp.arange(order_B.shape[0]) < preempt) & slots.running
    slots = slots.replace(running=slots.running & ~preempted_B, stop_reason=jnp.where(
        preempted_B, StopReason.PREEMPTED, slots.stop_reason))
    state = release_stopped(state.replace(slots=slots))
    slots, free = state.slots, state.free_pages
    need_B = need_B & ~preempted_B
    num_pages, batch = free.shape[0], tables_BX.shape[0]
    rank_P = jnp.cumsum(free, dtype=jnp.int32) - 1
    page_by_rank = jnp.zeros((num_pages,), jnp.int32).at[
        jnp.where(free, rank_P, num_pages)].set(jnp.arange(num_pages, dtype=jnp.int32),
                                                 mode="drop")
    page_B = page_by_rank[jnp.maximum(jnp.cumsum(need_B, dtype=jnp.int32) - 1, 0)]
    tables_BX = slots.cache.pages.at[jnp.arange(batch), jnp.where(need_B, column_B, per_row)].set(
        page_B, mode="drop")
    free = free.at[jnp.where(need_B, page_B, num_pages)].set(False, mode="drop")
    slots = slots.replace(cache=slots.cache.replace(pages=tables_BX))
    return state.replace(slots=slots, free_pages=free), preempted_B


def release_behind(state: EngineState, reach: int, active) -> EngineState:
    """Every running slot (when `active`) gives back to the pool its own pages whose
    positions all lie `reach` or more behind its next one, which no layer reads again (a
    query at position p reads p - reach + 1 .. p). Their entries read `NO_PAGE`, which the
    attention reads as page 0 and masks. A shared prefix's pages stay in the table."""
    slots, free = state.slots, state.free_pages
    tables_BX, page_size = slots.cache.pages, slots.cache.page_size
    behind_B = pages_behind(slots.cache.lengths, reach, page_size)
    behind_BX = ((active & slots.running)[:, None]
                 & (jnp.arange(tables_BX.shape[1], dtype=jnp.int32)[None] < behind_B[:, None]))
    gone_BX = behind_BX & _own(tables_BX, free)
    free = free.at[jnp.where(gone_BX, tables_BX, free.shape[0])].set(True, mode="drop")
    cache = slots.cache.replace(pages=jnp.where(gone_BX, M.NO_PAGE, tables_BX))
    return state.replace(slots=slots.replace(cache=cache), free_pages=free)


def release_stopped(state: EngineState) -> EngineState:
    """Every slot that is not running gives its pages back to the pool."""
    slots = state.slots
    tables = slots.cache.pages  # [B, pages per row]
    stopped = ~slots.running[:, None] & (tables >= 0)
    num_pages = state.free_pages.shape[0]
    free = state.free_pages.at[jnp.where(stopped, tables, num_pages)].set(True, mode="drop")
    cache = slots.cache.replace(pages=jnp.where(stopped, M.NO_PAGE, tables))
    return state.replace(slots=slots.replace(cache=cache), free_pages=free)


@functools.partial(jax.jit, donate_argnums=0)
def mirror_prefixes(state: EngineState, store: M.KVCache, lengths_R) -> EngineState:
    """The state with each prefix cache row's first `lengths` [R] positions (0: none) of
    `store`, the prefix cache's rows, copied into that row's pages of the pool, which the
    samples that start with its prefix share (`prefix_page`)."""
    count_trace("share_prefixes")
    cache = state.slots.cache
    rows, per_row = lengths_R.shape[0], cache.pages.shape[1]
    view = cache.replace(  # the prefix rows' tables over the pool
        pages=prefix_page(state, jnp.arange(rows))[:, None] + jnp.arange(per_row),
        lengths=jnp.zeros((rows,), jnp.int32), overflow=jnp.zeros((rows,), bool))
    source = store.replace(lengths=lengths_R)
    for row in range(rows):  # the slots' rings are filled from a sample's staged row
        view = copy_row_into_pages(view, source, row, row, fill_rings=False)
    cache = view.replace(pages=cache.pages, lengths=cache.lengths, overflow=cache.overflow)
    return state.replace(slots=state.slots.replace(cache=cache))


def share_kept(state: EngineState, prefixes) -> EngineState:
    """The state with the prefixes a `prefix_cache.PrefixCache` kept since the last call
    copied into their rows' pages of a paged pool (`mirror_prefixes`); unchanged without
    pages or prefix cache."""
    written = None if prefixes is None else prefixes.take_written()
    if state.free_pages is None or written is None:
        return state
    return mirror_prefixes(state, prefixes.store, written)
