"""The token embedding and output logits every variant shares (`Embedder`): token table,
positions added where they are learned or sinusoidal, and the logits of final hidden
states. Shape letters as in `model/cache.py`."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from . import int8_base
from .attention import soft_cap
from .config import TransformerConfig
from .norms import make_norm
from .positional import sinusoidal


class Embedder(nn.Module):
    """Token embedding (projected to D where `embedding_dim` is set, × √D, as in the paper,
    unless `scale_embeddings` is off, and × `embedding_multiplier`) plus positions, then
    normalised where `embedding_norm` is set; `logits` gives the output logits (plus a
    learned bias if `logits_bias`, divided by `logits_scaling`). With `per_stack_embeddings`
    the `stack` a call embeds for ("encoder" or "decoder") has its own learned positions
    (`encoder_position_embedding`, ...) and embedding norm."""

    config: TransformerConfig

    def setup(self):
        c = self.config
        width = c.embedding_dim or c.d_model
        self.embedding = nn.Embed(
            c.vocab_size, width, dtype=c.compute_dtype, param_dtype=c.weights_dtype,
            embedding_init=nn.initializers.normal(stddev=width**-0.5))
        if c.embedding_dim is not None:
            self.project_in = nn.Dense(c.d_model, use_bias=False, dtype=c.compute_dtype,
                                       param_dtype=c.weights_dtype)
            self.project_out = nn.Dense(c.embedding_dim, use_bias=False, dtype=c.compute_dtype,
                                        param_dtype=c.weights_dtype)
        learned = c.positional_encoding == "learned"
        if learned and c.per_stack_embeddings:
            self.encoder_position_embedding, self.decoder_position_embedding = (
                self.param(f"{stack}_position_embedding", nn.initializers.normal(stddev=0.02),
                           (c.max_len, c.d_model), c.weights_dtype)
                for stack in ("encoder", "decoder"))
        elif learned:
            self.position_embedding = self.param(
                "position_embedding", nn.initializers.normal(stddev=0.02),
                (c.max_len, c.d_model), c.weights_dtype)
        if not c.tie_embeddings:
            self.unembed = nn.Dense(c.vocab_size, use_bias=False, dtype=c.compute_dtype,
                                    param_dtype=c.weights_dtype)
        if c.embedding_norm and c.per_stack_embeddings:
            self.encoder_embedding_norm = make_norm(c, "encoder_embedding_norm")
            self.decoder_embedding_norm = make_norm(c, "decoder_embedding_norm")
        elif c.embedding_norm:
            self.embedding_norm = make_norm(c, "embedding_norm")
        if c.logits_bias:
            self.logits_bias = self.param("logits_bias", nn.initializers.zeros_init(),
                                          (c.vocab_size,), c.weights_dtype)
        self.dropout = nn.Dropout(c.dropout)

    def __call__(self, tokens_BT, positions_BT, stack: str = "decoder"):
        c = self.config
        own = f"{stack}_" if c.per_stack_embeddings else ""
        x = self.embedding(tokens_BT)
        if c.embedding_dim is not None:
            x = self.project_in(x)
        if c.scale_embeddings:
            x = x * jnp.sqrt(float(c.d_model)).astype(c.compute_dtype)
        if c.embedding_multiplier != 1.0:
            x = x * c.embedding_multiplier
        if c.positional_encoding == "sinusoidal":
            x = x + sinusoidal(positions_BT + c.sinusoid_offset, c.d_model,
                               c.sinusoid_layout).astype(x.dtype)
        elif c.positional_encoding == "learned":
            table = getattr(self, f"{own}position_embedding")
            x = x + jnp.take(table, positions_BT, axis=0).astype(x.dtype)
        if c.embedding_norm:
            x = getattr(self, f"{own}embedding_norm")(x)
        return self.dropout(x, deterministic=not self.has_rng("dropout"))

    def logits(self, x_BTD):
        """Float32 logits [B, T, V] (sampling and losses want full precision)."""
        if self.config.embedding_dim is not None:  # D is the table's width from here
            x_BTD = self.project_out(x_BTD)
        if self.config.tie_embeddings:
            table_VD, x_BTD = nn.dtypes.promote_dtype(self.embedding.embedding, x_BTD,
                                                      dtype=self.config.compute_dtype)
            # The table as the left operand: a matrix-vector product streams the rows of a
            # row-major [V, D] matrix as they lie; `x @ table.T` makes XLA:CPU copy a
            # transposed table on every decode step.
            logits = jnp.einsum("VD,BTD->BTV", table_VD, x_BTD).astype(jnp.float32)
        else:
            logits = self.unembed(x_BTD).astype(jnp.float32)
        if self.config.logits_bias:
            logits = logits + self.logits_bias.astype(jnp.float32)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return soft_cap(logits, self.config.logits_softcap)


def embedder(config: TransformerConfig) -> nn.Module:
    """The `Embedder` of `config`; with `kernel_dtype="int8"` its int8 table (and output
    kernel) are made into float arrays where it runs (`int8_base.decoding_unpack_fn`)."""
    if config.kernel_dtype != "int8":
        return Embedder(config)
    mapped = nn.map_variables(Embedder, "params", mutable=False, methods=["__call__", "logits"],
                              trans_in_fn=int8_base.decoding_unpack_fn(config))
    return mapped(config)
