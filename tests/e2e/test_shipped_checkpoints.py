"""The checkpoints committed under checkpoints/: they load, verified against their manifests,
and they do what their README says."""

import re
import shutil
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax import checkpoint, cli, decode, text
from kvjax import model as M
from kvjax.decode.buckets import padded_to_bucket
from kvjax.tokenizer import EOS_ID
from kvjax.train import data, tasks
from kvjax.train.update import validation_loss

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
LM = CHECKPOINTS / "python-docs-lm"
NUMBERS = CHECKPOINTS / "numbers-to-words"
EMBEDDING = "params/embedder/embedding/embedding"
# Where the embedding's data lies in each checkpoint's largest data file, as a fraction of the
# file's size; the file also holds the optimizer state, which sampling does not read.
EMBEDDING_DATA = {LM: 0.65, NUMBERS: 0.27}


@pytest.fixture(scope="module")
def lm():
    return text.load(LM)


@pytest.fixture(scope="module")
def numbers():
    return text.load(NUMBERS)


def test_each_checkpoint_holds_its_variant_and_a_lossless_tokenizer(lm, numbers):
    assert not lm.config.is_encoder_decoder and numbers.config.is_encoder_decoder
    for loaded in (lm, numbers):
        assert loaded.tokenizer.vocab_size == loaded.config.vocab_size
        sample = "def f(x):\n    return x ** 2  # ünïcödé ✓"
        assert loaded.tokenizer.decode(loaded.tokenizer.encode(sample)) == sample
        assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(loaded.params))


def test_scanned_checkpoints_load_in_the_default_layout_as_the_same_model(lm, numbers):
    """Both were saved with scanned layers; loading holds them in the default layout, whose
    logits are those of the layers held as they were saved. (The layouts decode alike through
    the cache: tests/model/test_layers.py.)"""
    for loaded, prompts in ((lm, ["The for statement", "A class"]), (numbers, ["4021", "77003"])):
        assert checkpoint.read_metadata(loaded.directory)[0]["scan_layers"] is True
        assert loaded.config.scan_layers == M.TransformerConfig.scan_layers
        as_saved = text.load(loaded.directory, scan_layers=True)
        assert as_saved.config == loaded.config.replace(scan_layers=True)
        rows = [text.prompt_tokens(loaded, prompt) for prompt in prompts]
        tokens = padded_to_bucket(rows, loaded.config.max_len)
        lengths = np.array([len(row) for row in rows], np.int32)
        batch = {"inputs": tokens, "lengths": lengths, "source": tokens,
                 "source_lengths": lengths}
        logits = [np.asarray(M.teacher_forced_logits(model.config, model.params, batch))
                  for model in (loaded, as_saved)]
        np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-5)


def test_greedy_translation_of_held_out_numbers_is_right(numbers):
    settings = tasks.TRANSLATE_SETTINGS
    num_heldout = tasks.default_heldout(settings.max_number, settings.num_heldout)
    assert num_heldout == 1000  # what the shipped checkpoint was trained with
    _, heldout = data.number_pairs(settings.max_number, num_heldout)
    pairs = heldout[:: len(heldout) // 16][:16]  # spread over the held-out range
    prompts = [text.prompt_tokens(numbers, source) for source, _ in pairs]
    output = decode.generate(numbers.net, numbers.params, prompts, max_new_tokens=32,
                             eos_ids=(EOS_ID,))
    got = [numbers.tokenizer.decode(tokens[:-1]) for tokens in output.token_lists()]
    assert got == [words for _, words in pairs]
    assert output.stop_reasons() == ["eos"] * len(pairs)


def test_lm_beats_half_the_unigram_perplexity_on_validation_text(lm):
    settings = tasks.LM_SETTINGS
    ids = data.tokenize_documents(lm.tokenizer, [data.python_docs_text()])
    windows = data.pack_lm_windows(ids, settings.seq_len)
    train_windows, val_windows = data.split_train_val(windows, settings.val_fraction, 0)
    unigram = tasks.unigram_perplexity(train_windows[:, 1:], val_windows[:, 1:],
                                       lm.tokenizer.vocab_size)
    ppl = validation_loss(lm.config, lm.params, tasks.lm_arrays(val_windows), batch_size=16,
                          max_batches=4)["val_ppl"]
    assert ppl <= 0.5 * unigram, (ppl, unigram)


def test_sample_streams_a_translation_from_the_command_line(capsys):
    assert cli.main(["sample", "--checkpoint", str(NUMBERS), "--prompt", "4021"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4021 -> four thousand twenty-one\n"), out
    assert "stop: eos" in out


def test_sample_with_int8_kernels_and_cache_and_speculation_translates_the_same(capsys):
    assert cli.main(["sample", "--checkpoint", str(NUMBERS), "--prompt", "4021",
                     "--kernel-dtype", "int8", "--cache-dtype", "int8",
                     "--speculative", "ngram"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4021 -> four thousand twenty-one\n"), out
    assert "[speculative ngram: " in out and " drafted tokens accepted (" in out, out


def test_streamed_text_pieces_add_up_to_the_result(lm):
    pieces = []
    sampling = decode.Sampling(temperature=0.8, top_p=0.9)
    result = text.sample_text(lm, "The for statement", max_new_tokens=40, sampling=sampling,
                              seed=3, on_text=pieces.append, chunk_size=4)
    assert len(pieces) > 1 and "".join(pieces) == result.text
    again = text.sample_text(lm, "The for statement", max_new_tokens=40, sampling=sampling,
                             seed=3)
    assert again.tokens == result.tokens


def test_the_shipped_checkpoints_carry_manifests_and_load_without_a_warning():
    for directory in (LM, NUMBERS):
        manifest = checkpoint.read_manifest(directory)
        assert manifest is not None and manifest["model"] == checkpoint.read_metadata(directory)[0]
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            checkpoint.load_for_sampling(directory)
        assert not record, [str(w.message) for w in record]


@pytest.mark.parametrize("source", [LM, NUMBERS], ids=lambda path: path.name)
def test_flipped_bytes_in_a_shipped_checkpoint_are_an_error_naming_the_array(tmp_path, capsys,
                                                                            source):
    damaged = tmp_path / source.name
    shutil.copytree(source, damaged)
    step = checkpoint.latest_step(damaged)
    files = (damaged / str(step) / "state" / "ocdbt.process_0" / "d").iterdir()
    biggest = max(files, key=lambda path: path.stat().st_size)
    data = bytearray(biggest.read_bytes())
    start = int(EMBEDDING_DATA[source] * len(data))
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])
    biggest.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError,
                       match=re.escape(f"{damaged / str(step)} is corrupted: the data of "
                                       f"{EMBEDDING} does not match")):
        checkpoint.load_for_sampling(damaged)
    assert cli.main(["sample", "--checkpoint", str(damaged), "--prompt", "12"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert len(captured.err.splitlines()) == 1 and EMBEDDING in captured.err, captured.err


def test_a_checkpoint_without_a_manifest_loads_with_one_warning_until_it_gets_one(tmp_path,
                                                                                 capsys):
    copy = tmp_path / NUMBERS.name
    shutil.copytree(NUMBERS, copy)
    shutil.rmtree(copy / "1500" / checkpoint.MANIFEST_ITEM)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        checkpoint.load_for_sampling(copy)
    assert [w.category for w in record] == [checkpoint.UnverifiedCheckpointWarning]
    message = str(record[0].message)
    assert f"checkpoint {copy} step 1500 has no manifest" in message
    assert "cannot be verified" in message
    assert cli.main(["sample", "--checkpoint", str(copy), "--prompt", "4021"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("4021 -> four thousand twenty-one\n")
    assert captured.err.splitlines() == [f"kvjax sample: warning: {message}"]

    assert checkpoint.write_manifest(copy) == 1500
    assert checkpoint.read_manifest(copy) == checkpoint.read_manifest(NUMBERS)  # as shipped
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        checkpoint.load_for_sampling(copy)
    assert not record, [str(w.message) for w in record]
    with pytest.raises(checkpoint.CheckpointError, match="already has a manifest"):
        checkpoint.write_manifest(copy)
