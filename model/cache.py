"""The KV cache: an immutable pytree that a model call takes and returns.

Shape letters used here and in the rest of `model/` (all of them: docs/shapes.md):
  L layers, B batch, T query length, S key length (cache capacity or source length),
  N query heads, K kv heads, H head dim, D model dim, V vocab, R rows picked.

Only K and V are cached. A new token's query is compared with the keys of every earlier
token and mixes their values; no later step ever needs an earlier token's query again.

Rows are right-padded: slot `s` of a row holds the token at position `s` of that row, and
`lengths[b]` is both how many slots row `b` has filled and the position of its next token.
Rows with different prompt lengths therefore keep their own positions with no offsets,
and a short row wastes no capacity at its front (left padding would).

Each layer's K and V are laid out [B, K, S, H], heads before slots (as Hugging Face's cache
is): attention multiplies each head's contiguous [S, H] block in place. With slots before
heads ([B, S, K, H]) every decode step would first transpose the whole cache.

Each layer's K and V are held as a tuple of stacks, `config.layer_stacks(L)`: one stack
[L, B, K, S, H] of every layer when layers are scanned (a scan step can only index into a
stack), or L stacks [1, B, K, S, H] of one layer each when they are unrolled, so each layer
reads its own buffer where it lies instead of a slice of a larger array. Layer code sees the
same thing either way: its stack and its index in it.

A paged cache (`model/paged.py`) holds each stack as a pool of pages [L_i, pages, K, U, H]
shared by the rows, with a page table per row (`pages`) that says which page holds which of
its slots.

A cache made for calls of a known number of tokens (`init_cache(..., step_tokens=T)`, as
`generate` makes them) holds each sliding-window layer's K/V in a ring of the slots its
window reads (`model/ring.py`): those stacks (`rings` says which) are [L_i, B, K, S, H]
with S below the capacity, which the cache then keeps as `slots`. A paged cache made so
keeps them beside the global layers' pools.

A model with multi-head latent attention (`model/latent_attention.py`) caches, in place of
each head's K and V, one latent row per token that every head reads as both: its `k` stacks
have one head of `config.cached_head_dim`, its `v` stacks none (`config.cached_heads`).

An int8 cache (`cache_dtype="int8"`, `model/quantize.py`) holds K and V as int8 and, next to
each stack, a stack of float32 scales [L_i, B, K, S], one per token and kv head. The scales
are written with the values, by the same scatter, and taken, sharded and counted with them.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from .config import TransformerConfig
from .config_checks import CACHE_SCALE_DTYPE
from .ring import copy_into_rings, ring_slots, ring_stacks


@flax.struct.dataclass
class KVCache:
    """Per-layer K/V of every decoder layer.

    Fields:
      k, v:           self-attention keys and values: a tuple of stacks [L_i, B, K, S, H]
                      (`config.layer_stacks`, see above); S is the capacity.
      lengths:        [B] int32, filled slots per row (= next position to write).
      overflow:       [B] bool, set when a write did not fit; the write was skipped, never
                      clamped (`lax.dynamic_update_slice` would silently move it).
      cross_k, cross_v: encoder-decoder only, held as k and v with S_src slots: the encoder
                      output projected once per layer, read by every decoding step; else None.
      source_lengths: [B] int32 valid source tokens per row (encoder-decoder), else None.
      k_scale, v_scale, cross_k_scale, cross_v_scale: an int8 cache's float32 scales of k,
                      v, cross_k and cross_v, [L_i, B, K, S] stacks held as those are;
                      None for a float cache.
      pages:          a paged cache's page tables [B, pages per row] int32 (`model/paged.py`):
                      k, v and their scales are then pools [L_i, pages, K, U, H] (scales
                      [L_i, pages, K, U]) and the capacity is pages per row x U; None for a
                      contiguous cache.
      slots:          static; the capacity where windowed layers keep rings of fewer slots
                      (`model/ring.py`), else None (the stacks' S, or pages per row x U, is
                      the capacity).
      rings:          static; for each stack, whether it is a ring [L_i, B, K, S, H] of the
                      slots its window reads (a paged cache's then lie beside its pools),
                      else None.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    overflow: jax.Array
    cross_k: tuple[jax.Array, ...] | None = None
    cross_v: tuple[jax.Array, ...] | None = None
    source_lengths: jax.Array | None = None
    k_scale: tuple[jax.Array, ...] | None = None
    v_scale: tuple[jax.Array, ...] | None = None
    cross_k_scale: tuple[jax.Array, ...] | None = None
    cross_v_scale: tuple[jax.Array, ...] | None = None
    pages: jax.Array | None = None
    slots: int | None = flax.struct.field(pytree_node=False, default=None)
    rings: tuple[bool, ...] | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def capacity(self) -> int:
        """Positions per row: a stack's S, or a paged cache's pages per row x page size."""
        if self.slots is not None:
            return self.slots
        slots = jax.tree.leaves(self.k)[0].shape[-2]
        return slots if self.pages is None else self.pages.shape[1] * slots

    @property
    def ring_slots(self) -> int | None:
        """S of the windowed layers' rings (`model/ring.py`), or None where none is kept."""
        if self.rings is None:
            return None
        return self.k[self.rings.index(True)].shape[-2]

    @property
    def paged(self) -> bool:
        return self.pages is not None

    @property
    def page_size(self) -> int:
        """U, the slots of one page of a paged cache."""
        return self._first_pool().shape[-2]

    @property
    def num_pages(self) -> int:
        """The pages of a paged cache's pool."""
        return self._first_pool().shape[1]

    def _first_pool(self) -> jax.Array:
        """A paged cache's first K stack that is a pool of pages, not a windowed layer's ring."""
        if self.pages is None:
            raise ValueError("a contiguous cache has no pages")
        return self.k[(self.rings or (False,)).index(False)]

    def _refuse_paged(self, method: str) -> None:
        if self.pages is not None:
            raise ValueError(f"KVCache.{method} moves whole rows of a contiguous cache; a "
                             f"paged cache's rows share one pool of pages: move their page "
                             f"tables (`pages`) and lengths instead")
        if self.slots is not None:
            raise ValueError(f"KVCache.{method} moves rows by their slots, which a windowed "
                             f"layer's ring holds out of order: make the cache without "
                             f"step_tokens (every layer holding every position)")

    @property
    def source_length(self) -> int:
        """S_src, the source slots of the cross-attention K/V (encoder-decoder only)."""
        return jax.tree.leaves(self.cross_k)[0].shape[-2]

    @property
    def dtype(self) -> jnp.dtype:
        return jax.tree.leaves(self.k)[0].dtype

    @property
    def quantized(self) -> bool:
        """Whether K and V are int8 with scales (`model/quantize.py`)."""
        return self.k_scale is not None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the cached K/V (self and cross) and their scales; the per-row counters
        are not counted."""
        return _nbytes((self.k, self.v, self.cross_k, self.cross_v, self.k_scale, self.v_scale,
                        self.cross_k_scale, self.cross_v_scale))

    @property
    def self_attention_nbytes(self) -> int:
        return _nbytes(self._self_attention())

    def take_rows(self, rows_R: jax.Array) -> KVCache:
        """The cache of rows `rows` [R] (repeats allowed): beam search reorders with this."""
        if self.pages is not None:
            self._refuse_paged("take_rows")

        def take(x):  # K/V [L_i, B, K, S, H] and scales [L_i, B, K, S]; counters are [B]
            return jnp.take(x, rows_R, axis=0 if x.ndim == 1 else 1)

        return jax.tree.map(take, self)

    def take_prefixes(self, rows_R: jax.Array, lengths_R: jax.Array, capacity: int) -> KVCache:
        """A cache of R rows of `capacity` slots (at most this one's) whose row r holds the
        first `lengths[r]` slots of row `rows[r]` of this one, to continue from there: a
        prefix kept from an earlier prompt. Slots past a length are left as they were (the
        length masks them). Self-attention only."""
        self._refuse_paged("take_prefixes")
        if self.cross_k is not None:
            raise ValueError("KVCache.take_prefixes keeps a decoder-only LM's prompt; an "
                             "encoder-decoder's target does not start with its prompt")
        if not 1 <= capacity <= self.capacity:
            raise ValueError(f"capacity={capacity} must be in [1, {self.capacity}]")

        def take(stack):  # K/V [L_i, B, K, S, H] and scales [L_i, B, K, S]
            cut = jax.lax.slice_in_dim(stack, 0, capacity, axis=3)
            return jnp.take(cut, rows_R, axis=1)

        return self.replace(**{name: tuple(map(take, stacks))
                               for name, stacks in self._self_attention().items()},
                            lengths=jnp.asarray(lengths_R, jnp.int32),
                            overflow=jnp.zeros(rows_R.shape, bool))

    def _self_attention(self) -> dict[str, tuple[jax.Array, ...]]:
        """The self-attention stacks by field name: K/V [L_i, B, K, S, H] and, for an int8
        cache, the scales [L_i, B, K, S]."""
        return {name: getattr(self, name) for name in ("k", "v", "k_scale", "v_scale")
                if getattr(self, name) is not None}

    def _cross_attention(self) -> dict[str, tuple[jax.Array, ...]]:
        """An encoder-decoder's cross-attention stacks by field name: K/V [L_i, B, K, S_src,
        H] and, for an int8 cache, the scales [L_i, B, K, S_src]; empty for a decoder-only
        cache."""
        return {name: getattr(self, name)
                for name in ("cross_k", "cross_v", "cross_k_scale", "cross_v_scale")
                if getattr(self, name) is not None}

    def _check_same_kind(self, source: KVCache, method: str) -> None:
        if (self.cross_k is None) != (source.cross_k is None):
            kinds = ["an encoder-decoder's" if c.cross_k is not None else "a decoder-only"
                     for c in (self, source)]
            raise ValueError(f"KVCache.{method} moves rows between caches of one kind; this "
                             f"is {kinds[0]}, the source {kinds[1]}")

    def put_rows(self, source: KVCache, rows_R: jax.Array, into_R: jax.Array) -> KVCache:
        """Rows `rows` [R] of `source`, a cache of at most this one's capacity (and source
        slots), written into rows `into` [R] of this one: their first `source.capacity`
        slots and their lengths, not overflowed, and an encoder-decoder's cross-attention
        K/V and source lengths. A row of `into` past the last one writes nothing (padding);
        what a row held past the new length stays, masked by it."""
        self._refuse_paged("put_rows")
        source._refuse_paged("put_rows")
        self._check_same_kind(source, "put_rows")

        def put(stack_LBKS_, source_LPKS_):
            index = (slice(None), into_R, slice(None), slice(0, source_LPKS_.shape[3]))
            return stack_LBKS_.at[index].set(jnp.take(source_LPKS_, rows_R, axis=1),
                                             mode="drop", unique_indices=True)

        def put_counter(all_B, new_R):
            return all_B.at[into_R].set(new_R, mode="drop", unique_indices=True)

        sources = {**source._self_attention(), **source._cross_attention()}
        stacks = {**self._self_attention(), **self._cross_attention()}
        cross = {} if self.source_lengths is None else {
            "source_lengths": put_counter(self.source_lengths, source.source_lengths[rows_R])}
        return self.replace(
            **{name: tuple(map(put, stacks[name], sources[name])) for name in stacks},
            lengths=put_counter(self.lengths, source.lengths[rows_R]),
            overflow=put_counter(self.overflow, jnp.zeros(rows_R.shape, bool)), **cross)

    def copy_row(self, source: KVCache, row: jax.Array, into: jax.Array,
                 block: int) -> KVCache:
        """Row `row` of `source`, a cache of this one's capacity (and source slots), copied
        into row `into` (both traced scalars): by blocks of `block` slots, only as many as
        its length needs (an encoder-decoder's cross-attention K/V, as many as its source
        length needs), so a row of long capacity costs no more to fill than it is filled.
        Into windowed layers' rings (`model/ring.py`) the row's last positions are copied
        where each ring holds them."""
        if self.pages is not None:
            self._refuse_paged("copy_row")
        source._refuse_paged("copy_row")
        self._check_same_kind(source, "copy_row")
        target_block = min(block, self.capacity)
        copied = self.with_row_copied(
            source, row, into, target_block,
            functools.partial(_copy_block, row, into, target_block, self.capacity,
                              source._self_attention()))
        if self.rings is not None:
            copied = copied.replace(**copy_into_rings(
                copied._self_attention(), source._self_attention(), self.rings, row, into,
                source.lengths[row]))
        return copied.with_source_copied(source, row, into, block)

    def with_source_copied(self, source: KVCache, row, into, block: int) -> KVCache:
        """This cache with row `row` of `source`'s source (an encoder-decoder's cross K/V,
        of as many source slots) copied into row `into` by blocks of `block` slots, as many
        as its length needs, and that length set; the same cache where rows hold none."""
        if self.source_lengths is None:
            return self
        if source.source_lengths is None or source.source_length != self.source_length:
            raise ValueError(f"a source is copied between caches of as many source slots "
                             f"({self.source_length} here)")
        source_block = min(block, self.source_length)
        length = source.source_lengths[row]
        cross = jax.lax.fori_loop(
            0, (length + source_block - 1) // source_block,
            functools.partial(_copy_block, row, into, source_block, self.source_length,
                              source._cross_attention()), self._cross_attention())
        return self.replace(**cross, source_lengths=self.source_lengths.at[into].set(length))

    def with_row_copied(self, source: KVCache, row, into, block: int, copy_block,
                        first_block=0) -> KVCache:
        """This cache after `copy_block(j, stacks)` (which returns the self-attention stacks
        with block j of `source`'s row `row` copied in) for each block of `block` slots that
        row's length fills from `first_block` on; row `into` then has that length and has
        not overflowed."""
        length = source.lengths[row]
        copied = jax.lax.fori_loop(first_block, (length + block - 1) // block, copy_block,
                                   self._self_attention())
        return self.replace(**copied, lengths=self.lengths.at[into].set(length),
                            overflow=self.overflow.at[into].set(False))


def _copy_block(row, into, block: int, slots: int, sources: dict, j, targets: dict) -> dict:
    """`targets` (stacks [L_i, B, K, S, ...] by name) with block j of `block` slots of row
    `row` of `sources` (stacks of the same names and S = `slots`) copied into row `into`."""
    # The last block may reach past the row's end: both starts clamp alike, so it copies
    # the same slots (some again) from `row` to `into`.
    start = jnp.minimum(j * block, slots - block)

    def copy(target, stack):
        if target.shape[3] != stack.shape[3]:  # a ring: `copy_into_rings` fills it
            return target
        tail = (0,) * (stack.ndim - 4)
        piece = jax.lax.dynamic_slice(stack, (0, row, 0, start, *tail),
                                      (stack.shape[0], 1, stack.shape[2], block,
                                       *stack.shape[4:]))
        return jax.lax.dynamic_update_slice(target, piece, (0, into, 0, start, *tail))

    return jax.tree.map(copy, targets, sources)


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def init_cache(
    config: TransformerConfig, batch_size: int, capacity: int, dtype=None,
    source_capacity: int | None = None, step_tokens: int | None = None,
) -> KVCache:
    """An empty self-attention cache of `capacity` slots per row, of `dtype` (default:
    `config.kv_cache_dtype`); an int8 one holds scales as well. With `source_capacity`, rows
    that `put_rows` and `copy_row` fill hold sources too (`empty_sources`). With
    `step_tokens`, the most tokens any call after the prefill writes, a decoder-only model's
    sliding-window layers keep rings of the slots their window reads (`model/ring.py`)."""
    if capacity < 1 or batch_size < 1:
        raise ValueError(f"cache needs capacity >= 1 and batch_size >= 1, got {capacity=}, "
                         f"{batch_size=}")
    if capacity > config.max_len:
        raise ValueError(f"cache capacity {capacity} exceeds the model's max_len {config.max_len}")
    ring = ring_slots(config, capacity, step_tokens)
    return KVCache(**empty_stacks(config, batch_size, capacity, dtype, ring),
                   lengths=jnp.zeros((batch_size,), jnp.int32),
                   overflow=jnp.zeros((batch_size,), bool),
                   **empty_sources(config, batch_size, source_capacity, dtype),
                   slots=None if ring is None else capacity,
                   rings=None if ring is None else ring_stacks(config))


def empty_sources(config: TransformerConfig, batch_size: int, source_capacity: int | None,
                  dtype=None) -> dict:
    """Zeroed cross fields of `source_capacity` source slots per row (of `dtype`, default
    `config.kv_cache_dtype`; int8 with scales), for rows filled from prefilled caches (an
    encoder-decoder's); none where `source_capacity` is None."""
    if source_capacity is None:
        return {}
    if not config.is_encoder_decoder:
        raise ValueError("source_capacity sizes an encoder-decoder's cross-attention "
                         "cache; this model is decoder-only")
    if not 1 <= source_capacity <= config.max_len:
        raise ValueError(f"source_capacity={source_capacity} must be in [1, max_len="
                         f"{config.max_len}]")
    dtype = config.kv_cache_dtype if dtype is None else jnp.dtype(dtype)
    stacks = config.layer_stacks(config.num_decoder_layers)
    shape = (batch_size, config.kv_heads, source_capacity)
    cross = {}
    for name in ("cross_k", "cross_v"):
        cross[name] = tuple(jnp.zeros((n, *shape, config.head_dim), dtype) for n in stacks)
        if dtype == jnp.int8:
            cross[f"{name}_scale"] = tuple(jnp.zeros((n, *shape), CACHE_SCALE_DTYPE)
                                           for n in stacks)
    return {**cross, "source_lengths": jnp.zeros((batch_size,), jnp.int32)}


def stack_slots(config: TransformerConfig, slots: int, ring: int | None = None
                ) -> tuple[int, ...]:
    """S of each stack of `config.layer_stacks`: `slots`, or `ring` for the stacks of
    windowed layers where rings of `ring` slots are kept (`model/ring.py`)."""
    return tuple(ring if ring is not None and kept else slots
                 for kept in ring_stacks(config))


def empty_stacks(config: TransformerConfig, rows: int | tuple[int, ...], slots: int,
                 dtype=None, ring: int | None = None) -> dict:
    """Zeroed `k` and `v`, each a tuple of stacks [L_i, rows, K, slots, H] per
    `config.layer_stacks` (K from `config.cached_heads`, H `config.cached_head_dim`), of
    `dtype` (default `config.kv_cache_dtype`), and for int8 their float32 scales `k_scale` and
    `v_scale` [L_i, rows, K, slots]. `rows` is a contiguous cache's batch or a pool's pages
    (or one per stack). With `ring`, windowed layers' stacks have that many slots
    (`stack_slots`)."""
    dtype = config.kv_cache_dtype if dtype is None else jnp.dtype(dtype)
    layers = config.layer_stacks(config.num_decoder_layers)
    rows = rows if isinstance(rows, tuple) else (rows,) * len(layers)

    def stacks(shape, stack_dtype):
        return tuple(jnp.zeros((n, r, shape[0], s, *shape[1:]), stack_dtype)
                     for n, r, s in zip(layers, rows, stack_slots(config, slots, ring),
                                        strict=True))

    fields = {}
    for name, heads in zip(("k", "v"), config.cached_heads, strict=True):
        fields[name] = stacks((heads, config.cached_head_dim), dtype)
        if dtype == jnp.int8:
            fields[f"{name}_scale"] = stacks((heads,), CACHE_SCALE_DTYPE)
    return fields


def check_cache(config: TransformerConfig, cache: KVCache, batch: int, num_tokens: int):
    """Raises a ValueError naming what does not match before a call with `cache` traces on.

    A cache built for the other `scan_layers` setting, another batch size or other heads
    would otherwise fail deep inside a layer with a bare shape error."""
    stacks = config.layer_stacks(config.num_decoder_layers)
    if cache.rings is not None and cache.rings != ring_stacks(config):
        raise ValueError(f"the cache keeps rings in stacks {cache.rings}, but this model's "
                         f"windowed layers are stacks {ring_stacks(config)}")
    rings = cache.rings or (False,) * len(stacks)
    if cache.paged:
        if cache.pages.ndim != 2 or cache.pages.shape[0] != batch:
            raise ValueError(f"a paged cache's page tables have shape {cache.pages.shape}, but "
                             f"a batch of {batch} needs [{batch}, pages per row]")
        leaves = jax.tree.leaves(cache.k)
        pool = leaves[rings.index(False)] if len(leaves) == len(rings) else leaves[0]
        rows, slots = jnp.shape(pool)[1], cache.page_size
        layout = "[L_i, pages, K, U, H] pools" + (" and [L_i, B, K, S, H] rings"
                                                  if cache.rings else "")
    else:
        rows, slots = batch, cache.capacity
        layout = "[L_i, B, K, S, H] stacks"
    every_slots = stack_slots(config, slots, cache.ring_slots)
    for name, heads in zip(("k", "v"), config.cached_heads, strict=True):
        expected = [(n, batch if kept else rows, heads, s, config.cached_head_dim)
                    for n, s, kept in zip(stacks, every_slots, rings, strict=True)]
        buffers = getattr(cache, name)
        found = ([jnp.shape(b) for b in buffers] if isinstance(buffers, tuple | list)
                 else [jnp.shape(buffers)])
        if found != expected:
            raise ValueError(
                f"cache.{name} has shapes {found}, but this model (scan_layers="
                f"{config.scan_layers}) with a batch of {batch} needs a tuple of "
                f"{len(stacks)} {layout}: {expected}")
    if cache.quantized != (cache.dtype == jnp.int8):
        raise ValueError(f"a cache of {cache.dtype} K/V needs scales exactly when it is int8; "
                         f"this one has {'' if cache.quantized else 'no '}scales")
    if num_tokens > cache.capacity:
        raise ValueError(f"{num_tokens} tokens per row cannot fit a cache of capacity "
                         f"{cache.capacity}")
