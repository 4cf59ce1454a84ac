"""What every generation call does before compiling anything: its inputs checked (a
ValueError names the first bad value), its prompts padded to a bucket (`buckets.py`), its
settings made traced arrays, and where it runs (one device, or a mesh) decided.
`Prepared` holds the result, which `generate`, `stream` and `beam_search` run, and
`speculative.py` reads. Shape letters: B batch, P padded prompt length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax import parallel
from kvjax.model import lora_rows

from . import automaton, checks, prompt_state
from . import speculative as spec
from .automaton import RowConstraints
from .bad_words import MAX_WORD_TOKENS, MAX_WORDS, checked_words, words_table
from .buckets import bucket, rows_bucket
from .constraints import TokenAutomaton
from .loop import StopConditions
from .plan import ON_DEVICE, LoopPlan, default_plan
from .processors import LogitProcessor
from .prompt_state import PromptState
from .sampling import SamplingParams, as_keys
from .settings import GREEDY, Sampling, check_num_samples, check_processors

Mesh = jax.sharding.Mesh

MAX_EOS_IDS = 8  # eos ids travel as a fixed-size array so their number never recompiles


def validate(config: M.TransformerConfig, params, tokens: np.ndarray, lengths: np.ndarray, *,
             max_new_tokens: int, eos_ids: Sequence[int], num_beams: int,
             continuing: bool = False) -> None:
    """Raises a ValueError naming the first bad input; runs before any compilation.
    Sampling settings are checked by `settings.py`. When `continuing` a state, the prompts
    are the tokens to append, which may be empty, and the state's cache bounds the length."""
    if (lengths < 1).any() and not continuing:
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty: every prompt needs at "
                         f"least one token")
    valid = np.arange(tokens.shape[1])[None] < lengths[:, None]
    bad = valid & ((tokens < 0) | (tokens >= config.vocab_size))
    if bad.any():
        row, col = map(int, np.argwhere(bad)[0])
        raise ValueError(f"token id {int(tokens[row, col])} (prompt {row}, position {col}) is "
                         f"outside the vocabulary [0, {config.vocab_size})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not continuing:
        M.check_prompt_length(config, int(lengths.max()), max_new_tokens)
    if num_beams < 1:
        raise ValueError(f"num_beams={num_beams} must be >= 1")
    _check_ids("eos", eos_ids, config.vocab_size)
    checks.check_params(config, params)


def _check_ids(kind: str, ids: Sequence[int], vocab_size: int) -> None:
    """At most `MAX_EOS_IDS` ids, each in the vocabulary; an InvalidValue names `kind`_ids."""
    if len(ids) > MAX_EOS_IDS:
        raise checks.InvalidValue(f"{kind}_ids", f"at most {MAX_EOS_IDS} {kind} ids, got "
                                                 f"{len(ids)}")
    for token in ids:
        if not 0 <= token < vocab_size:
            raise checks.InvalidValue(f"{kind}_ids", f"{kind} id {token} is outside the "
                                                     f"vocabulary [0, {vocab_size})")


def pad_prompts(tokens: np.ndarray, lengths: np.ndarray, padded_len: int) -> np.ndarray:
    """Prompts [B, padded_len] int32: each row's valid tokens, zeros after them (and past
    the end, cut where `padded_len` is shorter than the array)."""
    padded = np.zeros((tokens.shape[0], padded_len), np.int32)
    width = min(tokens.shape[1], padded_len)
    padded[:, :width] = np.where(
        np.arange(tokens.shape[1])[None] < lengths[:, None], tokens, 0)[:, :width]
    return padded


def placement(config: M.TransformerConfig, params, mesh=None):
    """`(mesh, params)` to generate with: `mesh` if given, else the one `params` are sharded
    over; None, with `params` as they are, on a single device. The params are placed on the
    mesh by `parallel.state_shardings`; a ValueError names a `model` axis that does not
    divide the heads or d_ff."""
    mesh = parallel.mesh_of(params) if mesh is None else mesh
    if mesh is None or mesh.size == 1:
        return None, params
    parallel.check_model_axis(config, mesh)
    return mesh, parallel.shard_params(params, mesh)


@dataclasses.dataclass(frozen=True)
class Prepared:
    tokens: jax.Array
    lengths: jax.Array
    batch: int
    capacity: int
    buffer_len: int
    stops: StopConditions
    sampling: SamplingParams
    rng: jax.Array
    num_samples: int
    processors: tuple[LogitProcessor, ...]
    state: PromptState | None
    mesh: Mesh | None = None
    speculative: spec.Speculative | None = None
    plan: LoopPlan = ON_DEVICE
    num_beams: int = 1
    constraints: RowConstraints | None = None
    adapters: lora_rows.RowAdapters | None = None

    @property
    def rows(self) -> int:
        """Rows of the output; the rows past them only fill the batch up to its bucket."""
        return self.batch * self.num_samples


def prepare(net, params, prompts, lengths, *, max_new_tokens, eos_ids, num_beams, rng,
             num_samples=1, sampling: Sampling = GREEDY, logit_processors=(), state=None,
             mesh=None, speculative=None, constraint: Constrained = None,
             fill_rows: bool = True, adapters=None, adapter=0,
             forced_end_id: int | None = None, banned_ids: Sequence[int] = (),
             bad_words: Sequence[Sequence[int]] = ()) -> Prepared:
    """Checks a call's arguments and lays them out as its compiled programs take them. The
    batch is filled up to its bucket (`rows_bucket`; on a mesh, to a multiple of the `data`
    axis too) with copies of its last prompt, which finish when it does and are dropped from
    the output; without `fill_rows` (a kept state must hold the caller's rows alone) and when
    continuing from a state, only a mesh fills."""
    config = net.config
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a decode.Sampling, got {type(sampling).__name__}")
    if mesh is not None and state is not None:
        raise ValueError("generation from a state (state=...) runs on one device; it does "
                         "not take a mesh or params sharded over one")
    if state is not None:
        prompt_state.check_is_state(state)
    if state is not None and prompts is None:
        prompts = [[] for _ in range(state.batch_size)]
    tokens, lengths = checks.prompt_array(prompts, lengths)
    rng = as_keys(rng, tokens.shape[0])
    max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 1)
    num_beams = checks.integer("num_beams", num_beams, 1)
    eos_ids = checks.token_ids("eos_ids", eos_ids)
    if forced_end_id is not None:
        forced_end_id = checks.integer("forced_end_id", forced_end_id, 0)
        if forced_end_id >= config.vocab_size:
            raise checks.InvalidValue("forced_end_id", f"forced_end_id {forced_end_id} is "
                                      f"outside the vocabulary [0, {config.vocab_size})")
    banned_ids = checks.token_ids("banned_ids", banned_ids)
    _check_ids("banned", banned_ids, config.vocab_size)
    bad_words = checked_words("bad_words", bad_words, config.vocab_size)
    if bad_words and speculative is not None:
        raise ValueError("speculative decoding does not take bad_words: its verification "
                         "would read each drafted token's own history")
    validate(config, params, tokens, lengths, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
             num_beams=num_beams, continuing=state is not None)
    check_num_samples(num_samples)
    processors = check_processors(logit_processors)
    if speculative is not None:
        spec.check_supported(speculative, config, processors=processors, sampling=sampling,
                             state=state, mesh=mesh, prompt_length=int(lengths.max()))
    automata = row_automata(constraint, tokens.shape[0], config.vocab_size, eos_ids)
    row_adapters = lora_rows.for_prompts(adapters, adapter, tokens.shape[0])
    if row_adapters is not None and (speculative is not None or state is not None):
        raise ValueError("adapters serve a plain, sampled or beam search call; not "
                         f"{'speculative decoding' if state is None else 'a kept state'}")
    if any(a is not None for a in automata) and "min_tokens" in sampling.changed():
        raise checks.InvalidValue("min_tokens", f"min_tokens={sampling.min_tokens} would hold "
                                  "back the end id a constraint needs to end its text")
    rows = sampling.rows(tokens.shape[0], num_samples)
    params_rows = SamplingParams.make(**rows, batch=tokens.shape[0] * num_samples)
    buffer_len = bucket(max_new_tokens, config.max_len)
    if state is not None:
        prompt_state.check_continuation(config, params, state, lengths, max_new_tokens)
        room = state.capacity - int(np.asarray(state.cache.lengths).max())
        padded_len = min(bucket(int(lengths.max()), config.max_len), room)
        padded_len = 0 if lengths.max() == 0 else padded_len
        capacity = state.capacity
    else:
        padded_len = bucket(int(lengths.max()), config.max_len)
        capacity = min(M.prompt_slots(config, padded_len) + buffer_len, config.max_len)
    padded = pad_prompts(tokens, lengths, padded_len)
    eos, bans = np.full(MAX_EOS_IDS, -1, np.int32), np.full(MAX_EOS_IDS, -1, np.int32)
    eos[:len(eos_ids)], bans[:len(banned_ids)] = eos_ids, banned_ids
    batch, lengths = tokens.shape[0], np.asarray(lengths, np.int32)
    fill = rows_bucket(batch) - batch if fill_rows and state is None else 0
    if mesh is not None:  # rows split evenly over `data`
        fill += -(batch + fill) % mesh.shape[parallel.DATA]
    if fill:
        def filled(array, copies):
            return np.concatenate([array, np.repeat(np.asarray(array)[-1:], copies, axis=0)])

        padded, lengths = filled(padded, fill), filled(lengths, fill)
        params_rows = jax.tree.map(lambda a: filled(a, fill * num_samples), params_rows)
        automata = automata + automata[-1:] * fill
        if row_adapters is not None:
            row_adapters = row_adapters.replace(
                adapter_B=jnp.asarray(filled(row_adapters.adapter_B, fill)))
        if rng.ndim:
            rng = jnp.concatenate([rng, jnp.repeat(rng[-1:], fill)])
    if row_adapters is not None:  # the stack whole on every device of a mesh
        row_adapters = row_adapters.replace(stack=lora_rows.placed(row_adapters.stack, mesh))
    if mesh is not None:
        padded = jax.device_put(padded, parallel.rows(mesh, 2))
        lengths = jax.device_put(lengths, parallel.rows(mesh))
    return Prepared(
        tokens=jnp.asarray(padded), lengths=jnp.asarray(lengths, jnp.int32),
        batch=batch, capacity=capacity, buffer_len=buffer_len,
        stops=StopConditions(jnp.asarray(eos), jnp.asarray(max_new_tokens, jnp.int32),
                             None if forced_end_id is None else
                             jnp.asarray(forced_end_id, jnp.int32),
                             jnp.asarray(bans) if banned_ids else None,
                             jnp.asarray(words_table(bad_words, MAX_WORDS, MAX_WORD_TOKENS))
                             if bad_words else None),
        sampling=params_rows, rng=rng,
        num_samples=num_samples, processors=processors, state=state, mesh=mesh,
        speculative=speculative, plan=default_plan(rows), num_beams=num_beams,
        constraints=automaton.for_rows([a for a in automata for _ in range(num_samples)]),
        adapters=row_adapters,
    )


Constrained = TokenAutomaton | Sequence[TokenAutomaton | None] | None


def row_automata(constraint: Constrained, batch: int, vocab_size: int,
                 eos_ids) -> list[TokenAutomaton | None]:
    """Each prompt's automaton (None: unconstrained), checked against the model and the
    call's other settings."""
    if constraint is None:
        return [None] * batch
    if isinstance(constraint, TokenAutomaton):
        constraint = [constraint] * batch
    constraint = list(constraint)
    if len(constraint) != batch:
        raise ValueError(f"constraint has {len(constraint)} entries for {batch} prompts")
    for i, one in enumerate(constraint):
        if one is None:
            continue
        if not isinstance(one, TokenAutomaton):
            raise ValueError(f"constraint {i} must be a TokenAutomaton (decode."
                             f"compile_constraint) or None, got {type(one).__name__}")
        if one.vocab_size > vocab_size:
            raise ValueError(f"constraint {i} was compiled for {one.vocab_size} token ids; "
                             f"the model has {vocab_size}")
        if one.end_id not in eos_ids:
            raise ValueError(f"constraint {i} ends with id {one.end_id}, which is not among "
                             f"eos_ids {tuple(eos_ids)}: its rows could never stop")
    return constraint
