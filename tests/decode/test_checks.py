"""The generation API refuses what it would otherwise round, truncate or misread, before
compiling anything: float token ids and counts, flat lists, strings, empty arrays."""

import jax
import numpy as np
import pytest
from conftest import FakeTokenizer, with_sampling

from kvjax import decode, text
from kvjax import model as M
from kvjax.decode import checks


@pytest.fixture(scope="module")
def tiny():
    config = M.preset("tiny")
    return M.build_model(config), M.init_params(config, jax.random.key(0))


def traces():
    return [decode.trace_count(name) for name in ("start", "continue", "beam")]


@pytest.mark.parametrize("prompts, kwargs, message", [
    ([[5.0, 6.5]], {}, r"prompt 0, position 0: 5.0 is not an int token id"),
    ([[5, 6, 7]], {"top_k": 2.5}, r"top_k=2.5 must be an int"),
    ([[5, 6, 7]], {"eos_ids": (2.7,)}, r"eos_ids: 2.7 is not an int token id"),
    ([[5, 6, 7]], {"eos_ids": 2}, r"eos_ids must be a sequence of int token ids"),
    ([5, 6, 7], {}, r"not a flat list of ints \(a batch of one prompt is written \[\[5, 6, 7\]"),
    ("hello", {}, r"prompts must be a list of token-id lists .*not a str"),
    (["hello"], {}, r"prompt 0 must be a list of int token ids"),
    ([[5, 6, 7]], {"max_new_tokens": 3.5}, r"max_new_tokens=3.5 must be an int"),
    ([[5, 6, 7]], {"max_new_tokens": True}, r"max_new_tokens=True must be an int"),
    (np.zeros((0, 3), np.int32), {}, r"prompts is empty \(shape \(0, 3\)\)"),
    (np.zeros((2, 0), np.int32), {}, r"prompt 0 is empty"),
    (np.zeros((1, 3), np.float32), {}, r"must be an int array \[batch, length\], got dtype "
                                       r"float32"),
    ([[5, 6, 7]], {"temperature": "0.5"}, r"temperature='0.5' must be a real number"),
    ([[5, 6, 7]], {"temperature": float("nan")}, r"temperature=nan must be finite"),
    ([[5, 6, 7]], {"temperature": float("inf")}, r"temperature=inf must be finite"),
    ([[5, 6, 7]], {"top_k": True}, r"top_k=True must be an int"),
    ([[5, 6, 7]], {"top_p": float("inf")}, r"top_p=inf must be finite"),
    # Each setting within the dtype the compiled code holds it in: int32 counts, float32 reals.
    ([[5, 6, 7]], {"top_k": 2**31}, r"top_k=2147483648 must be <= 2147483647"),
    ([[5, 6, 7]], {"no_repeat_ngram_size": 2**40}, r"no_repeat_ngram_size=1099511627776"),
    ([[5, 6, 7]], {"top_p": 1e-50}, r"top_p=1e-50 is 0.0 as float32, .* in \(0, 1\] too"),
    ([[5, 6, 7], [8]], {"repetition_penalty": [1.0, 1e-46]},
     r"repetition_penalty\[1\]=1e-46 is 0.0 as float32"),
    ([[5, 6, 7]], {"temperature": 1e39}, r"temperature=1e\+39 is inf as float32"),
    ([[5, 6, 7]], {"bad_words": [[5, 64]]}, r"bad_words \[5, 64\]: an id outside the vocab"),
    ([[5, 6, 7]], {"bad_words": [[5] * 9]}, r"a sequence is 1 to 8 ids"),
    ([[5, 6, 7]], {"bad_words": [[5, 6]], "speculative": decode.Speculative(num_draft_tokens=2)},
     r"speculative decoding does not take bad_words"),
])
def test_generate_refuses_before_compiling(tiny, prompts, kwargs, message):
    net, params = tiny
    before = traces()
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        decode.generate(net, params, prompts, **with_sampling(**kwargs))
    assert traces() == before


@pytest.mark.parametrize("kwargs, message", [
    ({"num_beams": 2.0}, r"num_beams=2.0 must be an int"),
    ({"num_beams": 0}, r"num_beams=0 must be >= 1"),
    ({"length_penalty": float("nan")}, r"length_penalty=nan must be finite"),
    ({"eos_ids": (2.7,)}, r"eos_ids: 2.7 is not an int token id"),
    ({"num_return_sequences": 3}, r"num_return_sequences=3 is more than num_beams=2"),
    ({"num_return_sequences": 0}, r"num_return_sequences=0 must be >= 1"),
])
def test_beam_search_refuses_before_compiling(tiny, kwargs, message):
    net, params = tiny
    before = traces()
    with pytest.raises(ValueError, match=message):
        decode.beam_search(net, params, [[5, 6, 7]], **{"max_new_tokens": 4, "num_beams": 2,
                                                         **kwargs})
    assert traces() == before


def test_stream_refuses_before_compiling(tiny):
    net, params = tiny
    before = traces()
    with pytest.raises(ValueError, match=r"chunk_size=1.5 must be an int"):
        next(decode.stream(net, params, [[5, 6]], max_new_tokens=4, chunk_size=1.5))
    with pytest.raises(ValueError, match=r"prompt 0, position 1: 6.5"):
        next(decode.stream(net, params, [[5, 6.5]], max_new_tokens=4))
    assert traces() == before


def test_numpy_ints_and_int_arrays_are_accepted():
    tokens, lengths = checks.prompt_array([np.array([5, 6]), [np.int32(7)]], None)
    assert tokens.tolist() == [[5, 6], [7, 0]] and lengths.tolist() == [2, 1]
    assert checks.integer("top_k", np.int64(3), 0) == 3
    assert checks.real("top_p", 1, lambda p: 0 < p <= 1, "in (0, 1]") == 1.0


@pytest.mark.parametrize("kwargs, message", [
    ({"num_beams": 0}, r"num_beams=0 must be >= 1"),
    ({"num_beams": 2.0}, r"num_beams=2.0 must be an int"),
    ({"max_new_tokens": 0}, r"max_new_tokens=0 must be >= 1"),
    ({"seed": 1.5}, r"seed=1.5 must be an int"),
    ({"chunk_size": 0}, r"chunk_size=0 must be >= 1"),
    ({"num_beams": 2, "temperature": 0.8}, r"beam search \(num_beams=2\) does not sample: it "
                                           r"takes no temperature"),
])
def test_sample_text_refuses_bad_settings(tiny, kwargs, message):
    net, params = tiny
    loaded = text.LoadedModel(net.config, FakeTokenizer(), params, "memory")
    before = traces()
    with pytest.raises(ValueError, match=message):
        text.sample_text(loaded, "hi", **with_sampling(**kwargs))
    assert traces() == before
