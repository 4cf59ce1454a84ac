"""The decode-attention kernels (`model/decode_kernel.py`), over a contiguous and a paged cache:
the formula, exact zeros for what a query may not see, and a model's decode steps through
them equal to XLA's ops.

The kernel runs as JAX ops ("interpret") on every backend; compiled through Triton only on an
NVIDIA GPU, where the "compiled" cases run and elsewhere skip, saying so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_tokens, run_cached, steps_traced_anew
from test_attention import numpy_attention

from kvjax import model as M
from kvjax.model import decode_kernel as D
from kvjax.model import paged
from kvjax.model.fused_attention import on_cuda

MODES = pytest.mark.parametrize("mode", ["interpret", "compiled"])
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}  # a few roundings of Q·scale and weights


def kernel_backend(mode):
    if mode == "compiled" and not D.compiles_here():
        pytest.skip(f"the kernel compiles through Triton on one NVIDIA GPU, not on "
                    f"{jax.device_count()} {jax.default_backend()} device(s)")


def decode_inputs(seed, batch, heads, kv_heads, capacity, dim, lengths, dtype, starts=None):
    """A query [B, 1, N, H] per row, one layer of cache K and V [B, K, S, H] holding NaN past
    each row's length and before its window's start (`starts`, default 0), and the mask
    [B, 1, S] of the slots between."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, 1, heads, dim))
    k, v = (rng.normal(size=(batch, kv_heads, capacity, dim)) for _ in range(2))
    slots = np.arange(capacity)[None, None]
    mask = slots < np.asarray(lengths)[:, None, None]
    if starts is not None:
        mask &= slots >= np.asarray(starts)[:, None, None]
    unseen = ~mask[:, 0][:, None, :, None]
    k, v = (np.where(unseen, np.nan, x) for x in (k, v))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, mask


@MODES
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("heads,kv_heads,capacity,dim,sinks", [
    (4, 4, 16, 16, False),     # one block of the whole capacity, one query head per kv head
    (8, 2, 100, 32, False),    # a capacity the block does not divide: the last block starts early
    (7, 1, 160, 64, False),    # a group of 7 (padded to 16 rows), three blocks
    (8, 2, 100, 32, True),     # each query head's sink logit (gpt-oss)
])
def test_kernel_equals_the_formula_and_ignores_unseen_slots(mode, dtype, heads, kv_heads,
                                                            capacity, dim, sinks):
    kernel_backend(mode)
    # Full, nothing to see, one block and a bit, a sliding window past the first block.
    lengths = [capacity, 0, capacity // 3 + 1, capacity]
    starts = [0, 0, 0, capacity - 20]
    q, k, v, mask = decode_inputs(0, 4, heads, kv_heads, capacity, dim, lengths, dtype, starts)
    assert D.decode_kernel_fits(q, k, v, None)
    sinks = jnp.linspace(-1.0, 3.0, heads) if sinks else None
    out = jax.jit(D.decode_attention, static_argnames="interpret")(
        q, k, v, jnp.asarray(mask), interpret=mode == "interpret", sinks_N=sinks)
    assert out.shape == q.shape and out.dtype == dtype
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)  # a row that may see nothing
    as_f64 = [np.nan_to_num(np.asarray(x, np.float64)).transpose(0, 2, 1, 3) for x in (k, v)]
    reference = numpy_attention(np.asarray(q, np.float64), *as_f64, mask, sinks=sinks)
    assert np.max(np.abs(out - reference)) <= TOLERANCE[dtype] * np.max(np.abs(reference))


def test_the_kernel_runs_where_it_applies():
    q, k, v, _ = decode_inputs(1, 2, 8, 2, 32, 16, [32, 5], jnp.bfloat16)
    assert D.compiles_here() == (on_cuda() and jax.device_count() == 1)
    assert D.decode_kernel_use(q, k, v, None) == ("compiled" if D.compiles_here() else None)
    with D.decode_kernel_mode("xla"):
        assert D.decode_kernel_use(q, k, v, None) is None
    with D.decode_kernel_mode("interpret"):
        assert D.decode_kernel_use(q, k, v, None) == "interpret"
        assert D.decode_kernel_use(q, k, v, 30.0) is None  # a soft cap
        assert D.decode_kernel_use(jnp.concatenate([q, q], 1), k, v, None) is None  # 2 queries
        assert D.decode_kernel_use(q, *(x.astype(jnp.float32) for x in (k, v)), None) is None
        assert D.decode_kernel_use(q[..., :12], k[..., :12], v[..., :12], None) is None
        assert D.decode_kernel_use(q, k[:, :, :8], v[:, :, :8], None) is None  # 8 slots
    with pytest.raises(ValueError, match="'cudnn'"):
        D.decode_kernel_mode("cudnn").__enter__()


@MODES
@pytest.mark.parametrize("variant", ["decoder_only", "encoder_decoder"])
def test_decode_steps_through_the_kernel_equal_xlas(mode, variant):
    """A bfloat16 model's steps (self-attention, and cross-attention over a padded source)
    through the kernel give XLA's logits, rows of different lengths."""
    kernel_backend(mode)
    config = M.preset("tiny", d_model=64, num_heads=4, num_kv_heads=2, positional_encoding="rope",
                      num_encoder_layers=2 if variant == "encoder_decoder" else 0)
    config, params = M.with_precision(config, M.init_params(config, jax.random.key(0)),
                                      "bfloat16")
    tokens = random_tokens(1, (2, 9), config.vocab_size)
    source = source_lengths = None
    if config.is_encoder_decoder:
        source = random_tokens(2, (2, 24), config.vocab_size)
        source_lengths = jnp.array([24, 7], jnp.int32)
    outputs = []
    for attention in ("xla", mode if mode == "interpret" else "auto"):
        with D.decode_kernel_mode(attention):
            outputs.append(steps_traced_anew(config, params, tokens, 32, source,
                                             source_lengths))
    assert np.isfinite(outputs[1]).all()
    spread = np.max(np.abs(outputs[0]))
    assert np.max(np.abs(outputs[1] - outputs[0])) <= 3e-2 * spread


@MODES
@pytest.mark.parametrize("page_size,pages_per_row,heads,kv_heads,dim,sinks", [
    (16, 3, 8, 2, 32, True),  # a page a block; the table's third page ends the row; sinks
    (4, 10, 4, 4, 16, False),  # 8 pages a block of 32 slots: the second block starts 6 early
])
def test_paged_kernel_reads_each_rows_pages_as_the_formula_does(mode, page_size, pages_per_row,
                                                                heads, kv_heads, dim, sinks):
    """Pages of layer 1 of two, scrambled over the pool; unseen slots, every page of layer 0
    and the pages no row names hold NaN; a row's unassigned entries (`NO_PAGE`) are masked,
    those of a row that saw nothing and those a windowed row gave back, wholly behind its
    window (as the engine's paged slots give them back: `serve/pages.py`)."""
    kernel_backend(mode)
    batch, num_pages = 4, 4 * pages_per_row + 2
    capacity = pages_per_row * page_size
    lengths = [capacity, 0, capacity // 2 + 1, capacity]  # the last: a window of 12 slots
    q, k, v, mask = decode_inputs(2, batch, heads, kv_heads, capacity, dim, lengths,
                                  jnp.bfloat16, starts=[0, 0, 0, capacity - 12])
    pages = np.random.default_rng(2).permutation(num_pages)[:batch * pages_per_row]
    pages = pages.reshape(batch, pages_per_row).astype(np.int32)
    pages[1] = M.NO_PAGE  # a row that sees nothing holds no page
    pages[3, :(capacity - 12) // page_size] = M.NO_PAGE  # behind the window: given back
    pools = []
    for rows in (k, v):  # [B, K, S, H] -> pools [2, pages, K, U, H]
        pool = np.full((2, num_pages, kv_heads, page_size, dim), np.nan, np.float32)
        by_page = np.asarray(rows, np.float32).reshape(batch, kv_heads, pages_per_row,
                                                       page_size, dim)
        for b, j in zip(*np.nonzero(pages >= 0), strict=True):
            pool[1, pages[b, j]] = by_page[b, :, j]
        pools.append(jnp.asarray(pool, jnp.bfloat16))
    sinks = jnp.linspace(2.0, -2.0, heads) if sinks else None
    out = jax.jit(D.paged_decode_attention, static_argnames="interpret")(
        q, *pools, 1, jnp.asarray(pages), jnp.asarray(mask), interpret=mode == "interpret",
        sinks_N=sinks)
    reference = jax.jit(D.decode_attention, static_argnames="interpret")(
        q, k, v, jnp.asarray(mask), interpret=True, sinks_N=sinks)
    assert out.shape == q.shape and np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(out, np.float32)[1], 0.0)
    as_f64 = [np.nan_to_num(np.asarray(x, np.float64)).transpose(0, 2, 1, 3) for x in (k, v)]
    expected = numpy_attention(np.asarray(q, np.float64), *as_f64, mask, sinks=sinks)
    error = np.max(np.abs(np.asarray(out, np.float64) - expected))
    assert error <= TOLERANCE[jnp.bfloat16] * np.max(np.abs(expected))
    # Both cases read the contiguous kernel's blocks of 32 slots, whatever their pages.
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(reference, np.float32))


def test_the_paged_kernel_takes_power_of_two_pages_of_16_slots_a_block_or_more():
    assert D.paged_block_pages(16, 3) == 2 and D.paged_block_pages(64, 5) == 1
    assert D.paged_block_pages(4, 10) == 8 and D.paged_block_pages(128, 1) == 1
    assert D.paged_block_pages(4, 3) is None  # 2 pages of 4: 8 slots
    assert D.paged_block_pages(12, 8) is None


@MODES
def test_paged_decode_steps_through_the_kernel_equal_xlas(mode, monkeypatch):
    """A bfloat16 model's paged steps through the kernel give XLA's logits, the rows of
    different lengths on scrambled pages."""
    kernel_backend(mode)
    calls = []
    kernel = paged.paged_decode_attention
    monkeypatch.setattr(paged, "paged_decode_attention",
                        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    config = M.preset("tiny", d_model=64, num_heads=4, num_kv_heads=2, positional_encoding="rope")
    config, params = M.with_precision(config, M.init_params(config, jax.random.key(0)),
                                      "bfloat16")
    tokens = random_tokens(1, (2, 12), config.vocab_size)
    pages = jnp.asarray(np.random.default_rng(4).permutation(9)[:6].reshape(2, 3), jnp.int32)
    outputs = []
    for attention in ("xla", mode if mode == "interpret" else "auto"):
        with D.decode_kernel_mode(attention):
            step = jax.jit(lambda *args: run_cached.__wrapped__(*args), static_argnums=0)
            cache = M.init_paged_cache(config, 2, 9, 16, 3).replace(pages=pages)
            _, cache = step(config, params, tokens[:, :5], cache, jnp.array([5, 2]))
            logits = []
            for t in range(5, 12):
                out, cache = step(config, params, tokens[:, t:t + 1], cache)
                logits.append(np.asarray(out, np.float32))
        outputs.append(np.stack(logits))
    assert len(calls) == config.num_decoder_layers  # traced once, through the kernel
    assert np.isfinite(outputs[1]).all()
    spread = np.max(np.abs(outputs[0]))
    assert np.max(np.abs(outputs[1] - outputs[0])) <= 3e-2 * spread


@pytest.mark.parametrize("page_size,pages_per_row,sinks", [
    (16, 6, False), (4, 24, False), (64, 2, False), (16, 6, True)])
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_both_kernels_lower_to_triton_for_an_nvidia_gpu_on_any_machine(page_size, pages_per_row,
                                                                        sinks):
    """Exported for an H100 (an abstract device: no GPU needed), each kernel becomes one
    Triton call: Triton's rules (every block a power of two, the ops it lowers) hold for the
    shapes `decode_kernel_fits` and `paged_block_pages` admit, with sinks too."""
    pytest.importorskip("jax.experimental.pallas.triton", reason="this jax has no Triton backend")
    if not hasattr(jax.sharding, "AbstractDevice"):
        pytest.skip("this jax cannot name an abstract GPU to lower for")
    from jax import export

    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                       platform="gpu")
    triton = "__gpu$xla.gpu.triton"
    batch, heads, kv_heads, dim = 3, 8, 2, 32
    capacity = page_size * pages_per_row
    q = jax.ShapeDtypeStruct((batch, 1, heads, dim), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((batch, kv_heads, capacity, dim), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2, 40, kv_heads, page_size, dim), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((batch, pages_per_row), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, 1, capacity), bool)
    sinks = {"sinks_N": jax.ShapeDtypeStruct((heads,), jnp.float32)} if sinks else {}
    assert D.decode_kernel_fits(q, rows, rows, None)
    assert D.paged_block_pages(page_size, pages_per_row) is not None
    for name, kernel, args in [
            ("kvjax_decode_attention",
             lambda q, k, v, m, **s: D.decode_attention(q, k, v, m, **s), (q, rows, rows, mask)),
            ("kvjax_paged_decode_attention",
             lambda q, k, v, t, m, **s: D.paged_decode_attention(q, k, v, 1, t, m, **s),
             (q, pool, pool, tables, mask))]:
        with jax.sharding.use_abstract_mesh(
                jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
            exported = export.export(jax.jit(kernel), platforms=["cuda"], disabled_checks=[
                export.DisabledSafetyCheck.custom_call(triton)])(*args, **sinks)
        module = exported.mlir_module()
        assert module.count(triton) == 1 and f'name = "{name}"' in module
