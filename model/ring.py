"""A sliding-window layer's cache as a ring: the slots its window reads, not every position.

A layer that attends over the last `window` positions never reads a key again once it is
`window` positions behind the newest query, so its cache need not hold it. A ring of S
slots holds position p in slot p mod S, each new K/V overwriting the oldest: a row of any
length costs S slots in that layer, not its length. Gemma 2 and 3 alternate such layers
with global ones, which still hold every position; in Mistral 7B v0.1, Phi-3 mini or
StarCoder2 every layer is windowed.

S must hold more than the window. A call of T new tokens writes all of them before its
queries read: the oldest query, at p, reads back to p - window + 1, and the newest token,
at p + T - 1, overwrites position p + T - 1 - S. So S = window + T - 1 slots for calls of
up to T tokens (`ring_slots`): one for the steps of plain sampling, beam search and the
engine's slots, a draft's length and one for a speculative step's verification, what a
draft model catches up by in one call for its own cache. A longer call (a prefill) attends
over its own new tokens and writes only each row's last S valid ones.

Softmax does not care in which order the keys lie, and RoPE has turned each key by its
position before the ring holds it, so a windowed layer reads its ring as it read a row of
every position: only the mask differs. Slot r of a row whose newest position is `last`
holds position last - ((last - r) mod S); a query sees it if that is in its window.
Position biases (ALiBi, T5's buckets) read a key's slot as its position: their layers keep
every position.

Shape letters as in `model/cache.py` (docs/shapes.md); a ring's S is its slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import TransformerConfig


def ring_stacks(config: TransformerConfig) -> tuple[bool, ...]:
    """For each stack of `config.layer_stacks`, whether its layers may keep a ring: every
    layer in it attends over a sliding window, and no position bias reads slots as
    positions. Scanned layers share one stack: a ring only if every layer is windowed. An
    encoder-decoder's target cache keeps every position."""
    if (config.sliding_window is None or config.is_encoder_decoder
            or config.positional_encoding in ("alibi", "relative")):
        return (False,) * len(config.layer_stacks(config.num_decoder_layers))
    if config.scan_layers:
        return (config.attention_reach is not None,)
    return tuple(config.is_local_layer(i) for i in range(config.num_decoder_layers))


def ring_layers(config: TransformerConfig) -> int:
    """How many decoder layers lie in the stacks that keep rings (`ring_stacks`)."""
    return sum(layers for layers, ring in zip(config.layer_stacks(config.num_decoder_layers),
                                              ring_stacks(config), strict=True) if ring)


def ring_slots(config: TransformerConfig, capacity: int, step_tokens: int | None
               ) -> int | None:
    """S, the slots of each windowed layer's ring in a cache of `capacity` positions whose
    later calls write at most `step_tokens` tokens each (see above); None where no layer
    keeps one: `step_tokens` not given, no windowed layer, or a ring no smaller than the
    capacity."""
    if step_tokens is None or not any(ring_stacks(config)):
        return None
    if step_tokens < 1:
        raise ValueError(f"step_tokens={step_tokens} must be >= 1")
    slots = config.sliding_window + step_tokens - 1
    return slots if slots < capacity else None


def paged_ring_slots(config: TransformerConfig, capacity: int, step_tokens: int | None
                     ) -> int | None:
    """S of the rings a paged cache of `capacity` positions per row keeps for its windowed
    layers (`ring_slots`), or None: where every layer is windowed, the pool's pages hold
    them all and a row gives back those its window leaves (`serve/pages.py`) instead.
    Elsewhere the windowed layers' rings lie beside the global layers' pools."""
    if all(ring_stacks(config)):
        return None
    return ring_slots(config, capacity, step_tokens)


def most_step_tokens(config: TransformerConfig, slots: int) -> int:
    """The most new tokens one call may write into rings of `slots` slots."""
    return slots - config.sliding_window + 1


def ring_inputs(window: int, slots: int, positions_BT: jax.Array, starts_B: jax.Array,
                new_lengths_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(mask [B, T, S], writes [B, T])` of a call that writes T new tokens after `starts`:
    which ring slots each query (at `positions`) sees, by the position each slot holds
    once the call has written, and the slot each new token is written to: `slots` (past
    the end: dropped) for padding, for a row that did not fit (`new_lengths` = `starts`)
    and for all but a row's last S valid tokens, which would overwrite each other."""
    held_B1S = held_positions(new_lengths_B, slots)[:, None, :]
    mask_BTS = ((held_B1S >= 0) & (held_B1S <= positions_BT[:, :, None])
                & (held_B1S > positions_BT[:, :, None] - window))
    new_BT = jnp.arange(positions_BT.shape[1], dtype=jnp.int32)[None, :]
    written_B = new_lengths_B - starts_B
    kept_BT = (new_BT < written_B[:, None]) & (new_BT >= written_B[:, None] - slots)
    writes_BT = jnp.where(kept_BT, jnp.mod(positions_BT, slots), slots)
    return mask_BTS, writes_BT


def held_positions(lengths, slots: int) -> jax.Array:
    """[..., S] the position each slot of a ring of `slots` holds in rows of `lengths` [...]:
    the latest one it was written, the last `slots` of each row's; negative where none."""
    last = jnp.asarray(lengths, jnp.int32)[..., None] - 1
    return last - jnp.mod(last - jnp.arange(slots, dtype=jnp.int32), slots)


def copy_into_rings(targets: dict, sources: dict, rings: tuple[bool, ...], row, into,
                    length) -> dict:
    """`targets` (tuples of stacks [L_i, B, K, S_i, ...] by name) with row `row` of `sources`
    (the same stacks, of every position) copied into row `into` of each ring among them
    (`rings`, a flag per stack; the other stacks are left as they are): each ring slot takes
    the position of the row's first `length` that it holds, the last S of them."""
    def copy(target, stack):
        slots = target.shape[3]
        held_S = held_positions(length, slots)
        source_row = jax.lax.dynamic_index_in_dim(stack, row, axis=1, keepdims=False)
        piece = jnp.take(source_row, jnp.maximum(held_S, 0), axis=2)  # [L, K, S, ...]
        before = jax.lax.dynamic_index_in_dim(target, into, axis=1, keepdims=False)
        held = (held_S >= 0).reshape((1, 1, slots) + (1,) * (piece.ndim - 3))
        return jax.lax.dynamic_update_index_in_dim(target, jnp.where(held, piece, before),
                                                   into, axis=1)

    return {name: tuple(copy(target, source) if ring else target
                        for target, source, ring in zip(stacks, sources[name], rings,
                                                        strict=True))
            for name, stacks in targets.items()}


def take_into_rings(stacks: dict, rings: tuple[bool, ...], slots: int, rows_R: jax.Array,
                    lengths_R: jax.Array) -> dict:
    """Rows `rows` [R] of `stacks` (tuples of stacks [L_i, B, K, S, ...] of every position,
    by name): the stacks `rings` flags as rings of `slots` slots holding each row's last
    positions of its first `lengths` [R] (a slot that holds none reads position 0, which
    the ring's mask hides), the others whole. One gather per stack, however long the rows."""
    held_RS = jnp.maximum(held_positions(lengths_R, slots), 0)

    def take(stack, ring):
        if not ring:
            return jnp.take(stack, rows_R, axis=1)
        piece = stack[:, rows_R[:, None], :, held_RS]  # [R, S, L, K, ...]
        return jnp.moveaxis(piece, (0, 1), (1, 3))  # [L, R, K, S, ...]

    return {name: tuple(map(take, stack_tuple, rings)) for name, stack_tuple in stacks.items()}

