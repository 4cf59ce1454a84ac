"""The tensors of DeepSeek-V3's multi-head latent attention (`deepseek_v3`, `glm4_moe_lite`)
as kvjax's `LatentQKV` holds them (`model/latent_attention.py`).

The file's heads are laid out [unturned, turned] in `q_b_proj` (or `q_proj`), the shared
turned key part last in `kv_a_proj_with_mqa` after the latent, and `kv_b_proj` gives each
head its unturned key and then its value dimensions. kvjax turns the leading dimensions of a
head, as the halves (x[i], x[i + r/2]): the turned part is moved first and, as the file's
RoPE turns pairs (x[2i], x[2i + 1]) (`rope_interleave`, the releases'), put in halves order,
which leaves every product of a query and a key as it was. The output projection's rows past
the value dimensions are zeros, as the values' are.
"""

from __future__ import annotations

import numpy as np

from kvjax import model as M

from .tensors import Params


def pairs_to_halves(turned: int) -> np.ndarray:
    """The order that puts dimensions turned as pairs (2i, 2i + 1) as halves (i, i + r/2)."""
    return np.concatenate([np.arange(0, turned, 2), np.arange(1, turned, 2)])


def read_latent_attention(p: Params, src: str, dst: str, c: M.TransformerConfig) -> None:
    """Layer `src`'s latent attention into `dst` (its self_attention/), its RoPE dimensions
    turned as pairs in the file (the readers refuse files that turn halves)."""
    d, heads, turned, unturned = c.d_model, c.num_heads, c.rotary_dims, c.latent_nope_dim
    order = pairs_to_halves(turned)
    src += "self_attn."

    def queries(rows_in):  # [heads · (unturned + turned), X] -> kernel [X, heads, turned + ...]
        rows = rows_in.reshape(heads, unturned + turned, -1)
        rows = np.concatenate([rows[:, unturned:][:, order], rows[:, :unturned]], axis=1)
        return rows.transpose(2, 0, 1)

    if c.latent_q_rank:
        rank = c.latent_q_rank
        p.set(dst + "latent/q_down/kernel", p.read(src + "q_a_proj.weight", (rank, d)).T)
        p.set(dst + "latent/q_norm/scale", p.read(src + "q_a_layernorm.weight", (rank,)))
        p.set(dst + "latent/q_up/kernel", queries(p.read(
            src + "q_b_proj.weight", (heads * (unturned + turned), rank))))
    else:
        p.set(dst + "latent/q/kernel", queries(p.read(
            src + "q_proj.weight", (heads * (unturned + turned), d))))
    rank = c.latent_kv_rank
    down = p.read(src + "kv_a_proj_with_mqa.weight", (rank + turned, d))
    p.set(dst + "latent/kv_down/kernel", np.concatenate([down[:rank], down[rank:][order]]).T)
    p.set(dst + "latent/kv_norm/scale", p.read(src + "kv_a_layernorm.weight", (rank,)))
    up = p.read(src + "kv_b_proj.weight", (heads * (unturned + c.latent_value_dim), rank))
    p.set(dst + "latent/kv_up/kernel", up.reshape(heads, -1, rank).transpose(2, 0, 1))
    out = p.read(src + "o_proj.weight", (d, heads * c.latent_value_dim)).T.reshape(
        heads, c.latent_value_dim, d)
    p.set(dst + "out/kernel", np.pad(out, ((0, 0), (0, c.head_dim - c.latent_value_dim),
                                           (0, 0))))
