"""Each precision measured: cache bytes, decode speed, and the quality of the shipped models.

Settings (`SETTINGS`): float32; bfloat16 (params, compute and cache); an int8 cache with
float32 compute; bfloat16 with an int8 cache; the layers' kernels int8 with float32 and with
bfloat16 compute. For each:

- the params' bytes (random weights of `preset`);
- cache bytes per sequence (`cache_size_bytes`, the formula `KVCache.nbytes` equals);
- decode tokens/s of `batch` rows with `filled` slots of a `filled`-slot cache, random
  weights (greedy steps in one compiled loop, as `fill_sweep` times them, best of `repeats`);
- the shipped LM's validation perplexity (the prefill's logits over held-out windows, so
  with an int8 cache every position attends over quantised K/V), its top-1 agreement with
  float32 on those positions, and how many greedy tokens from a few prompts equal
  float32's before the first that differs;
- the shipped translator's exact-match accuracy on held-out numbers, greedy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import decode, text
from kvjax import model as M
from kvjax.model.cache_size import format_bytes

from .fill_sweep import _Timed

# name: (dtype of params, compute and cache; cache_dtype; kernel_dtype)
SETTINGS = {
    "float32": (None, None, None),
    "bfloat16": ("bfloat16", None, None),
    "int8 cache": (None, "int8", None),
    "bfloat16 + int8 cache": ("bfloat16", "int8", None),
    "int8 kernels": (None, None, "int8"),
    "bfloat16 + int8 kernels": ("bfloat16", None, "int8"),
}
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
LM_PROMPTS = ("The for statement", "A class", "The import system", "Exceptions are",
              "The with statement", "A list")


def setting(config: M.TransformerConfig, params, name: str):
    """`(config, params)` of the setting `name` of `SETTINGS`."""
    return M.with_precision(config, params, *SETTINGS[name])


def params_bytes(config: M.TransformerConfig) -> dict[str, int]:
    """Bytes of the params of `config` per setting."""
    params = jax.eval_shape(functools.partial(M.init_params, config), jax.random.key(0))
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), params)
    return {name: sum(x.nbytes for x in jax.tree.leaves(setting(config, zeros, name)[1]))
            for name in SETTINGS}


def cache_bytes(config: M.TransformerConfig, length: int) -> dict[str, int]:
    """Bytes of one sequence's cache of `length` tokens per setting."""
    return {name: M.cache_size_bytes(setting(config, {}, name)[0], 1, length).total
            for name in SETTINGS}


def decode_speed(preset: str = "gpt-mini", batch: int = 32, filled: int = 1024,
                 repeats: int = 3, steps: int = 8,
                 log: Callable[[str], None] = print) -> dict[str, float]:
    """Decode tokens/s (all rows) per setting at `filled` slots of a `filled`-slot cache."""
    config = M.preset(preset, max_len=max(filled, M.preset(preset).max_len))
    params = M.init_params(config, jax.random.key(0))
    timed = {}
    for name in SETTINGS:
        log(f"precision: compiling {name} ...")
        timed[name] = _Timed(*setting(config, params, name), batch, filled, filled, steps)
        timed[name].time()
    for repeat in range(repeats):
        log(f"precision: repeat {repeat + 1} of {repeats} ...")
        for contender in timed.values():
            contender.time()
    return {name: batch / contender.best for name, contender in timed.items()}


@functools.partial(jax.jit, static_argnums=0)
def _window_logits(config: M.TransformerConfig, params, inputs_BT):
    """Logits [B, T, V] of a prefill over whole windows: every position attends over the
    K/V the cache holds (quantised for an int8 cache)."""
    net = M.build_model(config)
    cache = M.init_cache(config, inputs_BT.shape[0], inputs_BT.shape[1])
    return net.apply({"params": params}, inputs_BT, cache, fresh=True)[0]


def lm_windows(loaded: text.LoadedModel, max_windows: int = 64) -> np.ndarray:
    """Held-out windows [N, T + 1] of the shipped LM's validation text."""
    from kvjax.train import data, tasks

    settings = tasks.LM_SETTINGS
    ids = data.tokenize_documents(loaded.tokenizer, [data.python_docs_text()])
    windows = data.pack_lm_windows(ids, settings.seq_len)
    _, val = data.split_train_val(windows, settings.val_fraction, 0)
    return val[:max_windows]


@dataclasses.dataclass(frozen=True)
class LMQuality:
    perplexity: float
    top1_agreement: float  # share of positions whose argmax equals float32's
    greedy_prefix: int  # greedy tokens equal to float32's before the first that differs
    greedy_total: int


def lm_quality(loaded: text.LoadedModel, windows: np.ndarray, new_tokens: int = 32,
               batch: int = 16) -> dict[str, LMQuality]:
    """`LMQuality` of the loaded LM per setting (see the module docstring)."""
    prompts = [text.prompt_tokens(loaded, p) for p in LM_PROMPTS]
    results, reference = {}, None
    for name in SETTINGS:
        config, params = setting(loaded.config, loaded.params, name)
        nll, argmax = [], []
        for start in range(0, len(windows), batch):
            chunk = windows[start:start + batch]
            logits = _window_logits(config, params, jnp.asarray(chunk[:, :-1]))
            log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            targets = jnp.asarray(chunk[:, 1:])
            nll.append(-np.asarray(jnp.take_along_axis(log_probs, targets[..., None], -1)))
            argmax.append(np.asarray(jnp.argmax(logits, -1)))
        nll, argmax = np.concatenate([x.ravel() for x in nll]), np.concatenate(argmax)
        out = decode.generate(M.build_model(config), params, prompts, max_new_tokens=new_tokens)
        tokens = np.asarray(out.tokens)[:, :new_tokens]
        if reference is None:
            reference = argmax, tokens
        differs = tokens != reference[1]
        prefix = np.where(differs.any(1), differs.argmax(1), new_tokens)
        results[name] = LMQuality(float(np.exp(nll.mean())),
                                  float((argmax == reference[0]).mean()),
                                  int(prefix.sum()), tokens.size)
    return results


def translator_accuracy(loaded: text.LoadedModel, count: int = 1000) -> dict[str, float]:
    """Greedy exact-match accuracy on `count` held-out numbers per setting."""
    from kvjax.tokenizer import EOS_ID
    from kvjax.train import data, tasks

    settings = tasks.TRANSLATE_SETTINGS
    _, heldout = data.number_pairs(settings.max_number,
                                   tasks.default_heldout(settings.max_number,
                                                         settings.num_heldout))
    pairs = heldout[:count]
    prompts = [text.prompt_tokens(loaded, source) for source, _ in pairs]
    accuracy = {}
    for name in SETTINGS:
        config, params = setting(loaded.config, loaded.params, name)
        out = decode.generate(M.build_model(config), params, prompts, max_new_tokens=32,
                              eos_ids=(EOS_ID,))
        got = [loaded.tokenizer.decode(t[:-1]) for t in out.token_lists()]
        accuracy[name] = float(np.mean([g == words for g, (_, words) in zip(got, pairs,
                                                                          strict=True)]))
    return accuracy


def precision_report(preset: str = "gpt-mini", batch: int = 32, filled: int = 1024,
                     repeats: int = 3, quality: bool = True,
                     log: Callable[[str], None] = print) -> str:
    """Every measurement of the module docstring as a Markdown table."""
    config = M.preset(preset)
    rows = {name: [] for name in SETTINGS}
    header = [f"params bytes ({preset})"]
    for name, size in params_bytes(config).items():
        rows[name].append(format_bytes(size))
    header.append(f"cache bytes/sequence ({preset}, {config.max_len} tokens)")
    for name, size in cache_bytes(config, config.max_len).items():
        rows[name].append(format_bytes(size))
    header.append(f"decode tokens/s (batch {batch}, {filled} filled)")
    for name, speed in decode_speed(preset, batch, filled, repeats, log=log).items():
        rows[name].append(f"{speed:,.0f}")
    if quality:
        log("precision: the shipped LM ...")
        lm = text.load(CHECKPOINTS / "python-docs-lm")
        header += ["LM bytes/sequence (128 tokens)", "LM val perplexity",
                   "LM top-1 same as float32", "LM greedy tokens before a difference"]
        for name, size in cache_bytes(lm.config, 128).items():
            rows[name].append(format_bytes(size))
        for name, q in lm_quality(lm, lm_windows(lm)).items():
            rows[name] += [f"{q.perplexity:.3f}", f"{q.top1_agreement:.2%}",
                           f"{q.greedy_prefix}/{q.greedy_total}"]
        log("precision: the shipped translator ...")
        numbers = text.load(CHECKPOINTS / "numbers-to-words")
        header.append("translator accuracy (1,000 held out)")
        for name, accuracy in translator_accuracy(numbers).items():
            rows[name].append(f"{accuracy:.1%}")
    lines = ["| setting | " + " | ".join(header) + " |",
             "|---|" + "---:|" * len(header)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
    return "\n".join(lines)
