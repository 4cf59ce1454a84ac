"""`kvjax bench train --lora`: LoRA against full fine-tuning, with each step's peak memory."""

import jax
import numpy as np
from conftest import run_cli

from kvjax import model as M
from kvjax.benchmarks.train_lora import lora_benchmark


def test_rows_count_what_each_contender_trains_and_holds(capsys):
    rows, setting = lora_benchmark("tiny", batch_size=2, seq_len=16, rank=2, steps=1,
                                   repeats=1, base_dtypes=(None,), log=lambda _: None)
    full, adapted = rows
    params = M.init_params(M.preset("tiny"), jax.random.key(0))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert full.trained_params == sum(x.size for x in jax.tree.leaves(params))
    d, heads, layers = 32, 4 * 8, 2  # tiny: width 32, 4 heads of 8, 2 layers; q and v
    assert adapted.trained_params == layers * 2 * (d * 2 + 2 * heads)
    # What LoRA saves: both Adam moments and the gradient of every param (3 copies).
    assert full.peak_bytes - adapted.peak_bytes >= 2.5 * param_bytes
    assert all(np.isfinite(r.tokens_per_second) and r.tokens_per_second > 0 for r in rows)
    assert "`tiny` sizes" in setting
    # The same full fine-tuning program again, and LoRA over a bfloat16 base.
    code, out, err = run_cli(capsys, "bench", "train", "--lora", "--preset", "tiny",
                             "--batch-size", 2, "--seq-len", 16, "--steps", 1, "--repeats", 1,
                             "--lora-rank", 2, "--lora-base-dtype", "bfloat16")
    assert code == 0, err
    assert "| LoRA r=2 on q, v, bfloat16 base | 512 |" in out and "| full fine-tuning |" in out
