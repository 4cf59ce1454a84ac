"""serve/protocol.py without a server: an OpenAI request body becomes the engine's requests
setting for setting, every prompt form OpenAI takes is read, defaults are OpenAI's, and each
value the server cannot honour is refused with its status and the field at fault (the
refusals a client sees over HTTP are in test_server.py); a model's own sampling defaults
replace OpenAI's where the server is told to take them."""

import pytest
from conftest import FakeTokenizer

from kvjax import model as M
from kvjax.decode import Sampling
from kvjax.serve.protocol import (
    MAX_COMPLETION_LOGPROBS,
    SAMPLING_DEFAULTS,
    APIError,
    model_sampling_defaults,
    parse,
)
from kvjax.text import LoadedModel

MODEL, CAPACITY = "tiny", 64
LOADED = LoadedModel(M.preset("tiny"), FakeTokenizer(), None, f"/checkpoints/{MODEL}")
PREFIX = FakeTokenizer.document_prefix


def completion(**fields):
    return parse({"model": MODEL, "prompt": "AB", **fields}, LOADED, MODEL, CAPACITY,
                 chat_api=False)


def chat(**fields):
    return parse({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields},
                 LOADED, MODEL, CAPACITY, chat_api=True)


def test_a_completion_body_becomes_one_request_per_prompt_setting_for_setting():
    parsed = completion(prompt=["AB", [7, 8, 9]], n=3, max_tokens=5, temperature=0.5,
                        top_p=0.9, top_k=-1, min_p=0.1, repetition_penalty=1.2,
                        no_repeat_ngram_size=2, presence_penalty=-0.5, frequency_penalty=0.25,
                        logit_bias={"9": -100, "7": 2.5}, min_tokens=3, seed=4, stop="END",
                        logprobs=2, echo=True, stream=True,
                        stream_options={"include_usage": True})
    first, second = parsed.requests
    assert first.prompt == (*PREFIX, *FakeTokenizer.encode("AB")) and second.prompt == (7, 8, 9)
    assert parsed.echo == ("AB", FakeTokenizer.decode([7, 8, 9])) and parsed.echo_prompt
    assert first.sampling == Sampling(temperature=0.5, top_p=0.9, top_k=0, min_p=0.1,
                                      repetition_penalty=1.2, no_repeat_ngram_size=2,
                                      presence_penalty=-0.5, frequency_penalty=0.25,
                                      min_tokens=3)
    assert (first.n, first.max_tokens, first.seed, first.stop, first.logprobs) == (
        3, 5, 4, ("END",), 2)
    assert first.logit_bias == ((9, -100), (7, 2.5))  # checked (and sorted) by the engine
    assert first.stop_ids == tuple(FakeTokenizer.stop_ids)
    # vLLM's extensions: ids that also end a sample; none of the tokenizer's with ignore_eos.
    assert completion(stop_token_ids=[7, 2]).requests[0].stop_ids == (
        *FakeTokenizer.stop_ids, 7)
    assert completion(stop_token_ids=[7], ignore_eos=True).requests[0].stop_ids == (7,)
    assert completion(ignore_eos=True).requests[0].stop_ids == ()
    assert completion(include_stop_str_in_output=True).requests[0].include_stop
    assert not completion().requests[0].include_stop
    assert parsed.stream and parsed.include_usage and parsed.logprobs and not parsed.chat
    assert [r.prompt for r in completion(prompt=[[5], [6, 7]]).requests] == [(5,), (6, 7)]
    assert [r.prompt for r in completion(prompt=["A", "B"]).requests] == [
        (*PREFIX, *FakeTokenizer.encode(t)) for t in "AB"]
    # vLLM's add_special_tokens: false leaves a text's prompt unframed (ids stay as given).
    assert [r.prompt for r in completion(prompt=["AB", [5]], add_special_tokens=False
                                         ).requests] == [tuple(FakeTokenizer.encode("AB")), (5,)]


def test_special_tokens_are_written_if_asked_where_the_tokenizer_can():
    """vLLM's skip_special_tokens=false reaches the request; a tokenizer that cannot write
    special tokens (Marian's sentencepiece models) has it refused by name."""
    from pathlib import Path

    from kvjax.tokenizer.huggingface import load_tokenizer

    assert not completion(skip_special_tokens=False).requests[0].skip_special_tokens
    assert completion().requests[0].skip_special_tokens
    marian = load_tokenizer(Path(__file__).resolve().parents[1] / "fixtures" /
                            "hf_tokenizers" / "marian")
    loaded = LoadedModel(M.preset("tiny", vocab_size=marian.vocab_size), marian, None, MODEL)
    with pytest.raises(APIError, match="skip_special_tokens=false: a Marian tokenizer "
                                       "decodes text without its special tokens only") as error:
        parse({"model": MODEL, "prompt": [3, 4], "skip_special_tokens": False}, loaded, MODEL,
              CAPACITY, chat_api=False)
    assert error.value.param == "skip_special_tokens"


def test_vllms_prompt_logprobs_is_a_count_of_top_tokens_every_token_for_minus_one():
    assert completion().prompt_top is None and chat().prompt_top is None
    assert completion(prompt_logprobs=0).prompt_top == 0
    assert chat(prompt_logprobs=20).prompt_top == 20
    small = LoadedModel(M.preset("tiny", vocab_size=16), FakeTokenizer(), None, MODEL)
    assert parse({"model": MODEL, "prompt": [3, 4], "prompt_logprobs": -1}, small, MODEL,
                 CAPACITY, chat_api=False).prompt_top == 16


def test_defaults_are_openais():
    plain = completion()
    request = plain.requests[0]
    assert request.max_tokens == 16 and request.n == 1 and request.seed is None
    assert request.sampling == Sampling(temperature=1.0)  # OpenAI samples unless told not to
    assert not (plain.stream or plain.include_usage or plain.logprobs or plain.echo_prompt)
    assert plain.echo == ("",)
    near_the_end = completion(prompt=[5] * (CAPACITY - 3)).requests[0]
    assert near_the_end.max_tokens == 3  # what the slot has room for
    talk = chat()
    assert talk.chat and talk.requests[0].max_tokens == CAPACITY - len(talk.requests[0].prompt)
    assert chat(max_tokens=9, max_completion_tokens=4).requests[0].max_tokens == 4
    assert chat(logprobs=True, top_logprobs=3).requests[0].logprobs == 3
    assert request.cache_salt is None
    # OpenAI's fields at the values that change nothing are taken.
    assert chat(modalities=["text"], verbosity="medium", functions=[], function_call="none")
    assert [r.cache_salt for r in completion(prompt=["A", "B"], cache_salt="s").requests] == [
        "s", "s"]
    assert request.priority == 0
    assert [r.priority for r in chat(priority=-3).requests] == [-3]
    # vLLM's bad_words: each the ids of the word alone (after a space FakeTokenizer writes
    # one id more, so not that too).
    assert request.bad_words == ()
    assert chat(bad_words=["AB", " C"]).requests[0].bad_words == ((20, 21), (22,))
    # A generation config's bad_words_ids of several tokens come first; a beam search takes
    # them, and refuses a request's own (vLLM's beam search has none).
    class WordBanning(FakeTokenizer):
        bad_words = ((3, 4),)

    banning = LoadedModel(M.preset("tiny"), WordBanning(), None, LOADED.directory)
    body = {"model": MODEL, "prompt": "AB"}
    assert parse({**body, "bad_words": ["AB"]}, banning, MODEL, CAPACITY,
                 chat_api=False).requests[0].bad_words == ((3, 4), (20, 21))
    searched = {**body, "use_beam_search": True, "n": 2}
    assert parse(searched, banning, MODEL, CAPACITY,
                 chat_api=False).requests[0].bad_words == ((3, 4),)
    with pytest.raises(APIError, match="bad_words is not used by beam search"):
        parse({**searched, "bad_words": ["AB"]}, banning, MODEL, CAPACITY, chat_api=False)
    # vLLM's use_beam_search: greedy settings unless the request sets others (which the
    # engine's check refuses by name), its length_penalty.
    beam = completion(use_beam_search=True, n=3, length_penalty=0.5).requests[0]
    assert (beam.beam_search, beam.n, beam.length_penalty, beam.sampling) == (
        True, 3, 0.5, Sampling())
    assert not request.beam_search and request.length_penalty == 1.0


def test_a_chats_echo_is_the_final_message_its_answer_goes_on_with_in_its_role():
    """vLLM's: after a generation prompt the assistant answers and echoes the final message
    only if it is the assistant's; without one the answer goes on in the final message's
    role (its text parts joined as the prompt joins them)."""
    begun = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "Sure"},
                                               {"type": "text", "text": ", "}]}]
    asked = [{"role": "user", "content": "hi"}]
    cases = [(begun, dict(add_generation_prompt=False, continue_final_message=True),
              ("assistant", "Sure\n, ")),
             (begun, {}, ("assistant", "Sure\n, ")),
             (asked, {}, ("assistant", "")),
             (asked, dict(add_generation_prompt=False), ("user", "hi"))]
    for messages, fields, (role, echoed) in cases:
        parsed = chat(messages=messages, echo=True, **fields)
        assert (parsed.role, parsed.echo) == (role, (echoed,))
        assert chat(messages=messages, **fields).echo == ("",)  # only when asked
        assert chat(messages=messages, **fields).role == role


@pytest.mark.parametrize("parse_as, fields, status, param, message", [
    (completion, dict(model="gpt-4"), 404, "model", "The model `gpt-4` does not exist"),
    (completion, dict(model=None), 400, "model", "model is required"),
    (completion, dict(prompt=None), 400, "prompt", "prompt must be a string"),
    (completion, dict(prompt=[]), 400, "prompt", "prompt must be a string"),
    (completion, dict(prompt=[[5], "x", [True]]), 400, "prompt", "prompt must be a string"),
    (completion, dict(prompt=["a"] * 65), 400, "prompt", "prompt holds 65 prompts: at most 64"),
    (completion, dict(prompt=[5] * CAPACITY), 400, "prompt", "leaves no room in a slot of 64"),
    (completion, dict(temperature="hot"), 400, "temperature", "temperature='hot' must be a "
                                                              "number"),
    (completion, dict(n=True), 400, "n", "n=True must be an integer"),
    (completion, dict(stream="yes"), 400, "stream", "stream='yes' must be a boolean"),
    (completion, dict(stream_options=[1]), 400, "stream_options", "must be an object"),
    (completion, dict(stream=True, stream_options={"continuous_usage_stats": True}), 400,
     "stream_options", "continuous_usage_stats needs include_usage: true"),
    (completion, dict(stream=True, stream_options={"include_usage": "yes"}), 400,
     "include_usage", "include_usage='yes' must be a boolean"),
    (completion, dict(logprobs=MAX_COMPLETION_LOGPROBS + 1), 400, "logprobs",
     f"logprobs=6 must be in [0, {MAX_COMPLETION_LOGPROBS}]"),
    (completion, dict(stop=["a"] * 17), 400, "stop", "stop has 17 strings: at most 16"),
    (completion, dict(stop="x" * 1025), 400, "stop", "1025 characters: at most 1024"),
    (completion, dict(logit_bias=[1]), 400, "logit_bias", "logit_bias=[1] must be an object"),
    (completion, dict(logit_bias={"x": 1}), 400, "logit_bias", "key 'x' must be a token id"),
    (completion, dict(suffix="x"), 400, "suffix", "suffix='x' is not supported"),
    (chat, dict(skip_special_tokens="no"), 400, "skip_special_tokens", "must be a boolean"),
    (completion, dict(prompt_logprobs=-2), 400, "prompt_logprobs", "must be a count >= 0, or -1"),
    (completion, dict(prompt_logprobs=21), 400, "prompt_logprobs", "=21: this server reports at "
                                                                  "most 20"),
    (chat, dict(prompt_logprobs=-1), 400, "prompt_logprobs", "-1 asks for all 64 tokens'"),
    (chat, dict(prompt_logprobs=0, stream=True), 400, "prompt_logprobs", "not available when "
                                                                          "stream is true"),
    (completion, dict(prompt_logprobs="2"), 400, "prompt_logprobs", "must be an integer"),
    (completion, dict(stop_token_ids=[1.5]), 400, "stop_token_ids", "must be a list of token"),
    (completion, dict(ignore_eos="yes"), 400, "ignore_eos", "must be a boolean"),
    (completion, dict(best_of=3), 400, "best_of", "best_of=3 is not supported: use n"),
    (completion, dict(tools=[{"type": "function"}]), 400, "tools",
     "tools are for /v1/chat/completions"),
    (chat, dict(messages="hi"), 400, "messages", "messages must be a non-empty list"),
    (chat, dict(echo="yes"), 400, "echo", "echo='yes' must be a boolean"),
    (chat, dict(chat_template="{{ messages }}"), 400, "chat_template", "is not supported"),
    (chat, dict(add_special_tokens=True), 400, "add_special_tokens",
     "the chat template places the model's own"),
    (completion, dict(return_tokens_as_token_ids=1), 400, "return_tokens_as_token_ids",
     "must be a boolean"),
    (completion, dict(add_special_tokens=1), 400, "add_special_tokens", "must be a boolean"),
    (chat, dict(cache_salt=["a"]), 400, "cache_salt", "cache_salt=['a'] must be a string"),
    (chat, dict(functions=[{"name": "f"}]), 400, "functions", "(tools replaced it)"),
    (completion, dict(priority="high"), 400, "priority", "must be an integer"),
    (completion, dict(bad_words="ab"), 400, "bad_words", "must be a list of strings"),
    (completion, dict(length_penalty=0.5), 400, "length_penalty", "set use_beam_search"),
    (chat, dict(use_beam_search="yes"), 400, "use_beam_search", "must be a boolean"),
    (chat, dict(bad_words=[" "]), 400, "bad_words", "bad word ' ' has no tokens"),
    (chat, dict(function_call="auto"), 400, "function_call", "(tool_choice replaced it)"),
    (chat, dict(modalities=["text", "audio"]), 400, "modalities", "answers text"),
    (chat, dict(web_search_options={}), 400, "web_search_options", "is not supported"),
    (chat, dict(verbosity="low"), 400, "verbosity", "verbosity='low' is not supported"),
    (chat, dict(continue_final_message=True), 400, "continue_final_message",
     "needs add_generation_prompt=false"),
    (chat, dict(add_generation_prompt="no"), 400, "add_generation_prompt", "must be a boolean"),
    (completion, dict(continue_final_message=True), 400, "continue_final_message",
     "it is for /v1/chat/completions"),
    (chat, dict(top_logprobs=2), 400, "top_logprobs", "top_logprobs needs logprobs=true"),
])
def test_what_the_server_cannot_honour_is_refused_naming_the_field(parse_as, fields, status,
                                                                     param, message):
    with pytest.raises(APIError) as error:
        parse_as(**fields)
    assert (error.value.status, error.value.param) == (status, param)
    assert message in error.value.message


def test_missing_sampling_settings_take_the_models_defaults_where_served_with_them(tmp_path):
    """`kvjax serve --sampling-defaults model` (the default): what a request leaves out is
    what the model's generation config names (Qwen3's temperature 0.6, top_k 20), as vLLM
    takes it; what it gives, or OpenAI's defaults with "openai", otherwise."""
    import json
    import shutil
    from pathlib import Path

    from kvjax import text

    directory = tmp_path / "m2m_100"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "hf_models" / "m2m_100",
                    directory)
    path = directory / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.6,
                                "top_k": 20, "do_sample": True}))
    loaded = text.load(directory)
    defaults = model_sampling_defaults(loaded)
    assert defaults == {"temperature": 0.6, "top_k": 20}
    assert model_sampling_defaults(loaded, "openai") == {}

    def sampling(defaults, **fields):
        parsed = parse({"model": MODEL, "prompt": "in", **fields}, loaded, MODEL, 16,
                       chat_api=False, sampling_defaults=defaults)
        return parsed.requests[0].sampling

    assert sampling(defaults) == Sampling(temperature=0.6, top_k=20)
    assert sampling(defaults, temperature=0, top_k=-1) == Sampling(temperature=0.0)
    assert sampling(defaults, top_p=0.5) == Sampling(temperature=0.6, top_k=20, top_p=0.5)
    assert sampling({}) == Sampling(temperature=1.0)
    path.write_text(json.dumps({**json.loads(path.read_text()), "top_p": 1.5}))
    with pytest.raises(ValueError, match=r"generation config: top_p=1.5 must be in \(0, 1\]"):
        model_sampling_defaults(text.load(directory))
    with pytest.raises(ValueError, match="sampling_defaults='vllm' is not one of model, openai"):
        model_sampling_defaults(loaded, "vllm")


def test_the_command_line_offers_the_sampling_defaults_the_server_knows():
    """`kvjax serve --sampling-defaults` lists its choices before it imports the server."""
    from kvjax.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    (option,) = [a for a in serve._actions if "--sampling-defaults" in a.option_strings]
    assert tuple(option.choices) == SAMPLING_DEFAULTS and option.default == SAMPLING_DEFAULTS[0]


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(APIError, match="must be a JSON object"):
        parse([1, 2], LOADED, MODEL, CAPACITY, chat_api=False)


def test_a_translators_target_language_is_its_own_else_the_servers_default():
    """The language a translator's target starts with (NLLB's and M2M100's first target
    token): the request's `target_language`, else the server's default where the request
    holds its output to nothing else; refused by name when malformed, doubled or asked of a
    model that continues text."""
    from pathlib import Path

    from kvjax import text
    from kvjax.decode import Choice, StartsWith
    from kvjax.decode.checks import InvalidValue

    m2m = text.load(Path(__file__).resolve().parents[1] / "fixtures" / "hf_models" / "m2m_100")
    a, are = (StartsWith.from_text(m2m.tokenizer, code) for code in ("a", "are"))

    def first_constraint(default=None, **fields):
        parsed = parse({"model": MODEL, "prompt": ["in", "a"], **fields}, m2m, MODEL, 16,
                       chat_api=False, default_language=default)
        constraints = {request.constraint for request in parsed.requests}
        assert len(constraints) == 1  # every prompt of the request alike
        (automaton,) = constraints
        return None if automaton is None else automaton.constraint

    assert first_constraint() is None  # the model chooses
    # The end its generation config forces (none here) is every request's, as `text`'s.
    parsed = parse({"model": MODEL, "prompt": "in"}, m2m, MODEL, 16, chat_api=False)
    assert parsed.requests[0].forced_end_id is None is m2m.tokenizer.forced_end
    assert parsed.requests[0].banned_ids == () == m2m.tokenizer.banned_ids
    m2m.tokenizer.forced_end, m2m.tokenizer.banned_ids = m2m.tokenizer.eos_id, (5, 9)
    parsed = parse({"model": MODEL, "prompt": "in"}, m2m, MODEL, 16, chat_api=False)
    assert parsed.requests[0].forced_end_id == m2m.tokenizer.eos_id is not None
    assert parsed.requests[0].banned_ids == (5, 9)
    with pytest.raises(APIError, match="bad_words are not supported for a translator"):
        parse({"model": MODEL, "prompt": "in", "bad_words": ["a"]}, m2m, MODEL, 16,
              chat_api=False)
    assert first_constraint(target_language="are") == are
    assert first_constraint(default=a) == a
    assert first_constraint(default=a, target_language="are") == are
    assert first_constraint(default=a, structured_outputs={"choice": ["in"]}) == Choice(["in"])
    with pytest.raises(APIError, match="structured_outputs and target_language both") as error:
        first_constraint(target_language="a", structured_outputs={"choice": ["in"]})
    assert error.value.param == "target_language"
    for loaded, code, message in ((m2m, "fr", "'fr' is not one token"),
                                  (m2m, 7, "must be a string"),
                                  (LOADED, "A", "is a translator's")):
        with pytest.raises(InvalidValue, match=message) as error:
            parse({"model": MODEL, "prompt": "AB", "target_language": code}, loaded, MODEL,
                  CAPACITY, chat_api=False)
        assert error.value.name == "target_language"
