"""The engine's device side: its state in one pytree, and the two compiled programs that
change it.

The state (`EngineState`) holds two sets of rows of one layout (`SlotState`): the slots,
which decode, and the staged rows, samples prefilled and waiting for a slot.

  insert(state, prefix, rows, staged, ids) writes prefilled prompts into staged rows
                                    (traced indices) and samples their first tokens (two
                                    programs: the writing one per prompt bucket);
  decode_chunk(state, cancel, ...)  (`chunk.py`) runs up to `steps` decode steps over every
                                    slot in nested `lax.while_loop`s, moving a staged sample into
                                    each slot that frees on the way, and returns the tokens.

Both donate the state, so the cache is updated where it lies and never copied. Everything
a slot's request chose (sampling settings, stop ids, token budget, random key) is a row of
a traced array, so requests come and go without compiling anything. A slot picks its tokens
and ends as `decode` does (`decode.loop.choose`, `take`), with `decode`'s keys
(`decode.sampling`): its tokens do not depend on which other requests share the batch,
and equal those `generate` makes with the request's key. Every sample has an id
(`ID_SPACE`), which the tokens it made carry back to the host.

Shape letters: B slots, Q staged rows, S cache slots per row (capacity), C context buffer
(= S), E stop ids per slot, O steps per chunk, A top logprobs kept per token, R samples
staged in one call, P padded prompt length, V vocab.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from kvjax import device_loops, parallel
from kvjax import model as M
from kvjax.decode import loop as decode_loop
from kvjax.decode.automaton import UNCONSTRAINED, RowConstraints
from kvjax.decode.bad_words import MAX_WORD_TOKENS, MAX_WORDS, banned_by_words
from kvjax.decode.loop import StopReason
from kvjax.decode.processors import ProcessorState, RowLogitBias
from kvjax.decode.sampling import SamplingParams, sample_key
from kvjax.decode.tracing import count_trace

MAX_STOP_IDS = 8  # stop ids travel as a fixed-size row so their number never recompiles
MAX_BANNED_IDS = 8  # and so do the ids a request never makes
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions ask for at most 5
MAX_LOGIT_BIAS = 300  # tokens a request's logit_bias may name: a row of fixed size
# Sample ids cycle through [0, ID_SPACE): staged samples are admitted in the order of their
# ids counted from the last one admitted, which stays right however often the ids wrap.
ID_SPACE = 1 << 30
NO_SAMPLE = -1  # the id of a row that holds none
PRIORITY_BOUND = 1 << 30  # a priority's bound either way: an int32 with room to spare


@flax.struct.dataclass
class SlotState:
    """What the slots hold between programs.

    cache:           the model's `KVCache` with one row per slot [B, ..., S, ...].
    last_tokens:     [B] int32 each slot's newest token (fed at the next step).
    generated:       [B] int32 tokens the slot's request has made so far.
    max_tokens:      [B] int32 the request's token budget.
    forced_end:      [B] int32 the token the request makes last at its budget (-1: none).
    stop_ids:        [B, E] int32 ids that end the request (-1 pads).
    banned_ids:      [B, banned] int32 ids the request never makes (-1 pads).
    bad_words:       [B, words, tokens] int32 token sequences it never completes
                     (`decode.bad_words.words_table`).
    keys:            [B, 2] uint32 the request's random key (its key data).
    sampling:        `SamplingParams` with [B] fields.
    logit_bias:      the request's `RowLogitBias` [B, MAX_LOGIT_BIAS].
    context:         [B, C] int32 prompt and generated tokens, which the penalties read.
    context_lengths: [B] int32.
    running:         [B] bool the slot holds a request that is still generating.
    stop_reason:     [B] int32 `StopReason` of the slot's last request.
    owner:           [B] int32 the id of the sample the row holds (`NO_SAMPLE`: none yet).
    constraint_state: [B] int32 the row's state in the engine's constraint tables
                     (-1: unconstrained).
    prefix_row:      [B] int32 with a paged cache, the prefix cache's row whose pages the
                     sample's first `prefix_pages` [B] pages are (shared, only read; -1:
                     none): a staged sample takes them with its slot (`pages.py`).
    adapter:         [B] int32 the LoRA adapter the row's request adds (0: none;
                     `model.lora_rows`).
    priority:        [B] int32 the row's request's priority (lower first: `chunk.py` admits,
                     `pages.py` preempts by it).
    """

    cache: M.KVCache
    last_tokens: jax.Array
    generated: jax.Array
    max_tokens: jax.Array
    forced_end: jax.Array
    stop_ids: jax.Array
    banned_ids: jax.Array
    bad_words: jax.Array
    keys: jax.Array
    sampling: SamplingParams
    logit_bias: RowLogitBias
    context: jax.Array
    context_lengths: jax.Array
    running: jax.Array
    stop_reason: jax.Array
    owner: jax.Array
    constraint_state: jax.Array
    prefix_row: jax.Array
    prefix_pages: jax.Array
    adapter: jax.Array
    priority: jax.Array

    @property
    def num_slots(self) -> int:
        return self.running.shape[0]

    def forced_now(self) -> jax.Array:
        """[B] the token each row must make next (its forced end, if this is its last), -1
        for none."""
        return forced_ends(self.generated, self.max_tokens, self.forced_end)


def forced_ends(generated_B, max_tokens_B, forced_end_B) -> jax.Array:
    """[B] int32 each row's forced end where its next token is its last, else -1."""
    return jnp.where(generated_B + 1 >= max_tokens_B, forced_end_B, -1).astype(jnp.int32)


@flax.struct.dataclass
class EngineState:
    """slots: the decoding rows [B]; staged: prefilled samples [Q], each waiting for a slot
    while its `running` is set (its first token sampled, its prompt in its cache row);
    last_admitted: [] int32 the id of the sample that took a slot last; tables: the
    automata of the constrained samples (`constrained.py`: `RowConstraints` whose rows are
    given by `constraints`), None while no request asked for one; free_pages: [pages] bool
    which of the slots' pages of their paged cache no slot holds (`pages.py`; the pool's
    pages after those hold the prefix cache's rows), None where the slots' cache is
    contiguous."""

    slots: SlotState
    staged: SlotState
    last_admitted: jax.Array
    tables: RowConstraints | None = None
    free_pages: jax.Array | None = None

    def constraints(self, state_B: jax.Array) -> RowConstraints | None:
        """The constraints of rows in states `state_B` [B] of the tables, None without
        tables."""
        return None if self.tables is None else self.tables.replace(state=state_B)


@flax.struct.dataclass
class RowSettings:
    """The settings of R samples as slots hold them: max_tokens [R], forced_end [R],
    stop_ids [R, E], banned_ids [R, banned], bad_words [R, words, tokens], seed
    [R, 2] uint32 (the request's prompt key, `decode.sampling.seed_key`), sample [R] (each
    sample's index among its request's n, `sample_key`), sampling with [R] fields,
    logit_bias [R, MAX_LOGIT_BIAS], constraint_state [R] (the initial state of its automaton
    in the tables; -1: none), generated [R] (tokens the sample made before: a preempted one
    goes on from its count) and prefix_row, prefix_pages, adapter, priority [R] (as
    `SlotState`'s)."""

    max_tokens: jax.Array
    forced_end: jax.Array
    stop_ids: jax.Array
    banned_ids: jax.Array
    bad_words: jax.Array
    seed: jax.Array
    sample: jax.Array
    sampling: SamplingParams
    logit_bias: RowLogitBias
    constraint_state: jax.Array
    generated: jax.Array
    prefix_row: jax.Array
    prefix_pages: jax.Array
    adapter: jax.Array
    priority: jax.Array


@flax.struct.dataclass
class Emitted:
    """What B rows made in O steps. At step o row b served the sample `owner[b, o]`
    (`NO_SAMPLE`: none), which made `tokens[b, o]` if `made[b, o]` (not when its slot was
    full) and then stood at `reason[b, o]` (a `StopReason`; RUNNING: it goes on). A row serves
    one sample for consecutive steps, then maybe another. logprobs [B, O] are the model's,
    before any penalty; top_ids and top_logprobs [B, O, A]. After the steps `live` [] slots
    are running, `waiting` [Q] tells which staged rows still wait for a slot and
    `pages_used` [] how many pages the slots hold as their own (shared prefix pages left
    out; a chunk over paged slots, else None)."""

    tokens: jax.Array
    owner: jax.Array
    made: jax.Array
    reason: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    live: jax.Array
    waiting: jax.Array
    pages_used: jax.Array | None = None


def empty_state(config: M.TransformerConfig, num_slots: int, num_staged: int, capacity: int,
                mesh=None, pages: tuple[int, int] | None = None,
                prefix_rows: int = 0, source_capacity: int | None = None) -> EngineState:
    """Every slot and staged row free; on `mesh`, made in the layout the programs keep it in
    (rows split over `data`, kv heads over `model`: `parallel.constrain_rows`), so that their
    first call compiles for the layout every later one sees. With `pages` (num_pages,
    page_size) the slots' cache is a pool of that many pages, all free, and after them a
    row's pages for each of `prefix_rows` rows of the prefix cache (`pages.py`). An
    encoder-decoder's rows hold sources of up to `source_capacity` (default `capacity`)
    tokens."""
    if mesh is None:
        return _free_state(config, num_slots, num_staged, capacity, pages, prefix_rows,
                           source_capacity)
    return _free_state_on(config, num_slots, num_staged, capacity, mesh, pages, prefix_rows,
                          source_capacity)


def source_capacity(config: M.TransformerConfig, capacity: int, max_source_len: int | None,
                    prefix_cache_rows) -> int | None:
    """The source slots of an engine's rows: an encoder-decoder's `max_source_len` (default
    `capacity`), None for a language model. A ValueError names a setting the model is not
    served with."""
    if not M.prompt_is_source(config):
        if max_source_len is not None:
            raise ValueError(f"max_source_len={max_source_len} sizes an encoder-decoder's "
                             "sources; this model's prompts are not sources")
        return None
    if max_source_len is not None and (not isinstance(max_source_len, int)
                                       or not 1 <= max_source_len <= config.max_len):
        raise ValueError(f"max_source_len={max_source_len!r} must be an int in [1, the "
                         f"model's max_len {config.max_len}]")
    if prefix_cache_rows:
        raise ValueError(f"an encoder-decoder is served with no prefix cache (its prompts "
                         f"are sources); prefix_cache_rows={prefix_cache_rows} given")
    return capacity if max_source_len is None else max_source_len


def _free_state(config: M.TransformerConfig, num_slots: int, num_staged: int,
                capacity: int, pages: tuple[int, int] | None = None,
                prefix_rows: int = 0, source_capacity: int | None = None) -> EngineState:
    # A slot is written one token a step: its windowed layers keep rings of their window
    # (paged: those of a model that mixes them with global layers, beside the pools).
    slots_cache, free_pages = None, None
    if pages is not None:  # the slots' pages first, then each prefix row's (never free)
        num_pages, page_size = pages
        per_row = -(-capacity // page_size)
        slots_cache = M.init_paged_cache(config, num_slots, num_pages + prefix_rows * per_row,
                                         page_size, per_row, step_tokens=1,
                                         source_capacity=source_capacity)
        free_pages = jnp.ones((num_pages,), bool)
    return EngineState(slots=_free_rows(config, num_slots, capacity, slots_cache,
                                        source_capacity, step_tokens=1),
                       staged=_free_rows(config, num_staged, capacity, None, source_capacity),
                       last_admitted=jnp.full((), NO_SAMPLE, jnp.int32), free_pages=free_pages)


def _free_rows(config: M.TransformerConfig, rows: int, capacity: int,
               cache: M.KVCache | None = None, source_capacity: int | None = None,
               step_tokens: int | None = None) -> SlotState:
    def zeros():  # one buffer per field: the programs donate each of them
        return jnp.zeros((rows,), jnp.int32)

    return SlotState(
        cache=(M.row_cache(config, rows, capacity, source_capacity, step_tokens)
               if cache is None else cache),
        last_tokens=zeros(), generated=zeros(), max_tokens=zeros(),
        forced_end=jnp.full((rows,), -1, jnp.int32),
        stop_ids=jnp.full((rows, MAX_STOP_IDS), -1, jnp.int32),
        banned_ids=jnp.full((rows, MAX_BANNED_IDS), -1, jnp.int32),
        bad_words=jnp.full((rows, MAX_WORDS, MAX_WORD_TOKENS), -1, jnp.int32),
        keys=jnp.zeros((rows, 2), jnp.uint32),
        sampling=SamplingParams.make(batch=rows),
        logit_bias=RowLogitBias.empty(rows, MAX_LOGIT_BIAS),
        context=jnp.zeros((rows, capacity), jnp.int32),
        context_lengths=zeros(),
        running=jnp.zeros((rows,), bool),
        stop_reason=zeros(),
        owner=jnp.full((rows,), NO_SAMPLE, jnp.int32),
        constraint_state=jnp.full((rows,), UNCONSTRAINED, jnp.int32),
        prefix_row=jnp.full((rows,), -1, jnp.int32), prefix_pages=zeros(), adapter=zeros(),
        priority=zeros(),
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _free_state_on(config: M.TransformerConfig, num_slots: int, num_staged: int,
                   capacity: int, mesh, pages: tuple[int, int] | None = None,
                   prefix_rows: int = 0, source_capacity: int | None = None):
    return parallel.constrain_rows(
        _free_state(config, num_slots, num_staged, capacity, pages, prefix_rows,
                    source_capacity), mesh)


def choose(logits_BV, context_BC, context_lengths_B, sampling: SamplingParams,
           logit_bias: RowLogitBias, stop_ids_BE, keys_B2, positions_B, want_top=True,
           constraints: RowConstraints | None = None, live_B=None, forced_B=None,
           banned_ids=None, bad_words=None):
    """(token [B], logprob [B], top_logprobs [B, A], top_ids [B, A], constraint_state [B]
    or None): each row's next token as `decode` picks it (`decode.loop.choose`), drawn with
    the row's own key folded with its position (the tokens it has made so far, which are the
    last of its context, as the presence and frequency penalties count them, and which
    `min_tokens` compares to hold back its `stop_ids` [B, E]), its logit bias added after the
    penalties, the ids `banned_ids` [B, banned] names banned and the last ids of the
    `bad_words` [B, words, tokens] its newest tokens would complete
    (`decode.bad_words.banned_by_words`), its forced token where `forced_B` [B] names one
    (`forced_ends`), and each `live` row's constraint state after it. The top A are zeros
    unless `want_top`."""
    if bad_words is not None:
        banned_ids = jnp.concatenate([banned_ids, banned_by_words(
            bad_words, context_BC, context_lengths_B, positions_B)], axis=1)
    token_B, logprob_B, logprobs_BV = decode_loop.choose(
        logits_BV, ProcessorState(context_BC, context_lengths_B, jnp.zeros((), jnp.int32),
                                  sampling, positions_B, stop_ids_BE),
        jax.random.wrap_key_data(keys_B2), positions_B, processors=(logit_bias,),
        constraints=constraints, forced_B=forced_B, banned_ids=banned_ids)
    constraint_state_B = None if constraints is None else (
        constraints.advance(token_B, live_B).state)
    width = min(MAX_TOP_LOGPROBS, logits_BV.shape[-1])

    def top(logprobs_BV):
        values_BA, ids_BA = jax.lax.top_k(logprobs_BV, width)
        return values_BA, ids_BA.astype(jnp.int32)

    def nothing(logprobs_BV):
        batch = logprobs_BV.shape[0]
        return jnp.zeros((batch, width), jnp.float32), jnp.zeros((batch, width), jnp.int32)

    top_logprobs_BA, top_ids_BA = jax.lax.cond(want_top, top, nothing, logprobs_BV)
    return token_B, logprob_B, top_logprobs_BA, top_ids_BA, constraint_state_B


def record(state: SlotState, token_B, live_B) -> SlotState:
    """Takes the new token of every `live` row and stops those it ends, as the decode loop
    does (`decode.loop.take`)."""
    generated_B = state.generated + live_B
    state, _, ends_B = decode_loop.take(state, token_B, live_B, state.stop_ids,
                                        generated_B >= state.max_tokens, state.forced_now())
    return state.replace(generated=generated_B, running=state.running & ~ends_B)


def insert(state: EngineState, prefix_cache: M.KVCache, next_logits_PV, context_PC,
           context_lengths_P, rows_R, staged_R, ids_R, settings: RowSettings, mesh=None):
    """The state with R samples staged and their first tokens sampled, and those tokens'
    `Emitted` [R, 1]. Sample r, with id `ids[r]`, is prompt `rows[r]` of P prefilled ones
    (`prefix_cache`, whose capacity is at most the rows', the logits of each prompt's next
    token, its context), written into staged row `staged[r]`; a row past the last one stages
    nothing (padding). What a row held past the prompt is left: its length masks it. A
    sample that its first token ends waits for no slot. The indices are traced: any prompts
    into any rows compile nothing new. On `mesh` the state keeps its layout (see
    `empty_state`).

    Two programs: the prompts' cache and context are written by one compiled for each
    (P, R) (`_stage`); the settings are written and the first tokens chosen by one compiled
    for each R whatever the bucket (`_first_tokens`). Sampling and the logit
    processors, compiled with both branches of each decision, are most of the work of
    compiling an insert and need nothing of the prompt's length."""
    state, chosen_from = _stage(state, prefix_cache, next_logits_PV, context_PC,
                                context_lengths_P, rows_R, staged_R, mesh=mesh)
    return _first_tokens(state, *chosen_from, staged_R, ids_R, settings, mesh=mesh)


def _put(all_Q, staged_R, new_R):
    """Rows of `new` into the staged rows `staged_R` (one past the last: dropped)."""
    return all_Q.at[staged_R].set(new_R, mode="drop", unique_indices=True)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="mesh")
def _stage(state: EngineState, prefix_cache: M.KVCache, next_logits_PV, context_PC,
           context_lengths_P, rows_R, staged_R, mesh=None):
    """`insert`'s prompts written into their staged rows (cache and context), and what
    their first tokens are chosen from: (logits [R, V], context [R, C], its lengths [R])."""
    count_trace("serve_insert")
    rows = state.staged
    context_RC = jnp.pad(context_PC[rows_R],
                         ((0, 0), (0, rows.context.shape[1] - context_PC.shape[1])))
    context_lengths_R = context_lengths_P[rows_R]
    rows = rows.replace(cache=rows.cache.put_rows(prefix_cache, rows_R, staged_R),
                        context=_put(rows.context, staged_R, context_RC),
                        context_lengths=_put(rows.context_lengths, staged_R,
                                             context_lengths_R))
    state = parallel.constrain_rows(state.replace(staged=rows), mesh)
    return state, (next_logits_PV[rows_R], context_RC, context_lengths_R)


# Choosing a token decides (greedy or not, processors on or not) with conditionals: on a
# GPU they are decided on the device (`kvjax.device_loops`).
@functools.partial(device_loops.jit, donate_argnums=0, static_argnames="mesh")
def _first_tokens(state: EngineState, logits_RV, context_RC, context_lengths_R, staged_R,
                  ids_R, settings: RowSettings, mesh=None):
    """`insert`'s samples given their settings in the staged rows `_stage` wrote, and their
    first tokens chosen and recorded."""
    count_trace("serve_first_tokens")
    rows = state.staged
    keys_R2 = jax.random.key_data(jax.vmap(sample_key)(
        jax.random.wrap_key_data(settings.seed), settings.sample))

    def put(all_Q, new_R):
        return _put(all_Q, staged_R, new_R)

    new_Q = jnp.any(jnp.arange(rows.num_slots)[:, None] == staged_R[None], axis=1)
    rows = rows.replace(
        generated=put(rows.generated, settings.generated),
        max_tokens=put(rows.max_tokens, settings.max_tokens),
        forced_end=put(rows.forced_end, settings.forced_end),
        stop_ids=put(rows.stop_ids, settings.stop_ids),
        banned_ids=put(rows.banned_ids, settings.banned_ids),
        bad_words=put(rows.bad_words, settings.bad_words),
        keys=put(rows.keys, keys_R2),
        sampling=jax.tree.map(put, rows.sampling, settings.sampling),
        logit_bias=jax.tree.map(put, rows.logit_bias, settings.logit_bias),
        running=rows.running | new_Q,
        stop_reason=jnp.where(new_Q, StopReason.RUNNING, rows.stop_reason),
        owner=put(rows.owner, ids_R), prefix_row=put(rows.prefix_row, settings.prefix_row),
        prefix_pages=put(rows.prefix_pages, settings.prefix_pages),
        adapter=put(rows.adapter, settings.adapter),
        priority=put(rows.priority, settings.priority))
    constraints = state.constraints(settings.constraint_state)
    token_R, logprob_R, top_logprobs_RA, top_ids_RA, constraint_state_R = choose(
        logits_RV, context_RC, context_lengths_R, settings.sampling, settings.logit_bias,
        settings.stop_ids, keys_R2, settings.generated, constraints=constraints,
        live_B=jnp.ones(staged_R.shape, bool),
        forced_B=forced_ends(settings.generated, settings.max_tokens, settings.forced_end),
        banned_ids=settings.banned_ids, bad_words=settings.bad_words)
    if constraints is not None:
        rows = rows.replace(constraint_state=put(rows.constraint_state, constraint_state_R))
    token_Q = jnp.zeros(rows.num_slots, jnp.int32).at[staged_R].set(token_R, mode="drop")
    rows = record(rows, token_Q, new_Q)
    state = parallel.constrain_rows(state.replace(staged=rows), mesh)
    in_range_R = staged_R < rows.num_slots
    reason_R = rows.stop_reason[jnp.minimum(staged_R, rows.num_slots - 1)]
    first = Emitted(tokens=token_R[:, None],
                    owner=jnp.where(in_range_R, ids_R, NO_SAMPLE)[:, None],
                    made=in_range_R[:, None], reason=reason_R[:, None],
                    logprobs=logprob_R[:, None], top_ids=top_ids_RA[:, None],
                    top_logprobs=top_logprobs_RA[:, None],
                    live=jnp.sum(state.slots.running, dtype=jnp.int32), waiting=rows.running)
    return state, first
