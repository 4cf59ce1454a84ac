"""The engine serving imported Hugging Face models (`tests/fixtures/hf_models`): each
request's tokens are what it gets alone, through `generate` or in transformers' own record."""

import json
from pathlib import Path

import pytest
from test_engine import CHUNK, Collector

from kvjax import decode, hf, text
from kvjax import model as M
from kvjax.serve import Engine, GenerationRequest, chat

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_models"


def test_an_imported_gemma_serves_its_chat_prompts_as_generate_alone():
    """Gemma 3 (sliding-window layers among a global one, each kind with its RoPE, soft
    caps none): chat prompts rendered by its template, more requests than slots."""
    loaded = text.load(FIXTURES / "gemma3_text")
    net = M.build_model(loaded.config)
    questions = ["What is a KV cache?", "Why?", "And a sliding window, what does it keep?"]
    prompts = [loaded.tokenizer.encode(chat.render(loaded.tokenizer, [
        {"role": "user", "content": q}])[0]) for q in questions]
    gemma = Engine(loaded.config, loaded.params, max_slots=2, chunk_size=CHUNK,
                   prefill_batch=2, tokenizer=loaded.tokenizer)
    collectors = [Collector() for _ in prompts]
    for ids, collector in zip(prompts, collectors, strict=True):
        gemma.submit(GenerationRequest(tuple(ids), max_tokens=7), collector)
    gemma.run_until_idle()
    # A ragged batch gives each row what it gets alone (tests/decode).
    expected = decode.generate(net, loaded.params, prompts, max_new_tokens=7).token_lists()
    assert [c.tokens() for c in collectors] == expected


@pytest.mark.parametrize("name, page_size", [("mixtral", None), ("gpt_oss_mxfp4", 4),
                                             ("bloom", 4), ("mistral", 4), ("t5", None)])
def test_an_imported_model_serves_what_transformers_generates(name, page_size):
    """Mixtral (4 experts, 2 for each token), gpt-oss (attention sinks, a sliding window
    beside a full layer, experts with biases, stored as MXFP4) on pages of 4 slots, BLOOM
    (ALiBi, each slot's position its index in the row's pages) on pages too, Mistral (every
    layer over a window of 4: its slots hold only the window's pages, by default 3 a slot,
    a prompt of 11 taking none of its first 8 positions), and T5 (an encoder-decoder whose
    prompts are sources, attention biased by relative position): more requests than slots,
    each request's greedy tokens those transformers made for its prompt alone (the
    fixture's record)."""
    directory = FIXTURES / name
    record = json.loads((directory / "expected.json").read_text())
    config, _, params = hf.load_pretrained(directory)
    mixtral = Engine(config, params, max_slots=2, chunk_size=CHUNK, prefill_batch=2,
                     page_size=page_size)
    collectors = [Collector() for _ in record["prompts"]]
    for ids, collector in zip(record["prompts"], collectors, strict=True):
        mixtral.submit(GenerationRequest(tuple(ids), max_tokens=record["max_new_tokens"],
                                         stop_ids=(record["eos_id"],)), collector)
    mixtral.run_until_idle()
    assert [c.tokens() for c in collectors] == record["greedy"]
    if config.attention_reach is not None:
        assert mixtral.pages == (6, 4)
