"""decode.Sampling: checked when made, hashable, and expanded to one value per row."""

import numpy as np
import pytest

from kvjax import decode


def test_sequences_become_tuples_and_equal_settings_are_one_key():
    a = decode.Sampling(temperature=[0.5, 0.0], top_k=np.array([3, 1]))
    b = decode.Sampling(temperature=(0.5, 0), top_k=(3, 1))
    assert a.temperature == (0.5, 0.0) and a.top_k == (3, 1)
    assert isinstance(a.top_k[0], int) and isinstance(a.temperature[1], float)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert decode.Sampling(top_k=np.int64(4)).top_k == 4


def test_changed_names_the_settings_that_leave_greedy_decoding():
    assert decode.GREEDY == decode.Sampling() and decode.GREEDY.changed() == ()
    assert decode.Sampling(temperature=[0.0, 0.7], min_p=0.0).changed() == ("temperature",)
    assert decode.Sampling(repetition_penalty=1.2, top_p=0.9).changed() == (
        "top_p", "repetition_penalty")


def test_rows_repeat_each_prompts_value_for_its_samples():
    sampling = decode.Sampling(temperature=[0.5, 1.5], top_k=7)
    rows = sampling.rows(batch=2, num_samples=3)
    np.testing.assert_array_equal(rows["temperature"], [0.5] * 3 + [1.5] * 3)
    np.testing.assert_array_equal(rows["top_k"], [7] * 6)
    params = sampling.params(batch=2, num_samples=3)
    assert params.temperature.dtype == np.float32 and params.top_k.dtype == np.int32
    np.testing.assert_array_equal(params.top_k, rows["top_k"])


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=-1.0), r"temperature=-1.0 must be >= 0"),
    (dict(top_p=[0.5, 2]), r"top_p\[1\]=2.0 must be in \(0, 1\]"),
    (dict(top_k=1.5), r"top_k=1.5 must be an int"),
    (dict(min_p=[[0.1]]), r"min_p must be a number or a list of one per prompt"),
    (dict(no_repeat_ngram_size=-2), r"no_repeat_ngram_size=-2"),
])
def test_a_bad_value_is_refused_when_made_naming_it(settings, message):
    with pytest.raises(ValueError, match=message) as refused:
        decode.Sampling(**settings)
    assert refused.value.name.split("[")[0] == next(iter(settings))


def test_one_value_per_prompt_must_match_the_prompts():
    with pytest.raises(ValueError, match=r"temperature has 2 values \[0.5, 1.0\] for 3 prompts"):
        decode.Sampling(temperature=[0.5, 1.0]).rows(batch=3)
