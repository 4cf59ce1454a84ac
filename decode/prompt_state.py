"""Reusing a prefilled prompt: a `PromptState` holds a batch's cache after its prompt (and
any turns generated since) with the logits of each row's next token, so later calls continue
it without prefilling again (`generate(..., state=...)`): many continuations of one long
prompt, or a chat whose every turn appends to the same cache.

The invariant: the cache holds every token of each row's context, and `next_logits` are the
model's logits for the token after them. Continuing feeds the new tokens (if any) in one
call, then samples from the last logits exactly as `generate` does after a prefill, so a
continuation equals generating from the concatenated prompt. Shapes: B batch, T new tokens,
C context buffer (= cache capacity), V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax.model import lora_rows

from .automaton import RowConstraints
from .loop import DecodeState, StopConditions, initial_state, record
from .plan import ON_DEVICE, LoopPlan
from .sampling import SamplingParams, row_keys
from .tracing import count_trace


@dataclasses.dataclass(frozen=True, eq=False)
class PromptState:
    """What a continuation needs; treat it as immutable (continuing never changes it).

    config, params:  the model it was made with; continuing with others is a ValueError.
    cache:           the model cache holding every token of each row's context.
    next_logits:     [B, V] float32 logits of each row's next token.
    context:         [B, C] int32 each row's tokens so far (prompt, then generated and
                     appended ones; BOS then the target for an encoder-decoder), which
                     repetition penalties and logit processors read.
    context_lengths: [B] int32.
    """

    config: M.TransformerConfig
    params: Any
    cache: M.KVCache
    next_logits: jax.Array
    context: jax.Array
    context_lengths: jax.Array

    @property
    def batch_size(self) -> int:
        return self.context.shape[0]

    @property
    def capacity(self) -> int:
        return self.cache.capacity


def prompt_context(config: M.TransformerConfig, tokens_BP: jax.Array, lengths_B: jax.Array,
                   width: int) -> tuple[jax.Array, jax.Array]:
    """The context [B, width] a prefill leaves (`model.target_start`)."""
    tokens_BP, lengths_B = M.target_start(config, tokens_BP, lengths_B)
    context_BC = jnp.zeros((tokens_BP.shape[0], width), jnp.int32)
    return context_BC.at[:, :tokens_BP.shape[1]].set(tokens_BP), lengths_B


@functools.partial(jax.jit, static_argnums=(0, 4))
def prefill_state(config, params, tokens_BP, lengths_B, capacity: int, adapters=None,
                  adapter_B=None):
    """(cache, next_logits, context, context_lengths) of prompts prefilled into `capacity`;
    row b adds LoRA adapter `adapter_B[b]` of `adapters` (`model.lora_rows`), if given."""
    count_trace("prefill")
    logits_BV, cache = M.prefill(config, params, tokens_BP, lengths_B, capacity,
                                 adapters=lora_rows.for_rows(adapters, adapter_B))
    return (cache, logits_BV, *prompt_context(config, tokens_BP, lengths_B, capacity))


@functools.partial(jax.jit, static_argnums=(0, 9, 12, 13, 14), static_argnames="step_tokens")
def resume(config, params, cache, next_logits_BV, context_BC, context_lengths_B, new_BT,
           new_lengths_B, rng, buffer_len: int, stops: StopConditions,
           sampling: SamplingParams, num_samples: int, processors: tuple,
           plan: LoopPlan = ON_DEVICE, constraints: RowConstraints | None = None,
           step_tokens: int | None = None) -> DecodeState:
    """Feeds the new tokens [B, T] (`new_lengths` valid; T may be 0) after the state's and
    samples each row's first token, as `generate`'s start does after a prefill. With
    `step_tokens` (the most tokens the loop's calls write), the loop's cache keeps windowed
    layers in rings (`model/ring.py`), the kept state's rows copied in."""
    count_trace("resume")
    batch, num_new = new_BT.shape
    if num_new:
        logits_BTV, cache = M.step_fn(config, params)(new_BT, cache, new_lengths_B)
        fed_BV = logits_BTV[jnp.arange(batch), jnp.maximum(new_lengths_B - 1, 0)]
        next_logits_BV = jnp.where((new_lengths_B > 0)[:, None], fed_BV, next_logits_BV)
        slots_BT = context_lengths_B[:, None] + jnp.arange(num_new)
        slots_BT = jnp.where(jnp.arange(num_new) < new_lengths_B[:, None], slots_BT,
                             context_BC.shape[1])
        context_BC = context_BC.at[jnp.arange(batch)[:, None], slots_BT].set(
            new_BT, mode="drop")
        context_lengths_B = context_lengths_B + new_lengths_B
    rows = jnp.repeat(jnp.arange(batch), num_samples)
    in_rings = None if step_tokens is None else M.rows_in_rings(config, cache, rows, step_tokens)
    if num_samples > 1:
        next_logits_BV, context_BC, context_lengths_B = (
            next_logits_BV[rows], context_BC[rows], context_lengths_B[rows])
        cache = cache.take_rows(rows) if in_rings is None else in_rings
    elif in_rings is not None:
        cache = in_rings
    elif not num_new:
        # The loop updates its cache in place (donated), so it must not be the kept one.
        cache = jax.tree.map(jnp.copy, cache)
    state = initial_state(batch * num_samples, buffer_len, cache,
                          row_keys(rng, batch, num_samples), context_BC,
                          context_lengths_B, constraints)
    return record(state, next_logits_BV, stops, sampling, processors, plan)


@functools.partial(jax.jit, static_argnums=0)
def keep(config, params, state: DecodeState):
    """(cache, next_logits, context, context_lengths) after a generation, to continue from.

    The decode loop never feeds a row's last token, and keeps feeding rows that have
    stopped (their writes are ignored), so the cache is cut back to the context less its
    last token, which is then fed to get the next logits."""
    count_trace("keep")
    last_B = state.context_lengths - 1
    pending_B = jnp.take_along_axis(state.context, last_B[:, None], axis=1)
    cache = state.cache.replace(lengths=last_B, overflow=jnp.zeros_like(state.cache.overflow))
    logits_B1V, cache = M.step_fn(config, params)(pending_B, cache)
    capacity = cache.capacity
    context_BC = state.context[:, :capacity]
    context_BC = jnp.pad(context_BC, ((0, 0), (0, capacity - context_BC.shape[1])))
    return cache, logits_B1V[:, 0], context_BC, state.context_lengths


def check_is_state(state) -> None:
    if not isinstance(state, PromptState):
        raise ValueError(f"state must be a PromptState (from decode.prefill or "
                         f"generate(..., return_state=True)), got {type(state).__name__}")


def check_continuation(config: M.TransformerConfig, params, state: PromptState,
                       new_lengths: np.ndarray, max_new_tokens: int) -> None:
    """Raises a ValueError naming what stops `state` from being continued as asked."""
    check_is_state(state)
    if state.config != config:
        raise ValueError(f"state was made with another model: its config is {state.config}, "
                         f"this model's is {config}")
    made_with, given = jax.tree.leaves(state.params), jax.tree.leaves(params)
    if len(made_with) != len(given) or any(a is not b for a, b in zip(made_with, given,
                                                                      strict=False)):
        raise ValueError("params are not the ones the state was made with: continue a state "
                         "with the very params it was prefilled with")
    if len(new_lengths) != state.batch_size:
        raise ValueError(f"{len(new_lengths)} rows of new tokens for a state of "
                         f"{state.batch_size} rows: give one (possibly empty) list per row")
    held = np.asarray(state.cache.lengths)
    overflowed = np.flatnonzero(np.asarray(state.cache.overflow))
    if overflowed.size:
        raise ValueError(f"row {overflowed[0]} of the state filled its cache (capacity "
                         f"{state.capacity}): it cannot be continued")
    # Every token but the last one generated is fed, so n new tokens and m generated ones
    # take n + m - 1 slots; the new tokens are fed padded to the longest row's number.
    longest = int(new_lengths.max())
    for row, (n_held, n_new) in enumerate(zip(held, new_lengths, strict=True)):
        needed = n_held + max(longest, n_new + max_new_tokens - 1)
        if needed > state.capacity:
            raise ValueError(
                f"row {row} holds {n_held} tokens; with {n_new} new tokens (the longest row "
                f"has {longest}) and max_new_tokens={max_new_tokens} it needs {needed} cache "
                f"slots, more than the state's capacity {state.capacity} "
                f"(decode.prefill(..., capacity=...) sets it)")
