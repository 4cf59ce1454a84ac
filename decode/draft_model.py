"""The draft model of speculative decoding: a second, cheaper kvjax model with the target's
vocabulary that proposes k tokens per row and step, with its own KV cache.

The draft reads the prompt as the target does (a decoder-only draft for a decoder-only
target; an encoder-decoder draft, given the same source, for an encoder-decoder target)
and its cache holds a prefix of the row's context, the target's positions at the same
slots. At the start of an iteration it lags the context by one token (the newest, which the
target has not seen either) or two (when the target accepted every draft, the last draft
and the target's bonus token after it, as in Hugging Face's assisted generation), or more
after iterations where drafting was off (`catch_up` feeds those first): one call of T = 2
tokens (one or two valid per row) catches it up and gives the first draft's distribution,
and k - 1 calls of one token give the others. After the target's
verdict the caller rolls the draft's cache back to the accepted context by setting its
`lengths`: the cache then holds what the target's holds, or all of it but the last draft.

Each draft is drawn from q, the draft's distribution after the row's sampling filters
(temperature, top-k, top-p, min-p), which rejection sampling needs next to the target's p;
greedy rows take the argmax and need no q.

Shape letters: B batch, C context buffer, J draft length k, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax import model as M

from . import checks
from .sampling import SamplingParams, filter_logits, token_keys
from .tracing import count_trace

CATCH_UP_TOKENS = 16  # fed to a lagging draft per call


def check_draft(config: M.TransformerConfig, draft_config: M.TransformerConfig, draft_params,
                prompt_length: int) -> None:
    """Raises a ValueError unless the draft can propose tokens for the target."""
    if draft_config.vocab_size != config.vocab_size:
        raise ValueError(f"the draft model's vocab_size={draft_config.vocab_size} differs from "
                         f"the target model's vocab_size={config.vocab_size}: their token ids "
                         f"must mean the same tokens")
    if draft_config.is_encoder_decoder != config.is_encoder_decoder:
        kinds = {True: "an encoder-decoder", False: "a decoder-only model"}
        raise ValueError(f"the draft model is {kinds[draft_config.is_encoder_decoder]} and the "
                         f"target {kinds[config.is_encoder_decoder]}: the draft must read the "
                         f"prompt as the target does")
    if draft_config.is_encoder_decoder and draft_config.bos_id != config.bos_id:
        raise ValueError(f"the draft model's bos_id={draft_config.bos_id} differs from the "
                         f"target's bos_id={config.bos_id}: both targets start from it")
    try:
        checks.check_params(draft_config, draft_params)
        M.check_prompt_length(draft_config, prompt_length)
    except ValueError as error:
        raise ValueError(f"draft model: {error}") from None


def first_layers(config: M.TransformerConfig, params, num_layers: int):
    """(net, params) of a draft made of the first `num_layers` layers of a decoder-only
    model, with its embedding, final norm and unembedding: a draft that needs no second
    checkpoint."""
    if config.is_encoder_decoder or not 1 <= num_layers <= config.num_decoder_layers:
        raise ValueError(f"num_layers={num_layers} must be in [1, {config.num_decoder_layers}] "
                         f"of a decoder-only model")
    config, params = M.with_layer_layout(config, params, scan_layers=False)
    layers = {str(i): params["layers"][str(i)] for i in range(num_layers)}
    config = config.first_decoder_layers(num_layers)
    return M.build_model(config), {**params, "layers": layers}


def draft_capacity(draft_config: M.TransformerConfig, capacity: int) -> int:
    """The draft cache's slots: the target's, unless the draft's max_len is shorter."""
    return min(capacity, draft_config.max_len)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def start(draft_config, draft_params, tokens_BP, lengths_B, capacity: int,
          num_samples: int) -> M.KVCache:
    """The draft's cache after the prompts, copied to each prompt's `num_samples` rows; its
    windowed layers keep rings wide enough for the most tokens a call feeds it
    (`CATCH_UP_TOKENS`; `model/ring.py`)."""
    count_trace("draft_start")
    tokens_BP = tokens_BP[:, :draft_config.max_len]  # past it, padding (`check_draft`)
    _, cache = M.prefill(draft_config, draft_params, tokens_BP, lengths_B, capacity,
                         step_tokens=max(CATCH_UP_TOKENS, 2))
    if num_samples > 1:
        cache = cache.take_rows(jnp.repeat(jnp.arange(tokens_BP.shape[0]), num_samples))
    return cache


def draw(logits_BV: jax.Array, sampling: SamplingParams, keys_B: jax.Array
         ) -> tuple[jax.Array, jax.Array]:
    """(token [B], q [B, V]): the argmax for greedy rows, else a draw from q = the softmax of
    the filtered logits. When every row is greedy, q is zeros and no filter runs."""
    batch, vocab = logits_BV.shape
    greedy_B = jnp.broadcast_to(sampling.is_greedy, (batch,))
    argmax_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def sampled(logits_BV):
        filtered_BV = filter_logits(logits_BV, sampling)
        drawn_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV).astype(jnp.int32)
        return jnp.where(greedy_B, argmax_B, drawn_B), jax.nn.softmax(filtered_BV, axis=-1)

    def greedy(logits_BV):
        return argmax_B, jnp.zeros((batch, vocab), jnp.float32)

    return jax.lax.cond(jnp.all(greedy_B), greedy, sampled, logits_BV)


def catch_up(draft_step, cache: M.KVCache, context_BC: jax.Array, context_lengths_B: jax.Array,
             running_B: jax.Array) -> M.KVCache:
    """The draft's cache fed each running row's context up to its last two tokens, as far
    as it has room: after plain iterations, which do not run the draft, it lags by more.
    CATCH_UP_TOKENS go in per call while they fit, then one at a time (a write of T tokens
    needs T free slots, however few of them are valid; a cache smaller than that, as an
    encoder-decoder's for a short output, takes as many as it holds)."""
    width = context_BC.shape[1]

    def feed(num_tokens):
        def to_feed(cache):
            lag_B = context_lengths_B - 2 - cache.lengths
            fits_B = cache.lengths + num_tokens <= cache.capacity
            return jnp.where(running_B & fits_B, jnp.clip(lag_B, 0, num_tokens), 0)

        def call(cache):
            slots_BT = jnp.clip(cache.lengths[:, None] + jnp.arange(num_tokens), 0, width - 1)
            tokens_BT = jnp.take_along_axis(context_BC, slots_BT, axis=1)
            return draft_step(tokens_BT, cache, to_feed(cache))[1]

        return lambda cache: jax.lax.while_loop(lambda c: jnp.any(to_feed(c) > 0), call, cache)

    return feed(1)(feed(min(CATCH_UP_TOKENS, cache.capacity))(cache))


def propose(draft_step, cache: M.KVCache, context_BC: jax.Array, context_lengths_B: jax.Array,
            running_B: jax.Array, speculate: jax.Array, sampling: SamplingParams,
            keys_B: jax.Array, num_draft: int) -> tuple[jax.Array, jax.Array, M.KVCache]:
    """(drafts [B, J], q [B, J, V], cache): J tokens per running row, drawn one at a time.

    `draft_step(tokens [B, T], cache, lengths [B])` is the draft model's step. After
    `catch_up`, the first call feeds the one or two tokens of the context the draft has not
    seen (T = 2); the J - 1 calls of one token after it run only if `speculate`. A row
    whose cache has no room for the first call's two tokens is fed none."""
    cache = catch_up(draft_step, cache, context_BC, context_lengths_B, running_B)
    batch, width = context_BC.shape
    behind_B = jnp.clip(context_lengths_B - cache.lengths, 0, 2)
    unseen_B2 = jnp.take_along_axis(
        context_BC, jnp.clip(cache.lengths[:, None] + jnp.arange(2), 0, width - 1), axis=1)
    fits_B = cache.lengths + 2 <= cache.capacity  # else nothing is written, never clamped
    logits_B2V, cache = draft_step(unseen_B2, cache, jnp.where(running_B & fits_B, behind_B, 0))
    newest_B = jnp.maximum(behind_B - 1, 0)
    logits_BV = jnp.take_along_axis(logits_B2V, newest_B[:, None, None], axis=1)[:, 0]
    token_B, q_BV = draw(logits_BV, sampling, token_keys(keys_B, 0))
    drafts_BJ = jnp.zeros((batch, num_draft), jnp.int32).at[:, 0].set(token_B)
    q_BJV = jnp.zeros((batch, num_draft, q_BV.shape[-1]), jnp.float32).at[:, 0].set(q_BV)

    def next_draft(i, carry):
        drafts_BJ, q_BJV, cache = carry
        logits_B1V, cache = draft_step(drafts_BJ[:, i - 1, None], cache,
                                       running_B.astype(jnp.int32))
        token_B, q_BV = draw(logits_B1V[:, 0], sampling, token_keys(keys_B, i))
        return drafts_BJ.at[:, i].set(token_B), q_BJV.at[:, i].set(q_BV), cache

    # A loop with a traced trip count: XLA updates the cache in place through it, where a
    # conditional would copy it.
    return jax.lax.fori_loop(1, jnp.where(speculate, num_draft, 1), next_draft,
                             (drafts_BJ, q_BJV, cache))
