"""`generate`, `stream` and `beam_search` with a LoRA adapter per prompt (`adapters`,
`adapter`, `model/lora_rows.py`): each prompt's tokens, logprobs, samples and beams are those
of the model with its adapter merged in, whatever the other prompts ask for."""

import jax
import numpy as np
import pytest
from conftest import trained_adapters

from kvjax import decode
from kvjax.model import lora as L
from kvjax.model import lora_rows

LORAS = (L.LoRA(4, 8.0, ("q", "v", "o", "wi")), L.LoRA(2, None, ("k", "wo")))
PROMPTS = [[5, 9, 3, 7, 11, 4], [8, 2], [6, 6, 1, 9]]
ADAPTER = [2, 0, 1]  # one per prompt: the second adapter, none, the first


@pytest.fixture(scope="module")
def adapted(tiny_lm):
    """(stack, the params each index stands for: 0 the base, then each adapter merged)."""
    config, _, params = tiny_lm
    adapters = [(trained_adapters(config, params, lora, i + 20), lora)
                for i, lora in enumerate(LORAS)]
    merged = [params] + [L.merge(config, params, a, lora) for a, lora in adapters]
    return lora_rows.stack(config, params, adapters), merged


def test_each_prompt_generates_as_its_adapter_merged_greedy_and_sampled(tiny_lm, adapted):
    _, net, params = tiny_lm
    stack, merged = adapted
    out = decode.generate(net, params, PROMPTS, max_new_tokens=8, adapters=stack,
                          adapter=ADAPTER, return_logprobs=True)
    for b, index in enumerate(ADAPTER):
        alone = decode.generate(net, merged[index], [PROMPTS[b]], max_new_tokens=8,
                                return_logprobs=True)
        assert out.token_lists()[b] == alone.token_lists()[0]
        n = len(alone.token_lists()[0])
        np.testing.assert_allclose(out.logprobs[b, :n], alone.logprobs[0, :n], atol=2e-5)
    # Sampled, a key per prompt: each prompt's samples are the ones it draws alone.
    keys = jax.random.split(jax.random.key(7), len(PROMPTS))
    settings = dict(max_new_tokens=6, num_samples=2,
                    sampling=decode.Sampling(temperature=1.0, top_k=20))
    sampled = decode.generate(net, params, PROMPTS, rng=keys, adapters=stack, adapter=ADAPTER,
                              **settings)
    for b, index in enumerate(ADAPTER):
        alone = decode.generate(net, merged[index], [PROMPTS[b]], rng=keys[b:b + 1],
                                **settings)
        assert sampled.token_lists()[2 * b:2 * b + 2] == alone.token_lists()
    streamed = decode.stream(net, params, PROMPTS, max_new_tokens=8, chunk_size=3,
                             adapters=stack, adapter=ADAPTER)
    chunks = []
    try:
        while True:
            chunks.append(next(streamed))
    except StopIteration as done:
        assert done.value.token_lists() == out.token_lists()
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), out.tokens)


def test_each_prompt_keeps_its_adapters_beams(tiny_lm, adapted):
    _, net, params = tiny_lm
    stack, merged = adapted
    out = decode.beam_search(net, params, PROMPTS, max_new_tokens=6, num_beams=3,
                             adapters=stack, adapter=ADAPTER)
    for b, index in enumerate(ADAPTER):
        alone = decode.beam_search(net, merged[index], [PROMPTS[b]], max_new_tokens=6,
                                   num_beams=3)
        assert out.token_lists()[b] == alone.token_lists()[0]
        np.testing.assert_allclose(out.scores[b], alone.scores[0], atol=2e-5)


def test_what_adapters_cannot_serve_is_refused_by_name(tiny_lm, adapted):
    _, net, params = tiny_lm
    stack, _ = adapted
    state = decode.prefill(net, params, PROMPTS[:1])
    for kwargs, message in (
            (dict(adapter=1), r"adapter=1 needs adapters \(a lora_rows.AdapterStack\)"),
            (dict(adapters=stack, adapter=3), r"adapter 3 \(prompt 0\) is not among the 2"),
            (dict(adapters=stack, adapter=[1, 2]), "adapter has 2 entries for 3 prompts"),
            (dict(adapters={"a": 1}, adapter=1), "adapters must be a lora_rows.AdapterStack"),
            (dict(adapters=stack, adapter=1,
                  speculative=decode.Speculative(num_draft_tokens=2)),
             "not speculative decoding"),
            (dict(adapters=stack, adapter=1, return_state=True), "return_state=True keeps")):
        with pytest.raises(ValueError, match=message):
            decode.generate(net, params, PROMPTS, max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="not a kept state"):
        decode.generate(net, params, [[3]], max_new_tokens=4, state=state, adapters=stack,
                        adapter=1)
