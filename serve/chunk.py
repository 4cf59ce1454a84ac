"""The engine's decode chunk: up to `steps` decode steps over every slot, in one compiled
program, with each slot that frees on the way taken at once by the next staged sample (of the
lowest priority, the oldest).

Admission happens on the device, between steps, so a chunk can be long without slots
standing idle until it ends: the host's turns (handing out tokens, prefilling and staging
what arrived) only need to come often enough to keep samples staged. The program is two
nested `lax.while_loop`s: the inner one decodes (a step, or `steps_per_check` steps, per
iteration) while no slot is free with a sample waiting; the outer one then moves staged
samples into the free slots (`admit`) and decodes on.

Shape letters as in `slots.py`: B slots, Q staged rows, I ids to cancel, O steps, A top
logprobs kept per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax import device_loops, parallel
from kvjax import model as M
from kvjax.decode.loop import StopReason
from kvjax.decode.tracing import count_trace
from kvjax.model import lora_rows

from . import pages
from .slots import (
    ID_SPACE,
    MAX_TOP_LOGPROBS,
    NO_SAMPLE,
    PRIORITY_BOUND,
    Emitted,
    EngineState,
    SlotState,
    choose,
    record,
)

COPY_BLOCK = 128  # cache positions a staged prompt is copied into its slot by
INT_COLUMNS = 4  # a step's ints per row before its top ids: token, owner, made, reason


def _next_staged(state: EngineState) -> jax.Array:
    """The staged row of the waiting sample admitted next: of the lowest priority, the
    oldest (any row when none waits)."""
    staged = state.staged
    first_priority = jnp.min(jnp.where(staged.running, staged.priority, PRIORITY_BOUND))
    age_Q = (staged.owner - state.last_admitted - 1) & (ID_SPACE - 1)
    next_Q = staged.running & (staged.priority == first_priority)
    return jnp.argmin(jnp.where(next_Q, age_Q, ID_SPACE))


def admit(state: EngineState, reach: int | None = None) -> EngineState:
    """Moves the next waiting staged sample (`_next_staged`) into the first free slot (some
    must be both, and with a paged cache its pages must be free:
    `_slot_free_and_sample_waiting`).

    Its prompt's cache positions are copied by blocks of `COPY_BLOCK` (or by pages, into the
    pages it takes: `pages.py`), as many as its length needs, so a slot of long capacity
    costs no more to fill than its prompt is long."""
    slots, staged = state.slots, state.staged
    row = _next_staged(state)
    slot = jnp.argmin(slots.running)  # False first: a free slot

    def take(slots_B, staged_Q):
        return slots_B.at[slot].set(staged_Q[row])

    rest = jax.tree.map(take, slots.replace(cache=None), staged.replace(cache=None))
    if state.free_pages is None:
        cache, free_pages = slots.cache.copy_row(staged.cache, row, slot, COPY_BLOCK), None
    else:
        cache, free_pages = pages.admit_into_pages(state, row, slot, reach)
    return state.replace(slots=rest.replace(cache=cache),
                         staged=staged.replace(running=staged.running.at[row].set(False)),
                         last_admitted=staged.owner[row], free_pages=free_pages)


def _slot_free_and_sample_waiting(state: EngineState, reach: int | None = None):
    """A slot is free and a sample waits, whose pages (with a paged cache) are free; `reach`
    as in `admit`."""
    waiting = jnp.any(~state.slots.running) & jnp.any(state.staged.running)
    if state.free_pages is None:
        return waiting
    return waiting & pages.pages_free_for(state, _next_staged(state), reach)


def _release(state: EngineState) -> EngineState:
    """With a paged cache, the pages of every slot that stopped go back to the pool."""
    return state if state.free_pages is None else pages.release_stopped(state)


def _starving(state: EngineState, queued):
    """A slot is free, no sample is staged, and the host holds requests: only the host's
    turn can feed the slot, so the chunk ends."""
    return queued & jnp.any(~state.slots.running) & ~jnp.any(state.staged.running)


def decode_chunk(config: M.TransformerConfig, params, state: EngineState, cancel_I,
                 want_top, queued, steps: int, mesh=None, steps_per_check: int = 1,
                 adapters: lora_rows.AdapterStack | None = None) -> tuple[EngineState, Emitted]:
    """Up to `steps` decode steps over every running slot, after stopping every sample (in a
    slot or staged) whose id is in `cancel` (-2 pads): (state, `Emitted` [B, steps]). A slot
    that is free before a step takes the next staged sample, if one waits; if none does
    and `queued` (a traced bool: the host holds requests to stage), the chunk ends. The top
    logprobs are left out (zeros) unless `want_top` (a traced bool): some request asked for
    them. On `mesh` each device steps its own slots, the state kept in its layout (see
    `slots.empty_state`).

    With `steps_per_check` k > 1 the steps run k at a time in a loop of known trip count,
    and whether to go on, or to admit staged samples, is decided only between those: where
    loops do not stay on the device (on a GPU they do: `kvjax.device_loops`), a loop whose
    trip count the device cannot know waits for the host at every iteration. A slot that frees
    inside the k steps waits for their end; a step once every slot is done, or past `steps`,
    changes nothing (it feeds no row and emits nothing). Each slot adds the LoRA adapter of
    `adapters` its request named (`SlotState.adapter`)."""
    return _decode_chunk(config, params, state, cancel_I, want_top, queued, steps, mesh=mesh,
                         steps_per_check=steps_per_check, adapters=adapters)


# On a GPU a step's kernels can take less time than the host needs to launch them: the
# loops and their conditions run on the device (`kvjax.device_loops`).
@functools.partial(device_loops.jit, static_argnums=(0, 6),
                   static_argnames=("mesh", "steps_per_check"), donate_argnums=2)
def _decode_chunk(config, params, state, cancel_I, want_top, queued, steps, mesh=None,
                  steps_per_check=1, adapters=None):
    count_trace("serve_chunk")
    reach = config.attention_reach  # pages behind it go back to the pool (`pages.py`)

    def stop_cancelled(rows: SlotState) -> SlotState:
        cancelled = jnp.any(rows.owner[:, None] == cancel_I[None], axis=1)
        return rows.replace(running=rows.running & ~cancelled)

    state = _release(state.replace(slots=stop_cancelled(state.slots),
                                   staged=stop_cancelled(state.staged)))
    batch, width = state.slots.num_slots, min(MAX_TOP_LOGPROBS, config.vocab_size)
    # What a step emits is written as two rows, its ints [B, 4 + A] and its floats
    # [B, 1 + A], into buffers of one such row per step: two writes a step, not one per
    # field (fewer kernels); `Emitted` is cut from them after the steps. A step past
    # `steps` (see `steps_per_check`) writes into a spare last row.
    ints = jnp.zeros((steps + 1, batch, INT_COLUMNS + width), jnp.int32).at[..., 1].set(
        NO_SAMPLE)
    floats = jnp.zeros((steps + 1, batch, 1 + width), jnp.float32)

    def decoding(carry):
        step, state, _ = carry
        return ((step < steps) & jnp.any(state.slots.running)
                & ~_slot_free_and_sample_waiting(state, reach) & ~_starving(state, queued))

    def decode_step(carry, active=True):
        step, state, emitted = carry
        preempted_B = False
        if state.free_pages is not None:  # pages for the slots about to fill theirs
            state, preempted_B = pages.grow(state, active, reach)
        slots = state.slots
        full_B = active & slots.running & (slots.cache.lengths >= slots.cache.capacity)
        slots = slots.replace(
            running=slots.running & ~full_B,
            stop_reason=jnp.where(full_B, StopReason.CACHE_FULL, slots.stop_reason))
        live_B = active & slots.running
        # Stopped slots are fed nothing: their cache rows neither grow nor overflow.
        step_fn = M.step_fn(config, params, lora_rows.for_rows(adapters, slots.adapter))
        logits_B1V, cache = step_fn(slots.last_tokens[:, None], slots.cache,
                                    live_B.astype(jnp.int32))
        token_B, logprob_B, top_logprobs_BA, top_ids_BA, constraint_state_B = choose(
            logits_B1V[:, 0], slots.context, slots.context_lengths, slots.sampling,
            slots.logit_bias, slots.stop_ids, slots.keys, slots.generated, want_top,
            state.constraints(slots.constraint_state), live_B, slots.forced_now(),
            slots.banned_ids, slots.bad_words)
        if constraint_state_B is not None:
            slots = slots.replace(constraint_state=constraint_state_B)
        slots = record(slots.replace(cache=cache), token_B, live_B)
        served_B = live_B | full_B | preempted_B
        ints, floats = emitted
        step_ints = jnp.concatenate([
            jnp.stack([jnp.where(live_B, token_B, 0),
                       jnp.where(served_B, slots.owner, NO_SAMPLE),
                       live_B.astype(jnp.int32),
                       jnp.where(served_B, slots.stop_reason, StopReason.RUNNING)], axis=1),
            top_ids_BA], axis=1)
        step_floats = jnp.concatenate([logprob_B[:, None], top_logprobs_BA], axis=1)
        row = jnp.where(active, step, steps)
        emitted = (jax.lax.dynamic_update_slice_in_dim(ints, step_ints[None], row, 0),
                   jax.lax.dynamic_update_slice_in_dim(floats, step_floats[None], row, 0))
        step = step + jnp.asarray(active, jnp.int32)
        state = _release(state.replace(slots=slots))
        return step, parallel.constrain_rows(state, mesh), emitted

    def decode_steps(carry):
        if steps_per_check == 1:
            return decode_step(carry)

        def masked(_, carry):
            step, state, _ = carry
            return decode_step(carry, (step < steps) & jnp.any(state.slots.running))

        return jax.lax.fori_loop(0, steps_per_check, masked, carry)

    def admit_and_decode(carry):
        step, state, emitted = carry
        state = jax.lax.while_loop(functools.partial(_slot_free_and_sample_waiting, reach=reach),
                                   functools.partial(admit, reach=reach), state)
        slots = state.slots
        # A free slot's cache row holds nothing the attention needs to read.
        slots = slots.replace(cache=slots.cache.replace(
            lengths=jnp.where(slots.running, slots.cache.lengths, 0)))
        state = parallel.constrain_rows(state.replace(slots=slots), mesh)
        return jax.lax.while_loop(decoding, decode_steps, (step, state, emitted))

    def unfinished(carry):
        step, state, _ = carry
        return ((step < steps) & ~_starving(state, queued)
                & (jnp.any(state.slots.running) | _slot_free_and_sample_waiting(state, reach)))

    _, state, (ints, floats) = jax.lax.while_loop(
        unfinished, admit_and_decode,
        (jnp.zeros((), jnp.int32), parallel.constrain_rows(state, mesh), (ints, floats)))
    ints, floats = ints[:steps].transpose(1, 0, 2), floats[:steps].transpose(1, 0, 2)
    pages_used = None if state.free_pages is None else (  # shared prefix pages left out
        state.free_pages.shape[0] - jnp.sum(state.free_pages, dtype=jnp.int32))
    return state, Emitted(
        tokens=ints[..., 0], owner=ints[..., 1], made=ints[..., 2] > 0, reason=ints[..., 3],
        logprobs=floats[..., 0], top_ids=ints[..., INT_COLUMNS:], top_logprobs=floats[..., 1:],
        live=jnp.sum(state.slots.running, dtype=jnp.int32), waiting=state.staged.running,
        pages_used=pages_used)


def default_chunk_size() -> int:
    """Decode steps per chunk: 32 on a CPU, 64 on an accelerator. A chunk ends early when a
    slot is free and only the host can fill it (`_starving`), so a long chunk delays no
    admission; what it saves is host turns, each of which holds every stream (on an
    accelerator, for several steps' time). Measured in benchmarks/README.md."""
    return 32 if jax.default_backend() == "cpu" else 64


def default_steps_per_check() -> int:
    """Decode steps a chunk runs between its checks: 1 on a CPU, where checking costs
    little and a freed slot refills at once; 8 on an accelerator, where a step is short
    beside a check's turn through the loop (measured in benchmarks/README.md)."""
    return 1 if jax.default_backend() == "cpu" else 8
