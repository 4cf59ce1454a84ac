"""A generation config's rules about token ids, read as transformers' `generate` applies
them; what kvjax cannot apply, or an id the tokenizer does not know, is refused by name.
tests/hf/test_encoder_decoders.py holds the decoders that apply them equal to transformers."""

import numpy as np
import pytest

from kvjax.tokenizer.generation_rules import GenerationRules

KNOWN = np.ones(10, bool)
KNOWN[8] = False  # an id the tokenizer has a hole at


def test_every_rule_is_read_and_the_stop_ids_start_with_the_tokenizers_eos():
    rules = GenerationRules.read({"eos_token_id": [2, 3, 2], "forced_bos_token_id": 4,
                                  "forced_eos_token_id": [2],
                                  "bad_words_ids": [[5], [6], [5], [6, 7], [6, 7]]},
                                 eos_id=3, known=KNOWN)
    assert rules == GenerationRules(stop_ids=(3, 2), target_prefix=(4,), forced_end=2,
                                    banned_ids=(5, 6), bad_words=((6, 7),))
    assert GenerationRules.read({"eos_token_id": 7, "forced_eos_token_id": 7}, None,
                                KNOWN) == GenerationRules((7,), (), 7, ())
    assert GenerationRules.read({}, 1, KNOWN) == GenerationRules((1,), (), None, ())


def test_the_sampling_settings_its_authors_chose_are_read_as_written():
    rules = GenerationRules.read({"do_sample": True, "top_p": 0.9, "temperature": 0.6,
                                  "top_k": 20, "min_p": None, "typical_p": 0.5}, 1, KNOWN)
    assert rules.sampling == (("temperature", 0.6), ("top_k", 20), ("top_p", 0.9))


@pytest.mark.parametrize("generation, message", [
    ({"forced_eos_token_id": [2, 3]}, r"forced_eos_token_id \[2, 3\]: kvjax forces one"),
    ({"bad_words_ids": [[5], []]}, r"bad_words_ids \[\[5\], \[\]\]: a list of token id lists"),
    ({"bad_words_ids": [5]}, r"bad_words_ids \[5\]: a list of token id lists"),
    ({"bad_words_ids": [[10]]}, "bad_words_ids 10 is not a token id"),
    ({"bad_words_ids": [[5, 8]]}, "bad_words_ids 8 is not a token id"),
    ({"forced_eos_token_id": 8}, "forced_eos_token_id 8 is not a token id"),
    ({"forced_bos_token_id": -1}, "forced_bos_token_id -1 is not a token id"),
    ({"eos_token_id": ["2"]}, "eos_token_id '2' is not a token id"),
    ({"temperature": "0.6"}, "temperature '0.6' is not a number"),
    ({"top_k": True}, "top_k True is not a number"),
])
def test_what_cannot_be_applied_is_refused_by_name(generation, message):
    with pytest.raises(ValueError, match=message):
        GenerationRules.read(generation, 1, KNOWN)
