"""The checkpoints committed under checkpoints/: they load, and they do what their README says."""

from pathlib import Path

import jax
import numpy as np
import pytest
from kvjax.train import data, tasks
from kvjax.train.update import validation_loss

from kvjax import checkpoint, cli, decode, text
from kvjax import model as M
from kvjax.tokenizer import EOS_ID

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
LM = CHECKPOINTS / "python-docs-lm"
NUMBERS = CHECKPOINTS / "numbers-to-words"


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


def test_scanned_checkpoints_load_in_the_default_layout_and_decode_the_same_tokens(lm, numbers):
    """Both were saved with scanned layers; loading holds them in the default layout, and
    greedy decoding gives the tokens it gives with the layers held as they were saved."""
    for loaded, prompts in ((lm, ["The for statement", "A class"]), (numbers, ["4021", "77003"])):
        assert checkpoint.read_metadata(loaded.directory)[0]["scan_layers"] is True
        assert loaded.config.scan_layers == M.TransformerConfig.scan_layers
        as_saved = text.load(loaded.directory, scan_layers=True)
        assert as_saved.config == loaded.config.replace(scan_layers=True)
        tokens = [text.prompt_tokens(loaded, prompt) for prompt in prompts]
        outputs = [decode.generate(model.net, model.params, tokens, max_new_tokens=12,
                                   eos_ids=(EOS_ID,)) for model in (loaded, as_saved)]
        np.testing.assert_array_equal(outputs[0].tokens, outputs[1].tokens)
        np.testing.assert_array_equal(outputs[0].lengths, outputs[1].lengths)


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


def test_streamed_text_pieces_add_up_to_the_result(lm):
    pieces = []
    result = text.sample_text(lm, "The for statement", max_new_tokens=40, temperature=0.8,
                              top_p=0.9, seed=3, on_text=pieces.append, chunk_size=4)
    assert len(pieces) > 1 and "".join(pieces) == result.text
    again = text.sample_text(lm, "The for statement", max_new_tokens=40, temperature=0.8,
                             top_p=0.9, seed=3)
    assert again.tokens == result.tokens
