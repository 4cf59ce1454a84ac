"""Speculative decoding by prompt lookup, inside the compiled decode loop.

Each iteration drafts up to k tokens per row with no second model: the k tokens that
followed the latest earlier occurrence of the row's last n tokens in its context (prompt
and output), preferring the latest one that k known tokens follow. One model call of
T = k + 1 tokens per row (the newest token, then the draft) verifies the whole draft
through the cache; each row keeps the longest prefix of its draft that the model would
have chosen itself, plus the model's own token after it, so one call emits 1 to k + 1
tokens. Rollback is not advancing: the cache's `lengths` are set to what
each row accepted, and the K/V written past it are overwritten later, unread.

Greedy rows emit exactly what plain greedy decoding emits. Sampled rows use rejection
sampling; a prompt-lookup draft is a point mass q = δ(x), so the draft token is accepted
with probability p(x) and otherwise the token is drawn from p with x removed and
renormalised, where p is the target distribution after every sampling filter. The output
is then distributed exactly as plain sampling's (not sample-for-sample equal).

`num_draft_tokens` (k) is static: it sets T, the shape of the verifying call. `ngram_size`
(n, at most MAX_NGRAM_SIZE) is traced. The model sees T = k + 1 tokens only when some running
row has a draft and every running row has room for all k + 1 in its cache (a write that
does not fit is skipped whole, never clamped); otherwise the iteration is a plain
one-token step, so a batch with nothing to draft pays for no verification, and rows near
the end of their cache finish one token at a time, as without speculation.

Shape letters: B batch, N token buffer, C context buffer, K draft length k, T = K + 1,
V vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax import parallel

from .loop import DecodeState, StopConditions, StopReason, TokensToLogits
from .sampling import SamplingParams, filter_logits
from .tracing import count_trace

MAX_NGRAM_SIZE = 8  # n is traced; the match unrolls this many comparisons
METHODS = ("ngram",)


@dataclasses.dataclass(frozen=True)
class Speculative:
    """How to draft. method: 'ngram' (prompt lookup); num_draft_tokens: k drafted tokens
    per row and step; ngram_size: n, the length of the suffix looked up in the context."""

    method: str = "ngram"
    num_draft_tokens: int = 4
    ngram_size: int = 2

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {METHODS}")
        for name, value, top in (("num_draft_tokens", self.num_draft_tokens, 64),
                                 ("ngram_size", self.ngram_size, MAX_NGRAM_SIZE)):
            if (not isinstance(value, int | np.integer) or isinstance(value, bool)
                    or not 1 <= value <= top):
                raise ValueError(f"{name}={value!r} must be an integer in [1, {top}]")


@flax.struct.dataclass
class SpeculationStats:
    """drafted [B]: draft tokens proposed to running rows; accepted [B]: draft tokens kept;
    steps: scalar, model calls of the decode loop (verifying or plain)."""

    drafted: jax.Array
    accepted: jax.Array
    steps: jax.Array

    @property
    def acceptance_rate(self) -> float:
        return float(np.sum(self.accepted) / max(int(np.sum(self.drafted)), 1))


@flax.struct.dataclass
class SpeculativeState:
    """The loop carry: the plain loop's state (its `step` is the number of leading
    tokens every row has settled, see `settled`) and the statistics."""

    decode: DecodeState
    stats: SpeculationStats


def ngram_drafts(context_BC: jax.Array, lengths_B: jax.Array, ngram_size: jax.Array,
                 num_draft: int) -> tuple[jax.Array, jax.Array]:
    """(drafts [B, K], valid drafts [B]): per row, the K tokens after the latest earlier
    occurrence of its last `ngram_size` tokens that has K tokens after it (else after the
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
    slots_BK = first_B[:, None] + jnp.arange(num_draft)
    drafts_BK = jnp.take_along_axis(padded_BC, jnp.clip(slots_BK, 0, padded_BC.shape[1] - 1),
                                    axis=1)
    valid_B = jnp.where(latest_B >= 0, jnp.clip(lengths_B - first_B, 0, num_draft), 0)
    return drafts_BK, valid_B


def choose(logits_BTV: jax.Array, drafts_BK: jax.Array, valid_B: jax.Array,
           sampling: SamplingParams, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, T], accepted [B]): row b emits tokens[b, :accepted[b] + 1], its first
    `accepted` drafts followed by one token of the model's.

    logits[:, t] are the model's logits after the newest token and the first t drafts.
    Greedy rows accept a draft iff it is the argmax. Sampled rows accept draft x with
    probability p(x) and replace the first rejected one by a draw from p without x."""
    batch, num_tokens, vocab = logits_BTV.shape
    num_draft = num_tokens - 1
    greedy_B = jnp.broadcast_to(sampling.is_greedy, (batch,))
    argmax_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    drafted_BK = jnp.arange(num_draft)[None] < valid_B[:, None]

    def greedy(_):
        return argmax_BT, drafted_BK & (drafts_BK == argmax_BT[:, :num_draft])

    def sampled(_):
        rows = sampling.rows(batch)
        per_token = jax.tree.map(lambda x: jnp.repeat(x, num_tokens), rows)
        filtered_BTV = filter_logits(logits_BTV.reshape(-1, vocab), per_token).reshape(
            batch, num_tokens, vocab)
        probs_BKV = jax.nn.softmax(filtered_BTV[:, :num_draft], axis=-1)
        p_draft_BK = jnp.take_along_axis(probs_BKV, drafts_BK[..., None], axis=-1)[..., 0]
        accept_rng, draw_rng = jax.random.split(rng)
        uniform_BK = jax.random.uniform(accept_rng, (batch, num_draft))
        keep_BK = drafted_BK & (uniform_BK < p_draft_BK)
        # A rejected draft is removed from its position's distribution; positions without
        # a draft (and the one after the last draft) draw from p itself.
        rejected_BTV = jnp.pad(drafted_BK, ((0, 0), (0, 1)))[..., None] & (
            jnp.arange(vocab) == jnp.pad(drafts_BK, ((0, 0), (0, 1)))[..., None])
        residual_BTV = jnp.where(rejected_BTV, -jnp.inf, filtered_BTV)
        drawn_BT = jax.random.categorical(draw_rng, residual_BTV, axis=-1).astype(jnp.int32)
        return (jnp.where(greedy_B[:, None], argmax_BT, drawn_BT),
                jnp.where(greedy_B[:, None], drafted_BK & (drafts_BK == argmax_BT[:, :-1]),
                          keep_BK))

    model_BT, keep_BK = jax.lax.cond(jnp.all(greedy_B), greedy, sampled, None)
    accepted_B = jnp.sum(jnp.cumprod(keep_BK, axis=1), axis=1).astype(jnp.int32)
    positions_T = jnp.arange(num_tokens)
    draft_BT = jnp.pad(drafts_BK, ((0, 0), (0, 1)))
    tokens_BT = jnp.where(positions_T[None] < accepted_B[:, None], draft_BT, model_BT)
    return tokens_BT, accepted_B


def settled(state: DecodeState) -> jax.Array:
    """Leading tokens that every row has settled: a stopped row's are all settled."""
    return jnp.min(jnp.where(state.done, state.tokens.shape[1], state.lengths))


def advance(state: DecodeState, old_cache_lengths_B: jax.Array, logits_BTV: jax.Array,
            tokens_BT: jax.Array, accepted_B: jax.Array, stops: StopConditions
            ) -> tuple[DecodeState, jax.Array]:
    """Appends each running row's accepted tokens, cut after an eos and at max_new_tokens,
    and sets its cache length to the tokens it now has fed. Returns the state and the
    tokens each row emitted [B]."""
    batch, num_tokens = tokens_BT.shape
    running_B = ~state.done
    positions_T = jnp.arange(num_tokens)
    is_eos_BT = jnp.any(tokens_BT[..., None] == stops.eos_ids, axis=-1)
    first_eos_B = jnp.min(jnp.where(is_eos_BT, positions_T[None], num_tokens), axis=1)
    emitted_B = jnp.minimum(jnp.minimum(accepted_B, first_eos_B) + 1,
                            stops.max_new_tokens - state.lengths)
    emitted_B = jnp.where(running_B, emitted_B, 0)
    kept_BT = positions_T[None] < emitted_B[:, None]
    eos_B = jnp.any(kept_BT & is_eos_BT, axis=1)
    full_B = state.lengths + emitted_B >= stops.max_new_tokens
    stop_reason_B = jnp.where(running_B & eos_B, StopReason.EOS, jnp.where(
        running_B & full_B, StopReason.MAX_NEW_TOKENS, state.stop_reason))
    logprobs_BT = jnp.take_along_axis(jax.nn.log_softmax(logits_BTV.astype(jnp.float32)),
                                      tokens_BT[..., None], axis=-1)[..., 0]
    rows_B1 = jnp.arange(batch)[:, None]

    def put(buffer, starts_B, values_BT):
        slots_BT = jnp.where(kept_BT, starts_B[:, None] + positions_T, buffer.shape[1])
        return buffer.at[rows_B1, slots_BT].set(values_BT, mode="drop")

    newest_B = jnp.take_along_axis(tokens_BT, jnp.maximum(emitted_B - 1, 0)[:, None], 1)[:, 0]
    cache = state.cache.replace(lengths=old_cache_lengths_B + emitted_B)
    state = state.replace(
        tokens=put(state.tokens, state.lengths, tokens_BT),
        logprobs=put(state.logprobs, state.lengths, logprobs_BT),
        context=put(state.context, state.context_lengths, tokens_BT),
        lengths=state.lengths + emitted_B,
        context_lengths=state.context_lengths + emitted_B,
        last_tokens=jnp.where(running_B, newest_B, 0),
        stop_reason=stop_reason_B.astype(jnp.int32),
        cache=cache)
    return state.replace(step=settled(state)), emitted_B


def speculative_loop(tokens_to_logits: TokensToLogits, state: DecodeState,
                     stats: SpeculationStats, stops: StopConditions,
                     sampling: SamplingParams, step_limit: jax.Array, num_draft: int,
                     ngram_size: jax.Array) -> SpeculativeState:
    """Runs verify steps until every row is done or has `step_limit` tokens.

    `tokens_to_logits(tokens [B, T], cache, lengths [B])` is the model's step; rows that
    have stopped are fed with zero valid tokens, so their cache never grows."""

    def cond_fn(carry: SpeculativeState) -> jax.Array:
        decode = carry.decode
        return (settled(decode) < step_limit) & ~jnp.all(decode.done)

    def body_fn(carry: SpeculativeState) -> SpeculativeState:
        state, stats = carry.decode, carry.stats
        old_lengths_B = state.cache.lengths
        room_B = state.cache.capacity - old_lengths_B
        state = state.replace(stop_reason=jnp.where(
            ~state.done & (room_B < 1), StopReason.CACHE_FULL, state.stop_reason))
        running_B = ~state.done
        drafts_BK, valid_B = ngram_drafts(state.context, state.context_lengths, ngram_size,
                                          num_draft)
        valid_B = jnp.where(running_B, valid_B, 0)
        rng = jax.random.fold_in(state.rng, stats.steps + 1)

        def feed(cache, drafts_BK):
            fed_BT = jnp.concatenate([state.last_tokens[:, None], drafts_BK], axis=1)
            fed_lengths_B = jnp.where(running_B, fed_BT.shape[1], 0)
            logits_BTV, cache = tokens_to_logits(fed_BT, cache, fed_lengths_B)
            # A plain step's logits fill only the first of the T positions: with no valid
            # draft, nothing after it is read.
            padding = num_draft + 1 - fed_BT.shape[1]
            return jnp.pad(logits_BTV, ((0, 0), (0, padding), (0, 0))), cache

        worth_it = jnp.any(valid_B > 0) & jnp.all(~running_B | (room_B > num_draft))
        logits_BTV, cache = either_call(worth_it, lambda cache: feed(cache, drafts_BK),
                                        lambda cache: feed(cache, drafts_BK[:, :0]),
                                        state.cache)
        valid_B = jnp.where(worth_it, valid_B, 0)
        tokens_BT, accepted_B = choose(logits_BTV, drafts_BK, valid_B, sampling, rng)
        new_state, _ = advance(state.replace(cache=cache), old_lengths_B, logits_BTV,
                               tokens_BT, accepted_B, stops)
        accepted_B = jnp.minimum(accepted_B, new_state.lengths - state.lengths)
        state = new_state
        stats = SpeculationStats(
            drafted=stats.drafted + valid_B,
            accepted=stats.accepted + accepted_B,
            steps=stats.steps + 1)
        return SpeculativeState(state, stats)

    return jax.lax.while_loop(cond_fn, body_fn, SpeculativeState(state, stats))


def either_call(pred: jax.Array, if_true, if_false, cache):
    """`lax.cond(pred, if_true, if_false, cache)` for two model calls `cache -> (logits
    [B, T, V], cache)`, as two while loops of at most one iteration: XLA updates the cache
    in place through a while loop, where a conditional copies it whole."""
    def once(call):
        def body(carry):
            return (*call(carry[1]), jnp.asarray(False))
        return body

    logits = jax.eval_shape(if_true, cache)[0]
    carry = (jnp.zeros(logits.shape, logits.dtype), cache, jnp.asarray(True))
    carry = jax.lax.while_loop(lambda c: c[2] & pred, once(if_true), carry)
    carry = jax.lax.while_loop(lambda c: c[2] & ~pred, once(if_false), carry)
    return carry[0], carry[1]


def no_stats(batch: int) -> SpeculationStats:
    zeros = jnp.zeros((batch,), jnp.int32)
    return SpeculationStats(zeros, zeros, jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 7), static_argnames="mesh",
                   donate_argnums=2)
def continue_speculative(config, params, state: DecodeState, stats: SpeculationStats,
                         stops: StopConditions, sampling: SamplingParams, step_limit,
                         num_draft: int, ngram_size, mesh=None) -> SpeculativeState:
    """`generate`'s decode program with prompt-lookup drafts (see the module docstring)."""
    count_trace("speculative")
    state = parallel.constrain_rows(state, mesh)
    model_step = M.step_fn(config, params)

    def step(tokens_BT, cache, lengths_B):  # the cache keeps its layout over the devices
        logits_BTV, cache = model_step(tokens_BT, cache, lengths_B)
        return logits_BTV, parallel.constrain_rows(cache, mesh)

    return speculative_loop(step, state.replace(step=settled(state)), stats, stops, sampling,
                            step_limit, num_draft, ngram_size)


def check_supported(speculative, *, num_beams: int, processors, settings: dict,
                    defaults: dict) -> Speculative:
    """`speculative` checked against the other settings of a call."""
    if not isinstance(speculative, Speculative):
        raise ValueError(f"speculative must be a decode.Speculative, got "
                         f"{type(speculative).__name__}")
    if num_beams != 1:
        raise ValueError(f"speculative decoding does not go with beam search "
                         f"(num_beams={num_beams})")
    if processors:
        raise ValueError("speculative decoding does not take logit_processors: they would "
                         "see a context that does not yet hold the draft")
    for name in ("repetition_penalty", "no_repeat_ngram_size"):
        if np.any(np.asarray(settings.get(name, defaults[name])) != defaults[name]):
            raise ValueError(f"speculative decoding does not take {name}="
                             f"{settings[name]} (it reads the context the draft changes)")
    return speculative
