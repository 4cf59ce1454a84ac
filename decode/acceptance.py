"""Which drafted tokens a verifying call keeps, and how a row appends them.

One model call of T = k + 1 tokens per row (the newest token, then the k drafts) gives the
model's logits after each; `choose` keeps the longest prefix of the draft the model agrees
with (greedy) or accepts by rejection sampling, plus one token of the model's own after
it, and `advance` appends what each row kept to its tokens and context, cut at an eos or
`max_new_tokens` (where `force_end` puts a forced end), and sets its cache length to match
(see `speculative.py`).

Shape letters: B batch, J draft length k, T = J + 1, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .loop import DecodeState, StopConditions, StopReason
from .processors import ban
from .sampling import SamplingParams, filter_logits


def choose(logits_BTV: jax.Array, drafts_BJ: jax.Array, valid_B: jax.Array,
           sampling: SamplingParams, keys_B: jax.Array, draft_probs_BKV: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, T], accepted [B]): row b emits tokens[b, :accepted[b] + 1], its first
    `accepted` drafts followed by one token of the model's.

    logits[:, t] are the model's logits after the newest token and the first t drafts.
    Greedy rows accept a draft iff it is the argmax. Sampled rows accept draft x with
    probability min(1, p(x) / q(x)) and replace the first rejected one by a draw from
    max(p - q, 0), renormalised; q is `draft_probs` (the draft model's filtered
    distributions) or, without them, a point mass on x: accept with p(x), draw from p
    without x. Row b draws with its key `keys_B[b]` alone."""
    batch, num_tokens, vocab = logits_BTV.shape
    num_draft = num_tokens - 1
    greedy_B = jnp.broadcast_to(sampling.is_greedy, (batch,))
    argmax_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    drafted_BJ = jnp.arange(num_draft)[None] < valid_B[:, None]

    def greedy(_):
        return argmax_BT, drafted_BJ & (drafts_BJ == argmax_BT[:, :num_draft])

    def sampled(_):
        rows = sampling.rows(batch)
        per_token = jax.tree.map(lambda x: jnp.repeat(x, num_tokens), rows)
        filtered_BTV = filter_logits(logits_BTV.reshape(-1, vocab), per_token).reshape(
            batch, num_tokens, vocab)
        probs_BJV = jax.nn.softmax(filtered_BTV[:, :num_draft], axis=-1)
        p_draft_BK = jnp.take_along_axis(probs_BJV, drafts_BJ[..., None], axis=-1)[..., 0]
        accept_keys_B, draw_keys_B = jax.vmap(jax.random.split, out_axes=1)(keys_B)
        uniform_BJ = jax.vmap(lambda key: jax.random.uniform(key, (num_draft,)))(accept_keys_B)
        if draft_probs_BKV is None:
            keep_BJ = drafted_BJ & (uniform_BJ < p_draft_BK)
            # A rejected draft is removed from its position's distribution; positions
            # without a draft (and the one after the last draft) draw from p itself.
            rejected_BTV = jnp.pad(drafted_BJ, ((0, 0), (0, 1)))[..., None] & (
                jnp.arange(vocab) == jnp.pad(drafts_BJ, ((0, 0), (0, 1)))[..., None])
            residual_BTV = jnp.where(rejected_BTV, -jnp.inf, filtered_BTV)
        else:
            q_draft_BK = jnp.take_along_axis(draft_probs_BKV, drafts_BJ[..., None],
                                             axis=-1)[..., 0]
            keep_BJ = drafted_BJ & (uniform_BJ * q_draft_BK < p_draft_BK)
            excess_BJV = jnp.maximum(probs_BJV - draft_probs_BKV, 0.0)
            # p = q up to rounding leaves no excess; a rejection there is rounding too.
            use_excess_BK = drafted_BJ & (jnp.sum(excess_BJV, axis=-1) > 0)
            residual_BJV = jnp.where(use_excess_BK[..., None], jnp.log(excess_BJV),
                                     filtered_BTV[:, :num_draft])
            residual_BTV = jnp.concatenate([residual_BJV, filtered_BTV[:, num_draft:]], axis=1)
        drawn_BT = jax.vmap(jax.random.categorical)(draw_keys_B, residual_BTV).astype(jnp.int32)
        return (jnp.where(greedy_B[:, None], argmax_BT, drawn_BT),
                jnp.where(greedy_B[:, None], drafted_BJ & (drafts_BJ == argmax_BT[:, :-1]),
                          keep_BJ))

    model_BT, keep_BJ = jax.lax.cond(jnp.all(greedy_B), greedy, sampled, None)
    accepted_B = jnp.sum(jnp.cumprod(keep_BJ, axis=1), axis=1).astype(jnp.int32)
    positions_T = jnp.arange(num_tokens)
    draft_BT = jnp.pad(drafts_BJ, ((0, 0), (0, 1)))
    tokens_BT = jnp.where(positions_T[None] < accepted_B[:, None], draft_BT, model_BT)
    return tokens_BT, accepted_B


def banned(logits_BTV: jax.Array, stops: StopConditions) -> jax.Array:
    """The logits with `stops.banned_ids` at -inf at every position, as the plain loop's
    `choose` bans them."""
    if stops.banned_ids is None:
        return logits_BTV
    batch, num_tokens, vocab = logits_BTV.shape
    return ban(logits_BTV.reshape(-1, vocab), stops.banned_rows(batch * num_tokens)).reshape(
        batch, num_tokens, vocab)


def force_end(tokens_BT: jax.Array, lengths_B: jax.Array, stops: StopConditions) -> jax.Array:
    """The tokens with each row's forced end (`stops.forced_end_id`, if any) at the position
    where the row reaches `max_new_tokens`, given the `lengths` [B] it has: what the plain
    loop's `choose` forces there. A position past what a row keeps is never read."""
    last_BT = jnp.arange(tokens_BT.shape[1])[None] == (
        stops.max_new_tokens - lengths_B - 1)[:, None]
    forced_BT = stops.forced_at(last_BT)
    return tokens_BT if forced_BT is None else jnp.where(forced_BT >= 0, forced_BT, tokens_BT)


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
    if stops.forced_end_id is not None:  # a forced end: its budget's
        eos_B = eos_B & ~(full_B & (stops.forced_end_id >= 0))
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
