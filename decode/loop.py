"""The decode loop: one `lax.while_loop` that feeds one token per row per iteration.

The loop sees the model only through `tokens_to_logits(tokens [B, 1], cache) -> (logits
[B, 1, V], cache)`, so it runs unchanged with a fake model in tests. The cache must expose
`lengths` [B] (filled slots) and `capacity`, as `model.KVCache` does.

Shape letters: B batch, N token-buffer length (bucketed max_new_tokens), C context buffer
(prompt slots + N), V vocab.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from .processors import LogitProcessor, ProcessorState, apply_processors
from .sampling import SamplingParams, sample

TokensToLogits = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


class StopReason(enum.IntEnum):
    RUNNING = 0
    EOS = 1
    MAX_NEW_TOKENS = 2
    CACHE_FULL = 3


@flax.struct.dataclass
class DecodeState:
    """The while-loop carry.

    step:        scalar int32, tokens generated so far (the next one goes to `tokens[:, step]`).
    tokens:      [B, N] int32 generated tokens; 0 after a row stops.
    lengths:     [B] int32 tokens each row generated, its stopping EOS included.
    last_tokens: [B] int32 the newest token of each row (fed at the next step).
    logprobs:    [B, N] float32 log-probability of each generated token under the model.
    stop_reason: [B] int32 `StopReason`; RUNNING until the row stops.
    cache:       the model's cache pytree, updated in place by XLA (never copied).
    rng:         the base key; step t samples with `fold_in(rng, t)`, so no key is reused.
    context:     [B, C] int32 each row's tokens so far, which logit processors read: the
                 prompt (BOS for an encoder-decoder) and the generated tokens (`ProcessorState`).
    context_lengths: [B] int32 valid tokens of each row's context.
    """

    step: jax.Array
    tokens: jax.Array
    lengths: jax.Array
    last_tokens: jax.Array
    logprobs: jax.Array
    stop_reason: jax.Array
    cache: Any
    rng: jax.Array
    context: jax.Array
    context_lengths: jax.Array

    @property
    def done(self) -> jax.Array:
        return self.stop_reason != StopReason.RUNNING


@flax.struct.dataclass
class StopConditions:
    """eos_ids: [E] int32 ids that end a row (-1 pads unused slots); max_new_tokens: scalar."""

    eos_ids: jax.Array
    max_new_tokens: jax.Array


def record(state: DecodeState, logits_BV: jax.Array, stops: StopConditions,
           sampling: SamplingParams, processors: tuple[LogitProcessor, ...] = ()
           ) -> DecodeState:
    """Samples the next token of every running row and decides which rows stop."""
    rng = jax.random.fold_in(state.rng, state.step)
    processed_BV = apply_processors(logits_BV, ProcessorState(
        state.context, state.context_lengths, state.step, sampling), processors)
    token_B = sample(processed_BV, rng, sampling)
    logprob_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV.astype(jnp.float32)),
                                    token_B[:, None], axis=-1)[:, 0]
    running_B = ~state.done
    token_B = jnp.where(running_B, token_B, 0)
    is_eos_B = jnp.any(token_B[:, None] == stops.eos_ids[None, :], axis=-1)
    reached_max = state.step + 1 >= stops.max_new_tokens
    stop_reason = jnp.where(
        running_B & is_eos_B, StopReason.EOS,
        jnp.where(running_B & reached_max, StopReason.MAX_NEW_TOKENS, state.stop_reason))
    return state.replace(
        step=state.step + 1,
        tokens=state.tokens.at[:, state.step].set(token_B),
        lengths=state.lengths + running_B,
        last_tokens=token_B,
        logprobs=state.logprobs.at[:, state.step].set(jnp.where(running_B, logprob_B, 0.0)),
        stop_reason=stop_reason.astype(jnp.int32),
        context=state.context.at[jnp.arange(token_B.shape[0]), jnp.where(
            running_B, state.context_lengths, state.context.shape[1])].set(token_B, mode="drop"),
        context_lengths=state.context_lengths + running_B,
    )


def initial_state(batch: int, buffer_len: int, cache: Any, rng: jax.Array,
                  context_BC: jax.Array | None = None,
                  context_lengths_B: jax.Array | None = None) -> DecodeState:
    """The state before the first token. `context` [B, C] holds each row's tokens so far
    (`context_lengths` valid) with room for the ones to come; without it the context starts
    empty with room for `buffer_len`."""
    if context_BC is None:
        context_BC = jnp.zeros((batch, buffer_len), jnp.int32)
        context_lengths_B = jnp.zeros((batch,), jnp.int32)
    return DecodeState(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.zeros((batch, buffer_len), jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
        last_tokens=jnp.zeros((batch,), jnp.int32),
        logprobs=jnp.zeros((batch, buffer_len), jnp.float32),
        stop_reason=jnp.zeros((batch,), jnp.int32),
        cache=cache,
        rng=rng,
        context=jnp.asarray(context_BC, jnp.int32),
        context_lengths=jnp.asarray(context_lengths_B, jnp.int32),
    )


def decode_loop(tokens_to_logits: TokensToLogits, state: DecodeState, stops: StopConditions,
                sampling: SamplingParams, step_limit: jax.Array,
                processors: tuple[LogitProcessor, ...] = ()) -> DecodeState:
    """Runs decode steps until every row is done or `step_limit` tokens exist.

    Each iteration feeds every row's newest token, which writes its K/V into the cache,
    and samples the next one. A row whose cache has no free slot stops with CACHE_FULL
    before it is fed, so nothing is ever written past the capacity.
    `step_limit` (traced) lets streaming run the same loop a chunk at a time. `processors`
    change the logits before sampling (see processors.py).
    """

    def cond_fn(state: DecodeState) -> jax.Array:
        return (state.step < step_limit) & ~jnp.all(state.done)

    def body_fn(state: DecodeState) -> DecodeState:
        cache_full_B = state.cache.lengths >= state.cache.capacity
        state = state.replace(stop_reason=jnp.where(
            ~state.done & cache_full_B, StopReason.CACHE_FULL, state.stop_reason))
        logits_B1V, cache = tokens_to_logits(state.last_tokens[:, None], state.cache)
        return record(state.replace(cache=cache), logits_B1V[:, -1], stops, sampling,
                      processors)

    return jax.lax.while_loop(cond_fn, body_fn, state)
