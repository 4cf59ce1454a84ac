"""train/tasks.py: the language model's pipeline end to end (trained, resumed, loaded for
sampling), the baseline's perplexity, exact-match accuracy over padded batches, and overrides
checked by name. (The translator's pipeline learns in test_trainer.py.)"""

import math

import numpy as np
import pytest

from kvjax import checkpoint, decode
from kvjax import model as M
from kvjax.tokenizer import EOS_ID
from kvjax.train import data, tasks


class IdTokenizer:
    """`encode` for pairs that are already token ids."""

    @staticmethod
    def encode(ids):
        return list(ids)


def test_unigram_perplexity_is_add_one_smoothed():
    train_targets = np.array([[4, 4, 5], [4, 0, 0]])  # 0 is a token like any other
    val_targets = np.array([[4, 6]])
    vocab = 8
    p4, p6 = (3 + 1) / (6 + vocab), (0 + 1) / (6 + vocab)
    assert tasks.unigram_perplexity(train_targets, val_targets, vocab) == pytest.approx(
        math.exp(-(math.log(p4) + math.log(p6)) / 2))


def test_unknown_override_is_named(tmp_path):
    with pytest.raises(TypeError, match="stepz"):
        tasks.train_lm(tmp_path, stepz=3)


TINY_TRAINING = {"steps": 8, "warmup_steps": 2, "eval_every": 4, "save_every": 4,
                 "progress": False}


def test_train_lm_end_to_end(tmp_path):
    """Trained in the layout that is not the default, resumed in the layout it was saved in,
    loaded for sampling in the default one."""
    text_file = tmp_path / "text.txt"
    text_file.write_text(data.python_docs_text()[:40_000], encoding="utf-8")
    out_dir = tmp_path / "lm"
    other_layout = not M.TransformerConfig.scan_layers
    settings = dict(data_files=[text_file], preset="tiny", vocab_size=400, seq_len=32,
                    batch_size=8, **TINY_TRAINING)
    result = tasks.train_lm(out_dir, model_overrides={"scan_layers": other_layout}, **settings)
    assert result.step == 8 and sorted(result.losses) == list(range(1, 9))
    assert result.metrics["val_ppl"] > 1 and result.metrics["unigram_ppl"] > 1
    settings["steps"] = 10
    resumed = tasks.train_lm(out_dir, model_overrides={}, resume=True, allow_changes=True,
                             **settings)
    assert resumed.step == 10 and sorted(resumed.losses) == [9, 10]
    assert checkpoint.read_metadata(out_dir)[0]["scan_layers"] == other_layout
    config, tokenizer, params = checkpoint.load_for_sampling(out_dir)
    assert config.scan_layers == M.TransformerConfig.scan_layers
    assert not config.is_encoder_decoder and config.vocab_size == tokenizer.vocab_size
    prompt = tokenizer.encode("The ")
    output = decode.generate(M.build_model(config), params, [prompt], max_new_tokens=5)
    assert len(output.token_lists()[0]) == 5
    assert isinstance(tokenizer.decode(output.token_lists()[0]), str)


def test_exact_match_accuracy_counts_rows_equal_to_their_target(monkeypatch):
    answers = {5: [6, 5, EOS_ID], 7: [9, 9, EOS_ID], 8: [4, 4, 4]}  # 8: stopped without EOS

    def fake_generate(net, params, sources, *, lengths, max_new_tokens, eos_ids, constraint):
        assert eos_ids == (EOS_ID,) and max_new_tokens == 3 and constraint is None
        tokens = np.array([answers[int(source[0])] for source in sources])
        return decode.GenerateOutput(tokens=tokens, lengths=np.full(len(tokens), 3),
                                     stop_reason=np.zeros(len(tokens), int))

    monkeypatch.setattr(decode, "generate", fake_generate)
    pairs = [([5, 6], [6, 5]), ([7], [9, 8]), ([8], [4, 4]), ([5], [6, 5])]
    arrays = tasks.translation_arrays(IdTokenizer, pairs, max_len=4)
    # Batches of 3: the second one is padded with rows 0 and 1, which must not count again.
    accuracy = tasks.exact_match_accuracy(M.preset("tiny", num_encoder_layers=1), None, arrays,
                                          max_new_tokens=3, batch_size=3)
    assert accuracy == 2 / 4
