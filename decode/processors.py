"""Logit processors: traced functions `(logits [B, V], state) -> logits [B, V]` that change the
next-token logits before sampling, without forking the decode loop.

The loop applies the built-in ones (repetition, presence and frequency penalties, stop ids
held back until `min_tokens`, no-repeat n-gram; settings in `SamplingParams`, off by
default) and then the caller's, in order. A processor is a static argument of the compiled
programs: pass the same object (or an equal frozen dataclass, such as `LogitBias`) to reuse
a compilation; every setting that should vary per call belongs in a traced value. Processors
change what is sampled; the logprobs the loop reports stay those of the model. Shapes: B
batch, C context buffer, E stop ids, V vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from .plan import ON_DEVICE, LoopPlan
from .sampling import SamplingParams


@flax.struct.dataclass
class ProcessorState:
    """What a processor may read.

    context:         [B, C] int32 each row's tokens so far, right-padded: the prompt (for an
                     encoder-decoder, whose prompt is its source, the BOS its target starts
                     from) followed by the tokens generated so far.
    context_lengths: [B] int32 valid tokens of each row's context.
    step:            scalar int32, tokens generated so far in this call.
    settings:        the per-row `SamplingParams`.
    output_lengths:  [B] int32 how many of each row's context tokens, the last ones, it has
                     output so far (in this call of `generate`, in this request of the server).
    stop_ids:        [B, E] int32 the ids that end each row (-1 pads).
    """

    context: jax.Array
    context_lengths: jax.Array
    step: jax.Array
    settings: SamplingParams
    output_lengths: jax.Array
    stop_ids: jax.Array

    def scatter_to_vocab(self, values_BC: jax.Array, vocab: int) -> jax.Array:
        """[B, V] bool: token v of row b is True iff some valid context slot holding v is."""
        rows_B1 = jnp.arange(self.context.shape[0])[:, None]
        valid_BC = jnp.arange(self.context.shape[1])[None] < self.context_lengths[:, None]
        return jnp.zeros((self.context.shape[0], vocab), bool).at[rows_B1, self.context].max(
            values_BC & valid_BC, mode="drop")

    def output_counts(self, vocab: int) -> jax.Array:
        """[B, V] int32: how many times each row has output each token. Mapped over rows,
        the scatter has the batch as its batch axis, so rows split over devices are counted
        where they lie."""
        slots_C = jnp.arange(self.context.shape[1])[None]
        output_BC = ((slots_C < self.context_lengths[:, None])
                     & (slots_C >= (self.context_lengths - self.output_lengths)[:, None]))

        def count(context_C, output_C):
            return jnp.zeros((vocab,), jnp.int32).at[context_C].add(
                output_C.astype(jnp.int32), mode="drop")

        return jax.vmap(count)(self.context, output_BC)


LogitProcessor = Callable[[jax.Array, ProcessorState], jax.Array]


def penalise_repetition(logits_BV: jax.Array, state: ProcessorState) -> jax.Array:
    """The CTRL penalty (as Hugging Face applies it): the logit of every token already in the
    row's context is divided by the penalty if positive and multiplied by it if negative. A
    row whose penalty is 1 keeps its logits exactly."""
    penalty_B1 = state.settings.repetition_penalty[:, None]
    seen_BV = state.scatter_to_vocab(jnp.ones(state.context.shape, bool), logits_BV.shape[1])
    penalised_BV = jnp.where(logits_BV > 0, logits_BV / penalty_B1, logits_BV * penalty_B1)
    return jnp.where(seen_BV, penalised_BV, logits_BV)


def penalise_output(logits_BV: jax.Array, state: ProcessorState) -> jax.Array:
    """OpenAI's presence and frequency penalties (as vLLM applies them): the logit of a token
    the row has output c times so far loses frequency_penalty · c, and presence_penalty once
    if c > 0. The prompt's tokens are not counted. A row whose two penalties are 0 keeps its
    logits exactly."""
    counts_BV = state.output_counts(logits_BV.shape[1])
    settings = state.settings
    return (logits_BV - settings.frequency_penalty[:, None] * counts_BV
            - settings.presence_penalty[:, None] * (counts_BV > 0))


def hold_back_stops(logits_BV: jax.Array, state: ProcessorState) -> jax.Array:
    """A row that has output fewer than its `min_tokens` cannot draw its stop ids (-inf), as
    transformers' MinNewTokensLengthLogitsProcessor holds back its eos ids; other rows keep
    their logits exactly."""
    early_B = state.output_lengths < state.settings.min_tokens
    return ban(logits_BV, jnp.where(early_B[:, None], state.stop_ids, -1))


def _penalty_on(settings: SamplingParams) -> jax.Array:
    return jnp.any((settings.repetition_penalty != 1) | (settings.presence_penalty != 0)
                   | (settings.frequency_penalty != 0) | (settings.min_tokens > 0))


def ban_repeated_ngrams(logits_BV: jax.Array, state: ProcessorState, bound=None) -> jax.Array:
    """Bans (-inf) every token that would complete an n-gram already in the row's context,
    n = the row's `no_repeat_ngram_size` (0 = off, the row keeps its logits): the tokens that
    followed an earlier occurrence of the row's last n - 1 tokens. `bound`, a static int at
    least the largest size, makes the loop's trip count known (None: the largest size)."""
    n_B = state.settings.no_repeat_ngram_size
    if bound is None:
        bound = jnp.max(n_B)
    context_BC, length_B = state.context, state.context_lengths
    slots_C = jnp.arange(context_BC.shape[1])

    # follows_BC[b, j]: the n-gram ending at slot j starts with the row's last n-1 tokens,
    # so its last token, context[b, j], is banned. Checked one offset i at a time; offsets
    # at or past a row's n - 1 leave it as it is.
    def same_at_offset(i, follows_BC):
        earlier_BC = jnp.take_along_axis(
            context_BC, jnp.clip(slots_C[None] - 1 - i, 0, None), axis=1)
        recent_B = jnp.take_along_axis(
            context_BC, jnp.clip(length_B - 1 - i, 0, None)[:, None], axis=1)
        return follows_BC & ((i >= n_B - 1)[:, None] | (earlier_BC == recent_B))

    follows_BC = (n_B[:, None] > 0) & (slots_C[None] >= n_B[:, None] - 1)
    follows_BC = jax.lax.fori_loop(0, bound - 1, same_at_offset, follows_BC)
    banned_BV = state.scatter_to_vocab(follows_BC, logits_BV.shape[1])
    return jnp.where(banned_BV, -jnp.inf, logits_BV)


def _no_repeat_ngram_on(settings: SamplingParams) -> jax.Array:
    return jnp.any(settings.no_repeat_ngram_size > 0)


def apply_processors(logits_BV: jax.Array, state: ProcessorState,
                     processors: Sequence[LogitProcessor] = (),
                     plan: LoopPlan = ON_DEVICE) -> jax.Array:
    """float32 logits after the built-in processors and then `processors`, in order.
    `plan` says whether the built-in ones are on, or leaves it to the device (`plan.py`)."""
    logits_BV = logits_BV.astype(jnp.float32)
    state = state.replace(settings=state.settings.rows(logits_BV.shape[0]))
    if plan.penalty is None:
        # Off by default: then one cond skips them all at every decode step. Each leaves the
        # rows it is off for as they are, so when only one is on the others change nothing.
        def built_in(logits_BV):
            penalised_BV = penalise_output(penalise_repetition(logits_BV, state), state)
            return ban_repeated_ngrams(hold_back_stops(penalised_BV, state), state)

        any_on = _penalty_on(state.settings) | _no_repeat_ngram_on(state.settings)
        logits_BV = jax.lax.cond(any_on, built_in, lambda x: x, logits_BV)
    else:  # decided on the host
        if plan.penalty:
            logits_BV = hold_back_stops(penalise_output(penalise_repetition(logits_BV, state),
                                                        state), state)
        if plan.ngram_bound:
            logits_BV = ban_repeated_ngrams(logits_BV, state, plan.ngram_bound)
    for processor in processors:
        logits_BV = processor(logits_BV, state)
    return logits_BV


@dataclasses.dataclass(frozen=True)
class LogitBias:
    """Adds `bias[token]` to a token's logit in every row; -inf forbids the token.
    Hashable by value, so equal biases share one compiled program."""

    bias: tuple[tuple[int, float], ...]

    @classmethod
    def of(cls, bias: dict[int, float]) -> LogitBias:
        return cls(tuple(sorted((int(t), float(b)) for t, b in bias.items())))

    def __call__(self, logits_BV: jax.Array, state: ProcessorState) -> jax.Array:
        tokens, values = zip(*self.bias, strict=True) if self.bias else ((), ())
        return logits_BV.at[:, jnp.asarray(tokens, jnp.int32)].add(
            jnp.asarray(values, jnp.float32))


@flax.struct.dataclass
class RowLogitBias:
    """A logit bias of each row's own, traced, so that rows with other biases share one
    compiled program (the server's requests): each of row b's `values[b]` is added to the
    logit of the token its `ids[b]` entry names; both [B, entries] (an axis with no letter of
    its own), unused entries id 0 with value 0. Applied where `LogitBias` is, after the
    built-in processors; a batch whose values are all 0 skips it."""

    ids: jax.Array
    values: jax.Array

    @classmethod
    def empty(cls, batch: int, width: int) -> RowLogitBias:
        return cls(jnp.zeros((batch, width), jnp.int32), jnp.zeros((batch, width), jnp.float32))

    def __call__(self, logits_BV: jax.Array, state: ProcessorState) -> jax.Array:
        def add(logits_BV):  # mapped over rows: rows split over devices add where they lie
            return jax.vmap(lambda row_V, ids, values: row_V.at[ids].add(values))(
                logits_BV, self.ids, self.values)

        return jax.lax.cond(jnp.any(self.values != 0), add, lambda x: x, logits_BV)


def ban(logits_BV: jax.Array, banned_ids: jax.Array) -> jax.Array:
    """Row b can never draw the ids of `banned_ids[b]` ([B, banned], -1 pads): their logits
    -inf, as transformers' NoBadWordsLogitsProcessor bans a generation config's one-token
    `bad_words_ids` (Marian's pad); every other logit is kept exactly."""
    vocab = logits_BV.shape[1]
    ids = jnp.where(banned_ids >= 0, banned_ids, vocab)

    def forbid(row_V, row_ids):  # mapped over rows; an id of `vocab` writes nothing
        return row_V.at[row_ids].set(-jnp.inf, mode="drop")

    return jax.vmap(forbid)(logits_BV, ids)


def force_end(logits_BV: jax.Array, forced_B: jax.Array) -> jax.Array:
    """Each row whose `forced_B` [B] is a token id (not -1) can draw only that token (its
    logit 0, every other -inf), as transformers' ForcedEOSTokenLogitsProcessor makes a
    row's last token its `forced_eos_token_id`; other rows keep their logits exactly."""
    vocab_V = jnp.arange(logits_BV.shape[1])
    only_BV = jnp.where(vocab_V[None] == forced_B[:, None], 0.0, -jnp.inf)
    return jnp.where((forced_B >= 0)[:, None], only_BV, logits_BV)


def forbid_tokens(token_ids: Sequence[int]) -> LogitBias:
    """A processor that never lets `token_ids` be sampled."""
    return LogitBias.of({int(t): -jnp.inf for t in token_ids})
