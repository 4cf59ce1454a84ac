"""Writing new K/V into a cache's stacks: each row at its own slots, by one scatter with the
batch as its batch axis, never clamped (`lax.dynamic_update_slice` would move a write that
does not fit; these drop it).

Shape letters as in `model/cache.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_rows(stack: jax.Array, layer, new_BTKH: jax.Array, starts_B: jax.Array,
               fits_B: jax.Array) -> jax.Array:
    """Writes `new` into the K or V of layer `layer` of `stack` [L, B, K, S, H], each row at
    its own start slot. An int8 cache's scales [L, B, K, S] are written the same way, from
    `new` [B, T, K].

    The whole stack is updated rather than a slice of it, so inside the layer scan and the
    decode loop XLA writes the T new slots in place, never copying. With one start per row
    this is a scatter (what `vmap` of `lax.dynamic_update_slice` becomes), with B as its
    batch axis: row b of `new` goes to row b of the stack, so a stack split over devices by
    rows is written where it lies, without gathering the indices or the new K/V. A row that
    does not fit (`start + T > S`) writes nothing: its slots point past the end and the
    scatter drops them, where a clamped write would have overwritten the last slots. Its
    caller flags the row as overflowed.
    """
    capacity = stack.shape[-2]
    slots_BT = starts_B[:, None] + jnp.arange(new_BTKH.shape[1], dtype=starts_B.dtype)
    return write_slots(stack, layer, new_BTKH, jnp.where(fits_B[:, None], slots_BT, capacity),
                       ascending=True)


def write_slots(stack: jax.Array, layer, new_BTKH: jax.Array, slots_BT: jax.Array,
                ascending: bool = False) -> jax.Array:
    """`write_rows` with the slot of each new token given, [B, T], distinct in a row
    (`ascending` if they rise along T); a slot past the stack's end writes nothing (a
    windowed layer's ring, `model/ring.py`, wraps around and drops some)."""
    layer_BT = jnp.broadcast_to(jnp.asarray(layer, slots_BT.dtype), slots_BT.shape)
    indices_BT2 = jnp.stack([layer_BT, slots_BT], axis=-1)  # (layer, slot) of each new token
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(2, new_BTKH.ndim)),  # K, H of new [B, T, K, H]
        inserted_window_dims=(0, 3),  # one layer, one slot per token
        scatter_dims_to_operand_dims=(0, 3),
        operand_batching_dims=(1,),  # B of the stack ...
        scatter_indices_batching_dims=(0,))  # ... is B of the indices
    return jax.lax.scatter(stack, indices_BT2, new_BTKH.astype(stack.dtype), numbers,
                           indices_are_sorted=ascending, unique_indices=True,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
