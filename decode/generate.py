"""The generation API: `generate` and `stream`, for both model variants.

A call validates its inputs in Python (a ValueError names the bad value before anything is
compiled), pads the prompts into a bucketed shape, and runs two compiled programs:
  1. `_start`: the prefill — the whole prompt batch through the model in one parallel call
     that fills the cache — and the first sampled token;
  2. `_continue`: the decode `lax.while_loop` (see `decode/loop.py`).
Sampling settings, eos ids and max_new_tokens are traced values and prompt length, token
budget and cache capacity are rounded up to powers of two, so calls that differ only in
those compile nothing new. Shape letters: B batch, P padded prompt length, N token buffer.
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

from . import beam, checks
from .loop import (
    DecodeState,
    StopConditions,
    StopReason,
    decode_loop,
    initial_state,
    record,
)
from .sampling import SamplingParams
from .tracing import count_trace

MAX_EOS_IDS = 8  # eos ids travel as a fixed-size array so their number never recompiles
MIN_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """tokens [B, N] (0 after a row stops), lengths [B] (the stopping EOS counted),
    stop_reason [B] (`StopReason` values), logprobs [B, N] or None.
    For beam search, `scores` [B] holds each best hypothesis's length-penalised score."""

    tokens: np.ndarray
    lengths: np.ndarray
    stop_reason: np.ndarray
    logprobs: np.ndarray | None = None
    scores: np.ndarray | None = None

    def token_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]

    def stop_reasons(self) -> list[str]:
        return [StopReason(int(r)).name.lower() for r in self.stop_reason]


def bucket(n: int, limit: int) -> int:
    """The smallest power of two >= n (at least MIN_BUCKET), capped at `limit`."""
    return min(max(MIN_BUCKET, 1 << max(0, n - 1).bit_length()), limit)


# Validation ------------------------------------------------------------------------------


def validate(config: M.TransformerConfig, params, tokens: np.ndarray, lengths: np.ndarray, *,
             max_new_tokens: int, temperature: float, top_k: int, top_p: float,
             eos_ids: Sequence[int], num_beams: int) -> None:
    """Raises a ValueError naming the first bad input; runs before any compilation."""
    if (lengths < 1).any():
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
    M.check_prompt_length(config, int(lengths.max()), max_new_tokens)
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 means no limit)")
    if num_beams < 1:
        raise ValueError(f"num_beams={num_beams} must be >= 1")
    if len(eos_ids) > MAX_EOS_IDS:
        raise ValueError(f"at most {MAX_EOS_IDS} eos ids, got {len(eos_ids)}")
    for eos in eos_ids:
        if not 0 <= eos < config.vocab_size:
            raise ValueError(f"eos id {eos} is outside the vocabulary [0, {config.vocab_size})")
    check_params(config, params)


@functools.lru_cache(maxsize=32)
def _expected_params(config: M.TransformerConfig) -> dict:
    shapes = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    return dict(jax.tree_util.tree_leaves_with_path(shapes))


def check_params(config: M.TransformerConfig, params) -> None:
    """Raises a ValueError naming the first param whose presence, shape or dtype differs."""
    want = _expected_params(config)
    have = dict(jax.tree_util.tree_leaves_with_path(params))
    for path in sorted(set(want) | set(have), key=jax.tree_util.keystr):
        name = jax.tree_util.keystr(path)
        if path not in have:
            raise ValueError(f"params do not match the model: {name} is missing")
        if path not in want:
            raise ValueError(f"params do not match the model: unexpected {name}")
        w, h = want[path], have[path]
        if tuple(h.shape) != w.shape or jnp.dtype(h.dtype) != w.dtype:
            raise ValueError(f"params do not match the model: {name} has shape {tuple(h.shape)} "
                             f"{jnp.dtype(h.dtype)}, the model needs {w.shape} {w.dtype}")


# Compiled programs -----------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _start(config, params, tokens_BP, lengths_B, rng, capacity: int, buffer_len: int,
           stops: StopConditions, sampling: SamplingParams) -> DecodeState:
    count_trace("start")
    logits_BV, cache = M.prefill(config, params, tokens_BP, lengths_B, capacity)
    state = initial_state(tokens_BP.shape[0], buffer_len, cache, rng)
    return record(state, logits_BV, stops, sampling)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _continue(config, params, state: DecodeState, stops: StopConditions,
              sampling: SamplingParams, step_limit) -> DecodeState:
    count_trace("continue")
    return decode_loop(M.step_fn(config, params), state, stops, sampling, step_limit)


# Public API ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Prepared:
    tokens: jax.Array
    lengths: jax.Array
    batch: int
    capacity: int
    buffer_len: int
    stops: StopConditions
    sampling: SamplingParams
    rng: jax.Array


def _prepare(net, params, prompts, lengths, *, max_new_tokens, temperature, top_k, top_p,
             eos_ids, num_beams, rng) -> _Prepared:
    config = net.config
    tokens, lengths = checks.prompt_array(prompts, lengths)
    max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 1)
    temperature = checks.real("temperature", temperature, lambda t: t >= 0, ">= 0")
    top_k = checks.integer("top_k", top_k, 0)
    top_p = checks.real("top_p", top_p, lambda p: 0 < p <= 1, "in (0, 1]")
    num_beams = checks.integer("num_beams", num_beams, 1)
    eos_ids = checks.token_ids("eos_ids", eos_ids)
    validate(config, params, tokens, lengths, max_new_tokens=max_new_tokens,
             temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=eos_ids,
             num_beams=num_beams)
    prompt_len = int(lengths.max())
    padded_len = bucket(prompt_len, config.max_len)
    buffer_len = bucket(max_new_tokens, config.max_len)
    capacity = min(M.prompt_slots(config, padded_len) + buffer_len, config.max_len)
    padded = np.zeros((tokens.shape[0], padded_len), np.int32)
    padded[:, :tokens.shape[1]] = np.where(
        np.arange(tokens.shape[1])[None] < lengths[:, None], tokens, 0)[:, :padded_len]
    eos = np.full(MAX_EOS_IDS, -1, np.int32)
    eos[:len(eos_ids)] = eos_ids
    return _Prepared(
        tokens=jnp.asarray(padded), lengths=jnp.asarray(lengths, jnp.int32),
        batch=tokens.shape[0], capacity=capacity, buffer_len=buffer_len,
        stops=StopConditions(jnp.asarray(eos), jnp.asarray(max_new_tokens, jnp.int32)),
        sampling=SamplingParams.make(temperature, top_k, top_p),
        rng=jax.random.key(0) if rng is None else rng,
    )


def generate(net, params, prompts, *, max_new_tokens: int, lengths=None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_ids: Sequence[int] = (), num_beams: int = 1, length_penalty: float = 1.0,
             rng: jax.Array | None = None, return_logprobs: bool = False) -> GenerateOutput:
    """Generates up to `max_new_tokens` per prompt.

    `prompts`: a list of token-id lists (lengths may differ) or an int array [B, P] with
    `lengths` [B]. For an `EncoderDecoder` they are the source sequences and decoding starts
    from BOS. `num_beams > 1` runs beam search (sampling settings are then ignored) and
    scores hypotheses by sum(logprobs) / length**length_penalty.
    """
    length_penalty = checks.real("length_penalty", length_penalty, lambda _: True, "finite")
    prepared = _prepare(net, params, prompts, lengths, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=eos_ids,
                        num_beams=num_beams, rng=rng)
    config = net.config
    if num_beams > 1:
        result = beam.beam_search(
            config, params, prepared.tokens, prepared.lengths, prepared.capacity,
            prepared.buffer_len, num_beams, prepared.stops,
            jnp.asarray(length_penalty, jnp.float32))
        return _output(result, max_new_tokens, return_logprobs, scores=result.scores)
    state = _start(config, params, prepared.tokens, prepared.lengths, prepared.rng,
                   prepared.capacity, prepared.buffer_len, prepared.stops, prepared.sampling)
    state = _continue(config, params, state, prepared.stops, prepared.sampling,
                      prepared.stops.max_new_tokens)
    return _output(state, max_new_tokens, return_logprobs)


def stream(net, params, prompts, *, max_new_tokens: int, chunk_size: int = 8,
           **kwargs: Any) -> Generator[np.ndarray, None, GenerateOutput]:
    """Like `generate`, but yields the new tokens [B, k] after every chunk of k <= chunk_size
    steps. The same compiled loop runs a chunk at a time, carrying the cache between
    chunks; with the same rng the concatenated chunks equal `generate(...).tokens`
    (rows that stopped yield 0). The generator's return value (`StopIteration.value`) is
    the `GenerateOutput` of the whole run, with lengths and stop reasons."""
    if kwargs.get("num_beams", 1) != 1:
        raise ValueError(f"stream does not support beam search (num_beams="
                         f"{kwargs['num_beams']}); use generate")
    chunk_size = checks.integer("chunk_size", chunk_size, 1)
    return_logprobs = kwargs.pop("return_logprobs", False)
    prepared = _prepare(net, params, prompts, kwargs.pop("lengths", None),
                        max_new_tokens=max_new_tokens, num_beams=1,
                        **{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "eos_ids": (),
                           "rng": None, **kwargs})
    config = net.config
    state = _start(config, params, prepared.tokens, prepared.lengths, prepared.rng,
                   prepared.capacity, prepared.buffer_len, prepared.stops, prepared.sampling)
    emitted = 0
    while True:
        step = int(state.step)
        if step > emitted:
            yield np.asarray(state.tokens[:, emitted:step])
            emitted = step
        if step >= max_new_tokens or bool(jnp.all(state.done)):
            return _output(state, max_new_tokens, return_logprobs)
        limit = jnp.asarray(min(step + chunk_size, max_new_tokens), jnp.int32)
        state = _continue(config, params, state, prepared.stops, prepared.sampling, limit)


def _output(state, max_new_tokens: int, return_logprobs: bool, scores=None) -> GenerateOutput:
    tokens = np.asarray(state.tokens)[:, :max_new_tokens]
    logprobs = np.asarray(state.logprobs)[:, :max_new_tokens] if return_logprobs else None
    return GenerateOutput(tokens=tokens, lengths=np.asarray(state.lengths),
                          stop_reason=np.asarray(state.stop_reason), logprobs=logprobs,
                          scores=None if scores is None else np.asarray(scores))
