"""The logprobs of a prompt's own tokens, which `echo` with `logprobs` and vLLM's
`prompt_logprobs` report (evaluation harnesses score a text this way: `max_tokens` 0,
`echo`, `logprobs`).

One teacher-forced pass over the prompt, its length bucketed as a prefill's is. Shape letters:
P padded prompt length, V vocab, A top logprobs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as M
from kvjax.decode.buckets import bucket
from kvjax.decode.tracing import count_trace
from kvjax.model import lora_rows

from .slots import MAX_TOP_LOGPROBS


class PromptScores(NamedTuple):
    """Per prompt token, None for the first (nothing predicts it): its logprob given the
    tokens before it, the likeliest (id, logprob) pairs there, and its rank among them all
    (1: the likeliest; tokens as likely as it share its rank)."""

    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]
    ranks: list[int | None]


@functools.partial(jax.jit, static_argnums=0)
def _scores(config: M.TransformerConfig, params, tokens_1P, length_1, adapters=None,
            adapter_1=None):
    """(logprob [P - 1] of each token after the first, top logprobs and ids [P - 1, W], its
    rank [P - 1]: 1 + how many tokens are likelier)."""
    count_trace("serve_prompt_logprobs")
    logits_PV = M.teacher_forced_logits(config, params, {"inputs": tokens_1P,
                                                         "lengths": length_1},
                                        adapters=lora_rows.for_rows(adapters, adapter_1))[0]
    logprobs_PV = jax.nn.log_softmax(logits_PV.astype(jnp.float32))[:-1]
    chosen_P = jnp.take_along_axis(logprobs_PV, tokens_1P[0, 1:, None], axis=-1)[:, 0]
    top_PA, ids_PA = jax.lax.top_k(logprobs_PV, min(MAX_TOP_LOGPROBS, config.vocab_size))
    rank_P = 1 + jnp.sum(logprobs_PV > chosen_P[:, None], axis=-1)
    return chosen_P, top_PA, ids_PA, rank_P


def prompt_logprobs(config: M.TransformerConfig, params, prompt: tuple[int, ...], top: int,
                    adapter: int = 0, adapters: lora_rows.AdapterStack | None = None
                    ) -> PromptScores:
    """Each prompt token's logprob given the tokens before it, the `top` likeliest
    (id, logprob) there and its rank. With `adapters`, the model adds the one numbered
    `adapter` (0: none; `model.lora_rows`)."""
    if M.prompt_is_source(config):
        raise ValueError("an encoder-decoder's prompt is the source it reads, not text it "
                         "predicts: its tokens have no logprobs")
    padded = np.zeros((1, bucket(len(prompt), config.max_len)), np.int32)
    padded[0, :len(prompt)] = prompt
    adapter_1 = None if adapters is None else np.array([adapter], np.int32)
    chosen, values, ids, ranks = jax.device_get(_scores(
        config, params, padded, np.array([len(prompt)], np.int32), adapters, adapter_1))
    count = len(prompt) - 1
    tops = [list(zip(ids[t, :top].tolist(), values[t, :top].tolist(), strict=True))
            for t in range(count)]
    return PromptScores([None, *chosen[:count].tolist()], [None, *tops],
                        [None, *ranks[:count].tolist()])
