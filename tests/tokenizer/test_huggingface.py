"""Tokenizers of Hugging Face directories (kvjax.tokenizer.huggingface) against transformers.

tests/fixtures/hf_tokenizers/ holds tiny tokenizer directories in the Hugging Face layout,
each with an expected.json of what transformers' AutoTokenizer gives for it (written by
tests/fixtures/make_hf_tokenizers.py, which the last test reruns where transformers is
installed). transformers itself is not needed here.
"""

import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from kvjax import decode, detokenize, text
from kvjax import model as M
from kvjax.tokenizer import EOS_ID, TextTokenizer, Tokenizer, tokenizer_from_bytes
from kvjax.tokenizer.huggingface import HFTokenizer, load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_tokenizers"
NAMES = ("byte_bpe", "byte_bpe_bos", "spm_bpe", "spm_unigram", "marian", "byte_bpe_files",
         "nllb", "bart", "mbart", "mbart50", "m2m100")
OWN = Path(__file__).resolve().parents[2] / "checkpoints" / "python-docs-lm"
# Characters spelled by several tokens each (rare in the fixtures' training text).
MULTIBYTE = "ŧħæŧ 한국어 👨‍👩‍👧 ok 中文"


def expected(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text(encoding="utf-8"))


def has_tokenizers() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def all_loaded() -> dict[str, HFTokenizer]:
    """Every fixture's tokenizer that can be read here: all but Marian and M2M100 need
    `tokenizers`."""
    return {name: load_tokenizer(FIXTURES / name) for name in NAMES
            if name in ("marian", "m2m100") or has_tokenizers()}


@pytest.fixture
def loaded(all_loaded) -> dict[str, HFTokenizer]:
    if len(all_loaded) < len(NAMES):
        pytest.skip("the tokenizers package is not installed")
    return all_loaded


def one(all_loaded, name: str) -> HFTokenizer:
    if name not in all_loaded:
        pytest.skip("the tokenizers package is not installed")
    return all_loaded[name]


@pytest.fixture(scope="module")
def own() -> Tokenizer:
    return Tokenizer.load(OWN / "tokenizer.model")


def one_line_error(excinfo, *parts: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message


@pytest.mark.parametrize("name", NAMES)
def test_ids_are_transformers_ids(all_loaded, name):
    tokenizer, want = one(all_loaded, name), expected(name)
    for text_, ids, framed in zip(want["texts"], want["ids"], want["ids_with_special_tokens"],
                                  strict=True):
        assert tokenizer.encode(text_) == ids, repr(text_)
        # What transformers adds with add_special_tokens=True is the prefix and suffix.
        framed_here = [*tokenizer.document_prefix, *ids, *tokenizer.source_suffix]
        assert framed_here == framed, repr(text_)


@pytest.mark.parametrize("name", NAMES)
def test_decoding_is_transformers_decoding(all_loaded, name):
    tokenizer, want = one(all_loaded, name), expected(name)
    for framed, decoded in zip(want["ids_with_special_tokens"], want["decoded"], strict=True):
        assert tokenizer.decode(framed) == decoded
    for ids, decoded in zip(want["random_ids"], want["random_decoded"], strict=True):
        assert tokenizer.decode(ids) == decoded, ids
    round_trips = [t for t, d in zip(want["texts"], want["decoded"], strict=True) if t == d]
    assert len(round_trips) >= 5
    for text_ in round_trips:
        assert tokenizer.decode(tokenizer.encode(text_)) == text_


@pytest.mark.parametrize("name", NAMES)
def test_decoding_with_special_tokens_is_transformers_or_refused(all_loaded, name):
    """vLLM's skip_special_tokens=false: transformers' decode keeping them, where the
    `tokenizers` library decodes (every fixture but the two sentencepiece-only ones)."""
    tokenizer, want = one(all_loaded, name), expected(name)
    ids = want["ids_with_special_tokens"] + want["random_ids"]
    texts = want["decoded_with_special_tokens"] + want["random_decoded_with_special_tokens"]
    if name in ("marian", "m2m100"):
        with pytest.raises(ValueError, match="decodes text without its special tokens only"):
            tokenizer.decode(ids[0], skip_special_tokens=False)
        return
    assert texts != want["decoded"] + want["random_decoded"]  # some special token shows
    for row, text_ in zip(ids, texts, strict=True):
        assert tokenizer.decode(row, skip_special_tokens=False) == text_, row


@pytest.mark.parametrize("name", NAMES)
def test_pieces_are_transformers_tokens(all_loaded, name):
    tokenizer, want = one(all_loaded, name), expected(name)
    for ids, pieces in zip(want["ids_with_special_tokens"] + want["random_ids"],
                           want["pieces"] + want["random_pieces"], strict=True):
        assert tokenizer.pieces(ids) == pieces, ids
    with pytest.raises(ValueError, match=f"token id {tokenizer.vocab_size} is outside"):
        tokenizer.pieces([tokenizer.vocab_size])


@pytest.mark.parametrize("name", NAMES)
def test_special_ids_and_vocab_size(all_loaded, name):
    tokenizer, want = one(all_loaded, name), expected(name)
    assert isinstance(tokenizer, TextTokenizer)
    specials = want["special_ids"]
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unk_id) == (
        specials["bos"], specials["eos"], specials["pad"], specials["unk"])
    assert tokenizer.vocab_size == want["length"]
    assert tokenizer.stop_ids[0] == tokenizer.eos_id
    for bad in (-1, tokenizer.vocab_size):
        with pytest.raises(ValueError, match=f"token id {bad} is outside") as excinfo:
            tokenizer.decode([5, bad])
        one_line_error(excinfo)


def test_what_frames_a_prompt(loaded, own):
    frames = {name: (t.document_prefix, t.source_suffix, t.stop_ids)
              for name, t in loaded.items()}
    # A source is framed as a text is: only NLLB, mBART-50 and M2M100 put something first
    # (their language's code), BART its <s>.
    assert {name: t.source_prefix for name, t in loaded.items()} == {
        name: frames[name][0] for name in loaded}
    assert frames["byte_bpe"] == ((), (), (0,))  # GPT-2 adds nothing; <|endoftext|> ends
    bos = loaded["byte_bpe_bos"]
    # Llama 3: the post-processor's BOS; generation_config.json's two end ids.
    assert frames["byte_bpe_bos"] == ((bos.bos_id,), (), (bos.eos_id, bos.eos_id + 1))
    assert frames["spm_bpe"] == ((1,), (), (2,))  # add_bos_token: true
    assert frames["spm_unigram"] == ((), (), (2,))  # no add_bos_token: transformers 5 adds none
    assert frames["marian"] == ((), (0,), (0,))
    assert frames["byte_bpe_files"] == ((2,), (), (2,))  # OPT: </s> first and last
    nllb = loaded["nllb"]
    assert frames["nllb"] == ((nllb.encode("deu_Latn")[0],), (2,), (2,))  # src_lang deu_Latn
    assert frames["bart"] == ((0,), (2,), (2,))  # RoBERTa's <s> ... </s>
    # mBART: </s> and the source language's code (de_DE) after a text; mBART-50: the code
    # before it, </s> after.
    assert frames["mbart"] == ((), (2, loaded["mbart"].encode("de_DE")[0]), (2,))
    assert frames["mbart50"] == ((loaded["mbart50"].encode("de_DE")[0],), (2,), (2,))
    assert frames["m2m100"] == ((loaded["m2m100"].encode("__de__")[0],), (2,), (2,))
    assert (own.document_prefix, own.source_suffix, own.stop_ids) == ((EOS_ID,),) * 3
    assert own.source_prefix == ()


@pytest.mark.parametrize("name", NAMES)
def test_bytes_round_trip(all_loaded, name):
    tokenizer, want = one(all_loaded, name), expected(name)
    data = tokenizer.to_bytes()
    assert json.loads(data)["format"] == "kvjax-hf-tokenizer"
    again = tokenizer_from_bytes(data)
    assert isinstance(again, HFTokenizer) and again.to_bytes() == data
    for text_ in want["texts"]:
        assert again.encode(text_) == tokenizer.encode(text_)
    for ids in want["random_ids"]:
        assert again.decode(ids) == tokenizer.decode(ids)
    fields = ("vocab_size", "pad_id", "bos_id", "eos_id", "stop_ids", "document_prefix",
              "source_prefix", "source_suffix")
    assert [getattr(again, f) for f in fields] == [getattr(tokenizer, f) for f in fields]


def test_own_tokenizer_keeps_its_bytes(own):
    data = own.to_bytes()
    assert data == (OWN / "tokenizer.model").read_bytes()
    again = tokenizer_from_bytes(data)
    assert isinstance(again, Tokenizer) and isinstance(again, TextTokenizer)
    assert again.encode("The for statement") == own.encode("The for statement")


@pytest.mark.parametrize("name", ["byte_bpe", "spm_bpe"])
def test_streaming_never_shows_a_broken_character(all_loaded, name):
    tokenizer = one(all_loaded, name)
    ids = tokenizer.encode(MULTIBYTE)
    partial = [tokenizer.decode(ids[:k]) for k in range(1, len(ids))]
    assert any(p.endswith("\ufffd") for p in partial)  # some character is really split
    row = detokenize.RowText(tokenizer, ())
    pieces = [row.add([i]) for i in ids + [tokenizer.eos_id] + ids]
    row.finish(row.ids)
    pieces.append(row.text[len(row.sent):])
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == row.text == MULTIBYTE  # and nothing after the stop id


def loaded_model(tokenizer, translation: bool) -> text.LoadedModel:
    config = SimpleNamespace(is_encoder_decoder=translation)
    return text.LoadedModel(config, tokenizer, params=None, directory="")


def test_prompt_tokens_follow_the_tokenizer(loaded, own, tmp_path):
    for tokenizer in [own, *loaded.values()]:
        ids = tokenizer.encode("Hello world")
        assert text.prompt_tokens(loaded_model(tokenizer, False), "Hello world") == [
            *tokenizer.document_prefix, *ids]
        assert text.prompt_tokens(loaded_model(tokenizer, True), "Hello world") == [
            *tokenizer.source_prefix, *ids, *tokenizer.source_suffix]
    assert text.prompt_tokens(loaded_model(own, False), "") == [EOS_ID]
    assert text.prompt_tokens(loaded_model(loaded["byte_bpe"], False), "") == [0]  # BOS
    no_bos = tmp_path / "no_bos"
    shutil.copytree(FIXTURES / "byte_bpe", no_bos)
    config = json.loads((no_bos / "tokenizer_config.json").read_text())
    (no_bos / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": None}))
    with pytest.raises(ValueError, match="empty prompt needs a BOS"):
        text.prompt_tokens(loaded_model(load_tokenizer(no_bos), False), "")


def test_nllb_frames_a_text_by_its_config_not_by_the_files_template(all_loaded, tmp_path):
    """transformers builds NLLB's pipeline in code from the file's vocabulary, merges and
    charsmap: a tokenizer.json written with another pre-tokenizer and template (an older
    file's: the code last, for English) gives the fixture's ids all the same; the source
    language and `legacy_behaviour` of tokenizer_config.json frame a text."""
    nllb = one(all_loaded, "nllb")
    directory = tmp_path / "nllb"
    shutil.copytree(FIXTURES / "nllb", directory)
    file = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    file["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                             "prepend_scheme": "first", "split": False}
    file["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}},
        {"SpecialToken": {"id": "eng_Latn", "type_id": 0}}], "pair": [], "special_tokens": {
        name: {"id": name, "ids": nllb.encode(name), "tokens": [name]}
        for name in ("</s>", "eng_Latn")}}
    (directory / "tokenizer.json").write_text(json.dumps(file), encoding="utf-8")
    older = load_tokenizer(directory)
    want = expected("nllb")
    assert [older.encode(t) for t in want["texts"]] == want["ids"]
    assert (older.source_prefix, older.source_suffix) == (nllb.source_prefix, (2,))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    french = nllb.encode("fra_Latn")
    for changes, framing in (({"src_lang": "fra_Latn"}, (french, [2])),
                             ({"src_lang": "fra_Latn", "legacy_behaviour": True},
                              ([], [2, *french]))):
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))
        framed = load_tokenizer(directory)
        assert (list(framed.source_prefix), list(framed.source_suffix)) == framing
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "src_lang": "xx"}))
    with pytest.raises(ValueError, match="src_lang 'xx' is not a token of the vocabulary"):
        load_tokenizer(directory)


def test_m2m100_numbers_its_language_codes_after_the_vocabulary_as_special_tokens(
        all_loaded, tmp_path):
    """Each `__xx__` of `language_codes` is one special token, numbered after vocab.json's
    ids in the codes' order, whether or not the files list it (transformers 5 writes them
    unlisted); `src_lang` starts a source."""
    from kvjax.tokenizer.m2m100 import LANGUAGE_CODES

    m2m = one(all_loaded, "m2m100")
    directory = tmp_path / "m2m100"
    shutil.copytree(FIXTURES / "m2m100", directory)
    first = len(json.loads((directory / "vocab.json").read_text(encoding="utf-8")))
    french = first + LANGUAGE_CODES["m2m100"].index("fr")
    assert m2m.vocab_size == first + 100
    assert m2m.encode("__fr__ Hello world") == [french, *m2m.encode(" Hello world")]
    assert m2m.decode([french, *m2m.encode("Hello world"), 2]) == "Hello world"
    (directory / "special_tokens_map.json").unlink()  # as transformers 5 saves it
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for changes, prefix in (({}, first + LANGUAGE_CODES["m2m100"].index("de")),
                            ({"src_lang": "fr"}, french), ({"src_lang": None}, first + 18),
                            ({"language_codes": "wmt21"}, first + 7)):
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))
        unlisted = load_tokenizer(directory)
        assert (unlisted.source_prefix, unlisted.source_suffix) == ((prefix,), (2,))
        assert unlisted.encode("__de__") == [first + 7 if changes.get("language_codes")
                                             else first + 16]
    for changes, message in (({"src_lang": "xx"}, "src_lang 'xx' is not one of its m2m100"),
                             ({"language_codes": "all"}, "language_codes 'all' is not one of"),
                             ({"tokenizer_class": "XGLMTokenizer"},
                              "read for an M2M100Tokenizer only")):
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(ValueError, match=message) as excinfo:
            load_tokenizer(directory)
        one_line_error(excinfo, str(directory))


def test_bart_frames_a_text_as_roberta_whatever_the_files_template(all_loaded, tmp_path):
    """transformers' BartTokenizer (RoBERTa's) builds its pipeline in code from the file's
    vocabulary and merges, as NLLB's does: another pre-tokenizer and template in the file
    change nothing."""
    directory = tmp_path / "bart"
    shutil.copytree(FIXTURES / "bart", directory)
    file = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    file["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True,
                             "trim_offsets": True, "use_regex": True}
    file["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}}],
        "pair": [], "special_tokens": {"</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}}
    (directory / "tokenizer.json").write_text(json.dumps(file), encoding="utf-8")
    older, want = load_tokenizer(directory), expected("bart")
    assert older.tokenizer_class == "RobertaTokenizer"
    assert [older.encode(t) for t in want["texts"]] == want["ids"]
    assert (older.document_prefix, older.source_suffix) == ((0,), (2,))


@pytest.mark.parametrize("name", ["mbart", "mbart50"])
def test_mbart_frames_a_text_by_its_config_not_by_the_files_pipeline(all_loaded, tmp_path,
                                                                     name):
    """transformers builds mBART's and mBART-50's pipelines in code from the file's unigram
    vocabulary and charsmap: a tokenizer.json written with another normalizer, pre-tokenizer
    and template (an older converter's: runs of spaces left alone, the code of en_XX) gives
    the fixture's ids all the same; tokenizer_config.json's source language frames a text."""
    tokenizer = one(all_loaded, name)
    directory = tmp_path / name
    shutil.copytree(FIXTURES / name, directory)
    file = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    kept = [step for step in (file["normalizer"] or {}).get("normalizers", [])
            if step["type"] == "Precompiled"]
    file["normalizer"] = {"type": "Sequence", "normalizers": kept}
    file["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                             "prepend_scheme": "first", "split": False}
    file["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "en_XX", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [], "special_tokens": {"en_XX": {"id": "en_XX", "ids": tokenizer.encode("en_XX"),
                                                 "tokens": ["en_XX"]}}}
    (directory / "tokenizer.json").write_text(json.dumps(file), encoding="utf-8")
    older, want = load_tokenizer(directory), expected(name)
    assert [older.encode(t) for t in want["texts"]] == want["ids"]
    assert (older.source_prefix, older.source_suffix) == (tokenizer.source_prefix,
                                                          tokenizer.source_suffix)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "src_lang": None}))
    english = tuple(tokenizer.encode("en_XX"))  # the default source language
    framed = load_tokenizer(directory)
    assert (framed.source_prefix, framed.source_suffix) == (
        (english, (2,)) if name == "mbart50" else ((), (2, *english)))
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "src_lang": "xx"}))
    with pytest.raises(ValueError, match="src_lang 'xx' is not a token of the vocabulary"):
        load_tokenizer(directory)


def test_sampling_streams_and_stops_through_the_interface(all_loaded):
    tokenizer = one(all_loaded, "spm_bpe")
    config = M.preset("tiny", vocab_size=tokenizer.vocab_size)
    params = M.init_params(config, jax.random.key(0))
    lm = text.LoadedModel(config, tokenizer, params, "")
    pieces = []
    result = text.sample_text(lm, "Hello", max_new_tokens=24, seed=3,
                              sampling=decode.Sampling(temperature=1.0),
                              on_text=pieces.append)
    assert "".join(pieces) == result.text
    ends = [k for k, i in enumerate(result.tokens) if i in tokenizer.stop_ids]
    assert result.text == tokenizer.decode(result.tokens[:ends[0]] if ends else result.tokens)
    assert result.stop_reason == ("eos" if ends else "max_new_tokens")


def test_directories_without_a_usable_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        load_tokenizer(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError) as excinfo:
        load_tokenizer(empty)
    one_line_error(excinfo, str(empty), "tokenizer.json", "tokenizer.model", "source.spm")
    cases = {
        "bad_json": ("byte_bpe", "tokenizer.json", b'{"model": 3}'),
        "bad_model": ("spm_bpe", "tokenizer.model", b"not a sentencepiece model"),
        "bad_config": ("spm_bpe", "tokenizer_config.json", b"[1, 2"),
        "bad_spm": ("marian", "source.spm", b"\x00\x01"),
    }
    for case, (source, name, content) in cases.items():
        if source != "marian" and not has_tokenizers():
            continue
        directory = tmp_path / case
        shutil.copytree(FIXTURES / source, directory)
        (directory / name).write_bytes(content)
        with pytest.raises(ValueError) as excinfo:
            load_tokenizer(directory)
        one_line_error(excinfo, str(directory))
    if not has_tokenizers():
        return
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    shutil.copy(FIXTURES / "spm_bpe" / "tokenizer.model", unnamed)
    with pytest.raises(ValueError, match="LlamaTokenizer only") as excinfo:
        load_tokenizer(unnamed)
    one_line_error(excinfo, str(unnamed))


def test_bad_bundles_are_one_line_errors():
    for data in (b"{not json", b'{"format": "something else"}', b"{}",
                 b'{"format": "kvjax-hf-tokenizer", "version": 1, "kind": "x", '
                 b'"tokenizer_class": "y", "files": {}}'):
        with pytest.raises(ValueError) as excinfo:
            tokenizer_from_bytes(data)
        one_line_error(excinfo, "kvjax-hf-tokenizer")
    with pytest.raises(ValueError, match="sentencepiece"):
        tokenizer_from_bytes(b"\x0a\x03abc")


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_fixtures_are_what_transformers_computes(tmp_path):
    transformers = pytest.importorskip("transformers")
    # Tokenizers' outputs change between transformers releases (added-token handling,
    # cleanup of spaces): the fixtures are what the release that wrote them computes.
    written_by = {expected(name)["transformers_version"] for name in NAMES}
    if written_by != {transformers.__version__}:
        pytest.skip(f"the fixtures were written by transformers {sorted(written_by)}, this "
                    f"is {transformers.__version__}")
    script = FIXTURES.parent / "make_hf_tokenizers.py"
    spec = importlib.util.spec_from_file_location("make_hf_tokenizers", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path / "fresh")
    for name in NAMES:
        fresh = json.loads((tmp_path / "fresh" / name / "expected.json").read_text("utf-8"))
        assert fresh == expected(name), name
