"""kvjax/docs_tokenizer/token_bytes.py: the bytes of each tokenizer's tokens spell what it decodes
them to, and its special tokens spell nothing."""

from pathlib import Path

import pytest

from kvjax.tokenizer import huggingface

ROOT = Path(__file__).resolve().parents[2]
HF_MODELS = ROOT / "tests" / "fixtures" / "hf_models"


def test_sentencepiece_tokens_spell_what_they_decode_to(docs_tokenizer):
    pieces = docs_tokenizer.token_bytes()
    ids = docs_tokenizer.encode("for x in range(10):\n    print(x, 'é')  # ünïcode")
    assert b"".join(pieces[i] for i in ids).decode() == docs_tokenizer.decode(ids)
    assert [pieces[i] for i in (0, 1, 2, 3)] == [None] * 4


@pytest.mark.parametrize("directory", [
    HF_MODELS / "gpt2", HF_MODELS / "qwen3", HF_MODELS / "llama_gqa",
    ROOT / "tests" / "fixtures" / "hf_tokenizers" / "byte_bpe_bos",
    ROOT / "tests" / "fixtures" / "hf_tokenizers" / "spm_bpe"], ids=lambda d: d.name)
def test_hugging_face_tokens_spell_what_they_decode_to(directory):
    tok = huggingface.load_tokenizer(directory)
    pieces = tok.token_bytes()
    ids = tok.encode("Hello, wörld! 12 + 3 = 15\n\tdef f(): return 'ok'")
    spelled = b"".join(pieces[i] for i in ids).decode()
    # A Llama-2-style decoder drops the one space its Metaspace put in front.
    assert spelled in (tok.decode(ids), " " + tok.decode(ids))
    assert all(pieces[i] is None for i in tok.stop_ids)
