"""model/embedder.py: each stack's own learned positions and embedding norm (BART, mBART)
against the formula, read by the encoder and the decoder each."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax.model.embedder import Embedder


def layer_norm(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + eps) * scale + bias


def test_each_stack_adds_its_own_positions_and_norms_with_its_own_scale_and_bias():
    config = M.preset("tiny", num_encoder_layers=1, positional_encoding="learned",
                      embedding_norm=True, per_stack_embeddings=True, scale_embeddings=False)
    embedder = Embedder(config)
    tokens, positions = jnp.array([[3, 5, 7]]), jnp.array([[0, 1, 4]])
    params = {}  # a norm's params are made by the first call that uses it
    for stack in ("encoder", "decoder"):
        params |= embedder.init(jax.random.key(0), tokens, positions, stack=stack)["params"]
    # Norms of their own values, so that a stack reading the other's would differ.
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
    table = np.asarray(params["embedding"]["embedding"])[np.asarray(tokens)]
    outputs = {}
    for stack in ("encoder", "decoder"):
        got = np.asarray(embedder.apply({"params": params}, tokens, positions, stack=stack))
        added = table + np.asarray(params[f"{stack}_position_embedding"])[np.asarray(positions)]
        norm = params[f"{stack}_embedding_norm"]
        want = layer_norm(added, np.asarray(norm["scale"]), np.asarray(norm["bias"]),
                          config.layer_norm_eps)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        outputs[stack] = got
    assert not np.allclose(outputs["encoder"], outputs["decoder"])
    assert "position_embedding" not in params and "embedding_norm" not in params
