"""LoRA fine-tuning of the shipped LM (`kvjax train --lora-rank`): only the adapters train and
are saved, a resumed run continues bit-identically, and sampling with the adapters equals
sampling the checkpoint `kvjax merge-lora` writes."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_cli

from kvjax import checkpoint, decode, text
from kvjax import model as M
from kvjax.train import data, lora, run_dir, tasks

BASE = Path(__file__).resolve().parents[2] / "checkpoints" / "python-docs-lm"
# deterministic: a GPU's step too gives bit-identical losses when resumed.
SETTINGS = dict(steps=6, warmup_steps=1, batch_size=4, learning_rate=1e-2, save_every=3,
                progress=False, deterministic=True, lora=M.LoRA(4, 8.0, ("q", "v", "wo")))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.txt"
    path.write_text(data.python_docs_text()[:3000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    return out, tasks.train_lm(out, data_files=[corpus], init_from=BASE, **SETTINGS)


def flat_names(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_only_the_adapters_train_and_the_checkpoint_holds_them_alone(run):
    out, result = run
    losses = [result.losses[step] for step in sorted(result.losses)]
    assert np.mean(losses[-2:]) < losses[0] - 0.05
    saved = checkpoint.abstract_saved_state(out)
    assert {name.rsplit("/", 1)[-1] for name in flat_names(saved["params"])} == {
        "lora_a", "lora_b"}
    _, _, base = checkpoint.load_for_sampling(BASE)
    adapter_sizes = sum(x.size for x in jax.tree.leaves(saved["params"]))
    moments = sum(x.size for x in jax.tree.leaves(saved["opt_state"]))
    assert moments <= 2 * adapter_sizes + 8  # Adam's two moments of the adapters, and counts
    assert adapter_sizes < sum(x.size for x in jax.tree.leaves(base)) / 10
    record = json.loads((out / "config.json").read_text())["lora"]
    assert record == {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "wo"], "base_dtype": None,
                      "base": {"checkpoint": str(BASE.resolve()), "step": 400,
                               "params_sha256": checkpoint.params_digest(BASE)}}
    # The merged model is the base but for the adapted kernels, which moved.
    _, _, merged = checkpoint.load_for_sampling(BASE, lora=out)
    for path, leaf in jax.tree_util.tree_flatten_with_path(base)[0]:
        name = jax.tree_util.keystr(path)
        got = merged
        for key in path:
            got = got[key.key]
        adapted = "'qkv'" in name and "kernel" in name or "'wo'" in name and "kernel" in name
        assert np.array_equal(leaf, got) != adapted, name


def test_a_resumed_run_continues_bit_identically(run, corpus, tmp_path):
    _, whole = run
    out = tmp_path / "halves"
    first = tasks.train_lm(out, data_files=[corpus], init_from=BASE, stop_after=3, **SETTINGS)
    second = tasks.train_lm(out, data_files=[corpus], resume=True, **SETTINGS)
    assert {**first.losses, **second.losses} == whole.losses
    restored = [checkpoint.restore_params(path, checkpoint.abstract_saved_state(path)["params"])
                for path in (run[0], out)]
    for a, b in zip(*map(jax.tree.leaves, restored), strict=True):
        assert np.array_equal(a, b)
    assert json.loads((out / run_dir.RUN_FILE).read_text())[run_dir.INIT_FROM][
        "params_sha256"] == checkpoint.params_digest(BASE)


def test_sampling_with_the_adapters_equals_the_merged_checkpoint(run, capsys, tmp_path):
    out, _ = run
    merged_dir = tmp_path / "merged"
    code, stdout, err = run_cli(capsys, "merge-lora", "--checkpoint", BASE, "--lora", out,
                                "--out", merged_dir)
    assert code == 0, err
    with_adapters = text.load(BASE, lora=out)
    merged = text.load(merged_dir)
    for a, b in zip(jax.tree.leaves(with_adapters.params), jax.tree.leaves(merged.params),
                    strict=True):
        assert np.array_equal(a, b)
    prompt = text.prompt_tokens(merged, "The for statement")
    tokens = [decode.generate(lm.net, lm.params, [prompt], max_new_tokens=12).token_lists()
              for lm in (with_adapters, merged, text.load(BASE))]
    assert tokens[0] == tokens[1] != tokens[2]  # the adapters change what the model says
    args = ["sample", "--prompt", "The for statement", "--max-new-tokens", 12]
    code, sampled, err = run_cli(capsys, *args, "--checkpoint", BASE, "--lora", out)
    assert code == 0, err
    assert sampled.splitlines()[0] == run_cli(capsys, *args, "--checkpoint", merged_dir)[1] \
        .splitlines()[0]


def test_misuse_is_one_line_naming_the_fix(run, corpus, capsys, tmp_path, monkeypatch):
    out, _ = run
    code, _, err = run_cli(capsys, "sample", "--checkpoint", out, "--prompt", "x")
    assert code == 2 and f"--checkpoint {BASE.resolve()} --lora {out}" in err
    # `serve` reads --lora before it builds a server; none may start here.
    monkeypatch.setattr("kvjax.serve.server.build_app", pytest.fail)
    code, _, err = run_cli(capsys, "serve", "--checkpoint", BASE, "--lora", BASE)
    assert code == 2 and "holds no LoRA adapters" in err
    code, _, err = run_cli(capsys, "train", "--task", "lm", "--data", corpus, "--lora-rank", 4,
                           "--steps", 2, "--out", tmp_path / "no-base", "--no-progress")
    assert code == 2 and "give the checkpoint to adapt" in err
    other = BASE.parent / "numbers-to-words"
    with pytest.raises(checkpoint.CheckpointError, match="trained on other params"):
        text.load(other, lora=out)
    with pytest.raises(checkpoint.CheckpointError, match="holds no LoRA adapters"):
        lora.merge_into_checkpoint(BASE, BASE, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_an_int8_base_trains_the_adapters_alone_in_less_memory(corpus, tmp_path):
    """QLoRA-style: the base's layer kernels held as int8 (`model/int8_base.py`); the run
    trains and saves the adapters as over any base, resumes bit-identically (the base is
    quantized again alike), and a step holds less than over a bfloat16 base with its layers
    rematerialized alike."""
    from kvjax.benchmarks.train import kvjax_step

    int8 = M.LoRA(4, 8.0, ("q", "v", "wo"), base_dtype="int8")
    settings = {**SETTINGS, "lora": int8}
    out = tmp_path / "int8"
    result = tasks.train_lm(out, data_files=[corpus], init_from=BASE, **settings)
    halves = tmp_path / "halves"
    first = tasks.train_lm(halves, data_files=[corpus], init_from=BASE, stop_after=3,
                           **settings)
    second = tasks.train_lm(halves, data_files=[corpus], resume=True, **settings)
    assert {**first.losses, **second.losses} == result.losses
    losses = [result.losses[step] for step in sorted(result.losses)]
    assert np.mean(losses[-2:]) < losses[0] - 0.05
    saved = checkpoint.abstract_saved_state(out)
    assert {name.rsplit("/", 1)[-1] for name in flat_names(saved["params"])} == {
        "lora_a", "lora_b"}
    assert json.loads((out / "config.json").read_text())["lora"]["base_dtype"] == "int8"
    adapted = text.load(BASE, lora=out)  # sampling merges them over the stored base
    assert text.sample_text(adapted, "The for statement", max_new_tokens=4).tokens
    config, _, _ = checkpoint.load_for_sampling(BASE)
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (2, 65))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    held = {base: kvjax_step(config, batch, lora=M.LoRA(4, 8.0, ("q", "v", "wo"), base),
                             remat=True).peak_bytes for base in ("bfloat16", "int8")}
    assert held["int8"] < 0.9 * held["bfloat16"], held


def test_served_side_by_side_the_adapters_load_as_they_merge(run, capsys, monkeypatch):
    out, _ = run
    built = {}
    monkeypatch.setattr("kvjax.serve.server.build_app",
                        lambda loaded, **options: built.update(options, loaded=loaded))
    monkeypatch.setattr("uvicorn.run", lambda *args, **kwargs: None)
    code, _, err = run_cli(capsys, "serve", "--checkpoint", BASE, "--lora-modules",
                           f"docs={out}")
    assert code == 0, err
    (name, (adapters, settings)), = built["adapters"].items()
    assert name == "docs" and settings == SETTINGS["lora"]
    loaded = built["loaded"]
    merged = checkpoint.load_for_sampling(BASE, lora=out,
                                          scan_layers=loaded.config.scan_layers)[2]
    for a, b in zip(jax.tree.leaves(M.lora.merge(loaded.config, loaded.params, adapters,
                                                 settings)),
                    jax.tree.leaves(merged), strict=True):
        assert np.array_equal(a, b)
    for modules, message in (([f"docs{out}"], "expected NAME=DIR"),
                             ([f"a={out}", f"a={out}"], "the name 'a' is given twice")):
        code, _, err = run_cli(capsys, "serve", "--checkpoint", BASE, "--lora-modules",
                               *modules)
        assert code == 2 and message in err
    for extra in (["--lora-modules", f"docs={out}"], ["--allow-lora-loading"]):
        code, _, err = run_cli(capsys, "serve", "--checkpoint", BASE, "--lora", out, *extra)
        assert code == 2 and "give one or the other" in err
    # Loading while serving: the server's loader reads a run as --lora-modules does.
    code, _, err = run_cli(capsys, "serve", "--checkpoint", BASE, "--allow-lora-loading",
                           "--max-loras", 3, "--max-lora-rank", 8)
    assert code == 0, err
    assert (built["adapters"], built["max_adapters"], built["max_adapter_rank"]) == (None, 3, 8)
    loaded_later = built["load_adapter"](str(out))
    assert loaded_later[1] == settings
    jax.tree.map(np.testing.assert_array_equal, loaded_later[0], adapters)
    code, _, err = run_cli(capsys, "serve", "--checkpoint", BASE.parent / "numbers-to-words",
                           "--lora-modules", f"docs={out}")
    assert code == 2 and "trained on other params" in err
