"""The demo: train both variants from nothing, save them, and show what they learned.

`run_demo` trains a tokenizer and a decoder-only LM on Python's own documentation (shipped
with CPython) and an encoder-decoder on spelling numbers as English words, each for about two
minutes on a 2-core CPU; saves both checkpoints; prints greedy, sampled and beam-search
generations; and checks the two quality bars:

- translation: exact match on the held-out numbers (never seen in training) >= 95%;
- language model: validation perplexity at most half that of a unigram model fitted on the
  same training tokens.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvjax import decode, text
from kvjax.train import data, tasks
from kvjax.train.trainer import TrainResult

LM_NAME = "python-docs-lm"
TRANSLATE_NAME = "numbers-to-words"
LM_PROMPTS = ("The for statement", "A class definition")
NUM_SHOWN_NUMBERS = 4
MIN_ACCURACY = 0.95
MAX_PPL_FRACTION_OF_UNIGRAM = 0.5


@dataclasses.dataclass(frozen=True)
class DemoReport:
    """What the demo measured; `passed` tells whether both quality bars were met."""

    lm_dir: Path
    translate_dir: Path
    lm_metrics: Mapping[str, float]
    translate_metrics: Mapping[str, float]
    lm_tokens_per_second: float
    translate_tokens_per_second: float

    @property
    def accuracy_ok(self) -> bool:
        return self.translate_metrics["accuracy"] >= MIN_ACCURACY

    @property
    def perplexity_ok(self) -> bool:
        ppl = self.lm_metrics["val_ppl"]
        return ppl <= MAX_PPL_FRACTION_OF_UNIGRAM * self.lm_metrics["unigram_ppl"]

    @property
    def passed(self) -> bool:
        return self.accuracy_ok and self.perplexity_ok


def run_demo(out_dir: str | os.PathLike = "checkpoints/demo", *, progress: bool = True,
             lm_overrides: Mapping[str, Any] | None = None,
             translate_overrides: Mapping[str, Any] | None = None,
             log: Callable[[str], None] = print) -> DemoReport:
    """Trains, saves and samples both models under `out_dir`; returns the measurements.

    `*_overrides` change the training settings (see `train.tasks`), e.g. fewer steps for a
    quick look. A previous demo's checkpoints in `out_dir` are replaced only once the new
    ones are complete.
    """
    out_dir = Path(out_dir)
    log(f"[1/4] Language model on Python's documentation -> {out_dir / LM_NAME}")
    lm = _train_fresh(out_dir / LM_NAME, lambda d: tasks.train_lm(
        d, progress=progress, **(lm_overrides or {})))
    log(f"[2/4] Encoder-decoder: numbers to English words -> {out_dir / TRANSLATE_NAME}")
    translate = _train_fresh(out_dir / TRANSLATE_NAME, lambda d: tasks.train_translate(
        d, progress=progress, **(translate_overrides or {})))
    log("[3/4] Language model samples")
    lm_speed = _show_lm(text.load(out_dir / LM_NAME), log)
    log("[4/4] Translations of held-out numbers")
    translate_speed = _show_translations(text.load(out_dir / TRANSLATE_NAME),
                                         heldout_numbers(translate_overrides), log)
    report = DemoReport(out_dir / LM_NAME, out_dir / TRANSLATE_NAME, lm.metrics,
                        translate.metrics, lm_speed, translate_speed)
    log(summary(report))
    return report


def _train_fresh(target: Path, train: Callable[[Path], TrainResult]) -> TrainResult:
    """Trains into a new sibling directory and then moves it to `target`, so an interrupted
    demo never leaves `target` half-written and a finished one replaces the old run whole."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    result = train(partial)
    if target.exists():
        retired = target.with_name(target.name + ".old")
        shutil.rmtree(retired, ignore_errors=True)
        target.rename(retired)
        partial.rename(target)
        shutil.rmtree(retired)
    else:
        partial.rename(target)
    return dataclasses.replace(result, out_dir=target)


def _show_lm(loaded: text.LoadedModel, log: Callable[[str], None]) -> float:
    results = []
    for prompt in LM_PROMPTS:
        for label, settings in (("greedy", {}),
                                ("sampled T=0.8 top-p 0.9",
                                 dict(sampling=decode.Sampling(temperature=0.8, top_p=0.9)))):
            result = text.sample_text(loaded, prompt, max_new_tokens=48, **settings)
            results.append(result)
            log(f"  [{label}] {prompt!r} -> {prompt + result.text!r}")
    return _steady_speed(results)


def heldout_numbers(translate_overrides: Mapping[str, Any] | None = None) -> list[str]:
    """A few of the numbers the translation model never saw, spread over their range."""
    settings = tasks.with_overrides(tasks.TRANSLATE_SETTINGS, translate_overrides or {})
    num_heldout = tasks.default_heldout(settings.max_number, settings.num_heldout)
    _, heldout = data.number_pairs(settings.max_number, num_heldout)
    step = max(1, len(heldout) // NUM_SHOWN_NUMBERS)
    return [source for source, _ in heldout[step - 1::step][:NUM_SHOWN_NUMBERS]]


def _show_translations(loaded: text.LoadedModel, numbers: list[str],
                       log: Callable[[str], None]) -> float:
    results = []
    for number in numbers:
        greedy = text.sample_text(loaded, number, max_new_tokens=32)
        beam = text.sample_text(loaded, number, max_new_tokens=32, num_beams=4)
        results.append(greedy)
        log(f"  {number:>6} -> greedy {greedy.text!r}, beam(4) {beam.text!r}")
    return _steady_speed(results)


def _steady_speed(results: list[text.SampleResult]) -> float:
    """Tokens per second over the calls after the first, which pays for compilation."""
    later = results[1:] or results
    return sum(len(r.tokens) for r in later) / max(sum(r.seconds for r in later), 1e-9)


def summary(report: DemoReport) -> str:
    lm, tr = report.lm_metrics, report.translate_metrics
    ratio = lm["val_ppl"] / lm["unigram_ppl"]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    return "\n".join([
        "Results",
        f"  translation exact match on held-out numbers: {tr['accuracy']:.1%} "
        f"(bar >= {MIN_ACCURACY:.0%}) {verdict(report.accuracy_ok)}",
        f"  LM validation perplexity {lm['val_ppl']:.2f} vs unigram {lm['unigram_ppl']:.2f} "
        f"= {ratio:.2f}x (bar <= {MAX_PPL_FRACTION_OF_UNIGRAM}) {verdict(report.perplexity_ok)}",
        f"  decode speed (batch 1, after compilation): LM {report.lm_tokens_per_second:.0f} "
        f"tokens/s, translation {report.translate_tokens_per_second:.0f} tokens/s",
        f"  checkpoints: {report.lm_dir}, {report.translate_dir}",
        f"  try: kvjax sample --checkpoint {report.lm_dir} --prompt 'The with statement'",
    ])
