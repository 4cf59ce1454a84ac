"""An int8 base for LoRA (`model/int8_base.py`): its kernels are the formula's, and layers that
dequantize and adapt their own kernels compute what the merged model computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import model as M
from kvjax.model import int8_base, layers
from kvjax.model import lora as L

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


@pytest.mark.parametrize("encoder_layers, scan_layers", [(0, False), (1, True)],
                         ids=["decoder-only, unrolled", "encoder-decoder, scanned"])
def test_layers_unpacking_their_own_kernels_equal_the_merged_model(encoder_layers, scan_layers):
    """Loss and adapter gradients of layers that dequantize their int8 kernels and add their
    adapters inside (rematerialized, as training runs them) equal those of the whole model
    merged over the dequantized base first (`model.lora.merge`)."""
    config = M.preset("tiny", num_kv_heads=2, num_encoder_layers=encoder_layers,
                      scan_layers=scan_layers)
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
