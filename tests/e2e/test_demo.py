"""The demo end to end on tiny settings: both checkpoints saved and loadable, generations and
the quality verdicts printed. (The real settings are checked by the shipped checkpoints.)"""

import pytest

from kvjax import demo, text
from kvjax.train import data, tasks

TINY_MODEL = {"num_decoder_layers": 1, "d_model": 32, "d_ff": 64}
LM = dict(steps=4, warmup_steps=1, eval_every=4, save_every=4, seq_len=32, vocab_size=400,
          model_overrides=TINY_MODEL)
TRANSLATE = dict(steps=4, warmup_steps=1, eval_every=4, save_every=4, max_number=300,
                 num_heldout=20, eval_examples=20, vocab_size=300,
                 model_overrides={**TINY_MODEL, "num_encoder_layers": 1})


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    lines = []
    report = demo.run_demo(out, progress=False, lm_overrides=LM, translate_overrides=TRANSLATE,
                           log=lines.append)
    return out, report, "\n".join(lines)


def test_demo_saves_both_checkpoints_where_sampling_finds_them(demo_run):
    out, report, _ = demo_run
    assert sorted(p.name for p in out.iterdir()) == sorted([demo.LM_NAME, demo.TRANSLATE_NAME])
    assert not text.load(report.lm_dir).is_translation
    assert text.load(report.translate_dir).is_translation
    assert 0 <= report.translate_metrics["accuracy"] <= 1
    assert report.translate_metrics["val_loss"] > 0


def test_demo_prints_generations_and_judges_the_quality_bars(demo_run):
    _, report, log = demo_run
    for prompt in demo.LM_PROMPTS:
        assert f"[greedy] {prompt!r}" in log and f"[sampled T=0.8 top-p 0.9] {prompt!r}" in log
    numbers = demo.heldout_numbers(TRANSLATE)
    assert len(numbers) == demo.NUM_SHOWN_NUMBERS
    for number in numbers:
        assert f"{number:>6} -> greedy" in log
    # Four training steps teach nothing: both bars must be reported as failed.
    assert not report.accuracy_ok and not report.perplexity_ok and not report.passed
    assert "FAIL" in log and "PASS" not in log
    assert report.lm_tokens_per_second > 0 and report.translate_tokens_per_second > 0


def test_shown_numbers_are_held_out():
    settings = tasks.TRANSLATE_SETTINGS
    train_pairs, _ = data.number_pairs(
        settings.max_number, tasks.default_heldout(settings.max_number, settings.num_heldout))
    trained = {source for source, _ in train_pairs}
    assert not trained & set(demo.heldout_numbers())


def test_a_second_demo_replaces_the_first_whole(demo_run):
    out, first, _ = demo_run
    old = {p.name: p.stat().st_mtime_ns for p in first.lm_dir.iterdir()}
    demo._train_fresh(first.lm_dir, lambda d: _copy_of(first.lm_dir, d))
    assert sorted(p.name for p in out.iterdir()) == sorted([demo.LM_NAME, demo.TRANSLATE_NAME])
    assert {p.name for p in first.lm_dir.iterdir()} == set(old)
    text.load(first.lm_dir)


def _copy_of(source, target):
    import shutil

    from kvjax.train.trainer import TrainResult

    shutil.copytree(source, target)
    return TrainResult(out_dir=target, step=4, losses={}, metrics={})
