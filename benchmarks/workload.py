"""The serving benchmark's workload (`serve.py`), and what one contender's run of it gives:
the requests, with their prompts, token budgets and arrival times, and the tokens, time and
latencies a contender served them with."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax import model as M


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]  # seconds after the start

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(config: M.TransformerConfig, num_requests: int, rate: float,
                  prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int = 0, long_tail: bool = False, shared_prefix: int = 0) -> Workload:
    """Uniform prompt lengths and output lengths in the (inclusive) ranges; with `long_tail`
    the output lengths are log-uniform instead (many short answers, a few long ones, as in
    chat logs). Poisson arrivals at `rate` requests per second. With `shared_prefix` N,
    every prompt starts with the same N tokens (a system prompt or few-shot preamble)
    before its own; the rest of the workload is the one drawn without it."""
    prompt = shared_prefix + prompt_range[1]  # an encoder-decoder's is its source
    longest = max(prompt, M.prompt_slots(config, prompt) + output_range[1])
    if longest > config.max_len:
        raise ValueError(f"the shared prefix ({shared_prefix}), the longest prompt "
                         f"({prompt_range[1]}) and output ({output_range[1]}) need {longest} "
                         f"positions, more than the model's max_len {config.max_len}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_range[0], prompt_range[1] + 1, num_requests)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in lengths]
    if shared_prefix:
        preamble = np.random.default_rng([seed, 1]).integers(
            3, config.vocab_size, shared_prefix).tolist()
        prompts = [preamble + prompt for prompt in prompts]
    if long_tail:
        low, high = np.log(output_range[0]), np.log(output_range[1] + 1)
        outputs = np.exp(rng.uniform(low, high, num_requests)).astype(int).tolist()
    else:
        outputs = rng.integers(output_range[0], output_range[1] + 1, num_requests).tolist()
    arrivals = np.cumsum(rng.exponential(1 / rate, num_requests)).tolist()
    return Workload(prompts, outputs, arrivals)


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    tokens: int
    seconds: float
    ttft: np.ndarray  # per request
    itl: np.ndarray  # per token after the first

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds
