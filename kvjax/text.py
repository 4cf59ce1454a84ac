"""Text in, text out: a trained checkpoint wrapped with its tokenizer for sampling.

`load` reads everything from a checkpoint directory (config, tokenizer, params); `sample_text`
turns a prompt into tokens, runs the compiled generation API and turns tokens back into text,
streaming it chunk by chunk. Both variants are served:

- a language model continues the prompt, fed after the tokenizer's `document_prefix`: for
  kvjax's own LMs an EOS, since their training text is a stream of documents each followed
  by EOS, so the prompt starts a new document; for a Hugging Face model what its tokenizer
  puts in front of a text (Llama's BOS, nothing for GPT-2);
- a translation model (encoder-decoder) reads the prompt as the source, between the
  tokenizer's `source_prefix` and `source_suffix` (nothing and EOS, as in training; NLLB's
  source language code and EOS), and writes the target from BOS.

Either stops at the first of the tokenizer's `stop_ids`. Everything goes through the
`kvjax.tokenizer.TextTokenizer` interface, so a model's origin needs no branch here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from kvjax import checkpoint, decode
from kvjax import model as M
from kvjax.decode import checks
from kvjax.decode.sampling import seed_key
from kvjax.detokenize import RowText, check_stop_strings
from kvjax.tokenizer import TextTokenizer

MAX_SEED = 2**63 - 1  # jax.random.key takes a signed 64-bit seed


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A checkpoint ready for sampling: the model config, its module, tokenizer and params."""

    config: M.TransformerConfig
    tokenizer: TextTokenizer
    params: Any
    directory: str

    @property
    def net(self) -> M.DecoderOnlyLM | M.EncoderDecoder:
        return M.build_model(self.config)

    @property
    def is_translation(self) -> bool:
        return M.prompt_is_source(self.config)


def load(directory: str | os.PathLike, *, scan_layers: bool | None = None,
         lora: str | os.PathLike | None = None, max_len: int | None = None,
         dtype: str | None = None, kernel_dtype: str | None = None) -> LoadedModel:
    """The model in `directory`: the newest step of a kvjax checkpoint, or a Hugging Face
    model directory (`kvjax.hf.load_pretrained`, which takes `max_len`), its layers held as
    `scan_layers` says (None: the default layout, whichever the checkpoint stores); with
    `lora`, LoRA adapters trained on that model merged into its params: a run of kvjax
    train on a kvjax checkpoint, or a PEFT adapter directory on a Hugging Face one.
    `dtype` and `kernel_dtype` are `model.with_precision`'s (None: as stored); a Hugging Face
    directory is read in them, so the device never holds its weights in another precision.
    Raises `CheckpointError` or ValueError naming any problem."""
    from kvjax import hf

    peft = lora is not None and hf.is_peft_directory(lora)
    if hf.is_hf_directory(directory):
        if lora is not None and not peft:
            raise ValueError(_not_peft_message(directory, lora))
        config, tokenizer, params = hf.load_pretrained(
            directory, scan_layers=scan_layers, max_len=max_len, lora=lora, dtype=dtype,
            kernel_dtype=kernel_dtype)
    elif peft:
        raise ValueError(f"{lora} is a PEFT adapter: it merges into the Hugging Face directory "
                         f"it was trained on, and {directory} is a kvjax checkpoint")
    elif max_len is not None:
        raise ValueError(f"max_len={max_len} is chosen when a Hugging Face directory is "
                         f"loaded; the kvjax checkpoint {directory} keeps its own (kvjax "
                         "import-hf --max-len writes one with another)")
    else:
        config, tokenizer, params = checkpoint.load_for_sampling(
            directory, scan_layers=scan_layers, lora=lora)
        config, params = M.with_precision(config, params, dtype, kernel_dtype=kernel_dtype)
    return LoadedModel(config, tokenizer, params, os.fspath(directory))


def _not_peft_message(directory, lora) -> str:
    """Why kvjax's own adapters `lora` do not load onto the Hugging Face `directory`, and,
    where they name it, the kvjax checkpoint they do load onto."""
    try:
        base = (checkpoint.read_lora(lora) or {}).get("base", {}).get("checkpoint")
    except (OSError, ValueError):
        base = None
    if base is None:
        return (f"{lora} is not a PEFT adapter (no adapter_config.json); kvjax's own adapters "
                f"are trained on a kvjax checkpoint, and {directory} is a Hugging Face "
                "directory (kvjax import-hf writes it as one)")
    return (f"{lora} holds kvjax LoRA adapters, not a PEFT adapter: they load onto the kvjax "
            f"checkpoint they were trained on, {base}, not onto the Hugging Face directory "
            f"{directory} (kvjax sample --checkpoint {base} --lora {lora}; kvjax export-peft "
            "writes them as a PEFT adapter of that directory)")


@dataclasses.dataclass(frozen=True)
class SampleResult:
    """The generated text and how it ended.

    `seconds` runs from the call to the last token; `compile_seconds` is the part of it spent
    tracing and compiling (0 once the programs are compiled), so `tokens_per_second` is the
    speed of prefill and decoding alone. `first_chunk_seconds` is the time to the first
    streamed text (prefill and compilation). `stop_reason` is `decode`'s ('eos',
    'max_new_tokens', 'cache_full'), 'stop_string' (the text then ends before the first stop
    string, and `tokens` end with the token that completed it), or 'max_len' when the model's
    length ended generation before the `max_new_tokens` asked for; `max_new_tokens` is what
    was generated at most. `speculation` (with `speculative=...`) counts the call's drafted
    and accepted tokens (one entry per sample) and its decode model calls.
    """

    text: str
    tokens: list[int]
    stop_reason: str
    seconds: float
    first_chunk_seconds: float
    compile_seconds: float = 0.0
    max_new_tokens: int | None = None
    speculation: decode.SpeculationStats | None = None

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


def room(loaded: LoadedModel, prompt: str | Sequence[int]) -> int:
    """The most tokens the model's length leaves after `prompt`; a prompt that leaves none
    is a ValueError."""
    return _room(loaded.config, len(prompt_tokens(loaded, prompt)))


def prompt_tokens(loaded: LoadedModel, prompt: str | Sequence[int]) -> list[int]:
    """The token ids the model is given for `prompt` (see the module docstring); token ids
    (a chat template's rendering, already framed: `serve.chat.prompt_ids`) as they are."""
    if not isinstance(prompt, str):
        ids = checks.token_ids("prompt", prompt)
        if not ids or any(not 0 <= i < loaded.config.vocab_size for i in ids):
            raise checks.InvalidValue("prompt", f"prompt ids must be a non-empty list of ids "
                                                f"in [0, {loaded.config.vocab_size})")
        return list(ids)
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(prompt)
    if loaded.is_translation:
        return [*tokenizer.source_prefix, *ids, *tokenizer.source_suffix]
    tokens = list(tokenizer.document_prefix) + ids
    if not tokens:
        # An LM needs a token to predict from: an empty prompt starts from BOS (GPT-2's
        # <|endoftext|>), as transformers' generate does.
        if tokenizer.bos_id is None:
            raise ValueError("an empty prompt needs a BOS token to start from, and this "
                             "tokenizer has none")
        tokens = [tokenizer.bos_id]
    return tokens


def forced_start(loaded: LoadedModel) -> decode.StartsWith | None:
    """What a translator's targets start with unless told otherwise: its generation config's
    `forced_bos_token_id` (`tokenizer.target_prefix`), which transformers' `generate` forces
    too (BART-large-CNN's `<s>`, a one-direction NLLB's language); None for none."""
    prefix = loaded.tokenizer.target_prefix if loaded.is_translation else ()
    return decode.StartsWith(prefix) if prefix else None


def sample_text(loaded: LoadedModel, prompt: str | Sequence[int], *,
                on_text: Callable[[str], None] | None = None, **kwargs: Any) -> SampleResult:
    """Generates from `prompt`, calling `on_text` with each new piece of text as it is made.

    Keyword arguments are those of `sample_texts` (less `num_samples`).
    """
    on_row = None if on_text is None else (lambda _, piece: on_text(piece))
    return sample_texts(loaded, prompt, num_samples=1, on_text=on_row, **kwargs)[0]


def sample_texts(loaded: LoadedModel, prompt: str | Sequence[int], *, num_samples: int = 1,
                 max_new_tokens: int = 64, stop: str | Sequence[str] = (),
                 num_beams: int = 1, seed: int = 0,
                 on_text: Callable[[int, str], None] | None = None, chunk_size: int = 8,
                 sampling: decode.Sampling = decode.GREEDY,
                 logit_processors: Sequence[decode.LogitProcessor] = (),
                 speculative: decode.Speculative | None = None,
                 constraint: decode.Regex | decode.Choice | decode.JsonSchema
                 | decode.StartsWith | None = None
                 ) -> list[SampleResult]:
    """`num_samples` generations from `prompt` (a text, or the token ids the model reads,
    as `prompt_tokens` takes them; one prefill), calling `on_text(sample, piece)` with each
    new piece of text as it is made.

    `sampling`, `logit_processors` and `speculative` are `decode.generate`'s; `constraint`
    (a `decode.Regex`, `Choice` or `JsonSchema`) keeps every sample's text inside it, or
    (`decode.StartsWith`) starts every sample and beam with its tokens, compiled for the
    model's tokenizer (`decode.compile_constraint`); a translator whose generation config
    forces its first target token starts with it unless another constraint is given
    (`forced_start`), and one whose generation config forces an end token
    (`forced_eos_token_id`, Marian's) makes it last where a sample reaches `max_new_tokens`,
    as transformers' `generate` does; the `bad_words_ids` it names (Marian's pad) are never
    made, or, those of several tokens, never completed. A sample
    stops at its first `stop` string, which neither the streamed pieces nor the returned
    text include; text that might begin a stop string is held back until it cannot. Beam
    search only knows its answer at the end, so with `num_beams > 1` the text arrives in one piece.
    `seed` is the prompt's key (`decode.sampling.seed_key`), as the server's `seed` is: the
    same prompt, settings and seed sample the same text here and there.
    """
    stop = check_stop_strings(stop)
    num_samples = checks.integer("num_samples", num_samples, 1)
    max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 1)
    num_beams = checks.integer("num_beams", num_beams, 1)
    chunk_size = checks.integer("chunk_size", chunk_size, 1)
    seed = checks.integer("seed", seed, 0, MAX_SEED)
    if num_beams > 1 and num_samples != 1:
        raise ValueError(f"num_samples={num_samples} does not go with beam search")
    tokens = prompt_tokens(loaded, prompt)
    limit = min(max_new_tokens, _room(loaded.config, len(tokens)))
    settings = dict(max_new_tokens=limit, eos_ids=tuple(loaded.tokenizer.stop_ids),
                    rng=jax.random.wrap_key_data(seed_key(seed))[None], sampling=sampling,
                    logit_processors=logit_processors, speculative=speculative,
                    forced_end_id=loaded.tokenizer.forced_end,
                    banned_ids=loaded.tokenizer.banned_ids,
                    bad_words=loaded.tokenizer.bad_words)
    if constraint is None:
        constraint = forced_start(loaded)
    if constraint is not None:
        settings["constraint"] = decode.compile_constraint(constraint, loaded.tokenizer)
    on_text = on_text or (lambda row, piece: None)
    rows = [RowText(loaded.tokenizer, stop) for _ in range(num_samples)]
    with _compile_time() as compiling:
        start = time.perf_counter()
        if num_beams > 1:
            changed = sorted(sampling.changed()) + ["logit_processors"] * bool(
                logit_processors) + ["speculative"] * (speculative is not None)
            if changed:
                raise ValueError(f"beam search (num_beams={num_beams}) does not sample: it "
                                 f"takes no {changed[0]}")
            output = decode.beam_search(loaded.net, loaded.params, [tokens],
                                        num_beams=num_beams, max_new_tokens=limit,
                                        eos_ids=settings["eos_ids"],
                                        constraint=settings.get("constraint"),
                                        forced_end_id=settings["forced_end_id"],
                                        banned_ids=settings["banned_ids"],
                                        bad_words=settings["bad_words"])
            first = time.perf_counter() - start
            rows[0].add(output.token_lists()[0])
        else:
            chunks = decode.stream(loaded.net, loaded.params, [tokens], chunk_size=chunk_size,
                                   num_samples=num_samples, **settings)
            output, first = _stream_rows(rows, chunks, on_text, start)
        seconds = time.perf_counter() - start
    results = []
    for i, row in enumerate(rows):
        if row.stopped:
            generated, reason = row.ids, "stop_string"
        else:
            generated, reason = output.token_lists()[i], output.stop_reasons()[i]
            row.finish(generated)
            if reason == "max_new_tokens" and limit < max_new_tokens:
                reason = "max_len"  # the model's length, not the caller's limit, ended it
        speculation = None if output is None else output.speculation
        results.append(SampleResult(row.text, generated, reason, seconds, first, compiling[0],
                                    limit, speculation))
        if num_beams > 1:
            on_text(i, row.text)
        elif row.text.startswith(row.sent) and len(row.text) > len(row.sent):
            on_text(i, row.text[len(row.sent):])
    return results


def _room(config: M.TransformerConfig, prompt_len: int) -> int:
    """How many tokens fit after the prompt; a prompt that leaves none is an error."""
    M.check_prompt_length(config, prompt_len)
    return config.max_len - M.prompt_slots(config, prompt_len)


def _stream_rows(rows: list[RowText], chunks: Iterator[np.ndarray],
                 on_text: Callable[[int, str], None], start: float):
    """Feeds each row's chunks to its `RowText` and `on_text`; returns (GenerateOutput or
    None if every row met a stop string first, seconds to the first chunk)."""
    first = None
    output = None
    while True:
        try:
            chunk = next(chunks)
        except StopIteration as stop:
            output = stop.value
            break
        if first is None:
            first = time.perf_counter() - start
        for i, row in enumerate(rows):
            piece = row.add(chunk[i].tolist())
            if piece:
                on_text(i, piece)
        if all(row.stopped for row in rows):
            chunks.close()  # every sample has its answer: stop generating
            break
    return output, first if first is not None else time.perf_counter() - start
