"""Beam search in a compiled `lax.while_loop`, for both model variants: `start` prefills
and takes the first step, `advance` steps on to the end or to a step limit (a caller that
runs other work between chunks of steps gives one).

Each of the W beams of a row is one row of the cache (batch B·W). Every step extends each
alive beam by every token, keeps the 2W best candidates, moves those ending in EOS among the
best W to the finished pool (scored with a length penalty; a token a constraint gives, such as
a translator's forced first token, adds 0, as transformers scores it) and keeps the W best
others alive; the cache rows are then reordered by the beam each survivor came from. Under
a constraint (`automaton.py`) each beam carries its automaton state: only the tokens it
allows are candidates, and a survivor moves on from the state of the beam it came from.
Shapes: B batch, W beams, O token buffer, V vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from kvjax import model as M
from kvjax import parallel
from kvjax.model import lora_rows

from .automaton import RowConstraints
from .bad_words import MAX_WORD_TOKENS, newest_tokens
from .loop import StopConditions, StopReason
from .processors import ban
from .tracing import count_trace

NEG_INF = -1e9  # finite, so that sums of "impossible" stay comparable and never NaN


@flax.struct.dataclass
class BeamState:
    """The while-loop carry.

    step:                scalar int32, tokens in every alive beam.
    alive_tokens:        [B, W, N] int32.
    alive_logprob:       [B, W] float32 summed log-probability (NEG_INF: no such beam).
    alive_token_logprobs: [B, W, N] float32 per-token log-probabilities.
    finished_tokens / finished_token_logprobs: [B, W, N]; finished_lengths: [B, W] int32.
    finished_score:      [B, W] float32 length-penalised score (NEG_INF: empty slot).
    cache:               model cache with batch B·W, row b·W + w for beam w of row b.
    constraints:         each beam's automaton state [B·W] and the tables, or None.
    prompt_tail:         [B, MAX_WORD_TOKENS - 1] int32 each row's newest context tokens
                         before the search (right-aligned, -1 before them), which bad words
                         match with a beam's tokens; None without bad words.
    """

    step: jax.Array
    alive_tokens: jax.Array
    alive_logprob: jax.Array
    alive_token_logprobs: jax.Array
    finished_tokens: jax.Array
    finished_token_logprobs: jax.Array
    finished_lengths: jax.Array
    finished_score: jax.Array
    cache: Any
    constraints: RowConstraints | None = None
    prompt_tail: jax.Array | None = None

    @property
    def last_tokens(self) -> jax.Array:
        return jnp.take(self.alive_tokens, jnp.maximum(self.step - 1, 0), axis=2)


@flax.struct.dataclass
class BeamResult:
    """The best `num_return` hypotheses of each row, best first, row b·num_return + j the
    j-th of row b: tokens / logprobs [B·num_return, O], lengths / stop_reason / scores
    [B·num_return]."""

    tokens: jax.Array
    lengths: jax.Array
    stop_reason: jax.Array
    logprobs: jax.Array
    scores: jax.Array


def _penalised(logprob, length, length_penalty):
    return logprob / jnp.maximum(length, 1).astype(jnp.float32) ** length_penalty


def _top(values, k, *arrays):
    """The k largest `values` along the last axis and the matching entries of `arrays`."""
    top_values, index = jax.lax.top_k(values, k)
    return top_values, [jnp.take_along_axis(a, index.reshape(index.shape + (1,) * (
        a.ndim - index.ndim)), axis=index.ndim - 1) for a in arrays]


def beam_step(state: BeamState, logprobs_BWV: jax.Array, stops: StopConditions,
              length_penalty: jax.Array) -> tuple[BeamState, jax.Array]:
    """Extends the beams by one token; returns the new state and the cache rows to gather."""
    batch, width, vocab = logprobs_BWV.shape
    banned = _banned(state, stops)
    if banned is not None:
        logprobs_BWV = jnp.maximum(ban(logprobs_BWV.reshape(batch * width, vocab), banned),
                                   NEG_INF).reshape(batch, width, vocab)
    scores_BWV = logprobs_BWV
    if state.constraints is not None:
        logprobs_BWV = jnp.maximum(state.constraints.mask(
            logprobs_BWV.reshape(batch * width, vocab)), NEG_INF).reshape(batch, width, vocab)
        # A token the constraint gives (a `StartsWith`'s, transformers' forced first token)
        # adds 0 to the beam's score, as a forced end does below; its logprob stays the model's.
        given_BW = state.constraints.is_given().reshape(batch, width)
        scores_BWV = jnp.where(given_BW[..., None] & (logprobs_BWV > NEG_INF / 2), 0.0,
                               logprobs_BWV)
    # A forced end is each beam's only candidate, which adds 0 to its score (as transformers
    # scores it); its logprob stays the model's.
    forced = stops.forced_at(state.step + 1 >= stops.max_new_tokens)
    if forced is not None:
        scores_BWV = jnp.where(
            forced >= 0, jnp.where(jnp.arange(vocab) == forced, 0.0, NEG_INF), scores_BWV)
    candidates = (state.alive_logprob[..., None] + scores_BWV).reshape(batch, width * vocab)
    cand_logprob, flat = jax.lax.top_k(candidates, 2 * width)  # [B, 2W]
    origin, token = flat // vocab, flat % vocab
    token_logprob = jnp.take_along_axis(logprobs_BWV.reshape(batch, -1), flat, axis=1)

    def history(buffer_BWO, new_B2W):  # the origin beam's history plus the new entry
        rows = jnp.take_along_axis(buffer_BWO, origin[..., None], axis=1)
        return rows.at[:, :, state.step].set(new_B2W)

    cand_tokens = history(state.alive_tokens, token)
    cand_token_logprobs = history(state.alive_token_logprobs, token_logprob)
    is_eos = jnp.any(token[..., None] == stops.eos_ids, axis=-1) & (cand_logprob > NEG_INF / 2)
    length = state.step + 1
    constraints = state.constraints
    if constraints is not None:  # each candidate moves on from its origin beam's state
        cand_state = constraints.next_state(
            jnp.take_along_axis(constraints.state.reshape(batch, width), origin, axis=1), token)

    alive_logprob, (alive_tokens, alive_token_logprobs, alive_origin, *alive_state) = _top(
        jnp.where(is_eos, NEG_INF, cand_logprob), width, cand_tokens, cand_token_logprobs,
        origin, *([] if constraints is None else [cand_state]))
    if constraints is not None:
        constraints = constraints.replace(state=alive_state[0].reshape(-1))
    # Of the 2W candidates, those ending in EOS among the best W finish, as transformers
    # keeps them (the others only fill the alive beams up); none stays alive.
    finishing = is_eos & (jnp.arange(2 * width) < width)
    new_score = jnp.where(finishing, _penalised(cand_logprob, length, length_penalty), NEG_INF)
    finished_score, (finished_tokens, finished_token_logprobs, finished_lengths) = _top(
        jnp.concatenate([state.finished_score, new_score], axis=1), width,
        jnp.concatenate([state.finished_tokens, cand_tokens], axis=1),
        jnp.concatenate([state.finished_token_logprobs, cand_token_logprobs], axis=1),
        jnp.concatenate([state.finished_lengths, jnp.full_like(token, length)], axis=1))
    rows = (jnp.arange(batch)[:, None] * width + alive_origin).reshape(-1)
    new_state = state.replace(
        step=length, alive_tokens=alive_tokens, alive_logprob=alive_logprob,
        alive_token_logprobs=alive_token_logprobs, finished_tokens=finished_tokens,
        finished_token_logprobs=finished_token_logprobs, finished_lengths=finished_lengths,
        finished_score=finished_score, constraints=constraints)
    return new_state, rows


def _banned(state: BeamState, stops: StopConditions) -> jax.Array | None:
    """[B·W, banned] the ids no beam makes next (`StopConditions.banned_next`: bad words
    matched against the prompt's tail and the beam's tokens, as transformers matches them),
    or None."""
    batch, width, _ = state.alive_tokens.shape
    if stops.bad_words is None:
        return stops.banned_rows(batch * width)
    tail = state.prompt_tail.shape[1]
    context_BWC = jnp.concatenate(
        [jnp.broadcast_to(state.prompt_tail[:, None], (batch, width, tail)), state.alive_tokens],
        axis=2)
    return stops.banned_next(context_BWC.reshape(batch * width, -1),
                             jnp.full((batch * width,), tail + state.step, jnp.int32))


def is_settled(state: BeamState, max_new_tokens, length_penalty) -> jax.Array:
    """Per row: W hypotheses are finished and no alive beam can still beat the worst one.

    Log-probabilities only fall as a beam grows, so an alive beam's best possible score is
    its current log-probability under the most favourable length penalty ahead."""
    best_alive = jnp.max(state.alive_logprob, axis=1)
    longest = jnp.asarray(max_new_tokens, jnp.float32)
    optimistic = jnp.where(length_penalty > 0, best_alive / longest ** length_penalty,
                           best_alive)
    return jnp.min(state.finished_score, axis=1) >= optimistic


def beam_begin(first_logits_BV: jax.Array, cache: Any, num_beams: int, buffer_len: int,
               stops: StopConditions, length_penalty: jax.Array,
               constraints: RowConstraints | None = None,
               prompt_tail: jax.Array | None = None) -> BeamState:
    """The search after its first token, from the prefill's next-token logits; `cache`
    already has B·W rows, `constraints` (or None) a state per beam, and `prompt_tail`
    (`BeamState`'s; needed with bad words) each row's newest tokens."""
    batch = first_logits_BV.shape[0]
    only_first = jnp.where(jnp.arange(num_beams) == 0, 0.0, NEG_INF)  # beams start identical
    state = BeamState(
        step=jnp.zeros((), jnp.int32),
        alive_tokens=jnp.zeros((batch, num_beams, buffer_len), jnp.int32),
        alive_logprob=jnp.broadcast_to(only_first, (batch, num_beams)),
        alive_token_logprobs=jnp.zeros((batch, num_beams, buffer_len), jnp.float32),
        finished_tokens=jnp.zeros((batch, num_beams, buffer_len), jnp.int32),
        finished_token_logprobs=jnp.zeros((batch, num_beams, buffer_len), jnp.float32),
        finished_lengths=jnp.zeros((batch, num_beams), jnp.int32),
        finished_score=jnp.full((batch, num_beams), NEG_INF, jnp.float32),
        cache=cache,
        constraints=constraints,
        prompt_tail=prompt_tail,
    )
    first_BWV = jnp.repeat(jax.nn.log_softmax(first_logits_BV.astype(jnp.float32))[:, None],
                           num_beams, axis=1)
    state, rows = beam_step(state, first_BWV, stops, length_penalty)
    return state.replace(cache=state.cache.take_rows(rows))


def is_done(state: BeamState, stops: StopConditions, length_penalty) -> jax.Array:
    """Scalar bool: the search is over (its budget spent, every row settled, or a cache
    full)."""
    settled = is_settled(state, stops.max_new_tokens, length_penalty)
    cache_full = jnp.any(state.cache.lengths >= state.cache.capacity)
    return (state.step >= stops.max_new_tokens) | jnp.all(settled) | cache_full


def beam_advance(tokens_to_logits: Callable, state: BeamState, stops: StopConditions,
                 length_penalty: jax.Array, step_limit) -> BeamState:
    """The search stepped on until it is done or has `step_limit` tokens."""
    batch, num_beams = state.alive_logprob.shape

    def cond_fn(state: BeamState) -> jax.Array:
        return ~is_done(state, stops, length_penalty) & (state.step < step_limit)

    def body_fn(state: BeamState) -> BeamState:
        logits, cache = tokens_to_logits(state.last_tokens.reshape(-1, 1), state.cache)
        logprobs = jax.nn.log_softmax(logits[:, -1].astype(jnp.float32))
        state, rows = beam_step(state.replace(cache=cache),
                                logprobs.reshape(batch, num_beams, -1), stops, length_penalty)
        return state.replace(cache=state.cache.take_rows(rows))

    return jax.lax.while_loop(cond_fn, body_fn, state)


def beam_loop(tokens_to_logits: Callable, first_logits_BV: jax.Array, cache: Any,
              num_beams: int, buffer_len: int, stops: StopConditions,
              length_penalty: jax.Array,
              constraints: RowConstraints | None = None, num_return: int = 1,
              prompt_tail: jax.Array | None = None) -> BeamResult:
    """The whole search (`beam_begin`, then `beam_advance` to its end), returning the best
    `num_return` (at most W) hypotheses of each row."""
    state = beam_begin(first_logits_BV, cache, num_beams, buffer_len, stops, length_penalty,
                       constraints, prompt_tail)
    state = beam_advance(tokens_to_logits, state, stops, length_penalty, stops.max_new_tokens)
    return _ranked(state, stops, length_penalty, num_return)


def _ranked(state: BeamState, stops: StopConditions, length_penalty,
            count: int) -> BeamResult:
    """The best `count` of the finished and the still-alive hypotheses (those ran out of
    tokens/cache), as transformers adds the alive ones to the finished when the loop ends.
    One that its forced end finished stopped at its budget."""
    max_new_tokens = stops.max_new_tokens
    alive_score = jnp.where(state.alive_logprob > NEG_INF / 2,
                            _penalised(state.alive_logprob, state.step, length_penalty), NEG_INF)
    scores = jnp.concatenate([state.finished_score, alive_score], axis=1)
    _, ranked = jax.lax.top_k(scores, count)  # [B, count]: ties to the first, as argmax

    def pick(a):  # rows b·count + j
        index = ranked.reshape(ranked.shape + (1,) * (a.ndim - 2))
        return jnp.take_along_axis(a, index, axis=1).reshape((-1,) + a.shape[2:])

    width = state.alive_tokens.shape[1]
    lengths = pick(jnp.concatenate(
        [state.finished_lengths, jnp.full_like(state.finished_lengths, state.step)], 1))
    by_eos = ranked.reshape(-1) < width
    if stops.forced_end_id is not None:
        by_eos &= ~((stops.forced_end_id >= 0) & (lengths >= max_new_tokens))
    return BeamResult(
        tokens=pick(jnp.concatenate([state.finished_tokens, state.alive_tokens], 1)),
        lengths=lengths,
        stop_reason=jnp.where(
            by_eos, StopReason.EOS,
            jnp.where(state.step >= max_new_tokens, StopReason.MAX_NEW_TOKENS,
                      StopReason.CACHE_FULL)).astype(jnp.int32),
        logprobs=pick(jnp.concatenate(
            [state.finished_token_logprobs, state.alive_token_logprobs], 1)),
        scores=pick(scores),
    )


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6), static_argnames=("mesh",))
def start(config, params, tokens_BP, lengths_B, capacity: int, buffer_len: int,
          num_beams: int, stops: StopConditions, length_penalty, mesh=None,
          constraints: RowConstraints | None = None,
          adapters: lora_rows.RowAdapters | None = None) -> BeamState:
    """Prefills each prompt once, copies its cache to W beams and takes the first step
    (`beam_begin`; each beam starting in its prompt's automaton state if `constraints`, with
    a state per row).

    With a `mesh`, the B·W cache rows are split over `data` (the W beams of a row together,
    when `data` divides B) and the kv heads over `model`."""
    count_trace("beam")
    batch = tokens_BP.shape[0]
    first_logits_BV, cache = M.prefill(config, params, tokens_BP, lengths_B, capacity,
                                       adapters=lora_rows.collection_of(adapters, batch),
                                       step_tokens=1)
    cache = cache.take_rows(jnp.repeat(jnp.arange(tokens_BP.shape[0]), num_beams))
    if mesh is not None:
        cache = parallel.constrain_rows(cache, mesh)
    if constraints is not None:
        constraints = constraints.replace(state=jnp.repeat(constraints.state, num_beams))
    prompt_tail = None
    if stops.bad_words is not None:
        context_BC, context_lengths_B = M.target_start(config, tokens_BP, lengths_B)
        prompt_tail = newest_tokens(context_BC, context_lengths_B, MAX_WORD_TOKENS - 1)
    return beam_begin(first_logits_BV, cache, num_beams, buffer_len, stops, length_penalty,
                      constraints, prompt_tail)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("mesh", "num_return"),
                   donate_argnums=2)
def advance(config, params, state: BeamState, stops: StopConditions, length_penalty,
            step_limit, mesh=None, adapters: lora_rows.RowAdapters | None = None,
            num_return: int = 1) -> tuple[BeamState, jax.Array, BeamResult]:
    """(state, done, result): the search from `start` (or an earlier call) stepped on
    until it is done or has `step_limit` tokens; whether it is done (`is_done`); and each
    row's best `num_return` hypotheses so far (`_ranked`), its result once done."""
    count_trace("beam_advance")
    if mesh is not None:
        state = state.replace(cache=parallel.constrain_rows(state.cache, mesh))
    step = M.step_fn(config, params,
                     lora_rows.collection_of(adapters, state.alive_logprob.size))
    state = beam_advance(parallel.keep_rows(step, mesh), state, stops, length_penalty,
                         step_limit)
    return (state, is_done(state, stops, length_penalty),
            _ranked(state, stops, length_penalty, num_return))
