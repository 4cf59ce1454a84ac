"""decode/prompt_lookup.py: a row's draft is what followed the latest earlier occurrence of its
context's last n-gram."""


import jax.numpy as jnp
import numpy as np

from kvjax.decode import speculative as spec


def test_draft_follows_the_latest_earlier_occurrence_of_the_suffix():
    context = jnp.asarray([[4, 5, 6, 7, 4, 5, 8, 9, 4, 5, 0, 0],   # latest (4, 5) is at 4
                           [1, 2, 3, 1, 2, 0, 0, 0, 0, 0, 0, 0],
                           [1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 0],   # no earlier occurrence
                           [7, 7, 7, 7, 7, 7, 0, 0, 0, 0, 0, 0],   # the latest with 3 after
                           [9, 9, 1, 2, 1, 2, 0, 0, 0, 0, 0, 0]])  # two tokens follow (1, 2)
    lengths = jnp.asarray([10, 5, 6, 6, 6])
    drafts, valid = spec.ngram_drafts(context, lengths, jnp.asarray(2), 3)
    np.testing.assert_array_equal(valid, [3, 3, 0, 3, 2])
    np.testing.assert_array_equal(np.asarray(drafts)[[0, 1, 3]], [[8, 9, 4], [3, 1, 2], [7, 7, 7]])
    np.testing.assert_array_equal(drafts[4, :2], [1, 2])
    drafts, valid = spec.ngram_drafts(context, lengths, jnp.asarray(3), 3)
    np.testing.assert_array_equal(valid, [0, 0, 0, 3, 0])  # only row 3 repeats a 3-gram
