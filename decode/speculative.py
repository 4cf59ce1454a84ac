"""Speculative decoding inside the compiled decode loop: prompt-lookup or draft-model drafts.

Each iteration drafts up to k tokens per row, either with no second model (prompt lookup,
`prompt_lookup.py`: the k tokens that followed the latest earlier occurrence of the row's
last n tokens in its context) or with a draft model, a smaller model with the same
vocabulary and its own cache, carried in the loop (`draft_model.py`). One model call of
T = k + 1 tokens per row (the newest token, then the draft) verifies the whole draft
through the cache; each row keeps the longest prefix of its draft that the model would
have chosen itself, plus the model's own token after it, so one call emits 1 to k + 1
tokens (`acceptance.py`). Rollback is not advancing: the caches' `lengths` are set to what each row
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

Drafting turns itself off where it does not pay: while some running row's moving average
of the tokens it emitted per verifying call (from k + 1 at the start) is below
`min_tokens_per_call` (default 2: a call of k + 1 tokens costs about two of one on a CPU),
iterations are plain steps that draft nothing (what the plain loop's step does), but for a
verifying probe every `PROBE_EVERY` iterations, then every 16, up to every `MAX_PROBE_GAP`
while the probes find that drafting still does not pay (`Pacing`).

Shape letters: B batch, O token buffer, C context buffer, J draft length k, T = J + 1,
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
from .acceptance import advance, banned, choose, force_end, settled
from .loop import DecodeState, StopConditions, StopReason, TokensToLogits
from .prompt_lookup import MAX_NGRAM_SIZE, ngram_drafts
from .sampling import SamplingParams, sample, token_keys
from .tracing import count_trace

METHODS = ("ngram", "draft")
PROBE_EVERY = 8  # with drafting off, one iteration in this many still verifies its drafts,
MAX_PROBE_GAP = 32  # or fewer, down to one in this many, while the probes find it does not pay
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

    def start(self, state: DecodeState, prompts_BP: jax.Array, lengths_B: jax.Array,
              capacity: int, num_samples: int = 1) -> SpeculativeState:
        """The loop's first carry after the prefill that made `state` from the prompts [B, P]
        (`capacity`: the target's cache slots per row): no statistics yet and, with a draft
        model, the draft's cache after the prompts."""
        stats = no_stats(state.lengths.shape[0])
        optimistic = Pacing.optimistic(self.num_draft_tokens, state.lengths.shape[0])
        if self.method != "draft":
            return SpeculativeState(state, stats, pacing=optimistic)
        draft_config = self.draft_model.config
        cache = draft_model.start(draft_config, self.draft_params, prompts_BP, lengths_B,
                                  draft_model.draft_capacity(draft_config, capacity),
                                  num_samples)
        return SpeculativeState(state, stats, cache, optimistic)

    def run(self, config, params, carry: SpeculativeState, stops: StopConditions,
            sampling: SamplingParams, step_limit, mesh=None) -> SpeculativeState:
        """The compiled decode loop of this method, from `carry` up to `step_limit` tokens."""
        threshold = jnp.asarray(self.min_tokens_per_call, jnp.float32)
        if self.method == "draft":
            return continue_with_draft(
                config, params, self.draft_model.config, self.draft_params, carry, stops,
                sampling, step_limit, self.num_draft_tokens, threshold)
        return continue_speculative(
            config, params, carry.decode, carry.stats, stops, sampling, step_limit,
            self.num_draft_tokens, jnp.asarray(self.ngram_size, jnp.int32), carry.pacing,
            threshold, mesh=mesh)


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
class Pacing:
    """When drafting pays. tokens_per_call: [B] float32, the moving average of the tokens
    each row emitted per verifying call (from k + 1); probe_gap: int32 scalar, while
    drafting is off, one iteration in this many verifies, a probe (from PROBE_EVERY, doubled
    by each probe that leaves drafting off, up to MAX_PROBE_GAP); since_verifying: int32
    scalar, plain iterations since the last verifying one.

    Drafting pays while every running row's average reaches the threshold: a verifying call
    costs the whole batch the same, and the batch is done only when its slowest row is."""

    tokens_per_call: jax.Array
    probe_gap: jax.Array
    since_verifying: jax.Array

    @classmethod
    def optimistic(cls, num_draft: int, batch: int) -> Pacing:
        return cls(jnp.full((batch,), num_draft + 1, jnp.float32),
                   jnp.asarray(PROBE_EVERY, jnp.int32), jnp.zeros((), jnp.int32))

    def drafting_on(self, running_B: jax.Array, min_tokens_per_call) -> jax.Array:
        return jnp.all(~running_B | (self.tokens_per_call >= min_tokens_per_call))

    def pays(self, running_B: jax.Array, min_tokens_per_call) -> jax.Array:
        """Whether the next iteration should verify: drafting is on, or a probe is due."""
        return (self.drafting_on(running_B, min_tokens_per_call)
                | (self.since_verifying + 1 >= self.probe_gap))

    def after_verifying(self, emitted_B: jax.Array, running_B: jax.Array,
                        min_tokens_per_call) -> Pacing:
        """After a call that verified drafts: each running row emitted `emitted_B` tokens.
        A probe's result replaces the averages, which are from before the plain stretch."""
        was_on = self.drafting_on(running_B, min_tokens_per_call)
        blended_B = (1 - RECENT_WEIGHT) * self.tokens_per_call + RECENT_WEIGHT * emitted_B
        average_B = jnp.where(running_B, jnp.where(was_on, blended_B, emitted_B),
                              self.tokens_per_call)
        now_on = self.replace(tokens_per_call=average_B).drafting_on(running_B,
                                                                     min_tokens_per_call)
        gap = jnp.where(now_on | was_on, PROBE_EVERY,
                        jnp.minimum(2 * self.probe_gap, MAX_PROBE_GAP))
        return Pacing(average_B.astype(jnp.float32), gap.astype(jnp.int32),
                      jnp.zeros((), jnp.int32))

    def after_plain(self) -> Pacing:
        return self.replace(since_verifying=self.since_verifying + 1)


@flax.struct.dataclass
class SpeculativeState:
    """The loop carry: the plain loop's state (its `step` is the number of leading
    tokens every row has settled, see `settled`), the statistics and, with a draft model,
    its cache (holding a prefix of each row's context; None for prompt lookup), and the
    `Pacing` of drafting (None: not started)."""

    decode: DecodeState
    stats: SpeculationStats
    draft_cache: M.KVCache | None = None
    pacing: Pacing | None = None


def speculative_loop(tokens_to_logits: TokensToLogits, state: DecodeState,
                     stats: SpeculationStats, stops: StopConditions,
                     sampling: SamplingParams, step_limit: jax.Array, num_draft: int,
                     ngram_size: jax.Array, min_tokens_per_call=0.0,
                     pacing: Pacing | None = None) -> SpeculativeState:
    """`drafting_loop` with prompt-lookup drafts; it verifies only when some row has one."""

    def propose(state, draft_cache, fits, keys_B):
        drafts_BJ, valid_B = ngram_drafts(state.context, state.context_lengths, ngram_size,
                                          num_draft)
        valid_B = jnp.where(state.done, 0, valid_B)
        return drafts_BJ, valid_B, jnp.any(valid_B > 0) & fits, None, draft_cache

    carry = SpeculativeState(state, stats, pacing=pacing)
    return drafting_loop(tokens_to_logits, carry, stops, sampling, step_limit, num_draft,
                         propose, min_tokens_per_call)


def drafting_loop(tokens_to_logits: TokensToLogits, carry: SpeculativeState,
                  stops: StopConditions, sampling: SamplingParams, step_limit: jax.Array,
                  num_draft: int, propose, min_tokens_per_call=0.0) -> SpeculativeState:
    """Runs iterations until every row is done or has `step_limit` tokens.

    `tokens_to_logits(tokens [B, T], cache, lengths [B])` is the model's step; rows that
    have stopped are fed with zero valid tokens, so their cache never grows. An iteration
    verifies when drafting pays (`Pacing`) and every running row has room for J + 1 more
    tokens; `propose(state, draft_cache, fits, keys [B]) -> (drafts [B, J], valid drafts [B],
    speculate, draft probabilities [B, J, V] or None, draft_cache)` then drafts, and only if
    `speculate` does the model see them (else one token per row). The other iterations are
    plain one-token steps that leave a draft model alone (`propose` catches it up)."""

    def unfinished(carry: SpeculativeState) -> jax.Array:
        decode = carry.decode
        return (settled(decode) < step_limit) & ~jnp.all(decode.done)

    def begin(carry: SpeculativeState):
        """(carry, running rows [B], draft keys [B], choose keys [B]): rows with no free
        slot stop."""
        state = carry.decode
        full_B = ~state.done & (state.cache.lengths >= state.cache.capacity)
        state = state.replace(stop_reason=jnp.where(full_B, StopReason.CACHE_FULL,
                                                    state.stop_reason))
        keys_B2 = jax.vmap(jax.random.split)(token_keys(state.keys, carry.stats.steps + 1))
        return carry.replace(decode=state), ~state.done, keys_B2[:, 0], keys_B2[:, 1]

    def should_verify(carry: SpeculativeState) -> jax.Array:
        cache = carry.decode.cache
        running_B = ~carry.decode.done & (cache.lengths < cache.capacity)
        return (carry.pacing.pays(running_B, min_tokens_per_call)
                & jnp.all(~running_B | (cache.capacity - cache.lengths > num_draft)))

    def finish(carry, new_state, valid_B, accepted_B):
        accepted_B = jnp.minimum(accepted_B, new_state.lengths - carry.decode.lengths)
        draft_cache = carry.draft_cache
        if draft_cache is not None:
            # The draft keeps what it was fed of the accepted context (the target's cache).
            draft_cache = draft_cache.replace(
                lengths=jnp.minimum(draft_cache.lengths, new_state.cache.lengths))
        stats = SpeculationStats(drafted=carry.stats.drafted + valid_B,
                                 accepted=carry.stats.accepted + accepted_B,
                                 steps=carry.stats.steps + 1)
        return SpeculativeState(new_state, stats, draft_cache, carry.pacing), accepted_B

    def verifying(carry: SpeculativeState) -> SpeculativeState:
        carry, running_B, draft_keys_B, choose_keys_B = begin(carry)
        state, pacing = carry.decode, carry.pacing
        drafts_BJ, valid_B, speculate, draft_probs_BKV, draft_cache = propose(
            state, carry.draft_cache, jnp.asarray(True), draft_keys_B)

        def feed(cache, drafts_BJ):
            fed_BT = jnp.concatenate([state.last_tokens[:, None], drafts_BJ], axis=1)
            fed_lengths_B = jnp.where(running_B, fed_BT.shape[1], 0)
            logits_BTV, cache = tokens_to_logits(fed_BT, cache, fed_lengths_B)
            # A plain step's logits fill only the first of the T positions: with no valid
            # draft, nothing after it is read.
            padding = num_draft + 1 - fed_BT.shape[1]
            return jnp.pad(logits_BTV, ((0, 0), (0, padding), (0, 0))), cache

        logits_BTV, cache = either_call(speculate, lambda cache: feed(cache, drafts_BJ),
                                        lambda cache: feed(cache, drafts_BJ[:, :0]),
                                        state.cache)
        valid_B = jnp.where(speculate, valid_B, 0)
        rows = state.constraints  # the target's distributions are masked; drafts are not
        states_BT = None if rows is None else rows.along(drafts_BJ)
        allowed_BTV = banned(logits_BTV, stops)
        tokens_BT, accepted_B = choose(
            allowed_BTV if rows is None else rows.mask_each(allowed_BTV, states_BT), drafts_BJ,
            valid_B, sampling, choose_keys_B, draft_probs_BKV)
        tokens_BT = force_end(tokens_BT, state.lengths, stops)
        new_state, _ = advance(state.replace(cache=cache), state.cache.lengths, logits_BTV,
                               tokens_BT, accepted_B, stops)
        if rows is not None:
            new_state = new_state.replace(
                constraints=rows.after(states_BT, tokens_BT, accepted_B, running_B))
        carry, accepted_B = finish(carry.replace(draft_cache=draft_cache), new_state,
                                   valid_B, accepted_B)
        return carry.replace(pacing=jax.tree.map(
            functools.partial(jnp.where, speculate),
            pacing.after_verifying(accepted_B + 1, running_B, min_tokens_per_call),
            pacing.after_plain()))

    def plain(carry: SpeculativeState) -> SpeculativeState:
        # What the plain decode loop's step does: one token per running row, no drafting.
        carry, running_B, _, choose_keys_B = begin(carry)
        state = carry.decode
        logits_B1V, cache = tokens_to_logits(state.last_tokens[:, None], state.cache,
                                             running_B.astype(jnp.int32))
        rows = state.constraints
        allowed_BV = banned(logits_B1V, stops)[:, 0]
        token_B = sample(allowed_BV if rows is None else rows.mask(allowed_BV),
                         choose_keys_B, sampling)
        token_B = force_end(token_B[:, None], state.lengths, stops)[:, 0]
        zeros_B = jnp.zeros_like(running_B, jnp.int32)
        new_state, _ = advance(state.replace(cache=cache), state.cache.lengths, logits_B1V,
                               token_B[:, None], zeros_B, stops)
        if rows is not None:
            new_state = new_state.replace(constraints=rows.advance(token_B, running_B))
        carry, _ = finish(carry, new_state, zeros_B, zeros_B)
        return carry.replace(pacing=carry.pacing.after_plain())

    def body_fn(carry: SpeculativeState) -> SpeculativeState:
        # Plain steps in a loop of their own, as many as come before the next verifying
        # iteration: each costs what a step of the plain decode loop costs (no branch, no
        # second loop per step, which on a GPU each wait for the host).
        carry = jax.lax.while_loop(lambda c: unfinished(c) & ~should_verify(c), plain, carry)
        return jax.lax.while_loop(lambda c: c[1] & unfinished(c[0]),
                                  lambda c: (verifying(c[0]), jnp.asarray(False)),
                                  (carry, jnp.asarray(True)))[0]

    if carry.pacing is None:
        carry = carry.replace(pacing=Pacing.optimistic(num_draft,
                                                      carry.decode.lengths.shape[0]))
    return jax.lax.while_loop(unfinished, body_fn, carry)


def in_place_cond(pred: jax.Array, if_true, if_false, operand):
    """`lax.cond(pred, if_true, if_false, operand)` for functions whose result has the
    operand's structure, as two while loops of at most one iteration: XLA updates a cache
    in place through a while loop, where a conditional copies it whole."""
    def once(branch):
        return lambda carry: (branch(carry[0]), jnp.asarray(False))

    carry = jax.lax.while_loop(lambda c: c[1] & pred, once(if_true), (operand, jnp.asarray(True)))
    return jax.lax.while_loop(lambda c: c[1] & ~pred, once(if_false), carry)[0]


def either_call(pred: jax.Array, if_true, if_false, cache):
    """`in_place_cond` for two model calls `cache -> (logits [B, T, V], cache)`."""
    logits = jax.eval_shape(if_true, cache)[0]
    zeros = jnp.zeros(logits.shape, logits.dtype)
    return in_place_cond(pred, lambda carry: if_true(carry[1]),
                         lambda carry: if_false(carry[1]), (zeros, cache))


def no_stats(batch: int) -> SpeculationStats:
    return SpeculationStats(jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32),
                            jnp.zeros((), jnp.int32))  # distinct buffers: they are donated


@functools.partial(jax.jit, static_argnums=(0, 7), static_argnames="mesh",
                   donate_argnums=2)
def continue_speculative(config, params, state: DecodeState, stats: SpeculationStats,
                         stops: StopConditions, sampling: SamplingParams, step_limit,
                         num_draft: int, ngram_size, pacing: Pacing, min_tokens_per_call,
                         mesh=None) -> SpeculativeState:
    """`generate`'s decode program with prompt-lookup drafts (see the module docstring)."""
    count_trace("speculative")
    state = parallel.constrain_rows(state, mesh)
    model_step = M.step_fn(config, params)

    def step(tokens_BT, cache, lengths_B):  # the cache keeps its layout over the devices
        logits_BTV, cache = model_step(tokens_BT, cache, lengths_B)
        return logits_BTV, parallel.constrain_rows(cache, mesh)

    return speculative_loop(step, state.replace(step=settled(state)), stats, stops, sampling,
                            step_limit, num_draft, ngram_size, min_tokens_per_call, pacing)


def draft_model_loop(tokens_to_logits: TokensToLogits, draft_step: TokensToLogits,
                     carry: SpeculativeState, stops: StopConditions, sampling: SamplingParams,
                     step_limit: jax.Array, num_draft: int, min_tokens_per_call=0.0
                     ) -> SpeculativeState:
    """`drafting_loop` with a draft model's drafts: `draft_step` is its `tokens_to_logits`
    and `carry.draft_cache` its cache (see `draft_model.py`). Every running row drafts J
    tokens; the model verifies whenever both caches have room for them."""

    def propose(state, draft_cache, fits, keys_B):
        # The draft's last call writes slot context_length + J - 2 of its cache.
        fits &= jnp.all(state.done | (
            state.context_lengths + num_draft - 1 <= draft_cache.capacity))
        drafts_BJ, probs_BJV, draft_cache = draft_model.propose(
            draft_step, draft_cache, state.context, state.context_lengths, ~state.done, fits,
            sampling, keys_B, num_draft)
        return drafts_BJ, jnp.where(state.done, 0, num_draft), fits, probs_BJV, draft_cache

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


def check_supported(speculative, config: M.TransformerConfig, *, processors,
                    sampling, prompt_length: int, state=None,
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
    if processors:
        raise ValueError("speculative decoding does not take logit_processors: they would "
                         "see a context that does not yet hold the draft")
    for name in ("repetition_penalty", "no_repeat_ngram_size", "presence_penalty",
                 "frequency_penalty", "min_tokens"):
        if name in sampling.changed():
            raise ValueError(f"speculative decoding does not take {name}="
                             f"{getattr(sampling, name)} (it reads the context the draft "
                             "changes)")
    return speculative
