"""decode/acceptance.py's `choose` on logits made by hand: a greedy row keeps exactly the
longest prefix of its draft the argmax agrees with, then the argmax; a sampled row's first
token follows the model's filtered distribution whatever was drafted, with a drafted token
(prompt lookup) or a draft model's distribution (rejection sampling)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_draft_model import chi_square

from kvjax.decode.acceptance import choose
from kvjax.decode.sampling import SamplingParams


def test_a_greedy_row_keeps_the_prefix_the_argmax_agrees_with_then_the_argmax():
    rng = np.random.default_rng(0)
    batch, num_draft, vocab = 64, 4, 7
    logits = rng.normal(size=(batch, num_draft + 1, vocab)).astype(np.float32)
    argmax = logits.argmax(-1)
    # Drafts that agree with the argmax for a random number of tokens, then do not.
    agree = rng.integers(0, num_draft + 1, batch)
    drafts = np.where(np.arange(num_draft) < agree[:, None], argmax[:, :num_draft],
                      (argmax[:, :num_draft] + 1) % vocab)
    valid = rng.integers(0, num_draft + 1, batch)
    tokens, accepted = jax.jit(choose)(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32),
                                       jnp.asarray(valid, jnp.int32), SamplingParams.make(),
                                       jax.random.split(jax.random.key(0), batch))
    for b in range(batch):
        keep = min(agree[b], valid[b])  # a draft past the row's valid ones is never kept
        assert accepted[b] == keep, b
        np.testing.assert_array_equal(tokens[b, :keep], drafts[b, :keep])
        assert tokens[b, keep] == argmax[b, keep]


def filtered_probs(logits, top_k):
    kept = np.where(logits >= np.sort(logits)[-top_k], logits, -np.inf)
    probs = np.exp(kept - kept.max())
    return probs / probs.sum()


@pytest.mark.parametrize("with_draft_model", [False, True], ids=["drafted_token", "draft_model"])
def test_a_sampled_rows_first_token_follows_the_model_whatever_was_drafted(with_draft_model):
    rows, vocab, top_k = 40_000, 6, 5
    logits = np.array([[1.2, 0.3, -0.4, 0.8, -1.5, 0.1], [0.0] * vocab], np.float32)
    p = filtered_probs(logits[0], top_k)
    rng = np.random.default_rng(1)
    # Each row drafts one token: often a likely one, sometimes one the model never emits.
    q = np.array([0.05, 0.1, 0.05, 0.5, 0.2, 0.1])
    drafts = rng.choice(vocab, size=(rows, 1), p=q).astype(np.int32)
    draft_probs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (rows, 1, vocab))

    @jax.jit
    def first_tokens(keys):
        tokens, _ = choose(jnp.broadcast_to(jnp.asarray(logits), (rows, 2, vocab)),
                           jnp.asarray(drafts), jnp.ones(rows, jnp.int32),
                           SamplingParams.make(temperature=1.0, top_k=top_k, batch=rows), keys,
                           draft_probs if with_draft_model else None)
        return tokens[:, 0]

    counts = np.bincount(np.asarray(first_tokens(jax.random.split(jax.random.key(2), rows))),
                         minlength=vocab)
    assert counts[p == 0].sum() == 0  # the token top-k removes is never emitted
    statistic, bound = chi_square(counts, p, rows)
    assert statistic < bound, (counts / rows, p)
