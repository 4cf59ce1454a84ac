"""model/latent_attention.py: multi-head latent attention's heads, its cache and its checks.
What it computes is held to transformers' DeepSeek-V3 and GLM-4.7-Flash on tiny imported
models (tests/hf/test_hf_models.py); here, that decoding from the latent cache (absorbed)
gives what a full forward (expanded) does, the engine's int8 pages too, that the two ways are
the same products, that a head's padding adds nothing, what the cache holds, that int8
kernels compute as their dequantized floats and where LoRA's q, k and v adapt it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_cached, run_full, start_cache

from kvjax import model as M
from kvjax.model.cache_size import describe_cache_size
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
    # One latent row per token (4 shared turned + 10 latent dims) and no values: [L, B, K, S, H].
    layers = config.num_decoder_layers
    assert [x.shape for x in cache.k] == [(1, 2, 1, 16, 14)] * layers
    assert [x.shape for x in cache.v] == [(1, 2, 0, 16, 14)] * layers
    assert cache.nbytes == M.cache_size_bytes(config, 2, 16).total == 16 * layers * 14 * 4 * 2
    # The layers' params stacked and scanned, as any layer's.
    scanned, stacked = M.with_layer_layout(config, params, scan_layers=True)
    np.testing.assert_allclose(run_full(scanned, stacked, tokens), full, rtol=1e-5, atol=1e-5)


def _latent_layer(config, batch=2, tokens=3):
    x = jax.random.normal(jax.random.key(2), (batch, tokens, config.d_model))
    module = LatentQKV(config)
    every_param = module.init(jax.random.key(3), x, method=lambda m, x: m.expand(m(x)[1]))
    return module, every_param, x


def test_a_head_is_turned_then_unturned_dimensions_then_zeros():
    """The shared turned key part is the same in every head, and the dimensions past the
    queries' and keys' (and past the values') are zeros: they add nothing to a product."""
    config = M.preset("tiny", **LATENT, latent_q_rank=12)
    module, params, x = _latent_layer(config)
    q, rows = module.apply(params, x)
    assert q.shape == (2, 3, 4, 12) and rows.shape == (2, 3, 1, 14)
    k, v = module.apply(params, rows, method="expand")
    assert k.shape == v.shape == (2, 3, 4, 12)
    np.testing.assert_array_equal(q[..., 10:], 0)
    np.testing.assert_array_equal(k[..., 10:], 0)
    np.testing.assert_array_equal(v[..., 8:], 0)
    np.testing.assert_array_equal(k[..., :4], jnp.broadcast_to(rows[..., :4], k[..., :4].shape))
    assert not np.allclose(k[..., 4:10], k[:, :, :1, 4:10])  # the unturned part is each head's


def test_absorbed_queries_and_values_are_the_expanded_heads_products():
    """For every head, query · expanded key = absorbed query · latent row, and the expanded
    values mixed by any weights = the latent rows mixed by them, then taken to the value
    (float64 NumPy on the layer's own kernels)."""
    config = M.preset("tiny", **LATENT, latent_q_rank=12)
    module, params, x = _latent_layer(config, batch=1, tokens=5)
    q, rows = module.apply(params, x)
    k, v = module.apply(params, rows, method="expand")
    absorbed = module.apply(params, q, method="absorb")
    assert absorbed.shape == (1, 5, 4, 14)
    as64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    expanded_logits = np.einsum("BTNH,BSNH->BNTS", as64(q), as64(k))
    latent_logits = np.einsum("BTNH,BSH->BNTS", as64(absorbed), as64(rows[:, :, 0]))
    np.testing.assert_allclose(latent_logits, expanded_logits, rtol=1e-5, atol=1e-6)
    weights = jax.nn.softmax(jax.random.normal(jax.random.key(5), (1, 4, 5, 5)), axis=-1)
    mixed_rows = np.einsum("BNTS,BSH->BTNH", as64(weights), as64(rows[:, :, 0]))
    got = module.apply(params, jnp.asarray(mixed_rows, jnp.float32), method="values")
    np.testing.assert_allclose(got, np.einsum("BNTS,BSNH->BTNH", as64(weights), as64(v)),
                               rtol=1e-5, atol=1e-6)


def test_the_cache_holds_one_latent_row_per_token():
    """DeepSeek-V3's shape (61 layers, 128 heads, kv rank 512, 64 turned dims, 192-wide keys):
    70,272 bytes a token in bfloat16 where the heads' keys and values would take 85x that;
    an int8 cache adds one scale per token and layer. What is allocated is what is counted."""
    v3 = M.TransformerConfig(d_model=7168, num_heads=128, num_decoder_layers=61, d_ff=18432,
                             head_dim=192, positional_encoding="rope", rotary_dim=64,
                             latent_kv_rank=512, latent_q_rank=1536, latent_nope_dim=128,
                             latent_value_dim=128, max_len=4096)
    per_token = M.cache_size_bytes(v3, 1, 1, "bfloat16").self_attention
    assert per_token == 61 * (512 + 64) * 2 == 70_272
    assert 2 * 61 * 128 * 192 * 2 // per_token == 85
    assert M.cache_size_bytes(v3, 1, 1, "int8").self_attention == 61 * (576 + 4)
    assert "61 layers x a latent of 512 + 64 shared key dims" in describe_cache_size(v3, 1, 1)
    config = M.preset("tiny", **LATENT)
    for cache in (M.init_cache(config, 3, 20, "int8"),
                  M.init_paged_cache(config, 3, num_pages=5, page_size=4, pages_per_row=5)):
        rows = 3 * 20 if not cache.paged else 5 * 4
        assert cache.nbytes == M.cache_size_bytes(config, 1, rows, cache.dtype).total


@pytest.mark.parametrize("fields, message", [
    (dict(latent_value_dim=14), "head_dim=12 must hold rotary_dim + latent_nope_dim = 10 and "
                                "latent_value_dim = 14"),
    (dict(rotary_dim=None), "needs positional_encoding='rope' and rotary_dim"),
    (dict(num_kv_heads=2), "num_kv_heads=2 must be num_heads=4"),
    (dict(qk_norm=True), "qk_norm is not implemented for latent attention"),
    (dict(latent_kv_rank=0), "latent_nope_dim needs latent attention"),
    (dict(latent_q_rank=-1), "latent_q_rank=-1 must be >= 0"),
])
def test_latent_options_are_checked(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        M.preset("tiny", **{**LATENT, **fields})


def test_int8_kernels_are_the_formulas_and_compute_as_the_dequantized_model():
    """Each projection (queries from a latent, the latent down, `kv_up`) held as int8 values
    with a float32 scale per output feature; the model computes what the float model of the
    dequantized kernels computes, within the rounding of the float one."""
    from test_int8_base import assert_same_logits

    from kvjax.model import int8_base
    from kvjax.model import lora as L

    config = M.preset("tiny", **LATENT, latent_q_rank=12)
    params = M.init_params(config, jax.random.key(0))
    int8_config, held = M.with_precision(config, params, kernel_dtype="int8")
    checked = []
    for where, _ in L.layer_subtrees(params):
        latent = L.get(held, (*where, "self_attention", "latent"))
        for name in sorted(set(latent) & set(int8_base.LATENT_KERNELS)):
            w = np.asarray(L.get(params, (*where, "self_attention", "latent", name, "kernel")),
                           np.float64)
            values, scale = latent[name]["kernel"], latent[name]["kernel_scale"]
            assert values.dtype == jnp.int8 and scale.dtype == jnp.float32
            want = np.max(np.abs(w), axis=0, keepdims=True) / 127  # over the input axis
            np.testing.assert_allclose(scale, want, rtol=1e-6)
            assert np.all(np.abs(np.asarray(values, np.float64) * scale - w)
                          <= want / 2 * (1 + 1e-5) + 1e-9)
            checked.append(name)
    assert checked == ["kv_down", "kv_up", "q_down", "q_up"] * config.num_decoder_layers
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
    logits = run_full(int8_config, held, tokens)
    assert_same_logits(logits, run_full(config, int8_base.dequantize_layers(held), tokens))
    exact = run_full(config, params, tokens)
    assert np.abs(logits - exact).max() <= 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("q_rank", [0, 12])
def test_lora_adapts_the_query_kernel_and_kv_up_s_key_and_value_halves(q_rank):
    """q adapts the kernel that makes the heads' queries (`q`, or `q_up` after a latent),
    k and v the key and value dimensions of each head in `kv_up`: the merged kernels are the
    NumPy formula's, a zero B changes nothing, o's A starts (and, its inputs zero there,
    stays) zero over the heads' padding past their values, and a stack of adapters serves
    all four (tests/model/test_lora_rows.py checks what it computes)."""
    from kvjax.model import lora as L
    from kvjax.model import lora_rows

    config = M.preset("tiny", **LATENT, latent_q_rank=q_rank)
    params = M.init_params(config, jax.random.key(0))
    lora = M.LoRA(2, 6.0, ("q", "k", "v", "o"))
    adapters = L.init_adapters(config, params, lora, jax.random.key(1))
    padding = np.tile(np.arange(config.head_dim) >= 8, config.num_heads)  # values 8 wide
    for where, _ in L.layer_subtrees(params):
        a = np.asarray(L.get(adapters, (*where, "o"))["lora_a"])
        assert not a[padding].any() and a[~padding].all()
    np.testing.assert_array_equal(  # B starts at zero
        run_full(config, L.merge(config, params, adapters, lora), jnp.array([[3, 4, 5]])),
        run_full(config, params, jnp.array([[3, 4, 5]])))
    adapters = jax.tree.map(lambda x: x + jax.random.normal(jax.random.key(2), x.shape), adapters)
    merged = L.merge(config, params, adapters, lora, keep_dtype=False)
    heads, nope, rank = config.num_heads, config.latent_nope_dim, config.latent_kv_rank
    query = "q_up" if q_rank else "q"

    def update(where, target):  # alpha / r = 6 / 2
        pair = L.get(adapters, (*where, target))
        return 3.0 * np.asarray(pair["lora_a"], np.float64) @ np.asarray(pair["lora_b"])

    def kernel(tree, where, name):
        return np.asarray(L.get(tree, (*where, "self_attention", "latent", name, "kernel")),
                          np.float64)

    for where, _ in L.layer_subtrees(params):
        w, q = kernel(params, where, query), update(where, "q")
        assert q.shape == ((q_rank or config.d_model), heads * 10)  # 4 turned + 6 per head
        np.testing.assert_allclose(kernel(merged, where, query), w + q.reshape(w.shape),
                                   rtol=1e-5, atol=1e-6)
        w = kernel(params, where, "kv_up")
        want = np.concatenate([w[..., :nope] + update(where, "k").reshape(rank, heads, nope),
                               w[..., nope:] + update(where, "v").reshape(rank, heads, 8)],
                              axis=-1)
        np.testing.assert_allclose(kernel(merged, where, "kv_up"), want, rtol=1e-5, atol=1e-6)
    assert lora_rows.servable_targets(config, params) == ("q", "k", "v", "o", "wi", "wo")
    assert lora_rows.stack(config, params, [(adapters, lora)]).count == 1


def test_an_int8_paged_cache_serves_what_generate_makes_with_it():
    """The padded heads go through the engine's paged pool and the int8 cache's per-head
    scales as any others, from int8 kernels: each request's tokens and logprobs are
    `generate`'s alone."""
    from conftest import FakeTokenizer

    from kvjax import decode
    from kvjax.serve import Engine, GenerationRequest

    config = M.preset("tiny", **LATENT, latent_q_rank=12, scan_layers=True)
    config, params = M.with_precision(config, M.init_params(config, jax.random.key(4)),
                                      cache_dtype="int8", kernel_dtype="int8")
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


def test_a_prefix_kept_in_a_contiguous_cache_gives_generate_s_tokens():
    """The engine's prefix cache copies a kept prompt's latent rows (and the value stacks of
    no heads) into a slot: requests that share a 40-token preamble, served one after
    another, reuse it and still get `generate`'s tokens alone."""
    from conftest import FakeTokenizer

    from kvjax import decode
    from kvjax.serve import Engine, GenerationRequest

    config = M.preset("tiny", **LATENT, latent_q_rank=12, scan_layers=True)
    params = M.init_params(config, jax.random.key(4))
    engine = Engine(config, params, max_slots=2, chunk_size=4, max_queue=4, prefill_batch=2,
                    tokenizer=FakeTokenizer())
    preamble = [5 + j % 50 for j in range(40)]
    prompts = [preamble + [7, 8], preamble + [9], preamble + [11, 12, 13]]
    got = [[] for _ in prompts]
    for row, tokens in zip(prompts, got, strict=True):
        engine.submit(GenerationRequest(tuple(row), max_tokens=6),
                      lambda delta, tokens=tokens: tokens.append(delta))
        engine.run_until_idle()
    assert engine._prefixes.hits == 2
    net = M.build_model(config)
    for row, deltas in zip(prompts, got, strict=True):
        alone = decode.generate(net, params, [row], max_new_tokens=6)
        assert [t for d in deltas for t in d.token_ids] == alone.token_lists()[0]
