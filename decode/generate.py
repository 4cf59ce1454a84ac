"""The generation API: `generate`, `stream`, `beam_search` and `prefill`, for both model
variants.

A call validates its inputs in Python (a ValueError names the bad value before anything is
compiled) and pads the prompts into a bucketed shape (`prepare.py`), then runs two compiled
programs:
  1. `_start`: the prefill — the whole prompt batch through the model in one parallel call
     that fills the cache — and the first sampled token;
  2. `_continue`: the decode `lax.while_loop` (see `decode/loop.py`).
Sampling settings (one value per row), eos ids and max_new_tokens are traced values and
prompt length, token budget and cache capacity are rounded up to buckets (`buckets.py`), so
calls that differ only in those compile nothing new. `num_samples` copies each prefilled prompt's
cache to its samples' rows; `prompt_state.py` continues a kept `PromptState` instead of
prefilling. Shape letters: B batch, P padded prompt length, O token buffer, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Generator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax import parallel
from kvjax.distributed import host_arrays
from kvjax.model import lora_rows

from . import beam, checks, prompt_state
from . import speculative as spec
from .automaton import RowConstraints
from .buckets import bucket
from .loop import (
    DecodeState,
    StopConditions,
    StopReason,
    decode_loop,
    initial_state,
    record,
)
from .plan import ON_DEVICE, LoopPlan
from .prepare import (
    Constrained,
    Mesh,
    Prepared,
    pad_prompts,
    placement,
    prepare,
    validate,
)
from .processors import LogitProcessor
from .prompt_state import PromptState
from .sampling import SamplingParams, row_keys
from .settings import GREEDY, Sampling
from .tracing import count_trace


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """tokens [B, O] (0 after a row stops), lengths [B] (the stopping EOS counted),
    stop_reason [B] (`StopReason` values), logprobs [B, O] or None.
    For beam search, `scores` [B] holds each best hypothesis's length-penalised score.
    With `num_samples` n, row b·n + j is sample j of prompt b. `state` (with
    `return_state=True`) continues every row after its generated tokens. `speculation`
    (with `speculative=...`) counts drafted and accepted tokens and the loop's model calls."""

    tokens: np.ndarray
    lengths: np.ndarray
    stop_reason: np.ndarray
    logprobs: np.ndarray | None = None
    scores: np.ndarray | None = None
    state: PromptState | None = None
    speculation: spec.SpeculationStats | None = None

    def token_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]

    def stop_reasons(self) -> list[str]:
        return [StopReason(int(r)).name.lower() for r in self.stop_reason]


# Compiled programs -----------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 9, 10),
                   static_argnames=("mesh", "plan", "step_tokens"))
def _start(config, params, tokens_BP, lengths_B, rng, capacity: int, buffer_len: int,
           stops: StopConditions, sampling: SamplingParams, num_samples: int,
           processors: tuple[LogitProcessor, ...], mesh=None,
           plan: LoopPlan = ON_DEVICE, constraints: RowConstraints | None = None,
           adapters: lora_rows.RowAdapters | None = None,
           step_tokens: int | None = None) -> DecodeState:
    """Prefills each prompt once, copies its cache to its `num_samples` rows and samples
    every row's first token. `rng` is one key, or one per prompt (`sampling.row_keys`);
    `constraints` has one row per sample; `adapters`, each prompt's LoRA adapter;
    `step_tokens`, the most tokens the loop's calls write (windowed layers then keep rings
    of what their window reads, `model/ring.py`), or None for a state kept to continue."""
    count_trace("start")
    logits_BV, cache = M.prefill(config, params, tokens_BP, lengths_B, capacity,
                                 adapters=lora_rows.collection_of(adapters, tokens_BP.shape[0]),
                                 step_tokens=step_tokens)
    context_BC, context_lengths_B = prompt_state.prompt_context(
        config, tokens_BP, lengths_B, M.prompt_slots(config, tokens_BP.shape[1]) + buffer_len)
    if num_samples > 1:
        rows = jnp.repeat(jnp.arange(tokens_BP.shape[0]), num_samples)
        logits_BV, cache = logits_BV[rows], cache.take_rows(rows)
        context_BC, context_lengths_B = context_BC[rows], context_lengths_B[rows]
    keys_B = row_keys(rng, tokens_BP.shape[0], num_samples)
    state = initial_state(context_BC.shape[0], buffer_len, cache, keys_B, context_BC,
                          context_lengths_B, constraints)
    return parallel.constrain_rows(record(state, logits_BV, stops, sampling, processors, plan),
                                   mesh)


@functools.partial(jax.jit, static_argnums=(0, 6), static_argnames=("mesh", "plan"),
                   donate_argnums=2)
def _continue(config, params, state: DecodeState, stops: StopConditions,
              sampling: SamplingParams, step_limit,
              processors: tuple[LogitProcessor, ...], mesh=None,
              plan: LoopPlan = ON_DEVICE,
              adapters: lora_rows.RowAdapters | None = None) -> DecodeState:
    count_trace("continue")
    state = parallel.constrain_rows(state, mesh)
    step = M.step_fn(config, params,
                     lora_rows.collection_of(adapters, state.tokens.shape[0]))
    return decode_loop(parallel.keep_rows(step, mesh), state, stops, sampling, step_limit,
                       processors, plan)


# Public API ------------------------------------------------------------------------------

def _begin(config, params, p: Prepared, keep: bool = False) -> DecodeState:
    """The decode state after each row's first token: from a prefill, or from `p.state`.
    Windowed layers keep rings for the loop's calls; with `keep` (the state is kept to
    continue with tokens of any length), every layer's cache holds every position."""
    step_tokens = None if keep else 1 + (
        0 if p.speculative is None else p.speculative.num_draft_tokens)
    if p.state is None:
        return _start(config, params, p.tokens, p.lengths, p.rng, p.capacity, p.buffer_len,
                      p.stops, p.sampling, p.num_samples, p.processors, mesh=p.mesh,
                      plan=p.plan, constraints=p.constraints, adapters=p.adapters,
                      step_tokens=step_tokens)
    s = p.state
    return prompt_state.resume(
        config, params, s.cache, s.next_logits, s.context, s.context_lengths, p.tokens,
        p.lengths, p.rng, p.buffer_len, p.stops, p.sampling, p.num_samples, p.processors,
        p.plan, p.constraints, step_tokens=step_tokens)


def prefill(net, params, prompts, *, lengths=None, capacity: int | None = None) -> PromptState:
    """Prefills `prompts` (as for `generate`) into a cache of at least `capacity` slots per
    row (default: the model's `max_len`) and keeps it: `generate(net, params, new_tokens,
    state=...)` then continues each row without prefilling it again."""
    config = net.config
    tokens, lengths = checks.prompt_array(prompts, lengths)
    capacity = config.max_len if capacity is None else checks.integer("capacity", capacity, 1)
    if not 1 <= capacity <= config.max_len:
        raise ValueError(f"capacity={capacity} must be in [1, max_len={config.max_len}]")
    validate(config, params, tokens, lengths, max_new_tokens=1, eos_ids=(), num_beams=1)
    padded_len = bucket(int(lengths.max()), config.max_len)
    capacity = bucket(max(capacity, M.prompt_slots(config, int(lengths.max())) + 1),
                      config.max_len)
    padded_len = min(padded_len, capacity)
    padded = pad_prompts(tokens, lengths, padded_len)
    fields = prompt_state.prefill_state(config, params, jnp.asarray(padded),
                                        jnp.asarray(lengths, jnp.int32), capacity)
    return PromptState(config, params, *fields)


def generate(net, params, prompts=None, *, max_new_tokens: int, lengths=None,
             sampling: Sampling = GREEDY, logit_processors: Sequence[LogitProcessor] = (),
             eos_ids: Sequence[int] = (), num_samples: int = 1, state: PromptState | None = None,
             return_state: bool = False, rng: jax.Array | None = None,
             return_logprobs: bool = False, mesh: Mesh | None = None,
             speculative: spec.Speculative | None = None,
             constraint: Constrained = None, adapters: lora_rows.AdapterStack | None = None,
             adapter: int | Sequence[int] = 0,
             forced_end_id: int | None = None,
             banned_ids: Sequence[int] = (),
             bad_words: Sequence[Sequence[int]] = ()) -> GenerateOutput:
    """Generates up to `max_new_tokens` per prompt.

    `prompts`: a list of token-id lists (lengths may differ) or an int array [B, P] with
    `lengths` [B]. For an `EncoderDecoder` they are the source sequences and decoding starts
    from BOS. `sampling` (a `Sampling`; greedy by default) says how each row chooses its
    tokens, with one value for every prompt or one per prompt. `logit_processors` are
    applied after the built-in penalties (see `decode/processors.py`). `num_samples` draws
    that many samples of each prompt from one prefill. With `state` (from `prefill`, or a
    previous call's `return_state=True`), `prompts` are the tokens to append to each of its
    rows (None: nothing) and nothing is prefilled again. `beam_search` keeps the likeliest
    hypotheses instead of sampling.

    `rng` (default key 0) is one key for the batch or one key per prompt [B]; each row
    draws with a key of its own (`sampling.row_keys`), so a prompt's samples depend on its
    key and its position in `prompts`, never on the other prompts. With one key per prompt,
    a prompt samples the same tokens in any batch.

    On many devices (`mesh`, or the mesh `params` are sharded over; see `placement`) the
    rows and their cache are split over `data` and the kv heads over `model`; the tokens are
    the ones one device makes. A mesh may span several processes (`kvjax.distributed`): every
    process calls `generate` with the same arguments and gets the whole output.

    `speculative` (a `Speculative`) drafts tokens by prompt lookup or with a draft model and
    verifies them in one model call (see `decode/speculative.py`): greedy output is
    unchanged, sampled output keeps its distribution.

    `constraint` (a `TokenAutomaton` from `compile_constraint`, one for every prompt or a
    sequence of one or None per prompt) keeps a row's text inside a regular expression, a
    list of choices or a JSON Schema: each step allows only the tokens that keep it there,
    and the automaton's end id (which must be among `eos_ids`) only once the text is
    complete (`decode/constraints.py`).

    `adapters` (a `lora_rows.AdapterStack` of LoRA adapters trained on `params`) and
    `adapter` (an index in it for every prompt, or one per prompt; 0: none) give each prompt
    its own adapter, unmerged: its tokens are those of its adapter merged into the model.
    Not with `speculative` or a kept state (`state`, `return_state`).

    `forced_end_id` (transformers' `forced_eos_token_id`, which a translator's generation
    config may set): a row that reaches `max_new_tokens` makes this token last, whatever
    the model, a processor or a constraint would choose; it stops with `max_new_tokens`.
    `banned_ids` (at most 8; a generation config's one-token `bad_words_ids`, Marian's pad)
    are never made. `bad_words` (token sequences, up to 32 of up to 8 ids; a generation
    config's longer `bad_words_ids`) are never completed: a word's last id is banned where
    the row's tokens, its prompt's too, end with its others, as transformers bans them
    (`decode/bad_words.py`). Not with `speculative`.
    """
    _refuse_kept_adapters(return_state, adapters)
    mesh, params = _placement(net.config, params, mesh, return_state)
    prepared = prepare(net, params, prompts, lengths, max_new_tokens=max_new_tokens,
                       eos_ids=eos_ids, num_beams=1, rng=rng, num_samples=num_samples,
                       sampling=sampling, logit_processors=logit_processors, state=state,
                       mesh=mesh, speculative=speculative, constraint=constraint,
                       fill_rows=not return_state, adapters=adapters, adapter=adapter,
                       forced_end_id=forced_end_id, banned_ids=banned_ids, bad_words=bad_words)
    config = net.config
    carry = _run(config, params, _first(config, params, prepared, return_state), prepared,
                 prepared.stops.max_new_tokens)
    return _finish(config, params, carry, prepared.rows, max_new_tokens, return_logprobs,
                   return_state)


def beam_search(net, params, prompts, *, max_new_tokens: int, num_beams: int,
                length_penalty: float = 1.0, eos_ids: Sequence[int] = (), lengths=None,
                return_logprobs: bool = False, mesh: Mesh | None = None,
                constraint=None, adapters: lora_rows.AdapterStack | None = None,
                adapter: int | Sequence[int] = 0,
                forced_end_id: int | None = None,
                banned_ids: Sequence[int] = (),
                bad_words: Sequence[Sequence[int]] = (),
                num_return_sequences: int = 1) -> GenerateOutput:
    """The `num_beams` likeliest continuations of each prompt, best first: each step keeps
    the best `num_beams` hypotheses by their summed logprobs, and finished ones are scored
    by sum(logprobs) / length**length_penalty (`decode/beam.py`). Returns the best
    `num_return_sequences` (at most `num_beams`) per prompt, best first, row b·n + j the
    j-th of prompt b as transformers' `num_return_sequences` orders them, with their scores
    in `scores`. Prompts, eos ids, lengths, `mesh` and `constraint`
    (the logprobs of the tokens it allows compete; the rest are never candidates) are as for
    `generate`, and so are `adapters`, `adapter`, `banned_ids`, `bad_words` (matched against
    the prompt and each beam's tokens) and `forced_end_id` (the end every beam makes at
    `max_new_tokens`, adding 0 to its summed logprobs as transformers scores it);
    greedy in what it keeps, so there is no sampling."""
    return _drain(_searched(
        net, params, prompts, None, max_new_tokens=max_new_tokens, num_beams=num_beams,
        length_penalty=length_penalty, eos_ids=eos_ids, lengths=lengths,
        return_logprobs=return_logprobs, mesh=mesh, constraint=constraint, adapters=adapters,
        adapter=adapter, forced_end_id=forced_end_id, banned_ids=banned_ids,
        bad_words=bad_words, num_return_sequences=num_return_sequences))


def beam_search_chunks(net, params, prompts, *, chunk_size: int = 8, **options: Any
                       ) -> Generator[int, None, GenerateOutput]:
    """`beam_search(net, params, prompts, **options)` a chunk of at most `chunk_size` steps
    at a time: yields the tokens each hypothesis has after every chunk that leaves the search
    unfinished, and returns (`StopIteration.value`) what `beam_search` returns. The caller
    runs other work between chunks (a server's other requests decode there)."""
    return _searched(net, params, prompts, checks.integer("chunk_size", chunk_size, 1),
                     **options)


def _searched(net, params, prompts, chunk_size: int | None, *, max_new_tokens: int,
              num_beams: int, length_penalty: float = 1.0, eos_ids: Sequence[int] = (),
              lengths=None, return_logprobs: bool = False, mesh: Mesh | None = None,
              constraint=None, adapters: lora_rows.AdapterStack | None = None,
              adapter: int | Sequence[int] = 0, forced_end_id: int | None = None,
              banned_ids: Sequence[int] = (), bad_words: Sequence[Sequence[int]] = (),
              num_return_sequences: int = 1) -> Generator[int, None, GenerateOutput]:
    """The beam search in chunks of `chunk_size` steps (None: one call to its end)."""
    length_penalty = checks.real("length_penalty", length_penalty, lambda _: True, "finite")
    mesh, params = placement(net.config, params, mesh)
    prepared = prepare(net, params, prompts, lengths, max_new_tokens=max_new_tokens,
                       eos_ids=eos_ids, num_beams=num_beams, rng=None, mesh=mesh,
                       constraint=constraint, adapters=adapters, adapter=adapter,
                       forced_end_id=forced_end_id, banned_ids=banned_ids, bad_words=bad_words)
    returned = checks.integer("num_return_sequences", num_return_sequences, 1)
    if returned > prepared.num_beams:
        raise checks.InvalidValue("num_return_sequences", f"num_return_sequences={returned} "
                                  f"is more than num_beams={num_beams}: the search keeps "
                                  "that many")
    penalty = jnp.asarray(length_penalty, jnp.float32)
    state = beam.start(net.config, params, prepared.tokens, prepared.lengths,
                       prepared.capacity, prepared.buffer_len, prepared.num_beams,
                       prepared.stops, penalty, mesh=mesh, constraints=prepared.constraints,
                       adapters=prepared.adapters)
    reached = 1  # `start` takes the first step
    while True:
        limit = max_new_tokens if chunk_size is None else min(reached + chunk_size,
                                                              max_new_tokens)
        state, done, result = beam.advance(
            net.config, params, state, prepared.stops, penalty, jnp.asarray(limit, jnp.int32),
            mesh=mesh, adapters=prepared.adapters, num_return=returned)
        if chunk_size is None or bool(done):
            return _output(result, max_new_tokens, return_logprobs, prepared.batch * returned,
                           scores=result.scores)
        reached = int(state.step)
        yield reached


def _drain(generator: Generator[Any, None, Any]) -> Any:
    """What `generator` returns, once it has run to its end."""
    while True:
        try:
            next(generator)
        except StopIteration as done:
            return done.value


def stream(net, params, prompts=None, *, max_new_tokens: int, chunk_size: int = 8,
           **kwargs: Any) -> Generator[np.ndarray, None, GenerateOutput]:
    """Like `generate`, but yields the new tokens [B, k] after every chunk of k <= chunk_size
    steps. The same compiled loop runs a chunk at a time, carrying the cache between
    chunks; with the same rng the concatenated chunks equal `generate(...).tokens`
    (rows that stopped yield 0). The generator's return value (`StopIteration.value`) is
    the `GenerateOutput` of the whole run, with lengths and stop reasons."""
    chunk_size = checks.integer("chunk_size", chunk_size, 1)
    return_logprobs = kwargs.pop("return_logprobs", False)
    return_state = kwargs.pop("return_state", False)
    _refuse_kept_adapters(return_state, kwargs.get("adapters"))
    mesh, params = _placement(net.config, params, kwargs.pop("mesh", None), return_state)
    prepared = prepare(net, params, prompts, kwargs.pop("lengths", None),
                       max_new_tokens=max_new_tokens, num_beams=1, mesh=mesh,
                       fill_rows=not return_state, **{"eos_ids": (), "rng": None, **kwargs})
    config = net.config
    carry = _first(config, params, prepared, return_state)
    emitted = 0
    while True:
        state = _decode_state(carry)
        step = min(int(state.step), max_new_tokens, emitted + chunk_size)
        if step > emitted:
            yield host_arrays(state.tokens)[:prepared.rows, emitted:step]
            emitted = step
        if step >= max_new_tokens or bool(jnp.all(state.done)):
            return _finish(config, params, carry, prepared.rows, max_new_tokens,
                           return_logprobs, return_state)
        limit = jnp.asarray(min(step + chunk_size, max_new_tokens), jnp.int32)
        carry = _run(config, params, carry, prepared, limit)


Carry = DecodeState | spec.SpeculativeState  # the loop's state: plain, or speculative


def _placement(config, params, mesh: Mesh | None, return_state: bool):
    """`placement`, refusing `return_state` on a mesh: a kept state lives on one device."""
    mesh, params = placement(config, params, mesh)
    if mesh is not None and return_state:
        raise ValueError("return_state=True runs on one device; it does not take a mesh or "
                         "params sharded over one")
    return mesh, params


def _refuse_kept_adapters(return_state: bool, adapters) -> None:
    if return_state and adapters is not None:
        raise ValueError("return_state=True keeps a state that continues without adapters: "
                         "it does not take adapters")


def _finish(config, params, carry: Carry, rows: int, max_new_tokens: int,
            return_logprobs: bool, return_state: bool) -> GenerateOutput:
    """The output of a finished loop for its first `rows` rows, with the state to continue
    from if asked."""
    state = _decode_state(carry)
    return _output(state, max_new_tokens, return_logprobs, rows,
                   state_out=_kept(config, params, state) if return_state else None,
                   speculation=_stats(carry))


def _first(config, params, p: Prepared, keep: bool) -> Carry:
    """The loop's first carry: the state after each row's first token, with the draft's
    start where `p.speculative` drafts. `keep`: as `_begin` takes it."""
    state = _begin(config, params, p, keep)
    if p.speculative is None:
        return state
    return p.speculative.start(state, p.tokens, p.lengths, p.capacity, p.num_samples)


def _run(config, params, carry: Carry, p: Prepared, limit) -> Carry:
    """The decode loop up to `limit` tokens: plain, or speculative with `p.speculative`."""
    if p.speculative is None:
        return _continue(config, params, carry, p.stops, p.sampling, limit, p.processors,
                         mesh=p.mesh, plan=p.plan, adapters=p.adapters)
    return p.speculative.run(config, params, carry, p.stops, p.sampling, limit, p.mesh)


def _decode_state(carry: Carry) -> DecodeState:
    return carry.decode if isinstance(carry, spec.SpeculativeState) else carry


def _stats(carry: Carry) -> spec.SpeculationStats | None:
    return carry.stats if isinstance(carry, spec.SpeculativeState) else None


def _kept(config, params, state: DecodeState) -> PromptState:
    return PromptState(config, params, *prompt_state.keep(config, params, state))


def _output(state, max_new_tokens: int, return_logprobs: bool, rows: int, scores=None,
            state_out: PromptState | None = None,
            speculation: spec.SpeculationStats | None = None) -> GenerateOutput:
    """The first `rows` rows (the rest filled up a batch split over devices), whole on
    every process of a job of several."""
    def real(array, columns=None):
        array = host_arrays(array)
        return array[:rows, :columns] if columns else array[:rows]

    logprobs = real(state.logprobs, max_new_tokens) if return_logprobs else None
    return GenerateOutput(tokens=real(state.tokens, max_new_tokens),
                          lengths=real(state.lengths), stop_reason=real(state.stop_reason),
                          logprobs=logprobs, scores=None if scores is None else real(scores),
                          state=state_out, speculation=None if speculation is None else
                          spec.SpeculationStats(real(speculation.drafted),
                                                real(speculation.accepted),
                                                int(speculation.steps)))
