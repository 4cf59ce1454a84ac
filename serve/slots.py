"""The engine's device side: every slot's decode state in one pytree, and the two compiled
programs that change it.

  insert(state, prefix, rows, slots) writes prefilled prompts into slots (traced indices)
                                    and samples their first tokens;
  decode_chunk(state, keep, ...)    runs up to `steps` decode steps over every slot in one
                                    `lax.while_loop` and returns the tokens each slot made.

Both donate the state, so the cache is updated where it lies and never copied. Everything
a slot's request chose (sampling settings, stop ids, token budget, random key) is a row of
a traced array, so requests come and go without compiling anything. A slot samples token g
of its request with `fold_in(request key, g)`: its tokens do not depend on which other
requests share the batch.

Shape letters: B slots, S cache slots per row (capacity), C context buffer (= S), E stop
ids per slot, K steps per chunk, W top logprobs kept per token, V vocab.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from kvjax.decode.loop import StopReason
from kvjax.decode.processors import ProcessorState, apply_processors
from kvjax.decode.sampling import SamplingParams, filter_logits
from kvjax.decode.tracing import count_trace

from kvjax import model as M
from kvjax import parallel

MAX_STOP_IDS = 8  # stop ids travel as a fixed-size row so their number never recompiles
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions ask for at most 5


@flax.struct.dataclass
class SlotState:
    """What the slots hold between programs.

    cache:           the model's `KVCache` with one row per slot [B, ..., S, ...].
    last_tokens:     [B] int32 each slot's newest token (fed at the next step).
    generated:       [B] int32 tokens the slot's request has made so far.
    max_tokens:      [B] int32 the request's token budget.
    stop_ids:        [B, E] int32 ids that end the request (-1 pads).
    keys:            [B, 2] uint32 the request's random key (its key data).
    sampling:        `SamplingParams` with [B] fields.
    context:         [B, C] int32 prompt and generated tokens, which the penalties read.
    context_lengths: [B] int32.
    running:         [B] bool the slot holds a request that is still generating.
    stop_reason:     [B] int32 `StopReason` of the slot's last request.
    """

    cache: M.KVCache
    last_tokens: jax.Array
    generated: jax.Array
    max_tokens: jax.Array
    stop_ids: jax.Array
    keys: jax.Array
    sampling: SamplingParams
    context: jax.Array
    context_lengths: jax.Array
    running: jax.Array
    stop_reason: jax.Array

    @property
    def num_slots(self) -> int:
        return self.running.shape[0]


@flax.struct.dataclass
class RowSettings:
    """The settings of R samples as slots hold them: max_tokens [R], stop_ids [R, E], seed
    [R, 2] uint32 (`seed_key`), sample [R] (each sample's index among its request's n,
    folded into its key) and sampling with [R] fields."""

    max_tokens: jax.Array
    stop_ids: jax.Array
    seed: jax.Array
    sample: jax.Array
    sampling: SamplingParams


@flax.struct.dataclass
class Emitted:
    """Tokens the slots made: tokens [B, K], logprobs [B, K] (the model's, before any
    penalty), top_ids and top_logprobs [B, K, W] and counts [B]: slot b made
    tokens[b, :counts[b]]. `running` and `stop_reason` [B] are the slots' state after them."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    counts: jax.Array
    running: jax.Array
    stop_reason: jax.Array


def seed_key(seed: int) -> np.ndarray:
    """The key data [2] uint32 of a 64-bit `seed`: both halves count (`jax.random.key` with
    64-bit types off keeps only the low 32 bits, so seeds 5 and 2**32 + 5 would coincide)."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def empty_state(config: M.TransformerConfig, num_slots: int, capacity: int,
                mesh=None) -> SlotState:
    """Every slot free; on `mesh`, made in the layout the programs keep it in (slots split
    over `data`, kv heads over `model`: `parallel.constrain_rows`), so that their first call
    compiles for the layout every later one sees."""
    if config.is_encoder_decoder:
        raise ValueError("the serving engine runs decoder-only language models; this "
                         "checkpoint is an encoder-decoder")
    if mesh is None:
        return _free_slots(config, num_slots, capacity)
    return _free_slots_on(config, num_slots, capacity, mesh)


def _free_slots(config: M.TransformerConfig, num_slots: int, capacity: int) -> SlotState:
    def zeros():  # one buffer per field: the programs donate each of them
        return jnp.zeros((num_slots,), jnp.int32)

    return SlotState(
        cache=M.init_cache(config, num_slots, capacity),
        last_tokens=zeros(), generated=zeros(), max_tokens=zeros(),
        stop_ids=jnp.full((num_slots, MAX_STOP_IDS), -1, jnp.int32),
        keys=jnp.zeros((num_slots, 2), jnp.uint32),
        sampling=SamplingParams.make(batch=num_slots),
        context=jnp.zeros((num_slots, capacity), jnp.int32),
        context_lengths=zeros(),
        running=jnp.zeros((num_slots,), bool),
        stop_reason=zeros(),
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _free_slots_on(config: M.TransformerConfig, num_slots: int, capacity: int, mesh):
    return parallel.constrain_rows(_free_slots(config, num_slots, capacity), mesh)


def choose(logits_BV, context_BC, context_lengths_B, sampling: SamplingParams, keys_B2,
           positions_B, want_top=True):
    """(token [B], logprob [B], top_logprobs [B, W], top_ids [B, W]): each row's next token
    as `decode` samples it (built-in penalties, then greedy or top-k/p, min-p), drawn with
    the row's own key folded with its position. The top W are zeros unless `want_top`."""
    processed_BV = apply_processors(logits_BV, ProcessorState(
        context_BC, context_lengths_B, jnp.zeros((), jnp.int32), sampling))
    greedy_B = sampling.is_greedy

    def draw(logits_BV):
        def one(key, position, row_V):
            key = jax.random.fold_in(jax.random.wrap_key_data(key), position)
            return jax.random.categorical(key, row_V)

        drawn_B = jax.vmap(one)(keys_B2, positions_B, filter_logits(logits_BV, sampling))
        return jnp.where(greedy_B, jnp.argmax(logits_BV, axis=-1), drawn_B)

    token_B = jax.lax.cond(jnp.all(greedy_B), lambda x: jnp.argmax(x, axis=-1), draw,
                           processed_BV).astype(jnp.int32)
    logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32))
    logprob_B = jnp.take_along_axis(logprobs_BV, token_B[:, None], axis=-1)[:, 0]
    width = min(MAX_TOP_LOGPROBS, logits_BV.shape[-1])

    def top(logprobs_BV):
        values_BW, ids_BW = jax.lax.top_k(logprobs_BV, width)
        return values_BW, ids_BW.astype(jnp.int32)

    def nothing(logprobs_BV):
        batch = logprobs_BV.shape[0]
        return jnp.zeros((batch, width), jnp.float32), jnp.zeros((batch, width), jnp.int32)

    top_logprobs_BW, top_ids_BW = jax.lax.cond(want_top, top, nothing, logprobs_BV)
    return token_B, logprob_B, top_logprobs_BW, top_ids_BW


def _record(state: SlotState, token_B, live_B) -> SlotState:
    """Takes the new token of every `live` slot and stops those it ends."""
    token_B = jnp.where(live_B, token_B, 0)
    is_stop_B = jnp.any(token_B[:, None] == state.stop_ids, axis=-1)
    generated_B = state.generated + live_B
    reached_max_B = generated_B >= state.max_tokens
    stop_reason = jnp.where(
        live_B & is_stop_B, StopReason.EOS,
        jnp.where(live_B & reached_max_B, StopReason.MAX_NEW_TOKENS, state.stop_reason))
    width = state.context.shape[1]
    slots_B = jnp.where(live_B, state.context_lengths, width)
    context = jax.vmap(lambda row, slot, token: row.at[slot].set(token, mode="drop"))(
        state.context, slots_B, token_B)
    return state.replace(
        last_tokens=jnp.where(live_B, token_B, state.last_tokens),
        generated=generated_B,
        stop_reason=stop_reason.astype(jnp.int32),
        running=state.running & ~(live_B & (is_stop_B | reached_max_B)),
        context=context,
        context_lengths=state.context_lengths + live_B,
    )


@functools.partial(jax.jit, donate_argnums=0, static_argnames="mesh")
def insert(state: SlotState, prefix_cache: M.KVCache, next_logits_PV, context_PC,
           context_lengths_P, rows_R, slots_R, settings: RowSettings, mesh=None):
    """The state with R samples inserted and their first tokens sampled, and those tokens'
    `Emitted` [R, 1]. Sample r is prompt `rows[r]` of P prefilled ones (`prefix_cache`,
    whose capacity is at most the slots', the logits of each prompt's next token, its
    context), inserted into slot `slots[r]`; a slot past the last one inserts nothing
    (padding). What a slot's row held past the prompt is left: its length masks it. The rows and
    slots are traced: any prompts into any slots is one program per (P, R). On `mesh` the
    state keeps its layout (see `empty_state`)."""
    count_trace("serve_insert")
    keys_R2 = jax.vmap(lambda seed, sample: jax.random.key_data(
        jax.random.fold_in(jax.random.wrap_key_data(seed), sample)))(settings.seed,
                                                                   settings.sample)

    def put(all_B, new_R):  # rows of `new` into the slots
        return all_B.at[slots_R].set(new_R, mode="drop", unique_indices=True)

    def put_kv(stack_LBKS_, prefix_LPKS_):  # the prefix's first slots of each slot's row
        # [L, B, K, S, H] values or, for an int8 cache, [L, B, K, S] scales.
        index = (slice(None), slots_R, slice(None), slice(0, prefix_LPKS_.shape[3]))
        return stack_LBKS_.at[index].set(jnp.take(prefix_LPKS_, rows_R, axis=1), mode="drop",
                                         unique_indices=True)

    def put_stacks(stacks, prefix_stacks):
        return None if stacks is None else tuple(map(put_kv, stacks, prefix_stacks))

    cache = state.cache
    cache = cache.replace(
        k=put_stacks(cache.k, prefix_cache.k),
        v=put_stacks(cache.v, prefix_cache.v),
        k_scale=put_stacks(cache.k_scale, prefix_cache.k_scale),
        v_scale=put_stacks(cache.v_scale, prefix_cache.v_scale),
        lengths=put(cache.lengths, prefix_cache.lengths[rows_R]),
        overflow=put(cache.overflow, jnp.zeros(rows_R.shape, bool)))
    context_RC = jnp.pad(context_PC[rows_R],
                         ((0, 0), (0, state.context.shape[1] - context_PC.shape[1])))
    context_lengths_R = context_lengths_P[rows_R]
    live_B = jnp.any(jnp.arange(state.num_slots)[:, None] == slots_R[None], axis=1)
    state = state.replace(
        cache=cache,
        generated=put(state.generated, jnp.zeros(rows_R.shape, jnp.int32)),
        max_tokens=put(state.max_tokens, settings.max_tokens),
        stop_ids=put(state.stop_ids, settings.stop_ids),
        keys=put(state.keys, keys_R2),
        sampling=jax.tree.map(put, state.sampling, settings.sampling),
        context=put(state.context, context_RC),
        context_lengths=put(state.context_lengths, context_lengths_R),
        running=state.running | live_B,
        stop_reason=jnp.where(live_B, StopReason.RUNNING, state.stop_reason))
    token_R, logprob_R, top_logprobs_RW, top_ids_RW = choose(
        next_logits_PV[rows_R], context_RC, context_lengths_R, settings.sampling, keys_R2,
        jnp.zeros(rows_R.shape, jnp.int32))
    token_B = jnp.zeros(state.num_slots, jnp.int32).at[slots_R].set(token_R, mode="drop")
    state = parallel.constrain_rows(_record(state, token_B, live_B), mesh)
    in_range_R = jnp.minimum(slots_R, state.num_slots - 1)
    first = Emitted(tokens=token_R[:, None], logprobs=logprob_R[:, None],
                    top_ids=top_ids_RW[:, None], top_logprobs=top_logprobs_RW[:, None],
                    counts=jnp.ones(rows_R.shape, jnp.int32),
                    running=state.running[in_range_R], stop_reason=state.stop_reason[in_range_R])
    return state, first


@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames="mesh", donate_argnums=2)
def decode_chunk(config: M.TransformerConfig, params, state: SlotState, keep_B, want_top,
                 steps: int, mesh=None):
    """Up to `steps` decode steps over every running slot (after stopping those whose `keep`
    is False): (state, `Emitted` [B, steps]). The top logprobs are left out (zeros) unless
    `want_top` (a traced bool): some request asked for them. On `mesh` each device steps
    its own slots, the state kept in its layout (see `empty_state`)."""
    count_trace("serve_chunk")
    running_B = state.running & keep_B
    # A free slot's cache row holds nothing the attention needs to read.
    state = state.replace(running=running_B, cache=state.cache.replace(
        lengths=jnp.where(running_B, state.cache.lengths, 0)))
    batch, width = state.num_slots, min(MAX_TOP_LOGPROBS, config.vocab_size)
    emitted = Emitted(
        tokens=jnp.zeros((batch, steps), jnp.int32),
        logprobs=jnp.zeros((batch, steps), jnp.float32),
        top_ids=jnp.zeros((batch, steps, width), jnp.int32),
        top_logprobs=jnp.zeros((batch, steps, width), jnp.float32),
        counts=jnp.zeros((batch,), jnp.int32), running=running_B,
        stop_reason=state.stop_reason)
    step_fn = M.step_fn(config, params)

    def tokens_to_logits(tokens_B1, cache, lengths_B):  # the cache kept in its layout
        logits_B1V, cache = step_fn(tokens_B1, cache, lengths_B)
        return logits_B1V, parallel.constrain_rows(cache, mesh)

    def cond_fn(carry):
        step, state, _ = carry
        return (step < steps) & jnp.any(state.running)

    def body_fn(carry):
        step, state, emitted = carry
        full_B = state.running & (state.cache.lengths >= state.cache.capacity)
        state = state.replace(
            running=state.running & ~full_B,
            stop_reason=jnp.where(full_B, StopReason.CACHE_FULL, state.stop_reason))
        live_B = state.running
        # Stopped slots are fed nothing: their cache rows neither grow nor overflow.
        logits_B1V, cache = tokens_to_logits(state.last_tokens[:, None], state.cache,
                                             live_B.astype(jnp.int32))
        token_B, logprob_B, top_logprobs_BW, top_ids_BW = choose(
            logits_B1V[:, 0], state.context, state.context_lengths, state.sampling,
            state.keys, state.generated, want_top)
        state = _record(state.replace(cache=cache), token_B, live_B)
        emitted = emitted.replace(
            tokens=emitted.tokens.at[:, step].set(jnp.where(live_B, token_B, 0)),
            logprobs=emitted.logprobs.at[:, step].set(logprob_B),
            top_ids=emitted.top_ids.at[:, step].set(top_ids_BW),
            top_logprobs=emitted.top_logprobs.at[:, step].set(top_logprobs_BW),
            counts=emitted.counts + live_B)
        return step + 1, parallel.constrain_rows(state, mesh), emitted

    _, state, emitted = jax.lax.while_loop(
        cond_fn, body_fn, (jnp.zeros((), jnp.int32), parallel.constrain_rows(state, mesh),
                           emitted))
    return state, emitted.replace(running=state.running, stop_reason=state.stop_reason)
