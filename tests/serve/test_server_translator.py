"""The server in front of a translator (an encoder-decoder), in-process on 127.0.0.1: each
prompt of a completion is a source, translated as `kvjax sample` translates it alone, into
the target language asked (the protocol's rules for it are in test_protocol.py)."""

import json
import shutil
from pathlib import Path

import httpx
from conftest import SHIPPED_LM, serve_app

from kvjax import decode, text
from kvjax.serve.server import build_app

TIMEOUT = 30.0
M2M = Path(__file__).resolve().parents[1] / "fixtures" / "hf_models" / "m2m_100"


def test_a_translator_answers_completions_as_kvjax_sample_does():
    """The shipped encoder-decoder: each prompt of a request is a source, translated as
    `text.sample_text` translates it alone; its prompt has no logprobs and it has no chat."""
    numbers = text.load(SHIPPED_LM.parent / "numbers-to-words")
    # The engine of test_engine_encoder_decoder.py's greedy test, whose programs the
    # suite's shared compilation cache then holds for both.
    app = build_app(numbers, max_slots=2, max_queue=8, chunk_size=4, prefill_batch=2,
                    max_len=32, max_source_len=12)
    url, stop = serve_app(app, TIMEOUT)
    sources = ["4021", "90", "1000017"]
    try:
        def post(route, **body):
            return httpx.post(f"{url}/v1/{route}", json={"model": "numbers-to-words", **body},
                              timeout=TIMEOUT)

        answer = post("completions", prompt=sources, max_tokens=24, temperature=0).json()
        scored = post("completions", prompt="12", max_tokens=1, echo=True, logprobs=1)
        ranked = post("completions", prompt="12", max_tokens=1, prompt_logprobs=1)
        chat = post("chat/completions", messages=[{"role": "user", "content": "12"}])
    finally:
        stop()
    alone = [text.sample_text(numbers, s, max_new_tokens=24).text for s in sources]
    assert [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])] == alone
    assert alone[0] == "four thousand twenty-one"
    assert answer["usage"]["prompt_tokens"] == sum(
        len(text.prompt_tokens(numbers, s)) for s in sources)
    for refused in (scored, ranked):
        assert refused.status_code == 400 and "its tokens have no logprobs" in refused.text
    assert chat.status_code == 400 and "it has no chat" in chat.text


def test_a_translators_target_starts_with_the_language_asked_or_the_servers_default(tmp_path):
    """NLLB and M2M100 are told the target language by its token, first in the target
    (transformers' `forced_bos_token_id`, which tests/hf/test_encoder_decoders.py holds
    `decode.StartsWith` equal to): a request's `target_language`, else the server's
    (`kvjax serve --target-language`), else the one its generation config forces."""
    directory = tmp_path / "m2m_100"  # a tiny random M2M100, whose generation config forces
    shutil.copytree(M2M, directory)   # token 7 (one-token "codes" stand for languages below)
    config = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps(
        {**config, "forced_bos_token_id": 7}))
    m2m = text.load(directory)
    sources = ["Hello world", "in are"]

    def served(target_language, *asked):
        app = build_app(m2m, max_slots=2, max_queue=8, chunk_size=4, prefill_batch=2,
                        max_len=16, target_language=target_language)
        url, stop = serve_app(app, TIMEOUT)
        try:
            return [translations(url, fields) for fields in asked]
        finally:
            stop()

    def translations(url, fields):
        answer = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT, json={
            "model": "m2m_100", "prompt": sources, "max_tokens": 6, "temperature": 0,
            **fields}).json()
        return [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]

    def alone(first):
        starts = decode.StartsWith((first,))
        results = [text.sample_text(m2m, s, max_new_tokens=6, constraint=starts)
                   for s in sources]
        return [r.text for r in results]

    a, are = (m2m.tokenizer.encode(code)[0] for code in ("a", "are"))
    configured, asked = served(None, {}, {"target_language": "are"})
    (by_default,) = served("a", {})
    assert configured == alone(7) == [text.sample_text(m2m, s, max_new_tokens=6).text
                                      for s in sources]
    assert asked == alone(are) != configured
    assert by_default == alone(a) != configured
