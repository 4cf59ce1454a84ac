"""The KV cache: an immutable pytree that a model call takes and returns.

Shape letters used here and in the rest of `model/`:
  L layers, B batch, T query length, S key length (cache capacity or source length),
  N query heads, K kv heads, H head dim, D model dim, V vocab.

Only K and V are cached. A new token's query is compared with the keys of every earlier
token and mixes their values; no later step ever needs an earlier token's query again.

Rows are right-padded: slot `s` of a row holds the token at position `s` of that row, and
`lengths[b]` is both how many slots row `b` has filled and the position of its next token.
Rows with different prompt lengths therefore keep their own positions with no offsets,
and a short row wastes no capacity at its front (left padding would).

Each layer's K and V are laid out [B, K, S, H], heads before slots (as Hugging Face's cache
is): attention multiplies each head's contiguous [S, H] block in place. With slots before
heads ([B, S, K, H]) every decode step would first transpose the whole cache.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from model.config import TransformerConfig


@flax.struct.dataclass
class KVCache:
    """Per-layer K/V of every decoder layer, stacked over layers.

    Fields:
      k, v:           [L, B, K, S, H] self-attention keys and values; S is the capacity.
      lengths:        [B] int32, filled slots per row (= next position to write).
      overflow:       [B] bool, set when a write did not fit; the write was skipped, never
                      clamped (`lax.dynamic_update_slice` would silently move it).
      cross_k, cross_v: [L, B, K, S_src, H] encoder-decoder only: the encoder output
                      projected once per layer, read by every decoding step; else None.
      source_lengths: [B] int32 valid source tokens per row (encoder-decoder), else None.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    overflow: jax.Array
    cross_k: jax.Array | None = None
    cross_v: jax.Array | None = None
    source_lengths: jax.Array | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the cached K/V (self and cross); the per-row counters are not counted."""
        arrays = (self.k, self.v, self.cross_k, self.cross_v)
        return sum(a.size * a.dtype.itemsize for a in arrays if a is not None)

    def take_rows(self, rows_R: jax.Array) -> KVCache:
        """The cache of rows `rows` [R] (repeats allowed): beam search reorders with this."""
        by_batch = {"k": 1, "v": 1, "cross_k": 1, "cross_v": 1, "lengths": 0, "overflow": 0,
                    "source_lengths": 0}
        return self.replace(**{
            name: None if getattr(self, name) is None
            else jnp.take(getattr(self, name), rows_R, axis=axis)
            for name, axis in by_batch.items()})

    @property
    def self_attention_nbytes(self) -> int:
        return self.k.size * self.k.dtype.itemsize + self.v.size * self.v.dtype.itemsize


def init_cache(
    config: TransformerConfig, batch_size: int, capacity: int, dtype=None
) -> KVCache:
    """An empty self-attention cache of `capacity` slots per row (cross fields unset)."""
    if capacity < 1 or batch_size < 1:
        raise ValueError(f"cache needs capacity >= 1 and batch_size >= 1, got {capacity=}, "
                         f"{batch_size=}")
    if capacity > config.max_len:
        raise ValueError(f"cache capacity {capacity} exceeds the model's max_len {config.max_len}")
    dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
    shape = (config.num_decoder_layers, batch_size, config.kv_heads, capacity, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        overflow=jnp.zeros((batch_size,), bool),
    )


def write_rows(cache_LBKSH: jax.Array, layer: jax.Array, new_BTKH: jax.Array,
               starts_B: jax.Array, fits_B: jax.Array) -> jax.Array:
    """Writes `new` into layer `layer` of the stacked cache, each row at its own start slot.

    With one start per row this is a scatter (what `vmap` of `lax.dynamic_update_slice`
    becomes). It updates the whole stack rather than one layer's slice, so inside the
    layer scan and the decode loop XLA writes the T new slots in place, never copying the
    cache. A row that does not fit (`start + T > S`) writes nothing: its slots point past
    the end and `mode="drop"` discards them, where a clamped write would have overwritten
    the last slots. Its caller flags the row as overflowed.
    """
    capacity = cache_LBKSH.shape[3]
    slots_BT = starts_B[:, None] + jnp.arange(new_BTKH.shape[1], dtype=starts_B.dtype)
    slots_BT = jnp.where(fits_B[:, None], slots_BT, capacity)
    rows_B1 = jnp.arange(new_BTKH.shape[0])[:, None]
    # The two index arrays are split by the K slice, so the indexed block is [B, T, K, H].
    return cache_LBKSH.at[layer, rows_B1, :, slots_BT].set(
        new_BTKH.astype(cache_LBKSH.dtype), mode="drop")
