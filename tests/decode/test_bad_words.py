"""decode/bad_words.py: which ids a row's bad words ban, against a plain reading of vLLM's
rule, and how a text becomes the token sequences vLLM bans for it."""

import json
import re

import jax
import numpy as np
import pytest

from kvjax.decode.bad_words import banned_by_words, word_ids, words_table


def banned_as_vllm_bans(words, made):
    """vLLM's rule for one row: a word's last id is banned where the tokens the row made
    end with the word's others."""
    banned = set()
    for word in words:
        before = len(word) - 1
        if before <= len(made) and tuple(made[len(made) - before:]) == tuple(word[:-1]):
            banned.add(word[-1])
    return banned


def test_a_word_is_banned_where_the_newest_tokens_made_are_its_others():
    rng = np.random.default_rng(0)
    rows, num_words, word_tokens, capacity = 64, 5, 4, 12
    contexts = np.zeros((rows, capacity), np.int32)
    lengths, generated, tables, cases = [], [], [], []
    for b in range(rows):
        length = int(rng.integers(1, capacity + 1))
        made = int(rng.integers(0, length + 1))
        contexts[b, :length] = rng.integers(0, 4, length)  # few ids: words match often
        context = contexts[b, :length].tolist()
        # Words drawn from the context's end too, so that the rule decides, not chance.
        words = []
        for _ in range(int(rng.integers(0, num_words + 1))):
            size = int(rng.integers(1, word_tokens + 1))
            if rng.random() < 0.5 and size - 1 <= length:
                words.append(context[length - size + 1:] + [int(rng.integers(0, 4))])
            else:
                words.append(rng.integers(0, 4, size).tolist())
        lengths.append(length)
        generated.append(made)
        tables.append(words_table(words, num_words, word_tokens))
        cases.append((words, context[length - made:]))
    got = np.asarray(jax.jit(banned_by_words)(np.stack(tables), contexts, np.array(lengths),
                                              np.array(generated)))
    assert got.shape == (rows, num_words)
    for b, (words, made) in enumerate(cases):
        assert set(got[b][got[b] >= 0].tolist()) == banned_as_vllm_bans(words, made), b
    longer = [(word, made) for words, made in cases for word in words if len(word) > 1]
    matched = sum(bool(banned_as_vllm_bans([word], made)) for word, made in longer)
    assert 10 < matched < len(longer) - 10  # longer words both matched and missed


def spaced_words(text):
    """A tokenizer of whole words, a word after a space one token of its own (as GPT-2's and
    Llama's are): `vocab` numbers the pieces as they come."""
    return [spaced_words.vocab.setdefault(piece, len(spaced_words.vocab))
            for piece in re.findall(r" ?[^ ]+| ", text)]


spaced_words.vocab = {}


def test_a_text_is_banned_alone_and_after_a_space_as_vllm_tokenizes_it():
    ids = {piece: spaced_words(piece)[0] for piece in ("new", " new", "york", " york")}
    assert word_ids(spaced_words, ["new york", "  york"]) == (
        (ids["new"], ids[" york"]), (ids[" new"], ids[" york"]), (ids["york"],),
        (ids[" york"],))

    def one_id_per_character(text):
        return [ord(c) for c in text]

    # After a space the text has one more token: only the word alone is banned.
    assert word_ids(one_id_per_character, ["ab"]) == ((97, 98),)

    def spaces_dropped(text):
        return [ord(c) for c in text if c != " "]

    # After a space it is the same sequence: banned once.
    assert word_ids(spaces_dropped, ["ab"]) == ((97, 98),)
    with pytest.raises(ValueError, match="bad word ' ' has no tokens"):
        word_ids(spaces_dropped, [" "])


def test_generate_never_completes_bad_words_as_transformers_bans_them():
    """A ragged batch through `generate` against what transformers' `generate(bad_words_ids=
    ...)` made on the GPT-2 fixture (tests/fixtures/make_hf_models.py): words drawn from its
    free greedy tokens, one of them a prompt's last token and its first (transformers reads
    the prompt too), one a single token."""
    from pathlib import Path

    from kvjax import decode, hf
    from kvjax import model as M

    directory = Path(__file__).resolve().parents[1] / "fixtures" / "hf_models" / "gpt2"
    record = json.loads((directory / "expected.json").read_text())
    words, want = record["bad_words"]["words"], record["bad_words"]["greedy"]
    config, _, params = hf.load_pretrained(directory)
    got = decode.generate(M.build_model(config), params, record["prompts"], bad_words=words,
                          max_new_tokens=record["max_new_tokens"],
                          eos_ids=(record["eos_id"],)).token_lists()
    assert got == want
    assert all(banned != free for banned, free in zip(want, record["greedy"], strict=True))
    assert want[0][0] != record["greedy"][0][0]  # the word across the prompt's end bit


def test_beam_search_never_completes_bad_words_as_transformers_bans_them():
    """The same words through `beam_search` against transformers' beam search with them (its
    3 beams, `bad_words_ids`) on the GPT-2 fixture; and a word of a prompt's last token and
    the best hypothesis's first, which only the prompt's tokens can complete, bites."""
    from pathlib import Path

    from kvjax import decode, hf
    from kvjax import model as M

    directory = Path(__file__).resolve().parents[1] / "fixtures" / "hf_models" / "gpt2"
    record = json.loads((directory / "expected.json").read_text())
    words, want = record["bad_words"]["words"], record["bad_words"]["beam"]
    config, _, params = hf.load_pretrained(directory)
    net, prompts = M.build_model(config), record["prompts"]

    def searched(bad_words):
        return decode.beam_search(net, params, prompts, bad_words=bad_words,
                                  num_beams=record["num_beams"],
                                  max_new_tokens=record["max_new_tokens"],
                                  eos_ids=(record["eos_id"],)).token_lists()

    assert searched(words) == want
    assert want[1:] != record["beam"][1:]  # two rows' best hypotheses held words
    across = [[prompts[0][-1], record["beam"][0][0]]]
    assert searched(across)[0][0] != record["beam"][0][0]
