"""Int8 layer kernels (`model/int8_base.py`): their values and scales are the formula's; layers
that dequantize and adapt their own kernels compute what the merged model computes (a LoRA
base); a model of `kernel_dtype="int8"` decodes as the float model of its dequantized kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import decode
from kvjax import model as M
from kvjax.model import int8_base, layers
from kvjax.model import lora as L
from kvjax.train import update
from kvjax.train.config import TrainConfig

LORA = M.LoRA(2, 4.0, ("q", "k", "v", "o", "wi", "wo"))
# (module, kernel, input axes): every kernel a LoRA target can name in these models.
KERNELS = [("self_attention", "qkv", 1), ("self_attention", "out", 2), ("ffn", "wi", 1),
           ("ffn", "wo", 1)]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_kernels_are_int8_values_and_scales_of_the_formula(scan_layers):
    config = M.preset("tiny", num_kv_heads=2, scan_layers=scan_layers)
    params = M.init_params(config, jax.random.key(0))
    first = ("layers",) if scan_layers else ("layers", "0")
    wi = L.get(params, (*first, "ffn", "wi"))
    wi["kernel"] = wi["kernel"].at[..., 5].set(0.0)  # an output feature of zeros
    base = int8_base.quantize_layers(params, jnp.bfloat16)
    dequantized = int8_base.dequantize_layers(base)
    lead = 1 if scan_layers else 0
    checked = 0
    for where, _ in L.layer_subtrees(params):
        for module, name, inputs in KERNELS:
            w = np.asarray(L.get(params, (*where, module, name, "kernel")), np.float64)
            held = L.get(base, (*where, module, name))
            scale = np.max(np.abs(w), axis=tuple(range(lead, lead + inputs)), keepdims=True)
            scale /= 127
            assert held["kernel"].dtype == jnp.int8 and held["kernel_scale"].dtype == jnp.float32
            np.testing.assert_allclose(held["kernel_scale"], scale, rtol=1e-6)
            # round(w / scale), up to a float32 tie; never clipped
            assert np.abs(held["kernel"] - np.round(w / np.where(scale > 0, scale, 1))).max() <= 1
            back = np.asarray(L.get(dequantized, (*where, module, name, "kernel")))
            assert back.dtype == np.float32
            assert np.all(np.abs(back - w) <= scale / 2 * (1 + 1e-5) + 1e-9)
            checked += 1
    assert checked == 4 * (1 if scan_layers else 2)
    assert not np.any(np.asarray(L.get(dequantized, (*first, "ffn", "wi", "kernel")))[..., 5])
    # Everything else is held in bfloat16.
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(dequantized), strict=True):
        if not any(f"'{name}'" in jax.tree_util.keystr(path) for _, name, _ in KERNELS):
            np.testing.assert_array_equal(b, np.asarray(a).astype(jnp.bfloat16))


# Latent attention (`model/latent_attention.py`): q, k and v adapt its own kernels.
LATENT = dict(positional_encoding="rope", num_heads=4, head_dim=12, rotary_dim=4,
              latent_kv_rank=10, latent_nope_dim=6, latent_value_dim=8, latent_q_rank=12)


@pytest.mark.parametrize("fields", [dict(num_kv_heads=2),
                                    dict(num_kv_heads=2, num_encoder_layers=1, scan_layers=True),
                                    dict(LATENT, num_kv_heads=4, scan_layers=True)],
                         ids=["decoder-only, unrolled", "encoder-decoder, scanned",
                              "latent attention, scanned"])
def test_layers_unpacking_their_own_kernels_equal_the_merged_model(fields):
    """Loss and adapter gradients of layers that dequantize their int8 kernels and add their
    adapters inside (rematerialized, as training runs them) equal those of the whole model
    merged over the dequantized base first (`model.lora.merge`)."""
    config = M.preset("tiny", **fields)
    base = int8_base.quantize_layers(M.init_params(config, jax.random.key(0)))
    adapters = L.init_adapters(config, base, LORA, jax.random.key(1))
    adapters = jax.tree.map(  # B drawn, not zero, so every update counts
        lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), adapters)
    batch = {"inputs": jnp.array([[3, 4, 5, 6], [7, 8, 9, 0]]), "lengths": jnp.array([4, 3]),
             "source": jnp.array([[3, 4, 5], [6, 7, 0]]), "source_lengths": jnp.array([3, 2])}

    def merged_loss(adapters):
        params = L.merge(config, int8_base.dequantize_layers(base), adapters, LORA,
                         keep_dtype=False)
        return jnp.mean(M.teacher_forced_logits(config, params, batch) ** 2)

    def unpacked_loss(adapters):
        remat = config.replace(remat=True)
        with layers.layer_params_from(int8_base.unpack_fn(remat, LORA)):
            params = int8_base.attach(remat, base, adapters, LORA)
            return jnp.mean(M.teacher_forced_logits(remat, params, batch) ** 2)

    want, want_grads = jax.jit(jax.value_and_grad(merged_loss))(adapters)
    got, got_grads = jax.jit(jax.value_and_grad(unpacked_loss))(adapters)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert jax.tree.structure(got_grads) == jax.tree.structure(adapters)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


def assert_same_logits(got, want):
    """Bit for bit on the CPU. A GPU compiler may fuse a layer's dequantization into its
    matrix product and accumulate in another order: there, within a few roundings."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize("encoder_layers, scan_layers, tied", [(0, False, False), (1, True, True)],
                         ids=["decoder-only, unrolled, untied", "encoder-decoder, scanned, tied"])
def test_an_int8_kernel_model_computes_as_the_float_model_of_its_dequantized_kernels(
        encoder_layers, scan_layers, tied):
    config = M.preset("tiny", num_kv_heads=2, num_encoder_layers=encoder_layers,
                      scan_layers=scan_layers, tie_embeddings=tied)
    params = M.init_params(config, jax.random.key(0))
    int8_config, held = M.with_precision(config, params, kernel_dtype="int8")
    assert int8_config.kernel_dtype == "int8"
    for got, want in zip(jax.tree.leaves(held),
                         jax.tree.leaves(int8_base.quantize_for_decoding(params)), strict=True):
        np.testing.assert_array_equal(got, want)
    # The embedding table with a scale per row (a token's row, and the logits' row of it).
    table = held["embedder"]["embedding"]
    w = np.asarray(params["embedder"]["embedding"]["embedding"], np.float64)
    np.testing.assert_allclose(table["embedding_scale"],
                               np.abs(w).max(axis=1, keepdims=True) / 127, rtol=1e-6)
    assert table["embedding"].dtype == jnp.int8
    assert tied or held["embedder"]["unembed"]["kernel"].dtype == jnp.int8
    # Drawn for an int8 config: the float draw, quantized.
    for got, want in zip(jax.tree.leaves(M.init_params(int8_config, jax.random.key(0))),
                         jax.tree.leaves(held), strict=True):
        np.testing.assert_array_equal(got, want)
    tokens = jnp.array([[3, 4, 5, 6, 7], [8, 9, 10, 0, 0]])
    batch = {"inputs": tokens, "lengths": jnp.array([5, 3]), "source": tokens[:, :4],
             "source_lengths": jnp.array([4, 2])}
    logits = M.teacher_forced_logits(int8_config, held, batch)
    # The same float32 kernels, made inside each layer.
    assert_same_logits(logits, M.teacher_forced_logits(config, int8_base.dequantize_layers(held),
                                                        batch))
    # Within the quantisation error of the float model itself.
    exact = M.teacher_forced_logits(config, params, batch)
    assert np.abs(logits - exact).max() <= 0.05 * np.abs(exact).max()


def test_int8_kernels_in_bfloat16_compute_as_the_dequantized_bfloat16_model():
    """Logits of a ragged batch with the layers' kernels int8 and the rest of the model
    bfloat16 equal those of the bfloat16 model of the dequantized kernels; the kernels take a
    quarter of their float32 bytes. (The experts' test below decodes int8 kernels through
    the cache.)"""
    config = M.preset("tiny", positional_encoding="rope", num_kv_heads=2, scan_layers=True)
    params = M.init_params(config, jax.random.key(3))
    int8_config, held = M.with_precision(config, params, "bfloat16", kernel_dtype="int8")
    assert (int8_config.dtype, int8_config.kernel_dtype) == ("bfloat16", "int8")
    layer = held["layers"]
    assert layer["self_attention"]["qkv"]["kernel"].dtype == jnp.int8
    assert layer["self_attention"]["qkv"]["kernel_scale"].dtype == jnp.float32
    assert layer["ffn"]["wi"]["kernel"].nbytes * 4 == params["layers"]["ffn"]["wi"][
        "kernel"].nbytes
    assert held["embedder"]["embedding"]["embedding"].dtype == jnp.int8
    assert held["layers"]["attention_block"]["norm"]["scale"].dtype == jnp.bfloat16
    dequantized = M.with_precision(config, int8_base.dequantize_layers(held), "bfloat16")
    batch = {"inputs": jnp.array([[5, 6, 7, 8, 9, 10, 11], [12, 13, 0, 0, 0, 0, 0]]),
             "lengths": jnp.array([7, 2])}
    assert_same_logits(M.teacher_forced_logits(int8_config, held, batch),
                       M.teacher_forced_logits(*dequantized, batch))


def test_kernel_dtype_is_saved_only_when_set_and_checked():
    config = M.preset("tiny")
    assert "kernel_dtype" not in config.to_dict()
    int8 = config.replace(kernel_dtype="int8")
    assert M.TransformerConfig.from_json(int8.to_json()) == int8
    with pytest.raises(ValueError, match="kernel_dtype='int4' is not None or one of"):
        config.replace(kernel_dtype="int4")
    with pytest.raises(ValueError, match="kernel_dtype='int4' is not one of"):
        M.with_precision(config, {}, kernel_dtype="int4")
    with pytest.raises(ValueError, match="kernel_dtype='int8' holds weights for decoding"):
        update.init_state(int8, TrainConfig(steps=2, batch_size=1, warmup_steps=0,
                                            progress=False))


def test_int8_experts_are_the_formulas_and_decode_as_the_dequantized_model():
    """A mixture's experts held as int8 with a scale per output feature, its shared expert as
    a dense FFN's kernels: a prompt runs every expert, one row's steps gather the chosen
    ones (`experts.gathers`), and both give the tokens of the float model of the dequantized
    kernels."""
    config = M.preset("tiny", num_experts=8, experts_per_token=2, activation="swiglu",
                      ffn_bias=False, positional_encoding="rope", scan_layers=True,
                      shared_expert_d_ff=48, shared_expert_gate=True)
    params = M.init_params(config, jax.random.key(4))
    int8_config, held = M.with_precision(config, params, kernel_dtype="int8")
    experts, original = held["layers"]["ffn"]["experts"], params["layers"]["ffn"]["experts"]
    assert sorted(experts) == ["wi", "wi_gate", "wi_gate_scale", "wi_scale", "wo", "wo_scale"]
    shared = held["layers"]["ffn"]["shared_expert"]
    assert {shared[name]["kernel"].dtype for name in ("wi", "wi_gate", "wo")} == {
        jnp.dtype(jnp.int8)}
    assert held["layers"]["ffn"]["router"]["kernel"].dtype == jnp.float32
    for name, axis in int8_base.EXPERT_KERNELS.items():
        w = np.asarray(original[name], np.float64)
        scale = np.max(np.abs(w), axis=1 + axis, keepdims=True) / 127  # after the layers' L
        assert experts[name].dtype == jnp.int8
        np.testing.assert_allclose(experts[f"{name}_scale"], scale, rtol=1e-6)
        back = np.asarray(experts[name], np.float64) * scale
        assert np.all(np.abs(back - w) <= scale / 2 * (1 + 1e-5) + 1e-9)
    # Cast again, an int8 model keeps every scale in float32.
    _, recast = M.with_precision(int8_config, held, "bfloat16")
    kinds = {}  # is a scale: the dtypes of such floating-point leaves
    for path, leaf in jax.tree_util.tree_leaves_with_path(recast):
        if leaf.dtype != jnp.int8:
            kinds.setdefault(jax.tree_util.keystr(path).endswith("_scale']"), set()).add(
                leaf.dtype)
    assert kinds == {True: {jnp.dtype(jnp.float32)}, False: {jnp.dtype(jnp.bfloat16)}}, kinds
    dequantized = int8_base.dequantize_layers(held)
    prompts = [[5, 6, 7, 8, 9, 10]]
    got = decode.generate(M.build_model(int8_config), held, prompts, max_new_tokens=10)
    want = decode.generate(M.build_model(config), dequantized, prompts, max_new_tokens=10)
    np.testing.assert_array_equal(got.tokens, want.tokens)
