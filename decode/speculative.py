"""Speculative decoding inside the compiled decode loop: prompt-lookup or draft-model drafts.

Each iteration drafts up to k tokens per row, either with no second model (prompt lookup,
`prompt_lookup.py`: the k tokens that followed the latest earlier occurrence of the row's
last n tokens in its context) or with a draft model, a smaller model with the same
vocabulary and its own cache, carried in the loop (`draft_model.py`). One model call of
T = k + 1 tokens per row (the newest token, then the draft) verifies the whole draft
through the cache; each row keeps the longest prefix of its draft that the model would
have chosen itself, plus the model's own token after it, so one call emits 1 to k + 1
tokens. Rollback is not advancing: the caches' `lengths` are set to what each row
accepted, and the K/V written past it are overwritten later, unread.

Greedy rows emit exactly what plain greedy decoding emits. Sampled rows use rejection
sampling: draft x, drawn from q, is accepted with probability min(1, p(x) / q(x)), and the
first rejected one is replaced by a draw from max(p - q, 0), renormalised, where p and q
are the target's and the draft's distributions after every sampling filter; after k
accepted drafts the next token is drawn from p. A prompt-lookup draft is a point mass
q = δ(x): accepted with probability p(x), else replaced by a draw from p without x. The
output is then distributed exactly as plain sampling's (not sample-for-sample equal).

`num_draft_tokens` (k) is static: it sets T, the shape of the verifying call. `ngram_size`
(n, at most MAX_NGRAM_SIZE) and the draft's params are traced. The model sees T = k + 1
tokens only when some running row has a draft and every running row has room for all
k + 1 in its cache (and the draft in its own; a write that does not fit is skipped whole,
never clamped); otherwise the iteration is a plain one-token step, so a batch with nothing
to draft pays for no verification, and rows near the end of their cache finish one token
at a time, as without speculation.

Drafting turns itself off where it does not pay: while the moving average of the tokens a
verifying call emitted per running row (from k + 1 at the start) is below
`min_tokens_per_call` (default 2: a call of k + 1 tokens costs about two of one on a CPU),
iterations are plain steps, but for a verifying probe every `PROBE_EVERY` iterations.

Shape letters: B batch, N token buffer, C context buffer, K draft length k, T = K + 1,
V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax import parallel

from . import draft_model
from .loop import DecodeState, StopConditions, StopReason, TokensToLogits
from .prompt_lookup import MAX_NGRAM_SIZE, ngram_drafts
from .sampling import SamplingParams, filter_logits
from .tracing import count_trace

METHODS = ("ngram", "draft")
PROBE_EVERY = 8  # with drafting off, one iteration in this many still verifies its drafts
RECENT_WEIGHT = 0.25  # of the newest verifying call in the moving average


@dataclasses.dataclass(frozen=True)
class Speculative:
    """How to draft. method: 'ngram' (prompt lookup) or 'draft' (a draft model);
    num_draft_tokens: k drafted tokens per row and step; ngram_size: n, the length of the
    suffix looked up in the context ('ngram' only); draft_model, draft_params: the draft
    model (a kvjax model with the target's vocabulary and variant) and its params ('draft'
    only, see `draft_model.py`); min_tokens_per_call: drafting pays from this many tokens
    per verifying call and row (see above; 0: always draft)."""

    method: str = "ngram"
    num_draft_tokens: int = 4
    ngram_size: int = 2
    draft_model: Any = dataclasses.field(default=None, compare=False)
    draft_params: Any = dataclasses.field(default=None, compare=False, repr=False)
    min_tokens_per_call: float = 2.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {METHODS}")
        is_model = isinstance(self.draft_model, M.DecoderOnlyLM | M.EncoderDecoder)
        if self.method == "draft" and not (is_model and self.draft_params is not None):
            raise ValueError(f"speculative method 'draft' needs draft_model (a kvjax model, got "
                             f"{type(self.draft_model).__name__}) and draft_params")
        if self.method != "draft" and not (self.draft_model is None is self.draft_params):
            raise ValueError(f"speculative method {self.method!r} takes no draft model")
        for name, value, top in (("num_draft_tokens", self.num_draft_tokens, 64),
                                 ("ngram_size", self.ngram_size, MAX_NGRAM_SIZE)):
            if (not isinstance(value, int | np.integer) or isinstance(value, bool)
                    or not 1 <= value <= top):
                raise ValueError(f"{name}={value!r} must be an integer in [1, {top}]")
        bound, value = self.num_draft_tokens + 1, self.min_tokens_per_call
        if not (isinstance(value, int | float | np.number) and not isinstance(value, bool)
                and 0 <= value <= bound):
            raise ValueError(f"min_tokens_per_call={value!r} must be a number in [0, "
                             f"num_draft_tokens + 1 = {bound}]")


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
    tokens every row has settled, see `settled`), the statistics and, with a draft model,
    its cache (holding a prefix of each row's context; None for prompt lookup), and the
    moving average of the tokens a verifying call emitted per running row (None: k + 1)."""

    decode: DecodeState
    stats: SpeculationStats
    draft_cache: M.KVCache | None = None
    tokens_per_call: jax.Array | None = None


def choose(logits_BTV: jax.Array, drafts_BK: jax.Array, valid_B: jax.Array,
           sampling: SamplingParams, rng: jax.Array, draft_probs_BKV: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, T], accepted [B]): row b emits tokens[b, :accepted[b] + 1], its first
    `accepted` drafts followed by one token of the model's.

    logits[:, t] are the model's logits after the newest token and the first t drafts.
    Greedy rows accept a draft iff it is the argmax. Sampled rows accept draft x with
    probability min(1, p(x) / q(x)) and replace the first rejected one by a draw from
    max(p - q, 0), renormalised; q is `draft_probs` (the draft model's filtered
    distributions) or, without them, a point mass on x: accept with p(x), draw from p
    without x."""
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
        if draft_probs_BKV is None:
            keep_BK = drafted_BK & (uniform_BK < p_draft_BK)
            # A rejected draft is removed from its position's distribution; positions
            # without a draft (and the one after the last draft) draw from p itself.
            rejected_BTV = jnp.pad(drafted_BK, ((0, 0), (0, 1)))[..., None] & (
                jnp.arange(vocab) == jnp.pad(drafts_BK, ((0, 0), (0, 1)))[..., None])
            residual_BTV = jnp.where(rejected_BTV, -jnp.inf, filtered_BTV)
        else:
            q_draft_BK = jnp.take_along_axis(draft_probs_BKV, drafts_BK[..., None],
                                             axis=-1)[..., 0]
            keep_BK = drafted_BK & (uniform_BK * q_draft_BK < p_draft_BK)
            excess_BKV = jnp.maximum(probs_BKV - draft_probs_BKV, 0.0)
            # p = q up to rounding leaves no excess; a rejection there is rounding too.
            use_excess_BK = drafted_BK & (jnp.sum(excess_BKV, axis=-1) > 0)
            residual_BKV = jnp.where(use_excess_BK[..., None], jnp.log(excess_BKV),
                                     filtered_BTV[:, :num_draft])
            residual_BTV = jnp.concatenate([residual_BKV, filtered_BTV[:, num_draft:]], axis=1)
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
                     ngram_size: jax.Array, min_tokens_per_call=0.0,
                     tokens_per_call=None) -> SpeculativeState:
    """`drafting_loop` with prompt-lookup drafts; it verifies only when some row has one."""

    def propose(state, draft_cache, fits, rng):
        drafts_BK, valid_B = ngram_drafts(state.context, state.context_lengths, ngram_size,
                                          num_draft)
        valid_B = jnp.where(state.done, 0, valid_B)
        return drafts_BK, valid_B, jnp.any(valid_B > 0) & fits, None, draft_cache

    carry = SpeculativeState(state, stats, tokens_per_call=tokens_per_call)
    return drafting_loop(tokens_to_logits, carry, stops, sampling, step_limit, num_draft,
                         propose, min_tokens_per_call)


def drafting_loop(tokens_to_logits: TokensToLogits, carry: SpeculativeState,
                  stops: StopConditions, sampling: SamplingParams, step_limit: jax.Array,
                  num_draft: int, propose, min_tokens_per_call=0.0) -> SpeculativeState:
    """Runs verify steps until every row is done or has `step_limit` tokens.

    `tokens_to_logits(tokens [B, T], cache, lengths [B])` is the model's step; rows that
    have stopped are fed with zero valid tokens, so their cache never grows.
    `propose(state, draft_cache, fits, rng) -> (drafts [B, K], valid drafts [B], speculate,
    draft probabilities [B, K, V] or None, draft_cache)` drafts; `fits` says drafting pays
    (see the module docstring) and every running row has room for K + 1 more tokens. Only
    if `speculate` does the model verify; else the iteration is a plain one-token step."""

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
        draft_rng, choose_rng = jax.random.split(jax.random.fold_in(state.rng, stats.steps + 1))
        pays = ((carry.tokens_per_call >= min_tokens_per_call)
                | (stats.steps % PROBE_EVERY == PROBE_EVERY - 1))
        drafts_BK, valid_B, speculate, draft_probs_BKV, draft_cache = propose(
            state, carry.draft_cache, pays & jnp.all(~running_B | (room_B > num_draft)),
            draft_rng)

        def feed(cache, drafts_BK):
            fed_BT = jnp.concatenate([state.last_tokens[:, None], drafts_BK], axis=1)
            fed_lengths_B = jnp.where(running_B, fed_BT.shape[1], 0)
            logits_BTV, cache = tokens_to_logits(fed_BT, cache, fed_lengths_B)
            # A plain step's logits fill only the first of the T positions: with no valid
            # draft, nothing after it is read.
            padding = num_draft + 1 - fed_BT.shape[1]
            return jnp.pad(logits_BTV, ((0, 0), (0, padding), (0, 0))), cache

        logits_BTV, cache = either_call(speculate, lambda cache: feed(cache, drafts_BK),
                                        lambda cache: feed(cache, drafts_BK[:, :0]),
                                        state.cache)
        valid_B = jnp.where(speculate, valid_B, 0)
        tokens_BT, accepted_B = choose(logits_BTV, drafts_BK, valid_B, sampling, choose_rng,
                                       draft_probs_BKV)
        new_state, _ = advance(state.replace(cache=cache), old_lengths_B, logits_BTV,
                               tokens_BT, accepted_B, stops)
        accepted_B = jnp.minimum(accepted_B, new_state.lengths - state.lengths)
        if draft_cache is not None:
            # The draft keeps what it was fed of the accepted context (the target's cache).
            draft_cache = draft_cache.replace(
                lengths=jnp.minimum(draft_cache.lengths, new_state.cache.lengths))
        stats = SpeculationStats(
            drafted=stats.drafted + valid_B,
            accepted=stats.accepted + accepted_B,
            steps=stats.steps + 1)
        emitted = jnp.sum(jnp.where(running_B, accepted_B + 1, 0)) / jnp.maximum(running_B.sum(), 1)
        tokens_per_call = jnp.where(speculate, (1 - RECENT_WEIGHT) * carry.tokens_per_call
                                    + RECENT_WEIGHT * emitted, carry.tokens_per_call)
        return SpeculativeState(new_state, stats, draft_cache, tokens_per_call)

    if carry.tokens_per_call is None:
        carry = carry.replace(tokens_per_call=jnp.asarray(num_draft + 1, jnp.float32))
    return jax.lax.while_loop(cond_fn, body_fn, carry)


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
    return SpeculationStats(jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32),
                            jnp.zeros((), jnp.int32))  # distinct buffers: they are donated


@functools.partial(jax.jit, static_argnums=(0, 7), static_argnames="mesh",
                   donate_argnums=2)
def continue_speculative(config, params, state: DecodeState, stats: SpeculationStats,
                         stops: StopConditions, sampling: SamplingParams, step_limit,
                         num_draft: int, ngram_size, tokens_per_call, min_tokens_per_call,
                         mesh=None) -> SpeculativeState:
    """`generate`'s decode program with prompt-lookup drafts (see the module docstring)."""
    count_trace("speculative")
    state = parallel.constrain_rows(state, mesh)
    model_step = M.step_fn(config, params)

    def step(tokens_BT, cache, lengths_B):  # the cache keeps its layout over the devices
        logits_BTV, cache = model_step(tokens_BT, cache, lengths_B)
        return logits_BTV, parallel.constrain_rows(cache, mesh)

    return speculative_loop(step, state.replace(step=settled(state)), stats, stops, sampling,
                            step_limit, num_draft, ngram_size, min_tokens_per_call,
                            tokens_per_call)


def draft_model_loop(tokens_to_logits: TokensToLogits, draft_step: TokensToLogits,
                     carry: SpeculativeState, stops: StopConditions, sampling: SamplingParams,
                     step_limit: jax.Array, num_draft: int, min_tokens_per_call=0.0
                     ) -> SpeculativeState:
    """`drafting_loop` with a draft model's drafts: `draft_step` is its `tokens_to_logits`
    and `carry.draft_cache` its cache (see `draft_model.py`). Every running row drafts K
    tokens; the model verifies whenever both caches have room for them."""

    def propose(state, draft_cache, fits, rng):
        # The draft's last call writes slot context_length + K - 2 of its cache.
        fits &= jnp.all(state.done | (
            state.context_lengths + num_draft - 1 <= draft_cache.capacity))
        drafts_BK, probs_BKV, draft_cache = draft_model.propose(
            draft_step, draft_cache, state.context, state.context_lengths, ~state.done, fits,
            sampling, rng, num_draft)
        return drafts_BK, jnp.where(state.done, 0, num_draft), fits, probs_BKV, draft_cache

    return drafting_loop(tokens_to_logits, carry, stops, sampling, step_limit, num_draft,
                         propose, min_tokens_per_call)


@functools.partial(jax.jit, static_argnums=(0, 2, 8), donate_argnums=4)
def continue_with_draft(config, params, draft_config, draft_params, carry: SpeculativeState,
                        stops: StopConditions, sampling: SamplingParams, step_limit,
                        num_draft: int, min_tokens_per_call) -> SpeculativeState:
    """`generate`'s decode program with a draft model's drafts."""
    count_trace("speculative_draft")
    carry = carry.replace(decode=carry.decode.replace(step=settled(carry.decode)))
    return draft_model_loop(M.step_fn(config, params), M.step_fn(draft_config, draft_params),
                            carry, stops, sampling, step_limit, num_draft, min_tokens_per_call)


def start(prepared, state: DecodeState) -> SpeculativeState:
    """`run`'s first carry, after `generate`'s start (`prepared` is its checked call): no
    statistics yet and, with a draft model, the draft's cache after the prompts."""
    stats, speculative = no_stats(state.lengths.shape[0]), prepared.speculative
    if speculative is None:
        return SpeculativeState(state, stats)
    optimistic = jnp.asarray(speculative.num_draft_tokens + 1, jnp.float32)
    if speculative.method != "draft":
        return SpeculativeState(state, stats, tokens_per_call=optimistic)
    draft_config = speculative.draft_model.config
    cache = draft_model.start(draft_config, speculative.draft_params, prepared.tokens,
                              prepared.lengths,
                              draft_model.draft_capacity(draft_config, prepared.capacity),
                              prepared.num_samples)
    return SpeculativeState(state, stats, cache, optimistic)


def run(config, params, carry: SpeculativeState, prepared, step_limit) -> SpeculativeState:
    """The decode loop of `prepared.speculative`'s method, up to `step_limit` tokens."""
    speculative = prepared.speculative
    threshold = jnp.asarray(speculative.min_tokens_per_call, jnp.float32)
    if speculative.method == "draft":
        return continue_with_draft(
            config, params, speculative.draft_model.config, speculative.draft_params, carry,
            prepared.stops, prepared.sampling, step_limit, speculative.num_draft_tokens,
            threshold)
    return continue_speculative(
        config, params, carry.decode, carry.stats, prepared.stops, prepared.sampling,
        step_limit, speculative.num_draft_tokens,
        jnp.asarray(speculative.ngram_size, jnp.int32), carry.tokens_per_call, threshold,
        mesh=prepared.mesh)


def check_supported(speculative, config: M.TransformerConfig, *, num_beams: int, processors,
                    settings: dict, defaults: dict, prompt_length: int, state=None,
                    mesh=None) -> Speculative:
    """`speculative` checked against the other settings of a call."""
    if not isinstance(speculative, Speculative):
        raise ValueError(f"speculative must be a decode.Speculative, got "
                         f"{type(speculative).__name__}")
    if speculative.method == "draft":
        if state is not None:
            raise ValueError("speculation with a draft model starts from prompts: it does not "
                             "take a state (state=...)")
        if mesh is not None:
            raise ValueError("speculation with a draft model runs on one device; it does not "
                             "take a mesh or params sharded over one")
        draft_model.check_draft(config, speculative.draft_model.config,
                                speculative.draft_params, prompt_length)
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
