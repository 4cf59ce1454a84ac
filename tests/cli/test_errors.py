"""Every misuse of the command line ends with one line on stderr, on its own line, and a known
exit code; `kvjax sample` reports what it measured and why it stopped."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import FakeTokenizer, run_cli

from kvjax import cli, text
from kvjax import model as M
from kvjax.serve import memory
from kvjax.train import data, tasks, trainer

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
NUMBERS = CHECKPOINTS / "numbers-to-words"



def assert_one_line(err: str, *fragments: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("argv, fragments", [
    (["--compilation-cache", "pyproject.toml", "cache-size"], ["is not a directory"]),
    (["--compilation-cache", "pyproject.toml/below", "cache-size"], ["pyproject.toml/below"]),
    (["train", "--task", "lm", "--seed", "99999999999999999999999"], ["argument --seed"]),
    (["sample", "--checkpoint", "x", "--prompt", "x", "--seed", "-1"], ["argument --seed"]),
    (["sample", "--checkpoint", "x", "--prompt", "x", "--top-k", "-2"], ["argument --top-k"]),
    (["train", "--task", "lm", "--learning-rate", "nan"], ["argument --learning-rate"]),
    (["train", "--task", "lm", "--allow-changes"], ["--allow-changes only applies with"]),
    (["train", "--task", "lm", "--heldout", "5"], ["--heldout applies to --task translate"]),
    (["train", "--task", "lm", "--target-language", "fra_Latn"],
     ["--target-language applies to --task translate"]),
    (["bench", "train", "--remat", "both"], ["--remat both applies with --lora"]),
    (["demo", "--warmup-steps", "-1"], ["argument --warmup-steps: must be >= 0"]),
    (["serve", "--checkpoint", "x", "--mesh", "data=3"], ["mesh data=3 needs 3 devices"]),
    (["serve", "--checkpoint", "x", "--cache-memory", "4GB"],
     ["argument --cache-memory: a size is a number and one of B, KiB, MiB, GiB, TiB, got '4GB'"]),
    (["serve", "--checkpoint", "x", "--sampling-defaults", "vllm"],
     ["argument --sampling-defaults: invalid choice: 'vllm'"]),
    (["serve", "--checkpoint", "x", "--cache-memory", "1GiB"],
     ["--cache-memory sizes the slots' pages: give --page-size too"]),
    (["serve", "--checkpoint", "x", "--num-pages", "4", "--cache-memory", "1GiB"],
     ["argument --cache-memory: not allowed with argument --num-pages"]),
    (["serve", "--checkpoint", "checkpoints/python-docs-lm", "--target-language", "fr"],
     ["--target-language is a translator's (an encoder-decoder's): this model continues"]),
    (["serve", "--checkpoint", "checkpoints/numbers-to-words", "--target-language", "fra_Latn"],
     ["--target-language 'fra_Latn' is not one token of this tokenizer"]),
    pytest.param(
        ["serve", "--checkpoint", "checkpoints/python-docs-lm", "--max-slots", "1000000000"],
        ["the engine's cache of 2250000000 rows x max_len=", "lower max_len (none is small"],
        marks=pytest.mark.skipif(memory.free_bytes(jax.devices("cpu")[0]) is None,
                                 reason="this machine does not say how much memory is free")),
    (["bench", "kernels", "--random-hf", "gpt2", "--hf-dir", "x"],
     ["argument --hf-dir: not allowed with argument --random-hf"]),
    (["bench", "kernels", "--preset", "tiny", "--loop", "every"],
     ["decode loop 'every' is not default, device, host or host:K"]),
    (["bench", "serve", "--max-len", "100", "--no-hf"],
     ["max_len=100 is shorter than the longest request (64 prompt + 128 output tokens)"]),
    (["bench", "serve", "--shared-prefix", "300", "--max-len", "400", "--no-hf"],
     ["max_len=400 is shorter than the longest request (300 shared + 64 prompt + 128 "
      "output tokens)"]),
    (["bench", "serve", "--full-attention-layers", "2", "--no-hf"],
     ["full_attention_layers=[2] needs a sliding_window"]),
    (["bench", "serve", "--sliding-window", "16", "--full-attention-layers", "5", "--no-hf"],
     ["full_attention_layers=[5] must be distinct layer numbers in [0, 3)"]),
])
def test_misuse_is_one_line_with_exit_code_2(capsys, monkeypatch, argv, fragments):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert_one_line(err, *fragments)


def test_a_damaged_checkpoint_is_one_line_from_the_console_script(tmp_path):
    """A failed orbax read leaves pending reads that print 'Event loop is closed' or their own
    copy of the error when collected; the console entry point keeps stderr to one line."""
    damaged = tmp_path / "damaged"
    shutil.copytree(NUMBERS, damaged)
    for path in (damaged / "1500" / "state" / "ocdbt.process_0" / "d").iterdir():
        os.truncate(path, path.stat().st_size // 2)
    child = subprocess.run(
        [sys.executable, "-c", "from kvjax.cli import console_main; console_main()", "sample",
         "--checkpoint", str(damaged), "--prompt", "12"],
        capture_output=True, text=True, timeout=300)
    assert child.returncode == 2
    assert_one_line(child.stderr, f"cannot read checkpoint {damaged / '1500'}")


def _never_retrieved_record(error_in_file: str) -> logging.LogRecord:
    """What asyncio logs for a gathered read whose exception no one retrieved, for an
    exception raised by code in `error_in_file`."""
    namespace = {}
    exec(compile("def read():\n    raise ValueError('OUT_OF_RANGE')\n", error_in_file, "exec"),
         namespace)
    try:
        namespace["read"]()
    except ValueError as error:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 0,
                                 "_GatheringFuture exception was never retrieved", None,
                                 (type(error), error, error.__traceback__))


def test_the_console_script_drops_only_orbax_reads_no_one_retrieved():
    orbax_file = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "serialization.py")
    assert not cli._not_an_orbax_leftover(_never_retrieved_record(orbax_file))
    assert cli._not_an_orbax_leftover(_never_retrieved_record(__file__))
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 0, "Task was destroyed",
                              None, None)
    assert cli._not_an_orbax_leftover(other)


def test_the_console_script_drops_a_read_failed_in_native_code():
    """tensorstore sets a failed read on its future from C++: the exception has no frames."""
    error = ValueError('OUT_OF_RANGE: Error reading "params.wo/0.0" in OCDBT database')
    native = logging.LogRecord("asyncio", logging.ERROR, __file__, 0,
                               "Future exception was never retrieved", None,
                               (type(error), error, None))
    assert not cli._not_an_orbax_leftover(native)


def test_a_prompt_too_long_fails_before_anything_is_echoed(capsys):
    code, out, err = run_cli(capsys, "sample", "--checkpoint", str(NUMBERS),
                             "--prompt", "9" * 3000)
    assert code == 2 and out == ""
    assert_one_line(err, "max_len")


def test_training_stops_map_to_exit_codes(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise trainer.TrainingInterrupted("interrupted by SIGTERM: saved a checkpoint at step "
                                          "7 in runs/x; continue with --resume", 7, 15)

    monkeypatch.setattr(tasks, "train_lm", interrupted)
    code, _, err = run_cli(capsys, "train", "--task", "lm")
    assert code == 143
    assert_one_line(err, "saved a checkpoint at step 7")

    def diverged(*args, **kwargs):
        raise trainer.TrainingDiverged("training diverged: the loss at step 3 is nan; ...")

    monkeypatch.setattr(tasks, "train_lm", diverged)
    code, _, err = run_cli(capsys, "train", "--task", "lm")
    assert code == 1
    assert_one_line(err, "training diverged: the loss at step 3 is nan")


def test_train_passes_the_new_options_through(capsys, monkeypatch):
    seen = {}

    def fake_translate(out, *, data_tsv, **kwargs):
        seen.update(kwargs, out=out, data_tsv=data_tsv)
        return trainer.TrainResult(out_dir=Path(out), step=1, losses={}, metrics={})

    monkeypatch.setattr(tasks, "train_translate", fake_translate)
    code, _, _ = run_cli(capsys, "train", "--task", "translate", "--data", "p.tsv", "--steps",
                         "300", "--save-every", "25", "--heldout", "0", "--learning-rate",
                         "1e-4", "--resume", "--allow-changes", "--remat",
                         "--router-aux-loss-coef", "0.01")
    assert code == 0 and seen["remat"] is True and seen["router_aux_loss_coef"] == 0.01
    assert (seen["steps"], seen["warmup_steps"], seen["save_every"]) == (300, 30, 25)
    assert (seen["num_heldout"], seen["learning_rate"]) == (0, 1e-4)
    assert seen["resume"] and seen["allow_changes"] and seen["data_tsv"] == "p.tsv"
    settings = tasks.with_overrides(tasks.TRANSLATE_SETTINGS, {
        k: v for k, v in seen.items()
        if k not in ("out", "data_tsv", "resume", "allow_changes", "mesh")})
    assert settings.training.save_interval == 25 and settings.training.remat
    assert settings.training.router_aux_loss_coef == 0.01


@pytest.mark.parametrize("steps, warmup", [(10, 1), (300, 30), (5000, 50), (1, 0)])
def test_few_steps_scale_the_warmup_down(steps, warmup):
    args = cli.build_parser().parse_args(["demo", "--steps", str(steps)])
    overrides = cli._schedule(args)
    assert overrides == {"steps": steps, "warmup_steps": warmup}
    for settings in (tasks.LM_SETTINGS, tasks.TRANSLATE_SETTINGS):
        tasks.with_overrides(settings, overrides)  # a valid TrainConfig


def test_small_tsv_files_hold_out_a_tenth(tmp_path):
    assert tasks.default_heldout(50, None) == 5
    assert tasks.default_heldout(100_000, None) == 1000
    assert tasks.default_heldout(50, 0) == 0
    pairs = [(str(n), data.number_to_words(n)) for n in range(50)]
    train_pairs, heldout = tasks.split_pairs(pairs, 0)
    assert train_pairs == pairs and heldout == []
    with pytest.raises(ValueError, match=r"num_heldout=50 must be in \[0, 50\)"):
        tasks.split_pairs(pairs, 50)


def test_a_byte_order_mark_is_not_part_of_the_first_source(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_bytes("\ufeff1\tone\n2\ttwo\n".encode())
    assert data.read_tsv_pairs(path) == [("1", "one"), ("2", "two")]
    text_file = tmp_path / "text.txt"
    text_file.write_bytes("\ufeffHello".encode())
    assert data.read_text_file(text_file) == "Hello"


def test_sample_reports_speed_without_compilation_and_a_max_len_stop():
    config = M.preset("tiny")
    loaded = text.LoadedModel(config, FakeTokenizer(), M.init_params(config, jax.random.key(3)),
                              "memory")
    room = text.room(loaded, "abc")
    assert room == config.max_len - 4  # EOS + 3 prompt tokens
    first = text.sample_text(loaded, "abc", max_new_tokens=10_000, seed=7)
    assert first.max_new_tokens == room
    assert len(first.tokens) == room and first.stop_reason == "max_len"
    assert 0 < first.compile_seconds < first.seconds
    again = text.sample_text(loaded, "abc", max_new_tokens=10_000, seed=7)
    assert again.tokens == first.tokens
    assert again.compile_seconds == 0  # compiled once
    assert again.tokens_per_second == pytest.approx(len(again.tokens) / again.seconds)
    exact = text.sample_text(loaded, "abc", max_new_tokens=room, seed=7)
    assert exact.stop_reason == "max_new_tokens"  # the caller's limit, not the model's


def test_sample_announces_a_clamped_max_new_tokens(capsys):
    code, out, err = run_cli(capsys, "sample", "--checkpoint", str(NUMBERS), "--prompt",
                             "4021", "--max-new-tokens", "100000")
    assert code == 0
    assert_one_line(err, "--max-new-tokens 100000 does not fit", "generating at most")
    assert out.startswith("4021 -> four thousand twenty-one\n")
    assert "compilation" in out and "stop: eos" in out
