"""The encoder-decoders' own ways against transformers' (the fixtures of
tests/fixtures/hf_models, equal to transformers in tests/hf/test_hf_models.py): a target
language forced first (NLLB, M2M100, mBART-50), on the command line too; files that leave
out what transformers fills in."""


import numpy as np
import pytest
from conftest import run_cli
from test_hf_models import (
    FIXTURES,
    copy_of,
    edit_config,
    expected,
    generation_settings,
    rewrite_tensor,
)

from kvjax import decode, hf, text
from kvjax import model as M
from kvjax.tokenizer import tokenizer_from_bytes
from kvjax.tokenizer.huggingface import load_tokenizer


def test_a_forced_first_token_leads_the_target_as_in_transformers():
    """NLLB and M2M100 are told the target language by its token, forced first after the
    decoder's start (transformers' `forced_bos_token_id`): by a `StartsWith` constraint, in
    beam search too, where the forced token adds 0 to a beam's score."""
    config, tokenizer, params = hf.load_pretrained(FIXTURES / "m2m_100")
    record, _ = expected("m2m_100")
    net = M.build_model(config)
    forced = record["forced_first"]
    assert record["forced_greedy"] != [[forced, *g[:-1]] for g in record["greedy"]]
    starts = decode.compile_constraint(decode.StartsWith((forced,)), tokenizer,
                                       end_id=record["eos_id"])
    greedy = decode.generate(net, params, record["prompts"], constraint=starts,
                             **generation_settings(record))
    assert greedy.token_lists() == record["forced_greedy"]
    beam = decode.beam_search(net, params, record["prompts"], num_beams=record["num_beams"],
                              constraint=starts, **generation_settings(record))
    assert beam.token_lists() == record["forced_beam"] != record["forced_greedy"]
    # The forced token adds 0 to a beam's score, as transformers' forced token does, and an
    # end among the candidates past the best 3 finishes no hypothesis; the scores are
    # transformers' `sequences_scores`.
    for search in record["forced_beams"]:
        starts = decode.compile_constraint(decode.StartsWith((search["forced"],)), tokenizer,
                                           end_id=search["eos_id"])
        beam = decode.beam_search(net, params, record["prompts"], num_beams=record["num_beams"],
                                  constraint=starts, max_new_tokens=6,
                                  eos_ids=(search["eos_id"],))
        assert beam.token_lists() == search["beam"]
        np.testing.assert_allclose(beam.scores, search["scores"], rtol=1e-5)


def test_the_command_line_translates_into_the_target_language_it_is_given(capsys):
    directory = FIXTURES / "m2m_100"
    loaded = text.load(directory)
    (forced,) = loaded.tokenizer.encode("a")  # one piece of the fixture's tokenizer
    want = text.sample_text(loaded, "Hello world", max_new_tokens=6, num_beams=3,
                            constraint=decode.StartsWith((forced,)))
    assert want.tokens[0] == forced
    code, out, err = run_cli(capsys, "sample", "--checkpoint", directory, "--prompt",
                             "Hello world", "--max-new-tokens", 6, "--beams", 3,
                             "--target-language", "a")
    assert code == 0, err
    assert out.splitlines()[0] == "Hello world -> " + want.text
    for checkpoint, code_text, message in (("gpt2", "a", "is a translator's"),
                                           ("m2m_100", "Hello", "is not one token")):
        code, out, err = run_cli(capsys, "sample", "--checkpoint", FIXTURES / checkpoint,
                                 "--prompt", "x", "--target-language", code_text)
        assert code == 2 and out == "" and message in err, err


def test_a_first_token_the_generation_config_forces_starts_every_sampled_target(tmp_path):
    """transformers' `generate` forces the generation config's `forced_bos_token_id` first
    (BART-large-CNN's `<s>`, a one-direction NLLB's language), from generation_config.json,
    else config.json: `text` sampling does too, unless another constraint is given."""
    record, _ = expected("m2m_100")
    forced = record["forced_first"]
    directory = copy_of("m2m_100", tmp_path)
    edit_config(directory, "generation_config.json", forced_bos_token_id=forced)
    edit_config(directory, forced_bos_token_id=forced + 1)  # the generation config wins
    loaded, plain = text.load(directory), text.load(FIXTURES / "m2m_100")
    assert (loaded.tokenizer.target_prefix, plain.tokenizer.target_prefix) == ((forced,), ())
    bundled = tokenizer_from_bytes(loaded.tokenizer.to_bytes())
    assert bundled.target_prefix == (forced,)  # an import-hf checkpoint keeps it
    (directory / "generation_config.json").unlink()
    assert load_tokenizer(directory).target_prefix == (forced + 1,)

    source = "Hello world"
    unforced = text.sample_text(plain, source, max_new_tokens=6)
    want = text.sample_text(plain, source, max_new_tokens=6,
                            constraint=decode.StartsWith((forced,)))
    got = text.sample_text(loaded, source, max_new_tokens=6)
    assert got.tokens == want.tokens != unforced.tokens and got.tokens[0] == forced
    (code,) = loaded.tokenizer.encode("a")
    asked = text.sample_text(loaded, source, max_new_tokens=6,
                             constraint=decode.StartsWith((code,)))
    assert asked.tokens[0] == code
    edit_config(directory, forced_bos_token_id=10**6)
    with pytest.raises(ValueError, match="forced_bos_token_id 1000000 is not a token id"):
        load_tokenizer(directory)


@pytest.mark.parametrize("name", ["marian", "mbart"])
def test_an_end_forced_at_the_budget_ends_every_target_as_in_transformers(name):
    """transformers' `forced_eos_token_id` (Marian's releases set it): a target that reaches
    its budget ends with the token, in greedy and beam search, where a forced end adds 0 to
    a beam's score, so that another beam may win than the one cut at the budget."""
    config, _, params = hf.load_pretrained(FIXTURES / name)
    record, _ = expected(name)
    forced = record["forced_end"]
    net, eos, budget = M.build_model(config), record["eos_id"], forced["max_new_tokens"]
    settings = dict(max_new_tokens=budget, eos_ids=(eos,))
    greedy = decode.generate(net, params, record["prompts"], forced_end_id=eos, **settings)
    assert greedy.token_lists() == forced["greedy"]
    assert "max_new_tokens" in greedy.stop_reasons()
    beam = decode.beam_search(net, params, record["prompts"], num_beams=record["num_beams"],
                              forced_end_id=eos, **settings)
    assert beam.token_lists() == forced["beam"]
    assert [r for r, t in zip(beam.stop_reasons(), forced["beam"], strict=True)
            if len(t) == budget] == ["max_new_tokens"] * sum(len(t) == budget
                                                             for t in forced["beam"])
    cut = decode.beam_search(net, params, record["prompts"], num_beams=record["num_beams"],
                             **settings).token_lists()
    assert forced["beam"] != [t if len(t) < budget else t[:-1] + [eos] for t in cut]


def test_banned_tokens_are_never_made_as_in_transformers():
    """transformers' one-token `bad_words_ids` (Marian's releases ban their pad): greedy and
    beam search pass over the banned ids, which the model makes unbanned."""
    config, _, params = hf.load_pretrained(FIXTURES / "marian")
    record, _ = expected("marian")
    banned = record["banned"]
    net, settings = M.build_model(config), generation_settings(record)
    assert any(set(banned["ids"]) & set(g) for g in record["greedy"])
    greedy = decode.generate(net, params, record["prompts"], banned_ids=banned["ids"],
                             **settings)
    assert greedy.token_lists() == banned["greedy"]
    beam = decode.beam_search(net, params, record["prompts"], num_beams=record["num_beams"],
                              banned_ids=banned["ids"], **settings)
    assert beam.token_lists() == banned["beam"] != banned["greedy"]


def test_a_generation_config_that_forces_an_end_ends_sampled_targets_with_it(tmp_path):
    """`text` sampling forces the end a generation config names (config.json's where there
    is no generation_config.json, as transformers reads it); one it cannot force is refused
    by name."""
    record, _ = expected("marian")
    eos, budget = record["eos_id"], record["forced_end"]["max_new_tokens"]
    directory = copy_of("marian", tmp_path)
    source = "Hello world"
    plain = text.sample_text(text.load(directory), source, max_new_tokens=budget)
    assert len(plain.tokens) == budget and plain.tokens[-1] != eos
    edit_config(directory, "generation_config.json", forced_eos_token_id=eos)
    for beams in (1, 3):
        want = decode.beam_search if beams > 1 else decode.generate
        loaded = text.load(directory)
        got = text.sample_text(loaded, source, max_new_tokens=budget, num_beams=beams)
        kwargs = {"num_beams": beams} if beams > 1 else {}
        direct = want(loaded.net, loaded.params, [text.prompt_tokens(loaded, source)],
                      max_new_tokens=budget, eos_ids=loaded.tokenizer.stop_ids,
                      forced_end_id=eos, **kwargs)
        assert got.tokens == direct.token_lists()[0] and got.tokens[-1] == eos
        assert got.stop_reason == "max_new_tokens"
    (directory / "generation_config.json").unlink()
    edit_config(directory, forced_eos_token_id=eos)
    assert load_tokenizer(directory).forced_end == eos
    assert tokenizer_from_bytes(load_tokenizer(directory).to_bytes()).forced_end == eos
    edit_config(directory, forced_eos_token_id=[eos, 1])
    with pytest.raises(ValueError, match=r"forced_eos_token_id \[0, 1\]: kvjax forces one"):
        load_tokenizer(directory)


def test_the_tokens_a_generation_config_bans_are_never_sampled(tmp_path):
    """`text` sampling (and `kvjax serve`, test_protocol.py) bans a generation config's
    `bad_words_ids` (config.json's where there is no generation_config.json)."""
    directory = copy_of("marian", tmp_path)
    source = "Hello world"
    plain = text.sample_text(text.load(directory), source, max_new_tokens=8)
    banned = list(dict.fromkeys(plain.tokens))[:2]  # ids the model makes unbanned
    edit_config(directory, "generation_config.json", bad_words_ids=[[i] for i in banned])
    loaded = text.load(directory)
    assert loaded.tokenizer.banned_ids == tuple(banned)
    direct = decode.generate(loaded.net, loaded.params, [text.prompt_tokens(loaded, source)],
                             max_new_tokens=8, eos_ids=loaded.tokenizer.stop_ids,
                             banned_ids=banned)
    for beams in (1, 3):
        got = text.sample_text(loaded, source, max_new_tokens=8, num_beams=beams)
        assert not set(got.tokens) & set(banned)
    assert text.sample_text(loaded, source, max_new_tokens=8).tokens == direct.token_lists()[0]
    (directory / "generation_config.json").unlink()
    edit_config(directory, bad_words_ids=[[banned[0]]])
    assert tokenizer_from_bytes(load_tokenizer(directory).to_bytes()).banned_ids == (banned[0],)
    # A word of several tokens: its last never after the others, as `generate` and
    # `beam_search` ban it.
    word = plain.tokens[1:3]
    edit_config(directory, bad_words_ids=[word])
    loaded = text.load(directory)
    assert (loaded.tokenizer.banned_ids, loaded.tokenizer.bad_words) == ((), (tuple(word),))
    direct = decode.generate(loaded.net, loaded.params, [text.prompt_tokens(loaded, source)],
                             max_new_tokens=8, eos_ids=loaded.tokenizer.stop_ids,
                             bad_words=[word])
    sampled = text.sample_text(loaded, source, max_new_tokens=8)
    assert sampled.tokens == direct.token_lists()[0] != plain.tokens
    searched = decode.beam_search(loaded.net, loaded.params, [text.prompt_tokens(loaded, source)],
                                  max_new_tokens=8, num_beams=3,
                                  eos_ids=loaded.tokenizer.stop_ids, bad_words=[word])
    assert text.sample_text(loaded, source, max_new_tokens=8,
                            num_beams=3).tokens == searched.token_lists()[0]
    best = searched.token_lists()[0]
    assert all(best[i:i + 2] != word for i in range(len(best)))


@pytest.mark.parametrize("name", ["marian", "bart"])
def test_files_without_the_logits_bias_load_it_as_zeros(tmp_path, name):
    # transformers reads such files (its own bias of zeros, `_keys_to_ignore_on_load_missing`)
    directory = copy_of(name, tmp_path)
    rewrite_tensor(directory / "model.safetensors", "final_logits_bias", lambda v: None)
    config, _, params = hf.load_pretrained(directory)
    assert config.logits_bias and not np.any(np.asarray(params["embedder"]["logits_bias"]))


def test_mbart_without_a_decoder_start_decodes_from_bos_as_transformers_generate(tmp_path):
    directory = copy_of("mbart", tmp_path)
    edit_config(directory, decoder_start_token_id=None, bos_token_id=5)
    assert hf.load_model(directory)[0].bos_id == 5
