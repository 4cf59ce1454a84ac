"""Stop strings and several samples in the text API and the CLI, on the shipped LM: the text
ends before the stop string, streamed or not, and generation stops there."""

from pathlib import Path

import pytest

from kvjax import cli, decode, detokenize, text

LM = Path(__file__).resolve().parent.parent / "checkpoints" / "python-docs-lm"
PROMPT = "The for statement"


@pytest.fixture(scope="module")
def lm():
    return text.load(LM)


@pytest.fixture(scope="module")
def full(lm):
    return text.sample_text(lm, PROMPT, max_new_tokens=40)


def first_new_substring(text_, start, size):
    """A substring of `text_` from `start` on that does not occur before it."""
    for i in range(start, len(text_) - size):
        if text_.find(text_[i:i + size]) == i:
            return i, text_[i:i + size]
    raise AssertionError(f"no new substring in {text_!r}")


def test_text_ends_before_the_stop_string_and_generation_stops(lm, full):
    index, stop = first_new_substring(full.text, 20, 3)
    pieces = []
    result = text.sample_text(lm, PROMPT, max_new_tokens=40, stop=["never there", stop],
                              on_text=pieces.append, chunk_size=2)
    assert result.text == full.text[:index] and "".join(pieces) == result.text
    assert result.stop_reason == "stop_string"
    assert result.tokens == full.tokens[:len(result.tokens)] < full.tokens
    decode = lm.tokenizer.decode
    assert stop in decode(result.tokens) and stop not in decode(result.tokens[:-1])


def test_text_that_could_begin_a_stop_string_is_held_back_until_it_cannot(lm, full):
    _, almost = first_new_substring(full.text, 10, 4)
    pieces, sent = [], []
    result = text.sample_text(lm, PROMPT, max_new_tokens=40, stop=almost + "\x00", chunk_size=1,
                              on_text=lambda piece: (pieces.append(piece),
                                                     sent.append("".join(pieces))))
    assert result.text == full.text and result.stop_reason == full.stop_reason
    assert "".join(pieces) == full.text
    assert not any(s.endswith(almost) for s in sent[:-1])  # it could have begun the stop


def test_several_samples_each_stop_at_their_own_stop_string(lm):
    results = text.sample_texts(lm, PROMPT, num_samples=3, max_new_tokens=30,
                                sampling=decode.Sampling(temperature=1.0, min_p=0.05,
                                                         repetition_penalty=1.2),
                                stop=[" the", "."], seed=1)
    assert len(results) == 3 and len({tuple(r.tokens) for r in results}) == 3
    for result in results:
        assert " the" not in result.text and "." not in result.text
        if result.stop_reason == "stop_string":
            assert len(result.tokens) < 30


def test_a_prompt_of_token_ids_is_read_as_it_stands(lm, full):
    ids = text.prompt_tokens(lm, PROMPT)  # the text as the model reads it, framed
    assert text.prompt_tokens(lm, ids) == ids
    assert text.sample_text(lm, ids, max_new_tokens=40).tokens == full.tokens
    for bad in ([], [lm.config.vocab_size], [1.5]):
        with pytest.raises(ValueError, match="prompt"):
            text.prompt_tokens(lm, bad)


def test_an_empty_stop_string_is_refused(lm):
    with pytest.raises(ValueError, match=r"stop string 1 \(''\) must be a non-empty string"):
        text.sample_text(lm, PROMPT, stop=["x", ""])


def test_the_command_line_takes_the_new_sampling_options(capsys, full):
    _, stop = first_new_substring(full.text, 20, 3)
    argv = ["sample", "--checkpoint", str(LM), "--prompt", PROMPT, "--max-new-tokens", "40",
            "--stop", stop, "--min-p", "0.05", "--repetition-penalty", "1.0"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT + full.text[:full.text.index(stop)] + "\n")
    assert "stop: stop_string" in out
    assert cli.main(argv[:7] + ["--num-samples", "2", "--temperature", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "--- sample 1 of 2" in out and "--- sample 2 of 2" in out


@pytest.mark.parametrize("option, message", [
    (["--stop", ""], "stop string 0 ('') must be a non-empty string"),
    (["--min-p", "2"], "min_p=2.0 must be in [0, 1]"),
    (["--repetition-penalty", "0"], "repetition_penalty=0.0 must be > 0"),
    (["--presence-penalty", "2.5"], "presence_penalty=2.5 must be in [-2, 2]"),
    (["--frequency-penalty", "-3"], "frequency_penalty=-3.0 must be in [-2, 2]"),
    (["--num-samples", "0"], "argument --num-samples: must be >= 1, got 0"),
])
def test_bad_sampling_options_end_with_one_line(capsys, option, message):
    argv = ["sample", "--checkpoint", str(LM), "--prompt", PROMPT, *option]
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


def test_text_held_back_is_the_longest_end_that_starts_a_stop_string():
    """`StopStart` against the definition, on random texts that grow (and now and then
    change before their end, as decoded text can), and in time linear in the text."""
    import random
    import time

    def longest(text_, stop):
        return max((k for k in range(1, len(stop)) if text_.endswith(stop[:k])), default=0)

    rng = random.Random(0)
    for _ in range(2000):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 7)))
        start, text_ = detokenize.StopStart(stop), ""
        for _ in range(rng.randint(1, 6)):
            if text_ and rng.random() < 0.2:
                text_ = text_[:rng.randint(0, len(text_))]
            text_ += "".join(rng.choice("abc") for _ in range(rng.randint(0, 5)))
            assert start.held(text_) == longest(text_, stop), (stop, text_)
    # A 200,000-character stop string the text keeps almost completing: the quadratic
    # definition would compare 2e10 characters per call.
    stop = "x" * 200_000
    start, began = detokenize.StopStart(stop), time.perf_counter()
    grown = "y"
    for _ in range(50):
        grown += "x" * 3000
        assert start.held(grown) == len(grown) - 1
    assert time.perf_counter() - began < 10
