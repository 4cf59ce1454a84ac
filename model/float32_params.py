"""The params a model holds in float32 whatever its dtype, and casts that leave them so.

Two kinds: the float32 scales beside int8 values (`model/int8_base.py`: `kernel_scale`,
`embedding_scale`, `<expert kernel>_scale`), which a rounding would shift every value they
scale; and a router's bias of its choice (`selection_bias`, `model/experts.py`), added to
float32 scores whose small differences pick a token's experts, as transformers keeps
DeepSeek-V3's `e_score_correction_bias` in float32 in a bfloat16 model. A model built in
bfloat16 declares them float32, so a cast that rounded them would give params the model
does not take.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOAT32_PARAMS = ("selection_bias",)


def is_scale(name: str) -> bool:
    """Whether a param named `name` is the float32 scale of int8 values."""
    return name.endswith("_scale")


def keeps_float32(name: str) -> bool:
    """Whether a param named `name` stays float32 whatever the model's dtype."""
    return is_scale(name) or name in FLOAT32_PARAMS


def cast_floats(tree, dtype):
    """`tree` with its floating-point arrays in `dtype`, but those `keeps_float32` names."""
    def cast(path, x):
        name = str(getattr(path[-1], "key", "")) if path else ""
        if jnp.issubdtype(x.dtype, jnp.floating) and not keeps_float32(name):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map_with_path(cast, tree)
