"""model/latent_attention.py: multi-head latent attention's heads, its cache and its checks.
What it computes is held to transformers' DeepSeek-V3 and GLM-4.7-Flash on tiny imported
models (tests/hf/test_hf_models.py); here, that a cache gives what a full forward does (the
engine's int8 pages too) and that a head's padding adds nothing."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_cached, run_full, start_cache

from kvjax import model as M
from kvjax.model.latent_attention import LatentQKV

LATENT = dict(positional_encoding="rope", num_heads=4, head_dim=12, rotary_dim=4,
              latent_kv_rank=10, latent_nope_dim=6, latent_value_dim=8)


@pytest.mark.parametrize("q_rank", [0, 12])  # queries from the token, or from a latent
def test_cached_steps_equal_the_full_forward(q_rank):
    config = M.preset("tiny", **LATENT, latent_q_rank=q_rank)
    params = M.init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
    full = run_full(config, params, tokens)
    logits, cache = run_cached(config, params, tokens[:, :5],
                               start_cache(config, params, 2, 16))
    steps = [logits]
    for t in range(5, 9):
        logits, cache = run_cached(config, params, tokens[:, t:t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)
    # Each head's K and V, padded to H: the stacks [L, B, K, S, H].
    assert {x.shape[-1] for x in jax.tree.leaves(cache) if x.ndim == 5} == {config.head_dim}
    # The layers' params stacked and scanned, as any layer's.
    scanned, stacked = M.with_layer_layout(config, params, scan_layers=True)
    np.testing.assert_allclose(run_full(scanned, stacked, tokens), full, rtol=1e-5, atol=1e-5)


def test_a_head_is_turned_then_unturned_dimensions_then_zeros():
    """The shared turned key part is the same in every head, and the dimensions past the
    queries' and keys' (and past the values') are zeros: they add nothing to a product."""
    config = M.preset("tiny", **LATENT, latent_q_rank=12)
    x = jax.random.normal(jax.random.key(2), (2, 3, config.d_model))
    module = LatentQKV(config)
    params = module.init(jax.random.key(3), x)
    q, k, v = module.apply(params, x)
    assert q.shape == k.shape == v.shape == (2, 3, 4, 12)
    np.testing.assert_array_equal(q[..., 10:], 0)
    np.testing.assert_array_equal(k[..., 10:], 0)
    np.testing.assert_array_equal(v[..., 8:], 0)
    np.testing.assert_array_equal(k[..., :4], jnp.broadcast_to(k[:, :, :1, :4], k[..., :4].shape))
    assert not np.allclose(k[..., 4:10], k[:, :, :1, 4:10])  # the unturned part is each head's


@pytest.mark.parametrize("fields, message", [
    (dict(latent_value_dim=14), "head_dim=12 must hold rotary_dim + latent_nope_dim = 10 and "
                                "latent_value_dim = 14"),
    (dict(rotary_dim=None), "needs positional_encoding='rope' and rotary_dim"),
    (dict(num_kv_heads=2), "num_kv_heads=2 must be num_heads=4"),
    (dict(qk_norm=True), "qk_norm is not implemented for latent attention"),
    (dict(kernel_dtype="int8"), "kernel_dtype is not implemented for latent attention"),
    (dict(latent_kv_rank=0), "latent_nope_dim needs latent attention"),
    (dict(latent_q_rank=-1), "latent_q_rank=-1 must be >= 0"),
])
def test_latent_options_are_checked(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        M.preset("tiny", **{**LATENT, **fields})


def test_an_int8_paged_cache_serves_what_generate_makes_with_it():
    """The padded heads go through the engine's paged pool and the int8 cache's per-head
    scales as any others: each request's tokens and logprobs are `generate`'s alone."""
    from conftest import FakeTokenizer

    from kvjax import decode
    from kvjax.serve import Engine, GenerationRequest

    config = M.preset("tiny", **LATENT, latent_q_rank=12, scan_layers=True)
    config, params = M.with_precision(config, M.init_params(config, jax.random.key(4)),
                                      cache_dtype="int8")
    engine = Engine(config, params, max_slots=2, chunk_size=4, max_queue=4, prefill_batch=2,
                    tokenizer=FakeTokenizer(), page_size=4)
    prompts = [[3 + (7 * i + j) % 60 for j in range(n)] for i, n in enumerate((4, 7, 5))]
    got = [[] for _ in prompts]
    for row, tokens in zip(prompts, got, strict=True):
        engine.submit(GenerationRequest(tuple(row), max_tokens=6),
                      lambda delta, tokens=tokens: tokens.append(delta))
    engine.run_until_idle()
    net = M.build_model(config)
    for row, deltas in zip(prompts, got, strict=True):
        alone = decode.generate(net, params, [row], max_new_tokens=6, return_logprobs=True)
        assert [t for d in deltas for t in d.token_ids] == alone.token_lists()[0]
        logprobs = [p for d in deltas for p in d.logprobs]
        np.testing.assert_allclose(logprobs, alone.logprobs[0, :len(logprobs)], atol=1e-5)
