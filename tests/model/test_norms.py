"""model/norms.py: RMSNorm equals a NumPy evaluation of its formula."""

import numpy as np

from kvjax import model as M
from kvjax.model.norms import RMSNorm


def test_rms_norm_is_the_formula():
    config = M.preset("tiny", norm_type="rmsnorm", layer_norm_eps=1e-5)
    x = np.random.default_rng(0).normal(size=(2, 3, 32)).astype(np.float32)
    scale = np.random.default_rng(1).normal(size=32).astype(np.float32)
    out = RMSNorm(config).apply({"params": {"scale": scale}}, x)
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-6)
