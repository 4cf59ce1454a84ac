"""Tests for train.data: text sources, LM windows, batching and the translation tasks."""

import numpy as np
import pytest

from kvjax.tokenizer import BOS_ID, EOS_ID, PAD_ID
from kvjax.train.data import (
    Batches,
    encode_pairs,
    number_pairs,
    number_to_words,
    pack_lm_windows,
    pad_sequences,
    python_docs_text,
    read_text_files,
    read_tsv_pairs,
    repeat_task,
    reverse_task,
    split_train_val,
    tokenize_documents,
)

# ---------------------------------------------------------------------------------------------
# Text


def test_python_docs_text():
    text = python_docs_text()
    assert len(text) > 400_000
    assert 'The "for" statement' in text
    assert text == python_docs_text()


def test_read_text_files(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha ü\n", encoding="utf-8")
    b.write_text("beta", encoding="utf-8")
    assert read_text_files([a, b]) == "alpha ü\n\n\nbeta"
    with pytest.raises(FileNotFoundError, match="c.txt"):
        read_text_files([a, tmp_path / "c.txt"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt"):
        read_text_files([tmp_path / "latin1.txt"])
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt"):
        read_text_files([tmp_path / "empty.txt"])


# ---------------------------------------------------------------------------------------------
# Language modelling


class CharTokenizer:
    """Stands in for Tokenizer: one id per character, above the special ids."""

    bos_id, eos_id, pad_id = BOS_ID, EOS_ID, PAD_ID

    def encode(self, text):
        return [4 + ord(c) - ord("a") for c in text]


def test_tokenize_documents_ends_each_with_eos():
    stream = tokenize_documents(CharTokenizer(), ["ab", "c"])
    assert stream.dtype == np.int32
    assert stream.tolist() == [4, 5, EOS_ID, 6, EOS_ID]


def test_pack_lm_windows():
    tokens = np.arange(23, dtype=np.int32)
    windows = pack_lm_windows(tokens, window=5)
    assert windows.shape == (4, 6)  # (23 - 1) // 5 windows; the tail 20..22 only in part
    inputs, targets = windows[:, :-1], windows[:, 1:]
    np.testing.assert_array_equal(targets, inputs + 1)
    np.testing.assert_array_equal(windows[1:, 0], windows[:-1, -1])  # shared boundary token
    np.testing.assert_array_equal(targets.ravel(), np.arange(1, 21))  # each target once
    with pytest.raises(ValueError, match="too few"):
        pack_lm_windows(tokens[:5], window=5)


def test_split_train_val_is_fixed_and_disjoint():
    windows = np.arange(100)[:, None] * np.ones((1, 3), dtype=int)
    train, val = split_train_val(windows, 0.1, seed=3)
    assert (len(train), len(val)) == (90, 10)
    assert set(train[:, 0]).isdisjoint(val[:, 0])
    assert set(train[:, 0]) | set(val[:, 0]) == set(range(100))
    again_train, again_val = split_train_val(windows, 0.1, seed=3)
    np.testing.assert_array_equal(val, again_val)
    np.testing.assert_array_equal(train, again_train)
    _, other_val = split_train_val(windows, 0.1, seed=4)
    assert not np.array_equal(val, other_val)


def test_batches_pure_function_of_seed_and_step():
    examples = np.arange(103) * 10
    batches = Batches(examples, batch_size=10, seed=7)
    assert batches.steps_per_epoch == 10
    forward = [batches.batch(step) for step in range(35)]
    fresh = Batches(examples, batch_size=10, seed=7)
    for step in [34, 0, 21, 9, 10, 3]:  # any order, any instance
        np.testing.assert_array_equal(fresh.batch(step), forward[step])
    assert not np.array_equal(Batches(examples, 10, seed=8).batch(0), forward[0])


def test_batches_cover_each_example_once_per_epoch():
    examples = np.arange(103)
    batches = Batches(examples, batch_size=10, seed=0)
    for epoch in range(3):
        seen = np.concatenate([batches.batch(epoch * 10 + i) for i in range(10)])
        assert len(set(seen.tolist())) == 100  # 3 dropped: the last incomplete batch
        np.testing.assert_array_equal(
            np.sort(seen), np.sort(np.random.default_rng([0, epoch]).permutation(103)[:100])
        )
    assert not np.array_equal(batches.batch(0), batches.batch(10))  # reshuffled per epoch


def test_batches_of_tuples_stay_aligned():
    src, tgt = np.arange(20), np.arange(20) * 2
    s, t = Batches((src, tgt), batch_size=4, seed=1).batch(3)
    np.testing.assert_array_equal(t, s * 2)
    with pytest.raises(ValueError, match="batch_size"):
        Batches(src, batch_size=21, seed=0)


# ---------------------------------------------------------------------------------------------
# Translation


@pytest.mark.parametrize(
    "n, words",
    [
        (0, "zero"),
        (7, "seven"),
        (15, "fifteen"),
        (20, "twenty"),
        (21, "twenty-one"),
        (99, "ninety-nine"),
        (100, "one hundred"),
        (110, "one hundred ten"),
        (342, "three hundred forty-two"),
        (1000, "one thousand"),
        (1001, "one thousand one"),
        (4021, "four thousand twenty-one"),
        (19_000, "nineteen thousand"),
        (100_100, "one hundred thousand one hundred"),
        (999_999, "nine hundred ninety-nine thousand nine hundred ninety-nine"),
    ],
)
def test_number_to_words(n, words):
    assert number_to_words(n) == words


@pytest.mark.parametrize("n", [-1, 1_000_000, 5_000_000])
def test_number_to_words_range(n):
    with pytest.raises(ValueError, match=str(n)):
        number_to_words(n)


def test_number_pairs_heldout_fixed_and_disjoint():
    train, heldout = number_pairs(5000, num_heldout=200, seed=0)
    assert len(heldout) == 200 and len(train) == 4800
    train_sources = {src for src, _ in train}
    assert train_sources.isdisjoint(src for src, _ in heldout)
    assert train_sources | {src for src, _ in heldout} == {str(n) for n in range(5000)}
    assert ("4021", "four thousand twenty-one") in train + heldout
    assert number_pairs(5000, num_heldout=200, seed=0)[1] == heldout
    assert number_pairs(5000, num_heldout=200, seed=1)[1] != heldout


def test_read_tsv_pairs(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("1\tone\n\n  \n2\ttwo\r\n", encoding="utf-8")
    assert read_tsv_pairs(path) == [("1", "one"), ("2", "two")]
    for bad_line in ["3 three", "3\tthree\textra", "\tthree", "3\t "]:
        path.write_text(f"1\tone\n\n{bad_line}\n", encoding="utf-8")
        with pytest.raises(ValueError, match=r"pairs\.tsv:3"):
            read_tsv_pairs(path)


def test_pad_sequences():
    tokens, lengths = pad_sequences([[5, 6, 7], [8], []], pad_id=0)
    assert tokens.dtype == np.int32 and lengths.dtype == np.int32
    np.testing.assert_array_equal(tokens, [[5, 6, 7], [8, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(lengths, [3, 1, 0])
    tokens, _ = pad_sequences([[5]], pad_id=9, length=3)
    np.testing.assert_array_equal(tokens, [[5, 9, 9]])
    with pytest.raises(ValueError, match="sequence 1"):
        pad_sequences([[1], [1, 2, 3]], length=2)


def test_encode_pairs_teacher_forcing():
    src, src_len, tgt_in, tgt_out, tgt_len = encode_pairs(CharTokenizer(), [("ab", "c")], 4)
    np.testing.assert_array_equal(src, [[4, 5, EOS_ID, PAD_ID]])
    np.testing.assert_array_equal(tgt_in, [[BOS_ID, 6, PAD_ID, PAD_ID]])
    np.testing.assert_array_equal(tgt_out, [[6, EOS_ID, PAD_ID, PAD_ID]])
    assert src_len.tolist() == [3] and tgt_len.tolist() == [2]
    with pytest.raises(ValueError, match="pair 1"):
        encode_pairs(CharTokenizer(), [("a", "b"), ("abcd", "b")], 4)


# ---------------------------------------------------------------------------------------------
# Synthetic tasks


def test_reverse_task():
    examples = reverse_task(200, seq_len=6, vocab_low=4, vocab_high=20, seed=0)
    assert len(examples) == 200
    assert {len(src) for src, _ in examples} == set(range(1, 7))
    for src, tgt in examples:
        assert tgt == src[::-1]
        assert all(4 <= i < 20 for i in src)
    assert reverse_task(200, 6, 4, 20, seed=0) == examples


def test_repeat_task_windows_hold_repeated_segments():
    windows = repeat_task(8, window=16, max_segment_len=5, vocab_low=4, vocab_high=30, seed=0)
    assert windows.shape == (8, 17)
    stream = np.concatenate([windows[0], *[w[1:] for w in windows[1:]]]).tolist()
    assert len(stream) == 8 * 16 + 1
    ends = [i for i, token in enumerate(stream) if token == EOS_ID]
    assert len(ends) >= 8
    for start, end in zip([-1, *ends[:-1]], ends, strict=True):
        example = stream[start + 1 : end]
        half = len(example) // 2
        assert len(example) % 2 == 0 and 1 <= half <= 5
        assert example[:half] == example[half:]
