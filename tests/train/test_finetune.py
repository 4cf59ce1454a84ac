"""`kvjax train --init-from`: fine-tuning kvjax's own checkpoints and imported pretrained ones.

The imported models are the tiny Hugging Face fixtures of tests/fixtures/hf_models, written
as kvjax checkpoints once per module; every run is a few steps long.
"""

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_cli
from safetensors.numpy import load_file

from kvjax import checkpoint, decode, hf, text
from kvjax import model as M
from kvjax.hf.convert import import_checkpoint
from kvjax.tokenizer import EOS_ID, tokenizer_from_bytes, train_tokenizer
from kvjax.tokenizer.huggingface import load_tokenizer
from kvjax.train import data, lora, run_dir, tasks, trainer, update
from kvjax.train.config import TrainConfig, TrainTask

HF_MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "hf_models"
TEXT = data.python_docs_text()[:3000]
PAIRS = "".join(f"{n}\t{data.number_to_words(n)}\n" for n in range(40))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> a kvjax checkpoint of that Hugging Face fixture, made on first use."""
    root, made = tmp_path_factory.mktemp("imported"), {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = import_checkpoint(HF_MODELS / name, root / name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def own_tokenizer():
    return train_tokenizer([TEXT], 400)


# The data pipeline with other tokenizers ------------------------------------------------------


def test_an_imported_vocabularys_id_0_counts_in_the_loss():
    # GPT-2's "!" is id 0, kvjax's PAD: only the weights may say what counts.
    logits = np.random.default_rng(0).normal(size=(1, 3, 7)).astype(np.float32)
    batch = tasks.lm_arrays(np.array([[5, 0, 3, 0]]))
    weights = update.target_weights(batch)
    total, count = update.cross_entropy_sum(logits, batch["targets"], weights)
    assert count == 3
    moved = logits.copy()
    moved[0, 0, 0] += 2.0  # the logit of the target id 0 at position 0
    assert update.cross_entropy_sum(moved, batch["targets"], weights)[0] < total
    # A batch without weights counts every target too.
    del batch["weights"]
    assert float(update.cross_entropy_sum(logits, batch["targets"],
                                          update.target_weights(batch))[1]) == 3


def test_documents_are_framed_as_each_model_expects(imported, own_tokenizer):
    def stream(tokenizer, bos_id=1):
        framing = data.Framing.of(tokenizer, bos_id)
        return data.tokenize_documents(tokenizer, ["ab", "c"], framing).tolist()

    own = own_tokenizer
    assert data.Framing.of(own, 1) == data.KVJAX_FRAMING
    a, b = own.encode("ab"), own.encode("c")
    assert stream(own) == [*a, EOS_ID, *b, EOS_ID]  # the stream kvjax's LMs always had
    llama = tokenizer_from_bytes(checkpoint.read_metadata(imported("llama_gqa"))[2])
    a, b = llama.encode("ab"), llama.encode("c")
    assert stream(llama) == [llama.bos_id, *a, llama.eos_id, llama.bos_id, *b, llama.eos_id]
    gpt2 = tokenizer_from_bytes(checkpoint.read_metadata(imported("gpt2"))[2])
    a, b = gpt2.encode("ab"), gpt2.encode("c")
    assert stream(gpt2) == [*a, gpt2.eos_id, *b, gpt2.eos_id]


def test_marian_targets_start_from_its_decoder_start_and_end_with_its_eos(imported):
    config_dict, _, tokenizer_bytes = checkpoint.read_metadata(imported("marian"))
    config, tokenizer = M.TransformerConfig.from_dict(config_dict), tokenizer_from_bytes(
        tokenizer_bytes)
    framing = data.Framing.of(tokenizer, config.bos_id)
    arrays = tasks.translation_arrays(tokenizer, [("one", "eins zwei")], 12, framing)
    source, target = tokenizer.encode("one"), tokenizer.encode("eins zwei")
    length = len(target) + 1
    assert arrays["source"][0, : arrays["source_lengths"][0]].tolist() == [
        *source, *tokenizer.source_suffix]
    assert arrays["inputs"][0, :length].tolist() == [config.bos_id, *target]
    assert arrays["targets"][0, :length].tolist() == [*target, tokenizer.eos_id]
    assert arrays["weights"][0].tolist() == [1.0] * length + [0.0] * (12 - length)


def test_nllb_sources_start_with_their_languages_code_as_its_tokenizer_frames_them():
    tokenizer = load_tokenizer(HF_MODELS.parent / "hf_tokenizers" / "nllb")
    framing = data.Framing.of(tokenizer, 2)
    arrays = tasks.translation_arrays(tokenizer, [("Hallo Welt", "Hello world")], 12, framing)
    source = arrays["source"][0, : arrays["source_lengths"][0]].tolist()
    assert source == [*tokenizer.encode("deu_Latn"), *tokenizer.encode("Hallo Welt"), 2]


# Fine-tuning runs ------------------------------------------------------------------------------


def test_fine_tuning_imported_gpt2_lowers_the_loss_and_saves_a_loadable_run(
        imported, tmp_path, capsys):
    source = imported("gpt2")
    (tmp_path / "my.txt").write_text(TEXT, encoding="utf-8")
    out = tmp_path / "ft"
    result = tasks.train_lm(out, data_files=[tmp_path / "my.txt"], init_from=source, steps=10,
                            warmup_steps=1, batch_size=4, save_every=10, progress=False)
    assert np.mean([result.losses[step] for step in (8, 9, 10)]) < result.losses[1] - 0.1
    run = json.loads((out / run_dir.RUN_FILE).read_text())
    assert run[run_dir.INIT_FROM] == {"checkpoint": str(source.resolve()), "step": 0}
    assert run["data"]["seq_len"] == 64  # the model's max_len, below the default 128

    assert checkpoint.read_metadata(out) == checkpoint.read_metadata(source)
    config, tokenizer, _ = checkpoint.load_for_sampling(out)
    assert config == checkpoint.load_for_sampling(source)[0]
    assert tokenizer.to_bytes() == checkpoint.read_metadata(source)[2]
    lm = text.load(out)
    assert lm.config == config and lm.tokenizer.to_bytes() == tokenizer.to_bytes()

    # Resumed as any run: the config and tokenizer are the run's own, the record is kept.
    code, stdout, _ = run_cli(capsys, "train", "--task", "lm", "--data", tmp_path / "my.txt",
                              "--out", out, "--resume", "--allow-changes", "--steps", 12,
                              "--warmup-steps", 1, "--batch-size", 4, "--save-every", 10,
                              "--no-progress")
    assert code == 0 and "trained to step 12" in stdout
    assert json.loads((out / run_dir.RUN_FILE).read_text())[run_dir.INIT_FROM] == (
        run[run_dir.INIT_FROM])


# Mixtral: adapters beside experts; Gemma 3: a vision-language release's language model.
@pytest.mark.parametrize("name", ["gpt2", "mixtral", "gemma3"])
def test_a_hugging_face_directory_is_imported_into_the_run_and_fine_tuned(tmp_path, capsys,
                                                                          name):
    (tmp_path / "my.txt").write_text(TEXT, encoding="utf-8")
    out = tmp_path / "ft"
    result = tasks.train_lm(out, data_files=[tmp_path / "my.txt"], init_from=HF_MODELS / name,
                            steps=3, warmup_steps=1, batch_size=4, save_every=3,
                            progress=False, lora=M.LoRA(2))
    base = out / tasks.IMPORTED_BASE
    assert result.step == 3 and checkpoint.latest_step(base) == 0
    record = json.loads((out / run_dir.RUN_FILE).read_text())[run_dir.INIT_FROM]
    assert record["checkpoint"] == str(base.resolve())
    _, _, imported_params = checkpoint.load_for_sampling(base)
    _, _, hf_params = hf.load_pretrained(HF_MODELS / name)
    for a, b in zip(jax.tree.leaves(imported_params), jax.tree.leaves(hf_params), strict=True):
        assert np.array_equal(a, b)
    adapted = text.load(base, lora=out)
    assert adapted.config == text.load(HF_MODELS / name).config
    with pytest.raises(ValueError, match=f"onto the kvjax checkpoint they were trained on, "
                                         f"{re.escape(str(base.resolve()))}, not onto"):
        text.load(HF_MODELS / name, lora=out)
    # Written as a PEFT adapter of the directory it came from, the run merges the same.
    code, _, err = run_cli(capsys, "export-peft", "--lora", out, "--hf-dir", HF_MODELS / name,
                           "--out", tmp_path / "peft")
    assert code == 0, err
    _, _, exported = hf.load_pretrained(HF_MODELS / name, lora=tmp_path / "peft")
    layers = {"gpt2": "transformer.h", "mixtral": "model.layers",
              "gemma3": "model.language_model.layers"}[name]  # where PEFT finds the modules
    assert all(key.startswith(f"base_model.model.{layers}.")
               for key in load_file(str(tmp_path / "peft" / "adapter_model.safetensors")))
    pairs = list(zip(jax.tree.leaves(exported), jax.tree.leaves(adapted.params), strict=True))
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(exported), jax.tree.leaves(hf_params), strict=True))
    code, _, err = run_cli(capsys, "export-peft", "--lora", out, "--hf-dir",
                           HF_MODELS / "llama_gqa", "--out", tmp_path / "other")
    assert code == 2 and "were trained for another model config" in err
    with pytest.raises(checkpoint.CheckpointError, match="base already exists"):
        tasks.train_lm(out, data_files=[tmp_path / "my.txt"], init_from=HF_MODELS / name,
                       steps=3, progress=False)
    # The same command resumes it from its import; another model's directory cannot.
    resumed = dict(data_files=[tmp_path / "my.txt"], steps=4, warmup_steps=1, batch_size=4,
                   save_every=4, progress=False, lora=M.LoRA(2), resume=True,
                   allow_changes=True)
    with pytest.raises(checkpoint.CheckpointError, match="was not started from that Hugging"):
        tasks.train_lm(out, init_from=HF_MODELS / "llama_gqa", **resumed)
    assert tasks.train_lm(out, init_from=HF_MODELS / name, **resumed).step == 4


def test_a_bfloat16_import_fine_tunes_float32_params_and_resumes_from_the_same_command(
        tmp_path):
    """Training every weight of a bfloat16 checkpoint keeps float32 params (mixed precision:
    updates rounded to bfloat16 would mostly vanish), computing in bfloat16 as the checkpoint
    does; the run resumes with the same `init_from` although its params' dtype differs."""
    source = import_checkpoint(HF_MODELS / "gpt2", tmp_path / "bf16", dtype="bfloat16")
    (tmp_path / "my.txt").write_text(TEXT, encoding="utf-8")
    settings = dict(data_files=[tmp_path / "my.txt"], init_from=source, steps=2,
                    warmup_steps=1, batch_size=4, save_every=1, progress=False)
    tasks.train_lm(tmp_path / "ft", stop_after=1, **settings)
    result = tasks.train_lm(tmp_path / "ft", resume=True, **settings)
    assert result.step == 2 and all(np.isfinite(list(result.losses.values())))
    stored, _, start = checkpoint.load_for_sampling(source)
    config, _, tuned = checkpoint.load_for_sampling(tmp_path / "ft")
    assert (stored.dtype, stored.param_dtype) == ("bfloat16", "bfloat16")
    assert config == stored.replace(param_dtype="float32")
    assert {leaf.dtype for leaf in jax.tree.leaves(tuned)} == {np.dtype("float32")}
    moved = [np.max(np.abs(np.asarray(a, np.float32) - b))
             for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(tuned), strict=True)]
    assert 0 < max(moved) < 0.05  # trained, from the checkpoint's params


def test_an_int8_import_fine_tunes_as_the_float_model_of_its_dequantized_weights(tmp_path):
    """A checkpoint of int8 weights (`import-hf --kernel-dtype int8`) starts a float run from
    its dequantized weights; the adapters trained so load over it, merged into them."""
    source = import_checkpoint(HF_MODELS / "gpt2", tmp_path / "int8", kernel_dtype="int8")
    (tmp_path / "my.txt").write_text(TEXT, encoding="utf-8")
    out = tmp_path / "ft"
    result = tasks.train_lm(out, data_files=[tmp_path / "my.txt"], init_from=source, steps=3,
                            warmup_steps=1, batch_size=4, save_every=3, progress=False,
                            lora=M.LoRA(2))
    assert result.step == 3 and all(np.isfinite(list(result.losses.values())))
    # The same command resumes it, though the run's params are float and the start's int8.
    again = tasks.train_lm(out, data_files=[tmp_path / "my.txt"], init_from=source, steps=4,
                           warmup_steps=1, batch_size=4, save_every=4, progress=False,
                           lora=M.LoRA(2), resume=True, allow_changes=True)
    assert again.step == 4
    config, _, int8_params = checkpoint.load_for_sampling(source)
    assert config.kernel_dtype == "int8"
    settings, trained, _, adapters = checkpoint.read_adapters(out)
    assert trained == config.replace(kernel_dtype=None)
    expected = M.lora.merge(trained, M.int8_base.dequantize_layers(int8_params), adapters,
                            settings)
    adapted = text.load(source, lora=out)
    assert adapted.config == trained
    for a, b in zip(jax.tree.leaves(adapted.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fine_tuning_imported_marian_trains_and_loads(imported, tmp_path):
    (tmp_path / "pairs.tsv").write_text(PAIRS, encoding="utf-8")
    result = tasks.train_translate(
        tmp_path / "ft", data_tsv=tmp_path / "pairs.tsv", init_from=imported("marian"),
        num_heldout=0, steps=4, warmup_steps=1, batch_size=8, save_every=4, progress=False)
    assert result.step == 4 and all(np.isfinite(list(result.losses.values())))
    config = checkpoint.load_for_sampling(tmp_path / "ft")[0]
    assert config.is_encoder_decoder and config.bos_id == 283


def test_a_translation_run_over_a_low_precision_base_evaluates_its_translations(imported,
                                                                             tmp_path):
    """A LoRA run's evaluation decodes its base with the adapters merged, in the dtypes the
    model declares: a base held in bfloat16 (or int8) merges into bfloat16 arrays, which
    decoding refuses for a float32 model, so the merge is widened (the same values)."""
    (tmp_path / "pairs.tsv").write_text(PAIRS, encoding="utf-8")
    result = tasks.train_translate(
        tmp_path / "ft", data_tsv=tmp_path / "pairs.tsv", init_from=imported("marian"),
        num_heldout=2, steps=2, warmup_steps=1, batch_size=8, save_every=2, progress=False,
        lora=M.LoRA(2, base_dtype="bfloat16"))
    assert result.step == 2 and 0 <= result.metrics["accuracy"] <= 1
    config, _, params = checkpoint.load_for_sampling(imported("marian"))
    declared = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    settings = M.LoRA(2, base_dtype="int8")
    run = TrainConfig(lora=settings)
    base = lora.as_base(params, settings)
    adapters = lora.init_adapters(config, run, base)
    evaluated = lora.model_params(config, run, adapters, base)
    assert jax.tree.map(lambda x: x.dtype, evaluated) == jax.tree.map(lambda x: x.dtype,
                                                                       declared)
    np.testing.assert_array_equal(  # B starts at zero: the int8 base's values, widened
        evaluated["decoder_layers"]["0"]["ffn"]["wo"]["kernel"],
        M.int8_base.dequantize_layers(base)["decoder_layers"]["0"]["ffn"]["wo"]["kernel"])


def test_an_nllb_style_target_starts_with_its_language_and_is_forced_to_when_evaluated(
        tmp_path, monkeypatch):
    tokenizer = load_tokenizer(HF_MODELS.parent / "hf_tokenizers" / "nllb")
    (french,) = tokenizer.encode("fra_Latn")
    framing = dataclasses.replace(data.Framing.of(tokenizer, 2), target_prefix=(french,))
    arrays = tasks.translation_arrays(tokenizer, [("Hallo Welt", "Hello world")], 12, framing)
    target, length = tokenizer.encode("Hello world"), len(tokenizer.encode("Hello world")) + 2
    assert arrays["inputs"][0, :length].tolist() == [2, french, *target]
    assert arrays["targets"][0, :length].tolist() == [french, *target, 2]
    # A run from the M2M100 directory: the evaluation decodes with the language forced.
    (tmp_path / "pairs.tsv").write_text(PAIRS, encoding="utf-8")
    constraints = []
    accuracy = tasks.exact_match_accuracy
    monkeypatch.setattr(tasks, "exact_match_accuracy", lambda *args, **kwargs: (
        constraints.append(kwargs["constraint"]), accuracy(*args, **kwargs))[1])
    result = tasks.train_translate(
        tmp_path / "ft", data_tsv=tmp_path / "pairs.tsv", init_from=HF_MODELS / "m2m_100",
        num_heldout=4, steps=2, warmup_steps=1, batch_size=8, save_every=2, progress=False,
        target_language="a")
    assert result.step == 2 and 0 <= result.metrics["accuracy"] <= 1
    (forced,) = text.load(HF_MODELS / "m2m_100").tokenizer.encode("a")
    assert constraints and all(c.constraint == decode.StartsWith((forced,))
                               for c in constraints)
    with pytest.raises(ValueError, match="target_language 'Hello' is not one token"):
        tasks.train_translate(tmp_path / "bad", data_tsv=tmp_path / "pairs.tsv",
                              init_from=HF_MODELS / "m2m_100", steps=2, warmup_steps=1,
                              target_language="Hello")


def test_fine_tuning_a_kvjax_checkpoint_starts_from_its_params(own_tokenizer, tmp_path):
    tokenizer = own_tokenizer
    windows = data.pack_lm_windows(data.tokenize_documents(tokenizer, [TEXT]), 16)
    task = TrainTask(name="lm", tokenizer=tokenizer, train=tasks.lm_arrays(windows),
                     val={})
    config = M.preset("tiny", vocab_size=tokenizer.vocab_size)
    train_config = TrainConfig(steps=3, batch_size=8, warmup_steps=1, learning_rate=1e-2,
                               save_every=3, progress=False)
    first = trainer.train(config, train_config, task, tmp_path / "first")
    again = trainer.train(config, train_config, task, tmp_path / "again",
                          init_from=tmp_path / "first")

    _, _, params = checkpoint.load_for_sampling(tmp_path / "first")
    batch = dict(zip(task.train, data.Batches(tuple(task.train.values()), 8, 0).batch(0),
                     strict=True))
    loss = update.validation_loss(config, params, batch, batch_size=8)["val_loss"]
    assert again.losses[1] == pytest.approx(loss, rel=1e-5)
    assert again.losses[1] < first.losses[1] - 0.1  # not a fresh init's loss
    assert json.loads((tmp_path / "again" / run_dir.RUN_FILE).read_text())[
        run_dir.INIT_FROM]["step"] == 3


SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.mark.parametrize("task, name, data_option", [
    ("lm", "python-docs-lm", "text"), ("translate", "numbers-to-words", "pairs")])
def test_the_shipped_checkpoints_fine_tune_from_the_command_line(task, name, data_option,
                                                                 capsys, tmp_path):
    # Their config.json predates fields a config now writes (attention_block): a field left
    # out holds its default, and a speed-only setting never blocks a run.
    assert "attention_block" not in json.loads((SHIPPED / name / "config.json").read_text())[
        "model"]
    if data_option == "text":
        (tmp_path / "my.txt").write_text(TEXT)
        data_args = ["--data", tmp_path / "my.txt"]
    else:
        (tmp_path / "pairs.tsv").write_text(PAIRS)
        data_args = ["--data", tmp_path / "pairs.tsv", "--heldout", "4"]
    out = tmp_path / "ft"
    code, stdout, err = run_cli(capsys, "train", "--task", task, "--init-from", SHIPPED / name,
                                *data_args, "--steps", "2", "--batch-size", "4",
                                "--no-progress", "--out", out)
    assert code == 0, err
    assert "trained to step 2" in stdout
    assert checkpoint.latest_step(out) == 2
    record = json.loads((out / run_dir.RUN_FILE).read_text())[run_dir.INIT_FROM]
    assert record["checkpoint"] == str((SHIPPED / name).resolve())
    # The run's params started from the shipped ones: with a learning rate this small they
    # are still close to them after two steps, and far from a fresh init.
    _, _, shipped = checkpoint.load_for_sampling(SHIPPED / name)
    _, _, tuned = checkpoint.load_for_sampling(out)
    leaves = zip(jax.tree.leaves(shipped), jax.tree.leaves(tuned), strict=True)
    assert max(float(np.max(np.abs(a - b))) for a, b in leaves) < 0.05


# Misuse -----------------------------------------------------------------------------------------


def test_init_from_another_task_or_with_a_preset_is_one_line_and_exit_2(imported, capsys,
                                                                         tmp_path):
    source = imported("gpt2")
    code, out, err = run_cli(capsys, "train", "--task", "translate", "--init-from", source,
                             "--out", tmp_path / "x")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "'lm'" in err and "'translate'" in err and str(source) in err
    code, out, err = run_cli(capsys, "train", "--task", "lm", "--init-from", source,
                             "--preset", "tiny", "--out", tmp_path / "x")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "--preset" in err and "--init-from" in err
    assert not (tmp_path / "x").exists()
