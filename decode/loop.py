"""The decode loop: a `lax.while_loop` that feeds one token per row per step, and checks
whether to go on after every step, or after every `plan.steps_per_check` steps (`plan.py`).

The loop sees the model only through `tokens_to_logits(tokens [B, 1], cache) -> (logits
[B, 1, V], cache)`, so it runs unchanged with a fake model in tests. The cache must expose
`lengths` [B] (filled slots) and `capacity`, as `model.KVCache` does.

Shape letters: B batch, O token-buffer length (bucketed max_new_tokens), C context buffer
(prompt slots + O), V vocab.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from .automaton import RowConstraints
from .bad_words import banned_by_words
from .plan import ON_DEVICE, LoopPlan
from .processors import LogitProcessor, ProcessorState, apply_processors, ban, force_end
from .sampling import SamplingParams, sample

TokensToLogits = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


class StopReason(enum.IntEnum):
    """Why a row stopped. PREEMPTED: a serving engine took its cache back, to resume it later
    (`serve/pages.py`); a decode loop never stops a row so."""

    RUNNING = 0
    EOS = 1
    MAX_NEW_TOKENS = 2
    CACHE_FULL = 3
    PREEMPTED = 4


@flax.struct.dataclass
class DecodeState:
    """The while-loop carry.

    step:        scalar int32, tokens generated so far (the next one goes to `tokens[:, step]`).
    tokens:      [B, O] int32 generated tokens; 0 after a row stops.
    lengths:     [B] int32 tokens each row generated, its stopping EOS included.
    last_tokens: [B] int32 the newest token of each row (fed at the next step).
    logprobs:    [B, O] float32 log-probability of each generated token under the model.
    stop_reason: [B] int32 `StopReason`; RUNNING until the row stops.
    cache:       the model's cache pytree, updated in place by XLA (never copied).
    keys:        [B] each row's key (`sampling.row_keys`); step t samples with
                 `fold_in(key, t)`, so no key is reused and no row's draw depends on another.
    context:     [B, C] int32 each row's tokens so far, which logit processors read: the
                 prompt (BOS for an encoder-decoder) and the generated tokens (`ProcessorState`).
    context_lengths: [B] int32 valid tokens of each row's context.
    constraints: each row's token automaton and its state (`automaton.py`), or None when no
                 row is constrained.
    """

    step: jax.Array
    tokens: jax.Array
    lengths: jax.Array
    last_tokens: jax.Array
    logprobs: jax.Array
    stop_reason: jax.Array
    cache: Any
    keys: jax.Array
    context: jax.Array
    context_lengths: jax.Array
    constraints: RowConstraints | None = None

    @property
    def done(self) -> jax.Array:
        return self.stop_reason != StopReason.RUNNING


@flax.struct.dataclass
class StopConditions:
    """eos_ids: [E] int32 ids that end a row (-1 pads unused slots); max_new_tokens: scalar;
    forced_end_id: scalar int32, the token a row that reaches `max_new_tokens` makes last
    (transformers' `forced_eos_token_id`); banned_ids: [banned] int32 ids no row makes (a
    generation config's one-token `bad_words_ids`; -1 pads); bad_words: [words, tokens]
    int32 token sequences no row completes (`decode.bad_words.words_table`: its longer
    `bad_words_ids`). None for any of those compiles nothing for it."""

    eos_ids: jax.Array
    max_new_tokens: jax.Array
    forced_end_id: jax.Array | None = None
    banned_ids: jax.Array | None = None
    bad_words: jax.Array | None = None

    def banned_rows(self, batch: int) -> jax.Array | None:
        """[B, banned] the banned ids of every row, or None."""
        if self.banned_ids is None:
            return None
        return jnp.broadcast_to(self.banned_ids, (batch, self.banned_ids.shape[0]))

    def banned_next(self, context_BC: jax.Array, context_lengths_B: jax.Array
                    ) -> jax.Array | None:
        """[B, banned + words] the ids no row makes next: the banned ids, and the last id of
        each bad word that the row's tokens (its prompt's too, as transformers matches
        them) end with the others of; None without either."""
        batch = context_BC.shape[0]
        banned = self.banned_rows(batch)
        if self.bad_words is None:
            return banned
        words = banned_by_words(jnp.broadcast_to(self.bad_words, (batch, *self.bad_words.shape)),
                                context_BC, context_lengths_B, context_lengths_B)
        return words if banned is None else jnp.concatenate([banned, words], axis=1)

    def forced_at(self, last_B: jax.Array) -> jax.Array | None:
        """[B] int32 the token each row must make now, given which rows make their last
        (`last_B` [B] bool): the forced end id there, -1 (none) elsewhere; None without a
        forced end."""
        if self.forced_end_id is None:
            return None
        return jnp.where(last_B, self.forced_end_id, -1).astype(jnp.int32)


def choose(logits_BV: jax.Array, context: ProcessorState, keys_B: jax.Array, position,
           processors: tuple[LogitProcessor, ...] = (), plan: LoopPlan = ON_DEVICE,
           constraints: RowConstraints | None = None, forced_B: jax.Array | None = None,
           banned_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token [B], its logprob [B], logprobs [B, V]): each row's next token, as every
    decoder in kvjax picks it: the built-in penalties and `processors` on the logits, then
    the ids `banned_ids` ([B, banned], or None) names banned, then the row's constraint,
    then a forced token where `forced_B` [B] names one (not -1: a row's end at its budget,
    which overrides the rest, as in transformers), then greedy or a draw with the row's key
    folded with `position` (a scalar or [B], `sampling`). The logprobs are the model's,
    before any processor."""
    processed_BV = apply_processors(logits_BV, context, processors, plan)
    if banned_ids is not None:
        processed_BV = ban(processed_BV, banned_ids)
    if constraints is not None:
        processed_BV = constraints.mask(processed_BV)
    if forced_B is not None:
        processed_BV = force_end(processed_BV, forced_B)
    token_B = sample(processed_BV, keys_B, context.settings, plan.sampled, position)
    logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32))
    logprob_B = jnp.take_along_axis(logprobs_BV, token_B[:, None], axis=-1)[:, 0]
    return token_B, logprob_B, logprobs_BV


def take(rows, token_B: jax.Array, live_B: jax.Array, stop_ids_BE: jax.Array,
         reached_max_B: jax.Array, forced_B: jax.Array | None = None):
    """(rows, token [B], ends [B]): every `live` row takes its token, which becomes its newest
    and joins its context, and stops if it is a stop id or the row reached its budget; other
    rows keep theirs and their token reads 0. `forced_B` [B] (or None): the token each row
    was forced to make (-1: none), whose end is its budget's. `rows` is any state with
    `last_tokens`, `stop_reason`, `context` and `context_lengths` ([B] / [B, C]): the decode
    loop's and the server's slots both end rows here."""
    token_B = jnp.where(live_B, token_B, 0)
    stop_reason_B, ends_B = stop_reasons(live_B, token_B, stop_ids_BE, reached_max_B,
                                         rows.stop_reason,
                                         None if forced_B is None else forced_B >= 0)
    slots_B = jnp.where(live_B, rows.context_lengths, rows.context.shape[1])
    rows = rows.replace(
        last_tokens=jnp.where(live_B, token_B, rows.last_tokens),
        stop_reason=stop_reason_B,
        context=append_context(rows.context, slots_B, token_B),
        context_lengths=rows.context_lengths + live_B)
    return rows, token_B, ends_B


def record(state: DecodeState, logits_BV: jax.Array, stops: StopConditions,
           sampling: SamplingParams, processors: tuple[LogitProcessor, ...] = (),
           plan: LoopPlan = ON_DEVICE, active: jax.Array | None = None) -> DecodeState:
    """Samples the next token of every running row and decides which rows stop. With
    `active` (a traced bool) False, nothing changes but slots past what is recorded."""
    reached_max = state.step + 1 >= stops.max_new_tokens
    forced_B = stops.forced_at(jnp.broadcast_to(reached_max, state.lengths.shape))
    token_B, logprob_B, _ = choose(
        logits_BV, ProcessorState(state.context, state.context_lengths, state.step, sampling,
                                  state.lengths,
                                  jnp.broadcast_to(stops.eos_ids, (state.lengths.shape[0],
                                                                   stops.eos_ids.shape[0]))),
        state.keys, state.step, processors, plan, state.constraints, forced_B,
        stops.banned_next(state.context, state.context_lengths))
    running_B = ~state.done if active is None else ~state.done & active
    after, token_B, _ = take(state, token_B, running_B, stops.eos_ids[None, :], reached_max,
                             forced_B)
    return after.replace(
        step=state.step + (1 if active is None else active.astype(jnp.int32)),
        tokens=state.tokens.at[:, state.step].set(token_B),
        lengths=state.lengths + running_B,
        logprobs=state.logprobs.at[:, state.step].set(jnp.where(running_B, logprob_B, 0.0)),
        constraints=None if state.constraints is None else
        state.constraints.advance(token_B, running_B),
    )


def stop_reasons(running_B: jax.Array, token_B: jax.Array, stop_ids_BE: jax.Array,
                 reached_max_B: jax.Array, stop_reason_B: jax.Array,
                 forced_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(each row's stop reason [B], which running rows end [B]) after the running rows took
    `token`: EOS if it is one of the row's stop ids (-1 pads), MAX_NEW_TOKENS if the row
    reached its budget, as it did where `forced_B` [B] (or None) says its token was its
    forced end; other rows keep theirs."""
    is_stop_B = jnp.any(token_B[:, None] == stop_ids_BE, axis=-1)
    chose_stop_B = is_stop_B if forced_B is None else is_stop_B & ~forced_B
    reason_B = jnp.where(running_B & chose_stop_B, StopReason.EOS,
                         jnp.where(running_B & reached_max_B, StopReason.MAX_NEW_TOKENS,
                                   stop_reason_B))
    return reason_B.astype(jnp.int32), running_B & (is_stop_B | reached_max_B)


def append_context(context_BC: jax.Array, slots_B: jax.Array, token_B: jax.Array) -> jax.Array:
    """Writes each row's token at its slot (a slot past the end writes nothing). Mapped over
    rows, the scatter has the batch as its batch axis: rows split over devices are written
    where they lie, without gathering every row's slot first."""
    def write(row_C, slot, token):
        return row_C.at[slot].set(token, mode="drop")

    return jax.vmap(write)(context_BC, slots_B, token_B)


def initial_state(batch: int, buffer_len: int, cache: Any, keys_B: jax.Array,
                  context_BC: jax.Array | None = None,
                  context_lengths_B: jax.Array | None = None,
                  constraints: RowConstraints | None = None) -> DecodeState:
    """The state before the first token. `context` [B, C] holds each row's tokens so far
    (`context_lengths` valid) with room for the ones to come; without it the context starts
    empty with room for `buffer_len`. `constraints`: the rows' automata, if any."""
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
        keys=keys_B,
        context=jnp.asarray(context_BC, jnp.int32),
        context_lengths=jnp.asarray(context_lengths_B, jnp.int32),
        constraints=constraints,
    )


def decode_loop(tokens_to_logits: TokensToLogits, state: DecodeState, stops: StopConditions,
                sampling: SamplingParams, step_limit: jax.Array,
                processors: tuple[LogitProcessor, ...] = (),
                plan: LoopPlan = ON_DEVICE) -> DecodeState:
    """Runs decode steps until every row is done or `step_limit` tokens exist.

    Each step feeds every row's newest token, which writes its K/V into the cache, and
    samples the next one. A row whose cache has no free slot stops with CACHE_FULL before it
    is fed, so nothing is ever written past the capacity. `step_limit` (traced) lets
    streaming run the same loop a chunk at a time. `processors` change the logits before
    sampling (see processors.py).

    With `plan.steps_per_check` k > 1 each iteration runs k steps in a loop of known trip
    count. A step taken once every row is done or `step_limit` is reached is inactive: it
    feeds every row a token of length 0 (the cache's lengths stay; the K/V written past
    them are overwritten before anything reads them) and records nothing, so the outputs
    are those of one step per iteration. `tokens_to_logits` must then take the per-row
    lengths as `model.step` does.
    """

    def cond_fn(state: DecodeState) -> jax.Array:
        return (state.step < step_limit) & ~jnp.all(state.done)

    def step(state: DecodeState, active: jax.Array | None = None) -> DecodeState:
        running_B = ~state.done if active is None else ~state.done & active
        cache_full_B = state.cache.lengths >= state.cache.capacity
        state = state.replace(stop_reason=jnp.where(
            running_B & cache_full_B, StopReason.CACHE_FULL, state.stop_reason))
        tokens_B1 = state.last_tokens[:, None]
        if active is None:
            logits_B1V, cache = tokens_to_logits(tokens_B1, state.cache)
        else:
            fed_B = jnp.broadcast_to(active.astype(jnp.int32), state.lengths.shape)
            logits_B1V, cache = tokens_to_logits(tokens_B1, state.cache, fed_B)
        return record(state.replace(cache=cache), logits_B1V[:, -1], stops, sampling,
                      processors, plan, active)

    def body_fn(state: DecodeState) -> DecodeState:
        if plan.steps_per_check == 1:
            return step(state)
        return jax.lax.fori_loop(0, plan.steps_per_check,
                                 lambda _, state: step(state, cond_fn(state)), state)

    return jax.lax.while_loop(cond_fn, body_fn, state)
