"""`kvjax bench structured`: the decode step of rows held to a JSON Schema against free rows
and against the same rows held by the host, and the time to compile each schema into a
token automaton.

The model is a checkpoint whose tokenizer spells the tokens (the shipped Python-docs LM by
default); every prompt is a passage of CPython's documentation. At each batch size greedy
decoding runs `new_tokens` steps free (no end id, so every row runs every step) and then
with every row under the schema. A step's time is the call's time over the steps the loop
ran (its longest row), best of `repeats` after a compiling run; the prefill is in both.
Held by the host is what a logits processor outside the compiled program does (as
transformers' `generate` and host-side grammar engines do): a Python loop whose every step
builds the rows' masks from the same automaton on the host, runs one compiled step (mask,
argmax, the model's next logits) and reads its tokens back before the next; its time per
step excludes the prefill. Its tokens must equal the compiled loop's.
The build time is the first compile of each schema for a fresh copy of the tokenizer: the
vocabulary's bytes, outlines-core's index and kvjax's tables.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import decode, text
from kvjax import model as M
from kvjax.tokenizer import tokenizer_from_bytes

from .speculative import DEFAULT_CHECKPOINT, best_of, passages

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "count": {"type": "integer"},
        "kind": {"enum": ["list", "dict", "set"]}, "ok": {"type": "boolean"}},
        "required": ["name", "count", "kind"]},
    "nested": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "[a-f0-9]{8}"},
        "where": {"type": "object", "properties": {
            "file": {"type": "string", "maxLength": 24}, "line": {"type": "integer"}},
            "required": ["file", "line"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 4}},
        "required": ["id", "where"]},
    "any object": {"type": "object"},
}


@dataclasses.dataclass(frozen=True)
class StepRow:
    batch: int
    free_step_ms: float
    constrained_step_ms: float
    host_held_step_ms: float
    parsed: int  # constrained rows whose text ended and parses as JSON
    ended: int   # constrained rows that ended (the end id) within the steps


@dataclasses.dataclass(frozen=True)
class BuildRow:
    schema: str
    seconds: float
    states: int
    transitions: int


def _best_step(run, repeats: int) -> tuple[float, decode.GenerateOutput]:
    """Seconds per step of `run`'s fastest call, by the steps its longest row ran (the same
    every call: greedy), and its output."""
    seconds, output = best_of(run, repeats)
    return seconds / max(int(output.lengths.max()), 1), output


def structured_benchmark(checkpoint: str = DEFAULT_CHECKPOINT,
                         batch_sizes: Sequence[int] = (1, 32), prompt_len: int = 32,
                         new_tokens: int = 64, repeats: int = 3, schema: str = "flat"
                         ) -> tuple[list[StepRow], list[BuildRow]]:
    loaded = text.load(checkpoint)
    tokenizer = loaded.tokenizer
    builds = []
    for name, body in SCHEMAS.items():
        fresh = tokenizer_from_bytes(tokenizer.to_bytes())
        start = time.perf_counter()
        automaton = decode.compile_constraint(decode.JsonSchema(body), fresh)
        builds.append(BuildRow(name, time.perf_counter() - start, automaton.num_states,
                               int(automaton.tokens.size)))
    automaton = decode.compile_constraint(decode.JsonSchema(SCHEMAS[schema]), tokenizer)
    steps = []
    for batch in batch_sizes:
        prompts = passages(loaded, batch, prompt_len)

        def run(constraint=None, prompts=prompts):
            ends = () if constraint is None else tuple(tokenizer.stop_ids)
            return decode.generate(loaded.net, loaded.params, prompts,
                                   max_new_tokens=new_tokens, eos_ids=ends,
                                   constraint=constraint)

        free_s, _ = _best_step(run, repeats)
        held_s, held = _best_step(lambda: run(automaton), repeats)
        ended = [row for row, reason in zip(held.token_lists(), held.stop_reasons(),
                                            strict=True) if reason == "eos"]
        host_s, host_rows = best_of(lambda p=prompts: _host_held(loaded, p, automaton,
                                                                 new_tokens), repeats)
        if host_rows != held.token_lists():
            raise AssertionError("the host-held loop chose other tokens than the compiled one")
        steps.append(StepRow(batch, free_s * 1e3, held_s * 1e3,
                             host_s / max(map(len, host_rows)) * 1e3,
                             sum(_parses(tokenizer.decode(row)) for row in ended), len(ended)))
    return steps, builds


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _held_step(config, params, cache, logits_BV, allowed_BV, running_B):
    """The next token of every row among its allowed ones, and the logits after it."""
    token_B = jnp.argmax(jnp.where(allowed_BV, logits_BV, -jnp.inf), axis=-1).astype(jnp.int32)
    logits_B1V, cache = M.step_fn(config, params)(token_B[:, None], cache,
                                                 running_B.astype(jnp.int32))
    return token_B, logits_B1V[:, 0], cache


def _host_held(loaded, prompts, automaton, new_tokens: int) -> list[list[int]]:
    """Greedy decoding held to `automaton` by the host, one compiled step per token."""
    state = decode.prefill(loaded.net, loaded.params, prompts,
                           capacity=max(map(len, prompts)) + new_tokens + 1)
    cache, logits_BV = state.cache, state.next_logits
    batch, vocab = logits_BV.shape
    states = [automaton.initial] * batch
    rows: list[list[int]] = [[] for _ in range(batch)]
    running = np.ones(batch, bool)
    for _ in range(new_tokens):
        allowed_BV = np.zeros((batch, vocab), bool)
        for b in np.flatnonzero(running):
            allowed_BV[b, automaton.allowed(states[b])] = True
        allowed_BV[~running] = True
        token_B, logits_BV, cache = _held_step(loaded.config, loaded.params, cache, logits_BV,
                                               allowed_BV, running)
        token_B = np.asarray(token_B)  # the host reads every step's tokens
        for b in np.flatnonzero(running):
            rows[b].append(int(token_B[b]))
            if token_B[b] == automaton.end_id:
                running[b] = False
            else:
                states[b] = automaton.next_state(states[b], int(token_B[b]))
        if not running.any():
            break
    return rows


def _parses(text_: str) -> bool:
    try:
        json.loads(text_)
    except ValueError:
        return False
    return True


def format_tables(steps: Sequence[StepRow], builds: Sequence[BuildRow], schema: str) -> str:
    lines = [f"Greedy decode step, free rows against rows held to the {schema!r} JSON Schema "
             "in the compiled loop and by the host:",
             "| batch | free ms/step | constrained ms/step | ratio | host-held ms/step | "
             "host-held / constrained | ended rows that parse |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.batch} | {r.free_step_ms:.3f} | {r.constrained_step_ms:.3f} | "
              f"{r.constrained_step_ms / r.free_step_ms:.2f}x | {r.host_held_step_ms:.3f} | "
              f"{r.host_held_step_ms / r.constrained_step_ms:.2f}x | {r.parsed}/{r.ended} |"
              for r in steps]
    lines += ["", "Compiling a schema (fresh tokenizer: vocabulary, index, tables):",
              "| schema | seconds | states | transitions |", "|---|---|---|---|"]
    lines += [f"| {b.schema} | {b.seconds:.3f} | {b.states} | {b.transitions} |"
              for b in builds]
    return "\n".join(lines)
