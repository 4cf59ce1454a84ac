"""Prompt-lookup drafts for speculative decoding: no second model, only the row's context.

A row's draft is the k tokens that followed the latest earlier occurrence of its last n
tokens in its context (prompt and output), as Hugging Face's prompt-lookup decoding
proposes, computed for the whole batch at once inside the compiled loop. n is traced.

Shape letters: B batch, C context buffer, J draft length k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_NGRAM_SIZE = 8  # n is traced; the match unrolls this many comparisons


def ngram_drafts(context_BC: jax.Array, lengths_B: jax.Array, ngram_size: jax.Array,
                 num_draft: int) -> tuple[jax.Array, jax.Array]:
    """(drafts [B, J], valid drafts [B]): per row, the J tokens after the latest earlier
    occurrence of its last `ngram_size` tokens that has J tokens after it (else after the
    latest occurrence, cut at the end of the context)."""
    batch, width = context_BC.shape
    padded_BC = jnp.pad(context_BC, ((0, 0), (0, MAX_NGRAM_SIZE + num_draft)))
    starts_C = jnp.arange(width)
    # An occurrence at i ends before the suffix starts and leaves a token to draft.
    match_BC = (starts_C[None] + ngram_size < lengths_B[:, None]) & (
        lengths_B[:, None] >= ngram_size)
    for m in range(MAX_NGRAM_SIZE):
        suffix_slot_B = jnp.clip(lengths_B - ngram_size + m, 0, width - 1)
        suffix_B = jnp.take_along_axis(context_BC, suffix_slot_B[:, None], axis=1)[:, 0]
        equal_BC = padded_BC[:, m:m + width] == suffix_B[:, None]
        match_BC &= (m >= ngram_size) | equal_BC
    # The latest occurrence followed by k known tokens, else the latest one: in a periodic
    # stretch the latest occurrence overlaps the suffix and has too few tokens after it.
    full_BC = starts_C[None] + ngram_size + num_draft <= lengths_B[:, None]
    score_BC = jnp.where(match_BC, starts_C[None] + jnp.where(full_BC, width, 0), -1)
    best_B = jnp.max(score_BC, axis=1)
    latest_B = jnp.where(best_B >= width, best_B - width, best_B)
    first_B = latest_B + ngram_size
    slots_BJ = first_B[:, None] + jnp.arange(num_draft)
    drafts_BJ = jnp.take_along_axis(padded_BC, jnp.clip(slots_BJ, 0, padded_BC.shape[1] - 1),
                                    axis=1)
    valid_B = jnp.where(latest_B >= 0, jnp.clip(lengths_B - first_B, 0, num_draft), 0)
    return drafts_BJ, valid_B
