"""Constraints compiled to token automata: the tokens each state allows spell exactly the
texts of the language (checked against Python's `re`), and the JSON Schema keywords an automaton
cannot enforce are refused by name."""

import json
import re
from pathlib import Path

import pytest

from kvjax import decode
from kvjax.tokenizer import huggingface

ROOT = Path(__file__).resolve().parents[2]
HF_MODELS = ROOT / "tests" / "fixtures" / "hf_models"


def texts_of(automaton, token_bytes, limit):
    """Every complete text the automaton accepts in at most `limit` tokens, by walking it."""
    done, frontier = set(), [(automaton.initial, b"")]
    for _ in range(limit):
        following = []
        for state, so_far in frontier:
            for token in automaton.allowed(state).tolist():
                if token == automaton.end_id:
                    done.add(so_far)
                else:
                    following.append((automaton.next_state(state, token),
                                      so_far + token_bytes[token]))
        frontier = following
    return done


def test_a_choice_allows_exactly_its_options(docs_tokenizer):
    options = ["yes", "no", "not sure (a+b)*"]
    automaton = decode.compile_constraint(decode.Choice(options), docs_tokenizer)
    assert texts_of(automaton, docs_tokenizer.token_bytes(), 20) == {o.encode() for o in options}


def test_a_regex_allows_only_matching_texts_and_every_short_one(docs_tokenizer):
    pattern = "[ab]{1,3}c?"
    automaton = decode.compile_constraint(decode.Regex(pattern), docs_tokenizer)
    accepted = texts_of(automaton, docs_tokenizer.token_bytes(), 5)
    assert all(re.fullmatch(pattern, t.decode()) for t in accepted)
    letters = [a + b + c for a in ("", "a", "b") for b in ("", "a", "b") for c in ("a", "b")]
    assert {(w + e).encode() for w in letters for e in ("", "c")} <= accepted


def test_the_end_id_is_allowed_only_where_the_text_is_complete(docs_tokenizer):
    automaton = decode.compile_constraint(decode.Regex("ab"), docs_tokenizer)
    ends = [s for s in range(automaton.num_states)
            if docs_tokenizer.eos_id in automaton.allowed(s).tolist()]
    for state in range(automaton.num_states):
        allowed = automaton.allowed(state).tolist()
        assert all(t not in docs_tokenizer.stop_ids or t == automaton.end_id for t in allowed)
    # "ab" then the end, and nothing else, from the ends' state.
    assert len(ends) == 1 and automaton.allowed(ends[0]).tolist() == [docs_tokenizer.eos_id]


def test_compiling_again_reuses_the_automaton(docs_tokenizer):
    schema = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
    first = decode.compile_constraint(decode.JsonSchema(schema), docs_tokenizer)
    assert decode.compile_constraint(decode.JsonSchema(json.dumps(schema)), docs_tokenizer) is first
    assert decode.compile_constraint(decode.JsonSchema(schema), docs_tokenizer,
                                     end_id=docs_tokenizer.eos_id) is first


@pytest.mark.parametrize("schema, keyword, where", [
    ({"type": "integer", "minimum": 3}, "minimum", "#/minimum"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}},
     "multipleOf", "#/properties/n/multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems",
     "#/uniqueItems"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties",
     "#/patternProperties"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "not", "#/anyOf/1/not"),
    ({"oneOf": [{"type": "string"}]}, "oneOf", "#/oneOf"),
])
def test_a_keyword_an_automaton_cannot_enforce_is_named(schema, keyword, where):
    with pytest.raises(ValueError, match=f"keyword '{keyword}' \\(at {where}\\)"):
        decode.JsonSchema(schema)


@pytest.mark.parametrize("make, message", [
    (lambda: decode.JsonSchema("{not json"), "not JSON"),
    (lambda: decode.JsonSchema([1]), "is an object"),
    (lambda: decode.Choice([]), "at least one option"),
    (lambda: decode.Choice(["a", ""]), "choice 1"),
    (lambda: decode.Regex(""), "non-empty"),
    (lambda: decode.StartsWith(()), "needs token ids >= 0"),
    (lambda: decode.StartsWith((3, -1)), "needs token ids >= 0"),
    (lambda: decode.StartsWith((True,)), "needs token ids >= 0"),
    (lambda: decode.AllowedTokens([]), "a non-empty list of token ids >= 0"),
    (lambda: decode.AllowedTokens([4, -1]), "a non-empty list of token ids >= 0"),
    (lambda: decode.AllowedTokens("4"), "a non-empty list of token ids >= 0"),
])
def test_a_bad_constraint_is_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_format_outlines_cannot_spell_and_a_text_the_vocabulary_cannot_are_errors(docs_tokenizer):
    with pytest.raises(ValueError, match="Format zzz"):
        decode.compile_constraint(decode.JsonSchema({"type": "string", "format": "zzz"}),
                                  docs_tokenizer)
    with pytest.raises(ValueError, match="cannot compile Regex for this vocabulary"):
        decode.compile_constraint(decode.Regex("\u0000\u0001\u0002"), _NoBytes(docs_tokenizer))


class _NoBytes:
    """A docs_tokenizer none of whose tokens stands for a control character."""

    def __init__(self, inner):
        self.eos_id, self.vocab_size, self.stop_ids = inner.eos_id, inner.vocab_size, ()
        self._bytes = [b if b and b[0] >= 32 else None for b in inner.token_bytes()]

    def token_bytes(self):
        return self._bytes


def test_starts_with_allows_its_tokens_in_turn_then_any_and_reads_no_bytes():
    # Marian's tokenizer spells no bytes (refused for text constraints, below): ids suffice.
    tok = huggingface.load_tokenizer(HF_MODELS / "marian")
    automaton = decode.compile_constraint(decode.StartsWith((7, 5)), tok)
    state = automaton.initial
    for forced in (7, 5):
        assert automaton.allowed(state).tolist() == [forced]
        state = automaton.next_state(state, forced)
    assert automaton.allowed(state).tolist() == list(range(tok.vocab_size))
    assert automaton.next_state(state, automaton.end_id) == state
    assert decode.compile_constraint(decode.StartsWith([7, 5]), tok) is automaton  # reused
    with pytest.raises(ValueError, match=f"StartsWith token {tok.vocab_size} is outside"):
        decode.compile_constraint(decode.StartsWith((1, tok.vocab_size)), tok)


def test_allowed_tokens_are_allowed_alone_at_every_step_and_read_no_bytes():
    tok = huggingface.load_tokenizer(HF_MODELS / "marian")
    automaton = decode.compile_constraint(decode.AllowedTokens([9, 4, 9, tok.eos_id]), tok)
    assert automaton.num_states == 1
    assert automaton.allowed(automaton.initial).tolist() == sorted({4, 9, tok.eos_id})
    for token in (4, 9, tok.eos_id):
        assert automaton.next_state(automaton.initial, token) == automaton.initial
    with pytest.raises(ValueError, match="not allowed"):
        automaton.next_state(automaton.initial, 5)
    assert decode.compile_constraint(decode.AllowedTokens((4, 9, tok.eos_id)), tok) is automaton
    with pytest.raises(ValueError, match=f"allowed token {tok.vocab_size} is outside"):
        decode.compile_constraint(decode.AllowedTokens([tok.vocab_size]), tok)


def test_a_marian_tokenizer_is_refused_by_name():
    tok = huggingface.load_tokenizer(HF_MODELS / "marian")
    with pytest.raises(ValueError, match="Marian"):
        decode.compile_constraint(decode.Regex("a"), tok)
