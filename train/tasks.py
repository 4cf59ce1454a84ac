"""The two training pipelines: a decoder-only language model and an encoder-decoder translator.

Each builds a tokenizer, the data and the model config, then runs `trainer.train`. The
defaults (`LM_SETTINGS`, `TRANSLATE_SETTINGS`) are the demo settings, sized to train in about
two minutes each on a 2-core CPU. Any field of the settings or of their `TrainConfig` can be
overridden by keyword::

    train_lm("runs/lm", steps=200, seq_len=64)
    train_translate("runs/numbers", max_number=1000, num_heldout=100, progress=False)

`mesh` (`kvjax.parallel.make_mesh`) trains on many devices (see `trainer.train`).

`init_from` fine-tunes a checkpoint of the same task (kvjax's own, or a pretrained model that
`kvjax import-hf` wrote) instead of training a new model: its config and tokenizer are used
as they are and its params are the starting point::

    train_lm("runs/ft", data_files=["my.txt"], init_from="gpt2-kvjax", steps=200)

Shapes: B examples, T tokens per example, S source tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from kvjax import checkpoint, decode, hf
from kvjax import model as M
from kvjax.hf.convert import import_checkpoint
from kvjax.tokenizer import EOS_ID, TextTokenizer, Tokenizer, tokenizer_from_bytes, train_tokenizer

from . import data, run_dir, trainer
from .config import TrainConfig, TrainTask
from .trainer import TrainResult


@dataclasses.dataclass(frozen=True)
class LMSettings:
    """A decoder-only LM on windows of `seq_len` tokens; `val_fraction` of them (a fixed
    choice) are held out for validation."""

    preset: str = "small"
    model_overrides: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"num_decoder_layers": 2, "d_ff": 256})
    vocab_size: int = 1024
    seq_len: int = 128
    val_fraction: float = 0.05
    training: TrainConfig = TrainConfig(
        steps=400, batch_size=16, learning_rate=2e-3, warmup_steps=50, eval_every=100,
        eval_batches=8, keep_checkpoints=1)


@dataclasses.dataclass(frozen=True)
class TranslateSettings:
    """An encoder-decoder on (source, target) text pairs. Without a TSV file the pairs are
    the numbers below `max_number` spelled in English words. `num_heldout` pairs (a fixed
    choice; None: a tenth of them, at most 1000; 0: none, and no validation) are held out.
    Sources and targets (with EOS) are padded to `max_len` tokens. Periodic evaluations
    decode `eval_examples` held-out sources; the final one decodes all. `target_language`
    (a token of the tokenizer: NLLB's `fra_Latn`) starts every target after the decoder
    start, and is forced first when held-out sources are decoded."""

    preset: str = "small"
    model_overrides: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"num_encoder_layers": 2, "num_decoder_layers": 2,
                                 "d_model": 64, "d_ff": 256})
    vocab_size: int = 400
    max_number: int = 100_000
    num_heldout: int | None = None
    max_len: int | None = None  # None: the longest pair's
    eval_examples: int = 250
    target_language: str | None = None
    training: TrainConfig = TrainConfig(
        steps=1500, batch_size=64, learning_rate=3e-3, warmup_steps=50, eval_every=250,
        eval_batches=4, keep_checkpoints=1)


LM_SETTINGS = LMSettings()
TRANSLATE_SETTINGS = TranslateSettings()

_SPLIT_SEED = 0  # the train/validation split never changes with the training seed


# Language model --------------------------------------------------------------------------------


def train_lm(out_dir: str | os.PathLike, *, data_files: Sequence[str | os.PathLike] | None = None,
             init_from: str | os.PathLike | None = None, resume: bool = False,
             allow_changes: bool = False, settings: LMSettings = LM_SETTINGS,
             mesh: Mesh | None = None, stop_after: int | None = None,
             **overrides: Any) -> TrainResult:
    """Trains a decoder-only LM on `data_files` (default: Python's documentation topics).

    The final metrics include `val_ppl` and `unigram_ppl`, the perplexity on the same
    validation tokens of add-one smoothed token frequencies fitted on the training tokens.
    Fine-tuning (`init_from`) cuts windows of at most the model's `max_len` tokens.
    `stop_after` ends the run early as `trainer.train`'s does.
    """
    init_from = _as_checkpoint(init_from, out_dir, resume)
    pretrained = _pretrained(out_dir, "lm", init_from, resume, overrides)
    settings = with_overrides(settings, overrides)
    text = data.python_docs_text() if data_files is None else data.read_text_files(data_files)
    if pretrained is None:
        tokenizer = _tokenizer(out_dir, resume, [text], settings.vocab_size)
        config = _model_config(settings, tokenizer, settings.seq_len, out_dir, resume)
    else:
        config, tokenizer = pretrained
        settings = dataclasses.replace(settings, seq_len=min(settings.seq_len, config.max_len))
    framing = data.Framing.of(tokenizer, config.bos_id)
    windows = data.pack_lm_windows(data.tokenize_documents(tokenizer, [text], framing),
                                   settings.seq_len)
    train_windows, val_windows = data.split_train_val(windows, settings.val_fraction, _SPLIT_SEED)
    evaluate = None
    if len(val_windows):  # without validation text there is nothing to compare against
        unigram = unigram_perplexity(train_windows[:, 1:], val_windows[:, 1:],
                                     tokenizer.vocab_size)
        evaluate = lambda params, final: {"unigram_ppl": unigram}  # noqa: E731
    sources = {"files": data.describe_files(data_files)} if data_files is not None else {
        "python_docs_sha256": data.sha256_text(text)}
    task = TrainTask(
        name="lm", tokenizer=tokenizer, train=lm_arrays(train_windows),
        val=lm_arrays(val_windows), evaluate=evaluate,
        data={**sources, "seq_len": settings.seq_len, "val_fraction": settings.val_fraction})
    return trainer.train(config, settings.training, task, out_dir, resume=resume,
                         allow_changes=allow_changes, mesh=mesh, init_from=init_from,
                         stop_after=stop_after)


def lm_arrays(windows_BT: np.ndarray) -> dict[str, np.ndarray]:
    """Windows [N, T + 1] as a batch: inputs and next-token targets, each [N, T], and their
    weights (every target of a window counts)."""
    targets = windows_BT[:, 1:]
    return {"inputs": windows_BT[:, :-1], "targets": targets,
            "weights": np.ones(targets.shape, np.float32)}


def unigram_perplexity(train_targets: np.ndarray, val_targets: np.ndarray,
                       vocab_size: int) -> float:
    """Perplexity on `val_targets` of add-one smoothed token frequencies of `train_targets`
    (any shapes; every id counts, as every target of an LM window does)."""
    train_ids, val_ids = np.ravel(train_targets), np.ravel(val_targets)
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64)
    log_probs = np.log((counts + 1) / (counts.sum() + vocab_size))
    return math.exp(-log_probs[val_ids].mean())


# Translation -----------------------------------------------------------------------------------


def train_translate(out_dir: str | os.PathLike, *, data_tsv: str | os.PathLike | None = None,
                    init_from: str | os.PathLike | None = None, resume: bool = False,
                    allow_changes: bool = False,
                    settings: TranslateSettings = TRANSLATE_SETTINGS, mesh: Mesh | None = None,
                    stop_after: int | None = None, **overrides: Any) -> TrainResult:
    """Trains an encoder-decoder with teacher forcing on `data_tsv` (``source<TAB>target``
    lines) or, by default, on numbers spelled as words.

    Validation loss is measured on the held-out pairs; `accuracy` is the exact-match rate of
    greedy decoding on them (all of them in the final metrics). Fine-tuning (`init_from`)
    needs every pair to fit the model's `max_len`, the target after its decoder start.
    """
    init_from = _as_checkpoint(init_from, out_dir, resume)
    pretrained = _pretrained(out_dir, "translate", init_from, resume, overrides)
    settings = with_overrides(settings, overrides)
    if data_tsv is None:
        num_heldout = default_heldout(settings.max_number, settings.num_heldout)
        train_pairs, heldout_pairs = data.number_pairs(
            settings.max_number, num_heldout, _SPLIT_SEED)
        sources = {"max_number": settings.max_number}
    else:
        pairs = data.read_tsv_pairs(data_tsv)
        num_heldout = default_heldout(len(pairs), settings.num_heldout)
        train_pairs, heldout_pairs = split_pairs(pairs, num_heldout)
        sources = {"files": data.describe_files([data_tsv])}
    texts = [text for pair in train_pairs for text in pair]
    if pretrained is None:
        tokenizer = _tokenizer(out_dir, resume, ["\n".join(texts)], settings.vocab_size)
    else:
        config, tokenizer = pretrained
    target_prefix = () if settings.target_language is None else decode.StartsWith.from_text(
        tokenizer, settings.target_language, "target_language").token_ids
    max_len = settings.max_len or (_longest_pair(tokenizer, [*train_pairs, *heldout_pairs])
                                   + len(target_prefix))
    # + 1: the decoder start begins targets
    if pretrained is None:
        config = _model_config(settings, tokenizer, max_len + 1, out_dir, resume)
    elif max_len + 1 > config.max_len:
        raise ValueError(f"the pairs need {max_len} tokens and the target its decoder start "
                         f"before them, more than the model's max_len={config.max_len}")
    framing = dataclasses.replace(data.Framing.of(tokenizer, config.bos_id),
                                  target_prefix=target_prefix)
    heldout = translation_arrays(tokenizer, heldout_pairs, max_len, framing)
    accuracy = None
    if heldout_pairs:
        starts = None if not framing.target_prefix else decode.compile_constraint(
            decode.StartsWith(framing.target_prefix), tokenizer, end_id=framing.eos_id)
        accuracy = functools.partial(_heldout_accuracy, config, heldout, settings.eval_examples,
                                     max_len, (framing.eos_id,), starts)
    task = TrainTask(
        name="translate", tokenizer=tokenizer,
        train=translation_arrays(tokenizer, train_pairs, max_len, framing), val=heldout,
        evaluate=accuracy, data={**sources, "num_heldout": num_heldout, **(
            {"target_language": settings.target_language} if target_prefix else {})})
    return trainer.train(config, settings.training, task, out_dir, resume=resume,
                         allow_changes=allow_changes, mesh=mesh, init_from=init_from,
                         stop_after=stop_after)


def default_heldout(num_pairs: int, num_heldout: int | None) -> int:
    """`num_heldout`, or by default a tenth of the pairs, at most 1000."""
    return min(1000, num_pairs // 10) if num_heldout is None else num_heldout


def _longest_pair(tokenizer: TextTokenizer, pairs: Sequence[tuple[str, str]]) -> int:
    # The source prefix and suffix frame sources; + 1: the eos that ends targets.
    framing = len(tokenizer.source_prefix) + len(tokenizer.source_suffix)
    return max(max(len(tokenizer.encode(source)) + framing, len(tokenizer.encode(target)) + 1)
               for source, target in pairs)


def split_pairs(pairs: Sequence[tuple[str, str]], num_heldout: int
                ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """A fixed random choice of `num_heldout` pairs held out; both parts keep their order."""
    if isinstance(num_heldout, bool) or not isinstance(num_heldout, int | np.integer):
        raise ValueError(f"num_heldout={num_heldout!r} must be an int")
    if not 0 <= num_heldout < len(pairs):
        raise ValueError(f"num_heldout={num_heldout} must be in [0, {len(pairs)}) for "
                         f"{len(pairs)} pairs: at least one pair must be left to train on")
    heldout = np.zeros(len(pairs), bool)
    heldout[np.random.default_rng(_SPLIT_SEED).choice(len(pairs), num_heldout, False)] = True
    return ([p for p, h in zip(pairs, heldout, strict=True) if not h],
            [p for p, h in zip(pairs, heldout, strict=True) if h])


def translation_arrays(tokenizer, pairs: Sequence[tuple[Any, Any]], max_len: int,
                       framing: data.Framing = data.KVJAX_FRAMING) -> dict[str, np.ndarray]:
    """Teacher-forcing batch arrays (see `train.trainer`) for (source, target) pairs, framed
    by `framing`'s ids (`data.encode_pairs`); a target's weights are 1 up to its length.

    `tokenizer` needs only `encode`; with one that returns id lists unchanged, `pairs` may be
    (source ids, target ids).
    """
    source, source_lengths, inputs, targets, lengths = data.encode_pairs(
        tokenizer, pairs, max_len, framing)
    return {"source": source, "source_lengths": source_lengths, "inputs": inputs,
            "targets": targets, "lengths": lengths,
            "weights": data.length_weights(lengths, targets.shape[1])}


def exact_match_accuracy(config: M.TransformerConfig, params, arrays: Mapping[str, np.ndarray],
                         *, max_new_tokens: int, batch_size: int,
                         eos_ids: tuple[int, ...] = (EOS_ID,), constraint=None) -> float:
    """Fraction of rows whose greedy decoding (stopped by `eos_ids`; kept to `constraint`, a
    compiled one, where given) equals its target, the eos included.

    `arrays` are `translation_arrays` (source [N, S], source_lengths [N], targets [N, T],
    lengths [N]).
    Rows are decoded `batch_size` at a time; the last batch is padded to that size so that
    every call reuses one compiled program.
    """
    net = M.build_model(config)
    num_rows = len(arrays["source"])
    correct = 0
    for start in range(0, num_rows, batch_size):
        rows = np.arange(start, start + batch_size) % num_rows
        output = decode.generate(
            net, params, arrays["source"][rows], lengths=arrays["source_lengths"][rows],
            max_new_tokens=max_new_tokens, eos_ids=eos_ids, constraint=constraint)
        for row, generated in zip(rows[: num_rows - start], output.token_lists(), strict=False):
            correct += generated == arrays["targets"][row, : arrays["lengths"][row]].tolist()
    return correct / num_rows


def _heldout_accuracy(config, heldout, eval_examples: int, max_new_tokens: int,
                      eos_ids: tuple[int, ...], constraint, params,
                      final: bool) -> dict[str, float]:
    rows = heldout if final else {k: v[:eval_examples] for k, v in heldout.items()}
    batch_size = min(eval_examples, len(heldout["source"]))
    return {"accuracy": exact_match_accuracy(config, params, rows, batch_size=batch_size,
                                             max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                             constraint=constraint)}


# Shared ----------------------------------------------------------------------------------------


def with_overrides(settings, overrides: Mapping[str, Any]):
    """`settings` with fields of its own or of its `training` config replaced by name."""
    own = {f.name for f in dataclasses.fields(settings)} - {"training"}
    training = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(overrides) - own - training)
    if unknown:
        raise TypeError(f"unknown settings {unknown}; choose from {sorted(own | training)}")
    return dataclasses.replace(
        settings,
        training=settings.training.replace(
            **{k: v for k, v in overrides.items() if k in training}),
        **{k: v for k, v in overrides.items() if k in own})


# Where a run started from a Hugging Face model directory keeps it as a kvjax checkpoint.
IMPORTED_BASE = "base"


def _as_checkpoint(init_from: str | os.PathLike | None, out_dir: str | os.PathLike,
                   resume: bool) -> str | os.PathLike | None:
    """`init_from`; for a Hugging Face model directory, the kvjax checkpoint of it that a new
    run writes into `<out_dir>/base` (`kvjax import-hf`) and starts from, so that its record,
    a resumed run and LoRA adapters name a checkpoint that stays where it is. A run resumed
    with the same directory finds that checkpoint there."""
    if init_from is None or not hf.is_hf_directory(init_from):
        return init_from
    base = Path(out_dir) / IMPORTED_BASE
    if resume:
        if not base.is_dir() or M.TransformerConfig.from_dict(
                checkpoint.read_metadata(base)[0]) != hf.load_config(init_from):
            raise checkpoint.CheckpointError(
                f"cannot resume {out_dir} from {init_from}: the run was not started from "
                f"that Hugging Face model (it would have imported it into {base})")
        return base
    if base.exists():
        raise checkpoint.CheckpointError(
            f"{base} already exists: a run started from a Hugging Face directory imports it "
            "there; choose a new output directory")
    return import_checkpoint(init_from, base)


# What a fine-tuning run takes from its checkpoint; these settings would build another model.
_MODEL_SETTINGS = ("preset", "model_overrides", "vocab_size")


def _pretrained(out_dir: str | os.PathLike, task: str, init_from: str | os.PathLike | None,
                resume: bool, overrides: Mapping[str, Any]
                ) -> tuple[M.TransformerConfig, TextTokenizer] | None:
    """(config, tokenizer) of a fine-tuning run: `init_from`'s for a new run, its own
    directory's for a resumed one (run.json says whether it started from a checkpoint);
    None for a run that trains a model of its own."""
    record = run_dir.read_run_record(Path(out_dir)) if resume and Path(out_dir).is_dir() else None
    if record is not None and run_dir.INIT_FROM in record:
        source = Path(out_dir)
        if init_from is not None and not _started_from(init_from, source):
            raise checkpoint.CheckpointError(
                f"cannot resume: {out_dir} was started from "
                f"{record[run_dir.INIT_FROM].get('checkpoint')}, not from {init_from}")
    elif init_from is not None:
        if resume and record is not None:
            raise checkpoint.CheckpointError(
                f"cannot resume {out_dir} from init_from {init_from}: it was not started from "
                "a checkpoint")
        source = Path(init_from)
    else:
        return None
    given = sorted(set(overrides) & set(_MODEL_SETTINGS))
    if given:
        raise ValueError(f"{', '.join(given)} cannot be set when fine-tuning a checkpoint: its "
                         "model and tokenizer are used as they are")
    config_dict, saved_task, tokenizer_bytes = checkpoint.read_metadata(source)
    if saved_task != task:
        raise ValueError(f"{source} holds a {saved_task!r} model; it cannot start a {task!r} "
                         "run")
    try:
        config = M.TransformerConfig.from_dict(config_dict).replace(kernel_dtype=None)
    except (TypeError, ValueError) as e:
        raise checkpoint.CheckpointError(f"{source}: {e}") from e
    # A run trains float params: int8 weights (kernel_dtype) start it dequantized. Training
    # every weight keeps float32 params and optimizer state, as mixed precision does, and
    # computes in the checkpoint's dtype: updates rounded to bfloat16 params would mostly
    # vanish. LoRA's frozen base stays as stored (its adapters are float32); a resumed run
    # keeps its own config.
    if source != Path(out_dir) and overrides.get("lora") is None:
        config = config.replace(param_dtype="float32")
    return config, tokenizer_from_bytes(tokenizer_bytes)


def _started_from(checkpoint_dir: str | os.PathLike, run: Path) -> bool:
    """Whether the fine-tuning run in `run` started from `checkpoint_dir`: the same task,
    tokenizer and model, whatever dtypes each holds its params in (a run's are float, and
    float32 when it trains every weight)."""
    def started_as(path):
        config_dict, task, tokenizer_bytes = checkpoint.read_metadata(path)
        config = M.TransformerConfig.from_dict(config_dict)
        return config.replace(kernel_dtype=None, param_dtype="float32"), task, tokenizer_bytes

    return started_as(checkpoint_dir) == started_as(run)


def _tokenizer(out_dir: str | os.PathLike, resume: bool, texts: list[str],
               vocab_size: int) -> Tokenizer:
    # A resumed run keeps the tokenizer its checkpoints were trained with.
    if resume and (Path(out_dir) / checkpoint.TOKENIZER_FILE).exists():
        _, _, tokenizer_bytes = checkpoint.read_metadata(out_dir)
        return Tokenizer.from_bytes(tokenizer_bytes)
    return train_tokenizer(texts, vocab_size)


def _model_config(settings, tokenizer: Tokenizer, min_len: int, out_dir: str | os.PathLike,
                  resume: bool) -> M.TransformerConfig:
    config = M.preset(settings.preset, **settings.model_overrides,
                      vocab_size=tokenizer.vocab_size)
    if config.max_len < min_len:
        config = config.replace(max_len=min_len)
    # A resumed run keeps the layer layout its checkpoints are stored in (scanned ones were
    # the default once), unless the settings ask for one.
    if (resume and "scan_layers" not in settings.model_overrides
            and (Path(out_dir) / checkpoint.CONFIG_FILE).exists()):
        saved, _, _ = checkpoint.read_metadata(out_dir)
        if "scan_layers" in saved:
            config = config.replace(scan_layers=saved["scan_layers"])
    return config
