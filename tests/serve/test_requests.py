"""serve/requests.py: a request is checked before it is queued, each bad value refused by name
(the engine's own refusals are in test_engine.py); a seed is drawn when none is given; and
samples become the slots' per-row settings in their order."""

import dataclasses

import numpy as np
import pytest
from conftest import end_only_automaton

from kvjax.decode import Sampling
from kvjax.decode.sampling import seed_key
from kvjax.serve import GenerationRequest
from kvjax.serve.requests import row_settings
from kvjax.serve.slots import MAX_STOP_IDS, MAX_TOP_LOGPROBS
from kvjax.text import MAX_SEED

VOCAB, CAPACITY = 50, 32


@pytest.mark.parametrize("changes, message", [
    (dict(prompt=()), "the prompt is empty"),
    (dict(prompt=(5, -1)), r"prompt token id -1 is outside the vocabulary \[0, 50\)"),
    (dict(prompt=(5.0, 6)), "prompt: 5.0 is not an int token id"),
    (dict(max_tokens=0), "max_tokens=0 must be >= 1"),
    (dict(n=0), "n=0 must be >= 1"),
    (dict(sampling={"temperature": 1.0}), "sampling must be a decode.Sampling, got dict"),
    (dict(stop_ids=tuple(range(3, 4 + MAX_STOP_IDS))),
     f"at most {MAX_STOP_IDS} stop ids, got {MAX_STOP_IDS + 1}"),
    (dict(stop_ids=(2, 50)), r"stop id 50 is outside the vocabulary \[0, 50\)"),
    (dict(stop=("",)), r"stop string 0 \(''\) must be a non-empty string"),
    (dict(forced_end_id=50), r"forced_end_id 50 is not a token id in \[0, 50\)"),
    (dict(forced_end_id=2.0), r"forced_end_id 2.0 is not a token id"),
    (dict(banned_ids=(3, 50)), r"banned_ids \(3, 50\): at most 8 ids in \[0, 50\)"),
    (dict(banned_ids=tuple(range(9))), r"banned_ids \(0, 1, .*: at most 8 ids"),
    (dict(seed=-3), "seed=-3 must be >= 0"),
    (dict(seed=MAX_SEED + 1), f"seed={MAX_SEED + 1}"),
    (dict(logprobs=MAX_TOP_LOGPROBS + 1),
     f"logprobs={MAX_TOP_LOGPROBS + 1} must be <= {MAX_TOP_LOGPROBS}"),
    (dict(constraint="json"), "constraint must be a TokenAutomaton .*got str"),
    (dict(cache_salt=""), "cache_salt '' must be a non-empty string"),
    (dict(cache_salt=7), "cache_salt 7 must be a non-empty string"),
    (dict(priority=2 ** 30 + 1), f"priority={2 ** 30 + 1} must be <= {2 ** 30}"),
    (dict(priority=-2 ** 30 - 1), f"priority={-2 ** 30 - 1} must be >= {-2 ** 30}"),
    (dict(priority=1.0), "priority=1.0 must be an int"),
    (dict(bad_words=((3,),) * 33), "33 bad_words token sequences: at most 32"),
    (dict(bad_words=((3,) * 9,)), r"bad_words \[3, 3, .*\]: a sequence is 1 to 8 ids"),
    (dict(bad_words=((3, 50),)), r"bad_words \[3, 50\]: an id outside the vocabulary"),
    (dict(bad_words=((),)), r"bad_words \[\]: a sequence is 1 to 8 ids"),
    (dict(bad_words="ab"), "bad_words 'ab' must be a list of token id sequences"),
    (dict(beam_search=True, sampling=Sampling(temperature=0.7)),
     "temperature is not used by beam search"),
    (dict(beam_search=True, stop=("x",)), "stop is not used by beam search"),
    (dict(beam_search=True, logprobs=2), "logprobs is not used by beam search"),
    (dict(beam_search=True, length_penalty=float("nan")), "length_penalty"),
    (dict(constraint=end_only_automaton(VOCAB + 8, 2), stop_ids=(2,)),
     "compiled for 58 token ids; the model has 50"),
    (dict(constraint=end_only_automaton(VOCAB, 2), stop_ids=(3,)),
     r"ends with id 2, which is not among stop_ids \(3,\): it could never stop"),
])
def test_each_bad_value_is_refused_by_name(changes, message):
    request = dataclasses.replace(GenerationRequest((5, 6, 7)), **changes)
    with pytest.raises(ValueError, match=message):
        request.checked(VOCAB, CAPACITY)


def test_a_checked_request_keeps_its_values_and_draws_a_missing_seed():
    request = GenerationRequest([5, 6], max_tokens=CAPACITY - 2, stop_ids=[2], stop="END",
                                seed=None, constraint=end_only_automaton(VOCAB, 2),
                                logprobs=MAX_TOP_LOGPROBS)
    checked = request.checked(VOCAB, CAPACITY)
    assert checked.prompt == (5, 6) and checked.stop_ids == (2,) and checked.stop == ("END",)
    assert 0 <= checked.seed < MAX_SEED and checked.max_tokens == CAPACITY - 2
    assert checked.checked(VOCAB, CAPACITY) == checked  # a drawn seed stays drawn
    seeds = {request.checked(VOCAB, CAPACITY).seed for _ in range(8)}
    assert len(seeds) > 1
    assert GenerationRequest((5,), seed=7).checked(VOCAB, CAPACITY).seed == 7


def test_samples_become_one_row_of_settings_each_in_their_order():
    greedy = GenerationRequest((5, 6), max_tokens=4, stop_ids=(2, 9), seed=11,
                               forced_end_id=2, banned_ids=(7,))
    sampled = GenerationRequest((7,), max_tokens=9, seed=2**40 + 3, priority=-4,
                                sampling=Sampling(temperature=0.7, top_k=5, top_p=0.9))
    rows = row_settings([(greedy, 0), (sampled, 0), (sampled, 1)], constraint_states=[-1, 4, 4],
                        generated=[0, 0, 3], prefix_pages=[(-1, 0), (1, 2), (-1, 0)])
    np.testing.assert_array_equal(rows.max_tokens, [4, 9, 9])
    np.testing.assert_array_equal(rows.forced_end, [2, -1, -1])
    np.testing.assert_array_equal(rows.banned_ids[:, :2], [[7, -1]] * 1 + [[-1, -1]] * 2)
    np.testing.assert_array_equal(rows.sample, [0, 0, 1])
    np.testing.assert_array_equal(rows.stop_ids[0], [2, 9] + [-1] * (MAX_STOP_IDS - 2))
    assert (rows.stop_ids[1:] == -1).all()
    np.testing.assert_array_equal(rows.seed, [seed_key(11)] + [seed_key(2**40 + 3)] * 2)
    np.testing.assert_allclose(rows.sampling.temperature, [0.0, 0.7, 0.7])
    np.testing.assert_array_equal(rows.sampling.top_k, [0, 5, 5])
    assert rows.sampling.top_k.dtype == np.int32 and rows.sampling.top_p.dtype == np.float32
    np.testing.assert_array_equal(rows.constraint_state, [-1, 4, 4])
    np.testing.assert_array_equal(rows.generated, [0, 0, 3])
    np.testing.assert_array_equal(rows.prefix_row, [-1, 1, -1])
    np.testing.assert_array_equal(rows.prefix_pages, [0, 2, 0])
    np.testing.assert_array_equal(rows.priority, [0, -4, -4])
    assert (rows.bad_words == -1).all()
    worded = row_settings([(dataclasses.replace(greedy, bad_words=((4,), (7, 8, 9))), 0)])
    assert worded.bad_words.shape == (1, 32, 8)
    assert worded.bad_words[0, :2].tolist() == [[-1] * 7 + [4], [-1] * 5 + [7, 8, 9]]
    defaults = row_settings([(greedy, 0)])
    assert defaults.constraint_state.tolist() == [-1] and defaults.generated.tolist() == [0]
    assert defaults.prefix_row.tolist() == [-1] and defaults.prefix_pages.tolist() == [0]
