"""model/projections.py: the output projection is NumPy's sum over both head axes, on every
backend's path."""

import jax
import numpy as np
import pytest

from kvjax import model as M
from kvjax.model.projections import OutputProjection


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("rows", [(1, 1), (1, 3), (2, 1)])
def test_output_projection_is_the_heads_times_the_kernel(monkeypatch, backend, rows):
    """[B, T, N, H] x [N, H, D], NumPy's sum over both head axes; as a GPU computes it too,
    where one row (batch-1 decoding) is multiplied as two."""
    config = M.preset("tiny")
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    x = jax.random.normal(jax.random.key(0), (*rows, config.num_heads, config.head_dim))
    projection = OutputProjection(config)
    params = projection.init(jax.random.key(1), x)
    out = projection.apply(params, x)
    kernel = np.asarray(params["params"]["kernel"], np.float64)
    want = np.einsum("btnh,nhd->btd", np.asarray(x, np.float64), kernel)
    assert out.shape == (*rows, config.d_model)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
