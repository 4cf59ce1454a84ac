"""OpenAI's request bodies as engine requests, and the engine's output as OpenAI's answers.

`parse` checks every field it knows for its JSON type (a wrong type is an `APIError` 400
naming the field) and builds one `GenerationRequest` per prompt; the ranges of the values
are checked by `GenerationRequest.checked`, whose ValueError the server answers with a 400
as well. Fields this server does not implement with a value other than their no-op one
(`best_of`, `suffix`; tools on /v1/completions; vLLM's `logits_processors`) are a 400
naming them, never ignored; fields it does not know are ignored, as OpenAI's API does.
`max_tokens` 0 is accepted with `echo` or vLLM's `prompt_logprobs` (the answer is the prompt,
with its logprobs if asked).
Sampling defaults are OpenAI's: temperature 1, top_p 1, presence and frequency penalties 0
(counted over the request's output, as OpenAI and vLLM count them), no `logit_bias` (an
object of token ids, as strings, to biases in [-100, 100]); kvjax's extra settings (`top_k`,
`min_p`, `repetition_penalty`, `no_repeat_ngram_size`, `min_tokens`, `stop_token_ids`,
`ignore_eos`, `add_special_tokens`, whose false leaves a completion's text unframed, and
`truncate_prompt_tokens`, which keeps a prompt's last tokens: `prompts.py`,
`return_tokens_as_token_ids`, `include_stop_str_in_output`, `skip_special_tokens` and
`prompt_logprobs`, each prompt token's logprob, rank and likeliest alternatives:
`answers.py`) are read where given, as vLLM does.
Structured output (`response_format`, `structured_outputs`), a translator's
`target_language` and tools are read by `structured.py` and `tools.py`. A chat request's
`chat_template_kwargs` (an object) are more variables for the model's chat template, as vLLM
takes them, and OpenAI's `reasoning_effort` is one more (gpt-oss's template reads it;
chat_template_kwargs' wins); vLLM's `add_generation_prompt` and `continue_final_message`
end the prompt as they ask (`chat.render`); with a reasoning parser (`reasoning.py`,
`harmony.py`) its choices are split into reasoning and content.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax import model as M
from kvjax import text as T
from kvjax.decode.bad_words import word_ids
from kvjax.decode.constraints import StartsWith
from kvjax.decode.settings import Sampling

from . import chat, harmony, reasoning, structured
from .fields import BOOL, INT, NUMBER, OBJECT, STR, APIError, get_field, shown
from .prompts import chat_prompt, completion_prompts, decode_prompt, truncated
from .requests import GenerationRequest
from .slots import MAX_TOP_LOGPROBS
from .tools import Tools, parse_tools

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A request as the server runs it: one `GenerationRequest` per prompt (their samples
    are choices `prompt * n + sample`), the text each choice starts with (its prompt if
    `echo_prompt`, whose tokens' logprobs then come first if `logprobs`; a chat's: the final
    message it continues, with vLLM's `echo`), how to answer (a chat's in `role`)."""

    chat: bool
    model: str
    requests: tuple[GenerationRequest, ...]
    echo: tuple[str, ...]
    echo_prompt: bool
    stream: bool
    include_usage: bool
    logprobs: bool
    tools: Tools | None = None
    # With a reasoning parser, how this request's chat choices split (`reasoning.Think`,
    # `harmony.Harmony`); None without one, or for /v1/completions.
    reasoning: reasoning.Think | harmony.Harmony | None = None
    # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far.
    continuous_usage: bool = False
    role: str = "assistant"
    # vLLM's return_tokens_as_token_ids: a logprob's token is "token_id:{id}", not its text.
    tokens_as_ids: bool = False
    # vLLM's prompt_logprobs: how many of the likeliest tokens each prompt position reports
    # beside the prompt's own; None when not asked.
    prompt_top: int | None = None


# vLLM's extensions that would change the answer, which this server does not implement:
# (name, its no-op value, a hint). Refused rather than ignored as unknown fields are.
_VLLM_UNSUPPORTED = [
    ("logits_processors", None, "")]


_TOOLS, _IT = " (tools are for /v1/chat/completions)", " (it is for /v1/chat/completions)"
# What only a chat reads: (name, its no-op value, a hint), refused by /v1/completions.
CHAT_ONLY_FIELDS = [
    ("tools", [], _TOOLS), ("tool_choice", "none", _TOOLS),
    ("chat_template_kwargs", {}, " (they are for /v1/chat/completions)"),
    ("add_generation_prompt", True, _IT), ("continue_final_message", False, _IT),
    ("reasoning_effort", None, _IT)]


def _refuse_unsupported(body: dict, chat_api: bool) -> None:
    unsupported = [("suffix", "", ""), *_VLLM_UNSUPPORTED]
    if not chat_api:
        unsupported += CHAT_ONLY_FIELDS
    else:
        hint = " on /v1/chat/completions"
        unsupported += [("chat_template", None, hint),
                        ("documents", None, hint),
                        ("add_special_tokens", False, " on /v1/chat/completions (the chat "
                                                      "template places the model's own)"),
                        # OpenAI's: the functions API before tools, other modalities, search
                        ("functions", [], " (tools replaced it)"),
                        ("function_call", "none", " (tool_choice replaced it)"),
                        ("modalities", ["text"], " (this model answers text)"),
                        ("audio", None, ""), ("web_search_options", None, ""),
                        ("verbosity", "medium", "")]
    for name, off, hint in unsupported:
        if body.get(name) not in (None, off):
            raise APIError(400, f"{name}={shown(body[name])} is not supported by this "
                                f"server{hint}", name)
    if body.get("best_of") not in (None, body.get("n", 1)):
        raise APIError(400, f"best_of={shown(body['best_of'])} is not supported: use n",
                       "best_of")


def _logit_bias(body: dict) -> tuple[tuple[int, Any], ...]:
    """The request's logit_bias as (token id, bias) pairs; the ids and values are checked by
    `GenerationRequest.checked`."""
    bias = get_field(body, "logit_bias", OBJECT, {})
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdecimal()):
            raise APIError(400, f"logit_bias key {shown(key)} must be a token id (a string "
                                "of digits)", "logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)


def _prompt_top(body: dict, loaded: T.LoadedModel, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: a count of top logprobs per prompt token (-1: every token
    of the vocabulary), or None."""
    top = get_field(body, "prompt_logprobs", INT)
    if top is None:
        return None
    vocab = loaded.config.vocab_size
    if top < -1:
        raise APIError(400, f"prompt_logprobs={top} must be a count >= 0, or -1 for every "
                            "token", "prompt_logprobs")
    if top == -1 and vocab > MAX_TOP_LOGPROBS or top > MAX_TOP_LOGPROBS:
        asked = f"-1 asks for all {vocab} tokens' logprobs" if top == -1 else f"{top}"
        raise APIError(400, f"prompt_logprobs={asked}: this server reports at most "
                            f"{MAX_TOP_LOGPROBS}", "prompt_logprobs")
    if stream:
        raise APIError(400, "prompt_logprobs are not available when stream is true",
                       "prompt_logprobs")
    if loaded.is_translation:
        raise APIError(400, "an encoder-decoder's prompt is the source it reads, not text it "
                            "predicts: its tokens have no logprobs", "prompt_logprobs")
    return vocab if top == -1 else top


def _skip_special_tokens(body: dict, loaded: T.LoadedModel) -> bool:
    """vLLM's `skip_special_tokens`; false is refused where the tokenizer cannot write them."""
    skip = get_field(body, "skip_special_tokens", BOOL, True)
    if not skip:
        try:
            loaded.tokenizer.decode([], skip_special_tokens=False)
        except ValueError as error:
            raise APIError(400, f"skip_special_tokens=false: {error}",
                           "skip_special_tokens") from None
    return skip


def _top_k(body: dict, default: int = 0) -> int:
    """kvjax's top_k (0 = no limit) from the request's, where vLLM's -1 also means none."""
    top_k = get_field(body, "top_k", INT, default)
    return 0 if top_k == -1 else top_k


def _stops(body: dict, max_count: int, max_chars: int) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"stop={shown(stop)} must be a string or a list of strings",
                       "stop")
    if len(stop) > max_count:
        raise APIError(400, f"stop has {len(stop)} strings: at most {max_count}", "stop")
    for i, text in enumerate(stop):
        if len(text) > max_chars:
            raise APIError(400, f"stop string {i} has {len(text)} characters: at most "
                                f"{max_chars}", "stop")
    return tuple(stop)


def _stop_ids(body: dict, tokenizer) -> tuple[int, ...]:
    """The ids that end a sample: the tokenizer's end-of-text ids (none with vLLM's
    `ignore_eos`, which benchmarks send to get every token they ask for) and vLLM's
    `stop_token_ids`; their range is checked by `GenerationRequest.checked`."""
    extra = body.get("stop_token_ids")
    extra = [] if extra is None else extra
    if not isinstance(extra, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in extra):
        raise APIError(400, f"stop_token_ids={shown(extra)} must be a list of token ids",
                       "stop_token_ids")
    own = () if get_field(body, "ignore_eos", BOOL, False) else tuple(tokenizer.stop_ids)
    return tuple(dict.fromkeys((*own, *extra)))


def _length_penalty(body: dict, beam: bool) -> float:
    """vLLM's `length_penalty`, which only a beam search (`use_beam_search`) reads."""
    penalty = get_field(body, "length_penalty", NUMBER, 1.0)
    if penalty != 1.0 and not beam:
        raise APIError(400, f"length_penalty={penalty} is for a beam search: set "
                            "use_beam_search", "length_penalty")
    return penalty


def _bad_words(body: dict, loaded: T.LoadedModel, beam: bool) -> tuple[tuple[int, ...], ...]:
    """The model's generation config's `bad_words_ids` of several tokens, then vLLM's
    `bad_words`: texts, each the token sequences `decode.bad_words.word_ids` makes of it;
    their count and lengths are checked by `GenerationRequest.checked`."""
    own = tuple(loaded.tokenizer.bad_words)
    words = body.get("bad_words")
    if not words:
        return own
    if beam:  # vLLM's beam search has no bad words; a beam search matches the prompt's too
        raise APIError(400, "bad_words is not used by beam search, which keeps the likeliest "
                            "tokens", "bad_words")
    if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
        raise APIError(400, f"bad_words={shown(words)} must be a list of strings", "bad_words")
    if loaded.is_translation:
        raise APIError(400, "bad_words are not supported for a translator: its tokenizer "
                            "writes source text, not its target's", "bad_words")
    try:
        return own + word_ids(loaded.tokenizer.encode, words)
    except ValueError as error:
        raise APIError(400, str(error), "bad_words") from None


def _reasoning(parser: str | None, prompt_text: str, tokenizer: Any, tools: Tools | None):
    """How a chat request's choices split by the server's reasoning `parser`."""
    if parser is None:
        return None
    if parser in reasoning.HARMONY_PARSERS:
        names = frozenset(f["name"] for f in tools.functions) if tools else frozenset()
        return harmony.Harmony(harmony.marker_ids(tokenizer), tokenizer.decode, names)
    return reasoning.Think(reasoning.starts_in_reasoning(prompt_text))


SAMPLING_DEFAULTS = ("model", "openai")


def model_sampling_defaults(loaded: T.LoadedModel, source: str = "model") -> dict:
    """{setting: value} that requests take where they leave a sampling setting out: with
    `source` "model", those the model's generation config names (Llama 3's temperature 0.6
    and top_p 0.9, Qwen3's top_k 20), as vLLM takes them; with "openai", none (OpenAI's
    own defaults: temperature 1, nothing filtered). A value `decode.Sampling` refuses is a
    ValueError naming it, before anything is served."""
    if source not in SAMPLING_DEFAULTS:
        raise ValueError(f"sampling_defaults={source!r} is not one of "
                         f"{', '.join(SAMPLING_DEFAULTS)}")
    defaults = dict(loaded.tokenizer.sampling_defaults) if source == "model" else {}
    try:
        Sampling(**defaults)
    except ValueError as error:
        raise ValueError(f"the model's generation config: {error} (sampling defaults "
                         f"'openai' leave its settings out)") from None
    return defaults


def requested_model(body: Any, names: tuple[str | None, ...]) -> str | None:
    """The `model` that `body` (a JSON object) names, one of `names` (None: an empty adapter
    slot), or None where it names none; another is a 404."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = get_field(body, "model", STR)
    if model is not None and model not in names:
        raise APIError(404, f"The model `{model}` does not exist: this server serves "
                            f"{', '.join(f'`{n}`' for n in names if n is not None)}", "model",
                       kind="not_found_error")
    return model


def parse(body: Any, loaded: T.LoadedModel, served_name: str, capacity: int, *,
          chat_api: bool, max_prompts: int = 64, max_stop_strings: int = 16,
          max_stop_chars: int = 1024, reasoning_parser: str | None = None,
          adapter_names: tuple[str | None, ...] = (),
          default_language: StartsWith | None = None,
          sampling_defaults: dict | None = None) -> Parsed:
    """The request in `body` (already JSON-decoded) for /v1/chat/completions if `chat_api`,
    else for /v1/completions, within the given bounds (see `limits.Limits`); a chat
    request's choices split into reasoning and content with a `reasoning_parser`
    (`reasoning.PARSERS`). Its `model` is `served_name` or one of `adapter_names`, the
    engine's LoRA adapter slots in order (None for an empty one), which its requests then
    add. A translator's request that holds its output to nothing starts its target with
    `default_language` (`structured.language`). `sampling_defaults` ({setting: value}, the
    model's, `model_sampling_defaults`) replace OpenAI's defaults for what a request leaves
    out."""
    names = (served_name, *adapter_names)
    model = requested_model(body, names)
    if model is None:
        raise APIError(400, "model is required: the name /v1/models lists", "model")
    _refuse_unsupported(body, chat_api)
    tools = parse_tools(body) if chat_api else None
    constraint, field = structured.requested(body, tools)
    language = structured.target_language(body, loaded.tokenizer, loaded.is_translation)
    if language is not None and constraint is not None:
        raise APIError(400, f"{field} and target_language both hold the output: a request "
                            f"takes one", "target_language")
    if constraint is None:
        constraint, field = language or default_language, "target_language"
    stream = get_field(body, "stream", BOOL, False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    include_usage = get_field(options, "include_usage", BOOL, False)
    continuous_usage = get_field(options, "continuous_usage_stats", BOOL, False)
    if continuous_usage and not include_usage:
        raise APIError(400, "stream_options.continuous_usage_stats needs include_usage: true",
                       "stream_options")
    if chat_api:
        ids, prompt_text = chat_prompt(loaded, body, tools)
        prompts = [ids]
        splits = _reasoning(reasoning_parser, prompt_text, loaded.tokenizer, tools)
        role, continued = chat.answer_role(
            body["messages"], get_field(body, "add_generation_prompt", BOOL, True))
        echo = [continued if get_field(body, "echo", BOOL, False) else ""]
        echo_prompt = False
        max_tokens = get_field(body, "max_completion_tokens", INT,
                               get_field(body, "max_tokens", INT))
        want_logprobs = get_field(body, "logprobs", BOOL, False)
        top = get_field(body, "top_logprobs", INT, 0)
        if top and not want_logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    else:
        if "prompt" not in body:
            raise APIError(400, "prompt is required", "prompt")
        prompts, texts = completion_prompts(
            loaded, body["prompt"], max_prompts,
            framed=get_field(body, "add_special_tokens", BOOL, True))
        splits = None
        max_tokens = get_field(body, "max_tokens", INT)
        top = get_field(body, "logprobs", INT)
        want_logprobs = top is not None
        if want_logprobs and not 0 <= top <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"logprobs={top} must be in [0, {MAX_COMPLETION_LOGPROBS}]",
                           "logprobs")
        echo_prompt = get_field(body, "echo", BOOL, False)
        if echo_prompt and want_logprobs and loaded.is_translation:
            raise APIError(400, "an encoder-decoder's prompt is the source it reads, not text "
                                "it predicts: its tokens have no logprobs", "logprobs")
        echo = texts if echo_prompt else [""] * len(prompts)
    cut = truncated(body, prompts, capacity)
    if cut is not None:  # an echo shows what the model reads
        echo = [decode_prompt(loaded, ids) if len(ids) < len(whole) and echo_prompt else text
                for ids, whole, text in zip(cut, prompts, echo, strict=True)]
        prompts = cut
    # A beam search samples nothing: left out, every setting is greedy decoding's.
    beam = get_field(body, "use_beam_search", BOOL, False)
    unset = {"temperature": 0.0 if beam else 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
             "repetition_penalty": 1.0} | ({} if beam else sampling_defaults or {})
    settings = dict(
        n=get_field(body, "n", INT, 1),
        sampling=Sampling(temperature=get_field(body, "temperature", NUMBER, unset["temperature"]),
                          top_p=get_field(body, "top_p", NUMBER, unset["top_p"]),
                          top_k=_top_k(body, unset["top_k"]),
                          min_p=get_field(body, "min_p", NUMBER, unset["min_p"]),
                          repetition_penalty=get_field(body, "repetition_penalty", NUMBER,
                                                       unset["repetition_penalty"]),
                          no_repeat_ngram_size=get_field(body, "no_repeat_ngram_size", INT, 0),
                          presence_penalty=get_field(body, "presence_penalty", NUMBER, 0.0),
                          frequency_penalty=get_field(body, "frequency_penalty", NUMBER, 0.0),
                          min_tokens=get_field(body, "min_tokens", INT, 0)),
        logit_bias=_logit_bias(body),
        seed=get_field(body, "seed", INT), stop=_stops(body, max_stop_strings, max_stop_chars),
        logprobs=top or 0, adapter=names.index(model),
        cache_salt=get_field(body, "cache_salt", STR),
        priority=get_field(body, "priority", INT, 0), beam_search=beam,
        length_penalty=_length_penalty(body, beam),
        include_stop=get_field(body, "include_stop_str_in_output", BOOL, False),
        skip_special_tokens=_skip_special_tokens(body, loaded),
        stop_ids=_stop_ids(body, loaded.tokenizer), forced_end_id=loaded.tokenizer.forced_end,
        banned_ids=loaded.tokenizer.banned_ids, bad_words=_bad_words(body, loaded, beam),
        constraint=None if constraint is None else structured.compiled(
            constraint, field, loaded.tokenizer))
    requests = []
    for ids in prompts:
        room = capacity - M.prompt_slots(loaded.config, len(ids))
        if room < 1:
            raise APIError(400, f"the prompt has {len(ids)} tokens: it leaves no room in a "
                                f"slot of {capacity} tokens", "prompt")
        default = room if chat_api else min(16, room)
        requests.append(GenerationRequest(ids, max_tokens=default if max_tokens is None
                                          else max_tokens, **settings))
    return Parsed(chat_api, model, tuple(requests), tuple(echo), echo_prompt, stream,
                  include_usage, want_logprobs, tools, splits, continuous_usage,
                  role if chat_api else "assistant",
                  get_field(body, "return_tokens_as_token_ids", BOOL, False),
                  _prompt_top(body, loaded, stream))
