"""A paged KV cache: every row's K/V live in pages of one shared pool, found through the row's
page table, so memory is held for the tokens present rather than for each row's capacity.

A contiguous cache (`init_cache`) gives every row `capacity` slots of its own. A paged one
holds, per layer stack, a pool [L_i, pages, K, U, H] of fixed-size pages of U slots, and
per row a page table [B, pages per row] (int32) whose entry j is the pool page that holds the
row's slots j·U .. j·U + U - 1, or -1 where none is assigned yet. A row's capacity is its
table's width times U; what the pool holds is what is allocated. Whoever fills the tables
(an engine's host side) takes pages from the pool as rows grow, returns them when rows end,
and may point several rows at the same page to share a prefix's K/V: the model writes only
at each row's own positions from its length on, so a shared page of whole prefix positions
is only ever read.

The model takes a paged cache wherever it takes a contiguous one (`KVCache` with its `pages`
set; its `k`/`v` stacks are then the pools): slot s of a row still holds its position s, so
masks, positions and lengths mean what they always do, and only the writes
(`write_pages`) and the reads (`attend_pages`) go through the table. A write needs a page
for every position a row fills; a row without one writes nothing and is flagged as
overflowed, as a row that does not fit a contiguous cache is, never written somewhere else.

Shape letters as in `model/cache.py`; U is the slots of one page, the block the reads take.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import attention
from .cache import KVCache, empty_sources, empty_stacks
from .config import TransformerConfig
from .decode_kernel import (
    decode_kernel_use,
    paged_block_pages,
    paged_decode_attention,
    seen_blocks,
)
from .positional import PositionBias
from .ring import copy_into_rings, paged_ring_slots, ring_stacks

NO_PAGE = -1  # a page table's entry for slots with no page assigned


def init_paged_cache(config: TransformerConfig, batch_size: int, num_pages: int,
                     page_size: int, pages_per_row: int, dtype=None,
                     step_tokens: int | None = None,
                     source_capacity: int | None = None) -> KVCache:
    """An empty paged cache: pools of `num_pages` pages of `page_size` slots per layer stack
    (of `dtype`, default `config.kv_cache_dtype`; int8 with scales), and `batch_size` rows of
    `pages_per_row` page-table entries, none assigned yet (`NO_PAGE`). With `step_tokens`
    (the most tokens a call after the prefill writes), a model that mixes sliding-window
    layers with global ones keeps each windowed layer's K/V in a ring per row
    (`paged_ring_slots`), beside the global layers' pools: a page then holds the global
    layers alone. With `source_capacity` (an encoder-decoder's), each row also holds a
    source of that many slots, contiguous (`init_cache`'s cross fields): its target's K/V
    grow page by page, its source's are known whole when it is prefilled."""
    if min(batch_size, num_pages, page_size, pages_per_row) < 1:
        raise ValueError(f"a paged cache needs batch_size, num_pages, page_size and "
                         f"pages_per_row >= 1, got {batch_size=}, {num_pages=}, {page_size=}, "
                         f"{pages_per_row=}")
    if pages_per_row * page_size > config.max_len:
        raise ValueError(f"pages_per_row={pages_per_row} x page_size={page_size} = "
                         f"{pages_per_row * page_size} slots per row exceeds the model's "
                         f"max_len {config.max_len}")
    ring = paged_ring_slots(config, pages_per_row * page_size, step_tokens)
    rings = ring_stacks(config) if ring is not None else (False,) * len(
        config.layer_stacks(config.num_decoder_layers))
    # Pools of pages [L_i, pages, K, U, H], and rings [L_i, B, K, S, H] beside them.
    stacks = empty_stacks(config, tuple(batch_size if kept else num_pages for kept in rings),
                          page_size, dtype, ring)
    return KVCache(**stacks, lengths=jnp.zeros((batch_size,), jnp.int32),
                   overflow=jnp.zeros((batch_size,), bool),
                   **empty_sources(config, batch_size, source_capacity, dtype),
                   pages=jnp.full((batch_size, pages_per_row), NO_PAGE, jnp.int32),
                   slots=None if ring is None else pages_per_row * page_size,
                   rings=None if ring is None else rings)


def window_pages(reach: int, page_size: int) -> int:
    """The most pages a row holds when it keeps only the `reach` positions its next token
    reads (the last of them its own, to be written): they may start part-way into a page."""
    return (reach + page_size - 2) // page_size + 1


def most_pages_a_row_holds(pages_per_row: int, reach: int | None, page_size: int) -> int:
    """All of a row's `pages_per_row`, or with `reach` (`TransformerConfig.attention_reach`)
    its window's pages where fewer."""
    return pages_per_row if reach is None else min(pages_per_row, window_pages(reach, page_size))


def pages_hold(pages: jax.Array, page_size: int, starts_B: jax.Array,
               valid_B: jax.Array) -> jax.Array:
    """[B] bool: whether row b's table assigns a page to each of its positions starts[b] ..
    starts[b] + valid[b] - 1 (within its capacity)."""
    pages_per_row = pages.shape[1]
    first_B = starts_B // page_size
    last_B = (starts_B + valid_B - 1) // page_size  # first - 1 when nothing is written
    columns = jnp.arange(pages_per_row, dtype=jnp.int32)
    needed = (columns >= first_B[:, None]) & (columns <= last_B[:, None])  # [B, per row]
    within_B = last_B < pages_per_row
    return within_B & jnp.all(~needed | (pages >= 0), axis=1)


def write_pages(pool: jax.Array, layer, new_BTKH: jax.Array, starts_B: jax.Array,
                fits_B: jax.Array, pages: jax.Array) -> jax.Array:
    """`write_rows` for a pool [L, pages, K, U, H] (or an int8 cache's scales [L, pages, K,
    U], from `new` [B, T, K]): token t of row b goes to the slot of position starts[b] + t,
    in the page the row's table assigns it. Rows that do not fit and positions with no page
    write nothing (their indices point past the pool and the scatter drops them)."""
    num_pages, page_size = pool.shape[1], pool.shape[3]
    pages_per_row = pages.shape[1]
    positions_BT = starts_B[:, None] + jnp.arange(new_BTKH.shape[1], dtype=jnp.int32)
    columns_BT = positions_BT // page_size
    page_BT = jnp.take_along_axis(pages, jnp.minimum(columns_BT, pages_per_row - 1), axis=1)
    keep_BT = fits_B[:, None] & (columns_BT < pages_per_row) & (page_BT >= 0)
    page_BT = jnp.where(keep_BT, page_BT, num_pages)
    offset_BT = positions_BT % page_size
    return pool.at[layer, page_BT, :, offset_BT].set(new_BTKH.astype(pool.dtype), mode="drop")


def gather_rows(pool: jax.Array, layer, pages: jax.Array) -> jax.Array:
    """Layer `layer` of a pool [L, pages, K, U, H] as a contiguous stack of one layer [1, B, K,
    S, H] (scales: [L, pages, K, U] -> [1, B, K, S]), S = pages per row x U: every row's pages
    in table order. Unassigned entries read page 0, which the row's length masks."""
    # The layers' pools as one of L x pages (a reshape, no copy), each row's pages offset into
    # its layer's: slicing the layer out of a stack of several would first copy all of it.
    num_layers, num_pages = pool.shape[:2]
    every_layer = pool.reshape(num_layers * num_pages, *pool.shape[2:])
    rows = jnp.take(every_layer, jnp.maximum(pages, 0) + layer * num_pages,
                    axis=0)  # [B, pages per row, K, U, ...]
    rows = jnp.swapaxes(rows, 1, 2)  # [B, K, pages per row, U, ...]
    batch, kv_heads, per_row, page_size = rows.shape[:4]
    return rows.reshape(1, batch, kv_heads, per_row * page_size, *rows.shape[4:])


def attend_pages(q_BTNH: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                 pages: jax.Array, mask_BTS: jax.Array, block_size: int,
                 scales: tuple[jax.Array, jax.Array] | None = None,
                 one_read_bytes: int | None = None, scale: float | None = None,
                 softcap: float | None = None, sinks_N: jax.Array | None = None,
                 bias: PositionBias | None = None) -> jax.Array:
    """`attend_blocks` over layer `layer` of the pools [L, pages, K, U, H], each row reading
    its own pages (`pages` [B, pages per row]). Returns [B, T, N, H].

    A decode step the kernel takes (`decode_kernel_use`, on one NVIDIA GPU) reads each
    row's pages in place, up to its last seen slot (`paged_decode_attention`). Elsewhere,
    where a contiguous layer of these rows would be read in one pass (`one_read_bytes`,
    default `one_read_max_bytes()`: a small layer, or any on an accelerator), the rows'
    pages are gathered into one and read so.
    Otherwise the online softmax runs over blocks of about `block_size` slots (whole pages)
    from the first to the last slot any query sees, each gathered from the rows' pages as it
    is read: a row's cost follows its tokens (or its sliding window), not its capacity.
    Masked slots get exactly zero weight, as in `attend_blocks`; `sinks` and `bias`
    are its too (a slot's position: its index in the row's pages, in order)."""
    batch, _, capacity = mask_BTS.shape
    page_size = k_pool.shape[3]
    view_BKSH = jax.ShapeDtypeStruct((batch, k_pool.shape[2], capacity, k_pool.shape[4]),
                                     k_pool.dtype)
    kernel = None if scales is not None or bias is not None else decode_kernel_use(
        q_BTNH, view_BKSH, view_BKSH, softcap)
    if kernel is not None and paged_block_pages(page_size, pages.shape[1]) is not None:
        return paged_decode_attention(q_BTNH, k_pool, v_pool, layer, pages, mask_BTS, scale,
                                      interpret=kernel == "interpret", sinks_N=sinks_N)
    view_bytes = batch * capacity * k_pool.shape[2] * k_pool.shape[4] * k_pool.dtype.itemsize
    if one_read_bytes is None:
        one_read_bytes = attention.one_read_max_bytes()
    if view_bytes <= one_read_bytes:
        views = [gather_rows(pool, layer, pages) for pool in (k_pool, v_pool)]
        view_scales = None if scales is None else tuple(
            gather_rows(s, layer, pages) for s in scales)
        out, _ = attention.attend_blocks(q_BTNH, *views, 0, mask_BTS, capacity,
                                         scales=view_scales, one_read_bytes=view_bytes,
                                         scale=scale, softcap=softcap, sinks_N=sinks_N,
                                         bias=bias)
        return out
    block = page_size * min(pages.shape[1], max(1, block_size // page_size))
    first_block, num_blocks = seen_blocks(mask_BTS, block)
    q_XMH = attention._queries_XMH(q_BTNH, k_pool.shape[2], scale)
    out_XMH = attention._attend_filled_blocks(
        q_XMH, k_pool, v_pool, layer, mask_BTS, softcap, block, num_blocks, scales, pages=pages,
        sinks_KG=attention._sinks_KG(sinks_N, k_pool.shape[2]), first_block=first_block,
        bias=bias)
    return attention._to_BTNH(out_XMH, q_BTNH)


def copy_row_into_pages(cache: KVCache, source: KVCache, row, into, first_page=0,
                        fill_rings: bool = True) -> KVCache:
    """Row `row` of `source`, a contiguous cache, copied into the pages that row `into` of
    this paged cache's tables assigns (traced scalars): page by page from its page
    `first_page` on (those before it hold these positions already, e.g. a shared prefix),
    only as many as its length fills, which the caller has assigned; and where the cache
    keeps windowed layers in rings (`fill_rings`), the row's last positions into row
    `into`'s rings; where rows hold sources (an encoder-decoder's), the row's source into
    row `into`'s. Its length is set and its overflow cleared."""
    page_size, num_pages, rings = cache.page_size, cache.num_pages, cache.rings or ()
    sources = source._self_attention()

    def copy_page(j, pools):
        page = cache.pages[into, j]
        page = jnp.where(page < 0, num_pages, page)  # unassigned: dropped, never clamped
        # Slots past the source's capacity (a last page it fills in part) read zeros.
        slots_U = j * page_size + jnp.arange(page_size)

        def copy(pool, stack):  # pool [L, pages, K, U, ...], stack [L, B, K, S, ...]
            piece = stack.at[:, row, :, slots_U].get(mode="fill", fill_value=0)  # [U, L, K, ...]
            return pool.at[:, page].set(jnp.moveaxis(piece, 0, 2), mode="drop")

        return {name: tuple(pool if rings and rings[i] else copy(pool, sources[name][i])
                            for i, pool in enumerate(stacks))
                for name, stacks in pools.items()}

    copied = cache.with_row_copied(source, row, into, page_size, copy_page, first_page
                                   ).with_source_copied(source, row, into, page_size)
    if not rings or not fill_rings:
        return copied
    return copied.replace(**copy_into_rings(copied._self_attention(), sources, rings, row,
                                            into, source.lengths[row]))
