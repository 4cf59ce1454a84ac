"""The KV-cache size formula: what the allocated caches hold, in the formula's bytes."""

import jax
import jax.numpy as jnp
import pytest

from kvjax import model as M


def test_cache_size_formula_for_llama2_7b_shape():
    # 32 layers x 32 heads x 128 head dim at 1024 tokens in float16: 512 MiB per sequence.
    config = M.TransformerConfig(d_model=4096, num_heads=32, num_decoder_layers=32,
                                 d_ff=11008, max_len=4096)
    size = M.cache_size_bytes(config, batch=1, length=1024, dtype=jnp.float16)
    assert size.self_attention == 2 * 1024 * 32 * 32 * 128 * 2 == 512 * 2**20
    assert size.cross_attention == 0


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_allocated_cache_bytes_equal_formula(kv_heads, dtype):
    config = M.preset("tiny", num_kv_heads=kv_heads)
    cache = M.init_cache(config, batch_size=3, capacity=20, dtype=dtype)
    assert [k.shape for k in cache.k] == [
        (layers, 3, config.kv_heads, 20, config.head_dim)
        for layers in config.layer_stacks(config.num_decoder_layers)]
    expected = 2 * 20 * config.num_decoder_layers * config.kv_heads * config.head_dim
    expected *= jnp.dtype(dtype).itemsize * 3
    assert cache.nbytes == M.cache_size_bytes(config, 3, 20, dtype).total == expected


def test_encoder_decoder_cache_reports_cross_attention_separately():
    config = M.preset("tiny", num_encoder_layers=2, num_kv_heads=2)
    net = M.build_model(config)
    params = M.init_params(config, jax.random.key(0))
    encoded = jnp.zeros((2, 9, config.d_model))
    cache = net.apply({"params": params}, encoded, None, 16, method=net.start_decoding)
    size = M.cache_size_bytes(config, 2, 16, source_length=9)
    assert cache.self_attention_nbytes == size.self_attention
    assert cache.nbytes == size.total
    assert [k.shape for k in cache.cross_k] == [
        (layers, 2, 2, 9, config.head_dim) for layers in config.layer_stacks(2)]


def test_generate_cache_bytes_counts_rings_in_the_windowed_layers_alone():
    # Gemma 3 1B's shape: 26 layers, one kv head of 256, bfloat16, a window of 512 in all
    # but every sixth layer.
    gemma = M.TransformerConfig(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=1,
                                head_dim=256, d_ff=64, num_decoder_layers=26,
                                sliding_window=512, full_attention_layers=(5, 11, 17, 23),
                                max_len=32768, dtype="bfloat16", scan_layers=False)
    assert M.cache_size_bytes(gemma, 1, 32768).self_attention == 832 * 2**20
    assert M.generate_cache_bytes(gemma, 1, 32768) == 2 * 2 * 256 * (22 * 512 + 4 * 32768)
    cache = jax.eval_shape(lambda: M.init_cache(gemma, 1, 32768, step_tokens=1))
    assert cache.nbytes == M.generate_cache_bytes(gemma, 1, 32768)
    # Paged: a page of 16 holds the 4 global layers, each row a ring per windowed layer.
    page, rings = M.paged_cache_bytes(gemma, 32768)
    assert (page, rings) == (2 * 2 * 256 * 4, 2 * 2 * 256 * 22 * 512)
    paged = jax.eval_shape(lambda: M.init_paged_cache(gemma, 3, 100, 16, 2048, step_tokens=1))
    assert paged.nbytes == page * 100 * 16 + rings * 3
    # No ring where the window holds every position anyway.
    short = M.cache_size_bytes(gemma, 1, 400).self_attention
    assert M.generate_cache_bytes(gemma, 1, 400) == short
    # Fields that number layers (here SmolLM3's layers without RoPE) are the config's own.
    nope = M.preset("tiny", num_decoder_layers=4, positional_encoding="rope", sliding_window=8,
                    full_attention_layers=(3,), unrotated_layers=(3,), scan_layers=False)
    assert M.generate_cache_bytes(nope, 2, 32) == (3 * 8 + 32) * 2 * M.cache_size_bytes(
        nope, 1, 1).self_attention // 4
