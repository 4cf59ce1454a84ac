"""What a Hugging Face model's `generation_config.json` says about token ids, as transformers'
`generate` applies it: the ids that end generation (`eos_token_id`), the first target token
it forces (`forced_bos_token_id`), the end it forces at the length limit
(`forced_eos_token_id`) and the single tokens it bans (`bad_words_ids`); and the sampling
settings its authors chose (`temperature`, `top_k`, `top_p`, `min_p`,
`repetition_penalty`), which a server takes for what a request leaves out, as vLLM does.
Every id must be one the tokenizer knows; what kvjax cannot apply (several forced ends, a bad
word of several tokens, a setting that is not a number) is refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class GenerationRules:
    """stop_ids: the ids that end generation, the tokenizer's eos first; target_prefix: what
    a target starts with; forced_end: the id made last at the limit, or None; banned_ids:
    the ids never made (one-token `bad_words_ids`); bad_words: the sequences of several ids
    never completed (the longer `bad_words_ids`); sampling: the (setting, value) pairs of
    `SAMPLING_KEYS` the file names."""

    stop_ids: tuple[int, ...]
    target_prefix: tuple[int, ...]
    forced_end: int | None
    banned_ids: tuple[int, ...]
    sampling: tuple[tuple[str, float | int], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def read(cls, generation: dict, eos_id: int | None, known: np.ndarray) -> GenerationRules:
        """The rules of `generation` (the file's JSON object) for a tokenizer whose eos is
        `eos_id` and whose ids are those `known` [vocab] marks."""
        ends = generation.get("eos_token_id", [])
        stops = [eos_id] * (eos_id is not None) + (
            [ends] if isinstance(ends, int) else list(ends or []))
        forced = generation.get("forced_bos_token_id")
        forced_end = generation.get("forced_eos_token_id")
        if isinstance(forced_end, list) and len(forced_end) == 1:
            forced_end = forced_end[0]
        if isinstance(forced_end, list):  # transformers lets the model choose among them
            raise ValueError(f"generation_config.json forced_eos_token_id {forced_end}: "
                             f"kvjax forces one end token")
        bad_words = generation.get("bad_words_ids") or []
        if not isinstance(bad_words, list) or any(
                not isinstance(w, list) or not w for w in bad_words):
            raise ValueError(f"generation_config.json bad_words_ids {bad_words}: a list of "
                             f"token id lists")
        sampling = tuple((key, generation[key]) for key in SAMPLING_KEYS
                         if generation.get(key) is not None)
        for key, value in sampling:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"generation_config.json {key} {value!r} is not a number")
        rules = cls(stop_ids=tuple(dict.fromkeys(stops)),
                    target_prefix=() if forced is None else (forced,), forced_end=forced_end,
                    banned_ids=tuple(dict.fromkeys(w[0] for w in bad_words if len(w) == 1)),
                    sampling=sampling,
                    bad_words=tuple(dict.fromkeys(tuple(w) for w in bad_words if len(w) > 1)))
        for name, ids in (("eos_token_id", rules.stop_ids),
                          ("forced_bos_token_id", rules.target_prefix),
                          ("forced_eos_token_id", () if forced_end is None else (forced_end,)),
                          ("bad_words_ids", rules.banned_ids + sum(rules.bad_words, ()))):
            for i in ids:
                if not isinstance(i, int) or not 0 <= i < known.size or not known[i]:
                    raise ValueError(f"generation_config.json {name} {i!r} is not a token id")
        return rules
