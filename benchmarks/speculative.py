"""`kvjax bench speculative`: greedy tokens/s with speculative decoding against plain greedy.

The drafts come from prompt lookup, or from a draft model: another checkpoint with the same
tokenizer (`draft_checkpoint`; the target's own directory gives the upper bound on
acceptance) or the target's first `draft_layers` layers.

Two tasks on the shipped Python-docs LM, each prompt a passage of CPython's own
documentation (`pydoc_data.topics`, what the model was trained on):
  - copying: the passage, then its first tokens again, so the text to come is in the prompt;
  - fresh: the passage alone, so whatever follows has to be made up.
With `preset`, a model of that size with random weights instead, on random-token passages
(its greedy output soon repeats itself, which the drafts then copy).
Each is timed at every batch size (rows are different passages), plain and speculative,
best of `repeats` after a compiling run; the outputs are checked to be the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from kvjax import decode, text
from kvjax import model as M
from kvjax.decode import draft_model

from .floors import best_seconds

DEFAULT_CHECKPOINT = "checkpoints/python-docs-lm"


@dataclasses.dataclass(frozen=True)
class Row:
    task: str
    batch: int
    plain_tokens_per_s: float
    speculative_tokens_per_s: float
    acceptance: float
    tokens_per_step: float
    same_tokens: bool


def passages(loaded: text.LoadedModel | None, count: int, length: int,
             vocab_size: int = 0) -> list[list[int]]:
    """`count` passages of `length` tokens, each from its own documentation topic (random
    tokens without a `loaded` model)."""
    from pydoc_data.topics import topics

    if loaded is None:
        rng = np.random.default_rng(0)
        return rng.integers(3, vocab_size, (count, length)).tolist()

    found = []
    for name in sorted(topics):
        body = topics[name].split("\n", 3)[-1]  # past the title and its underline
        ids = loaded.tokenizer.encode(body)
        if len(ids) >= length:
            found.append(ids[:length])
        if len(found) == count:
            return found
    raise ValueError(f"only {len(found)} topics have {length} tokens, {count} needed")


def prompts_of(task: str, rows: list[list[int]], repeat: int) -> list[list[int]]:
    if task == "copying":
        return [row + row[:repeat] for row in rows]
    return rows


def best_of(run, repeats: int) -> tuple[float, decode.GenerateOutput]:
    """(`best_seconds` of `run` after a call that compiles it, the last call's output)."""
    last = [run()]

    def timed():
        last[0] = run()
        return last[0]

    return best_seconds(timed, repeats), last[0]


def _model(checkpoint: str, preset: str | None):
    """(net, params, loaded model or None for random weights)."""
    if preset is None:
        loaded = text.load(checkpoint)
        return loaded.net, loaded.params, loaded
    config = M.preset(preset)
    return M.build_model(config), M.init_params(config, jax.random.key(0)), None


def drafting(net, params, num_draft_tokens: int, ngram_size: int,
             draft_checkpoint: str | None, draft_layers: int | None,
             min_tokens_per_call: float = 2.0) -> decode.Speculative:
    """Prompt lookup, or the draft model that `draft_checkpoint` or `draft_layers` name."""
    if draft_checkpoint is not None:
        draft = text.load(draft_checkpoint)
        draft_net, draft_params = draft.net, draft.params
    elif draft_layers is not None:
        draft_net, draft_params = draft_model.first_layers(net.config, params, draft_layers)
    else:
        return decode.Speculative("ngram", num_draft_tokens, ngram_size,
                                  min_tokens_per_call=min_tokens_per_call)
    return decode.Speculative("draft", num_draft_tokens, draft_model=draft_net,
                              draft_params=draft_params,
                              min_tokens_per_call=min_tokens_per_call)


def speculative_benchmark(checkpoint: str = DEFAULT_CHECKPOINT, preset: str | None = None,
                          batch_sizes: Sequence[int] = (1, 8), prompt_len: int = 96,
                          new_tokens: int = 96, num_draft_tokens: int = 4, ngram_size: int = 2,
                          repeats: int = 10, draft_checkpoint: str | None = None,
                          draft_layers: int | None = None,
                          min_tokens_per_call: float = 2.0) -> list[Row]:
    net, params, loaded = _model(checkpoint, preset)
    drafts = drafting(net, params, num_draft_tokens, ngram_size, draft_checkpoint,
                      draft_layers, min_tokens_per_call)
    table = []
    for task in ("copying", "fresh"):
        for batch in batch_sizes:
            rows = passages(loaded, batch, prompt_len, net.config.vocab_size)
            prompts = prompts_of(task, rows, repeat=8)

            def run(speculative=None, prompts=prompts):
                return decode.generate(net, params, prompts,
                                       max_new_tokens=new_tokens, speculative=speculative)

            plain_s, plain = best_of(run, repeats)
            fast_s, fast = best_of(lambda: run(drafts), repeats)
            generated = int(plain.lengths.sum())
            stats = fast.speculation
            table.append(Row(task, batch, generated / plain_s, generated / fast_s,
                             stats.acceptance_rate, new_tokens / max(stats.steps + 1, 1),
                             np.array_equal(plain.tokens, fast.tokens)))
    return table


def format_table(rows: Sequence[Row], num_draft_tokens: int, ngram_size: int,
                 drafts_from: str | None = None) -> str:
    """`drafts_from` names the draft model; None: prompt lookup with `ngram_size`."""
    method = (f"prompt lookup (n={ngram_size})" if drafts_from is None
              else f"the draft model {drafts_from}")
    lines = [f"greedy decoding, k={num_draft_tokens} tokens drafted by {method}",
             "| task | batch | plain tokens/s | speculative tokens/s | speed-up | acceptance "
             "| tokens per model call | same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.task} | {r.batch} | {r.plain_tokens_per_s:,.0f} | "
                     f"{r.speculative_tokens_per_s:,.0f} | "
                     f"{r.speculative_tokens_per_s / r.plain_tokens_per_s:.2f}x | "
                     f"{r.acceptance:.0%} | {r.tokens_per_step:.2f} | "
                     f"{'yes' if r.same_tokens else 'NO'} |")
    return "\n".join(lines)
