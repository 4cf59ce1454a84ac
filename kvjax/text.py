"""Text in, text out: a trained checkpoint wrapped with its tokenizer for sampling.

`load` reads everything from a checkpoint directory (config, tokenizer, params); `sample_text`
turns a prompt into tokens, runs the compiled generation API and turns tokens back into text,
streaming it chunk by chunk. Both variants are served:

- a language model continues the prompt. Its training text is a stream of documents each
  followed by EOS, so the prompt is fed after an EOS, as the start of a new document, and
  generation stops at the next EOS;
- a translation model (encoder-decoder) reads the prompt as the source (plus EOS, as in
  training) and writes the target from BOS until EOS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from kvjax import checkpoint, decode
from kvjax import model as M
from kvjax.decode import checks
from kvjax.tokenizer import EOS_ID, Tokenizer

MAX_SEED = 2**63 - 1  # jax.random.key takes a signed 64-bit seed


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A checkpoint ready for sampling: the model config, its module, tokenizer and params."""

    config: M.TransformerConfig
    tokenizer: Tokenizer
    params: Any
    directory: str

    @property
    def net(self) -> M.DecoderOnlyLM | M.EncoderDecoder:
        return M.build_model(self.config)

    @property
    def is_translation(self) -> bool:
        return self.config.is_encoder_decoder


def load(directory: str | os.PathLike) -> LoadedModel:
    """The newest checkpoint in `directory`; raises `CheckpointError` naming any problem."""
    config, tokenizer, params = checkpoint.load_for_sampling(directory)
    return LoadedModel(config, tokenizer, params, os.fspath(directory))


@dataclasses.dataclass(frozen=True)
class SampleResult:
    """The generated text and how it ended.

    `seconds` runs from the call to the last token; `compile_seconds` is the part of it spent
    tracing and compiling (0 once the programs are compiled), so `tokens_per_second` is the
    speed of prefill and decoding alone. `first_chunk_seconds` is the time to the first
    streamed text (prefill and compilation). `stop_reason` is `decode`'s ('eos',
    'max_new_tokens', ...), or 'max_len' when the model's length ended generation before the
    `max_new_tokens` asked for; `max_new_tokens` is what was generated at most.
    """

    text: str
    tokens: list[int]
    stop_reason: str
    seconds: float
    first_chunk_seconds: float
    compile_seconds: float = 0.0
    max_new_tokens: int | None = None

    @property
    def decode_seconds(self) -> float:
        return max(self.seconds - self.compile_seconds, 0.0)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / max(self.decode_seconds, 1e-9)


# jax reports the time it spends on each of these; together they are the compilation.
_COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})


@contextlib.contextmanager
def _compile_time() -> Iterator[list[float]]:
    """Yields [seconds]: the compile time jax reports while the block runs."""
    total = [0.0]

    def listener(event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            total[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield total
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def room(loaded: LoadedModel, prompt: str) -> int:
    """The most tokens the model's length leaves after `prompt`; a prompt that leaves none
    is a ValueError."""
    return _room(loaded.config, len(prompt_tokens(loaded, prompt)))


def prompt_tokens(loaded: LoadedModel, prompt: str) -> list[int]:
    """The token ids the model is given for `prompt` (see the module docstring)."""
    ids = loaded.tokenizer.encode(prompt)
    return ids + [EOS_ID] if loaded.is_translation else [EOS_ID] + ids


def sample_text(loaded: LoadedModel, prompt: str, *, max_new_tokens: int = 64,
                temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                num_beams: int = 1, seed: int = 0,
                on_text: Callable[[str], None] | None = None,
                chunk_size: int = 8) -> SampleResult:
    """Generates from `prompt`, calling `on_text` with each new piece of text as it is made.

    Sampling arguments are those of `decode.generate`. Beam search only knows its answer at
    the end, so with `num_beams > 1` the text arrives in one piece.
    """
    max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 1)
    num_beams = checks.integer("num_beams", num_beams, 1)
    chunk_size = checks.integer("chunk_size", chunk_size, 1)
    seed = checks.integer("seed", seed, 0, MAX_SEED)
    tokens = prompt_tokens(loaded, prompt)
    limit = min(max_new_tokens, _room(loaded.config, len(tokens)))
    settings = dict(max_new_tokens=limit, temperature=temperature, top_k=top_k,
                    top_p=top_p, eos_ids=(EOS_ID,), rng=jax.random.key(seed))
    on_text = on_text or (lambda _: None)
    with _compile_time() as compiling:
        start = time.perf_counter()
        if num_beams > 1:
            output = decode.generate(loaded.net, loaded.params, [tokens], num_beams=num_beams,
                                     **settings)
            first = time.perf_counter() - start
        else:
            chunks = decode.stream(loaded.net, loaded.params, [tokens], chunk_size=chunk_size,
                                   **settings)
            output, first = _stream_text(loaded.tokenizer, chunks, on_text, start)
        seconds = time.perf_counter() - start
    generated = output.token_lists()[0]
    text = loaded.tokenizer.decode(_until_eos(generated))
    if num_beams > 1:
        on_text(text)
    reason = output.stop_reasons()[0]
    if reason == "max_new_tokens" and limit < max_new_tokens:
        reason = "max_len"  # the model's length, not the caller's limit, ended it
    return SampleResult(text, generated, reason, seconds, first, compiling[0], limit)


def _room(config: M.TransformerConfig, prompt_len: int) -> int:
    """How many tokens fit after the prompt; a prompt that leaves none is an error."""
    M.check_prompt_length(config, prompt_len)
    return config.max_len - M.prompt_slots(config, prompt_len)


def _stream_text(tokenizer: Tokenizer, chunks: Iterator[np.ndarray],
                 on_text: Callable[[str], None], start: float):
    """Feeds `on_text` the text of each chunk of row 0; returns (GenerateOutput, seconds to
    the first chunk). Text is decoded from all tokens so far and only its new suffix is sent,
    so a character split over byte pieces of two chunks comes out whole."""
    ids: list[int] = []
    sent = ""
    first = None
    while True:
        try:
            chunk = next(chunks)
        except StopIteration as stop:
            output = stop.value
            break
        if first is None:
            first = time.perf_counter() - start
        ids.extend(chunk[0].tolist())
        text = tokenizer.decode(_until_eos(ids))
        stable = text.rstrip("\ufffd")  # an unfinished UTF-8 sequence waits for its bytes
        if stable.startswith(sent) and len(stable) > len(sent):
            on_text(stable[len(sent):])
            sent = stable
    final = tokenizer.decode(_until_eos(output.token_lists()[0]))
    if final.startswith(sent) and len(final) > len(sent):
        on_text(final[len(sent):])
    return output, first if first is not None else time.perf_counter() - start


def _until_eos(ids: list[int]) -> list[int]:
    return ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids
