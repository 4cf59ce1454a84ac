"""The HTTP server, in-process on 127.0.0.1 with an ephemeral port, through the official
`openai` client and raw `httpx`: answers equal `decode.generate` run alone, streaming, errors,
backpressure and disconnects."""

import asyncio
import dataclasses
import json
import time

import httpx
import numpy as np
import openai
import pytest
from conftest import SERVED_MODEL, FakeTokenizer, greedy_text, openai_client, serve_app

import kvjax
from kvjax import decode
from kvjax.serve import GenerationRequest, chat
from kvjax.serve.server import build_app
from kvjax.text import prompt_tokens

MODEL = SERVED_MODEL
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def server(tiny_loaded):
    """The base URL of a running server, and its app."""
    app = build_app(tiny_loaded, max_slots=4, max_queue=64, chunk_size=4, prefill_batch=4)
    url, stop = serve_app(app, TIMEOUT)
    yield url, app
    stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[0], TIMEOUT)


def live_slots(url):
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("kvjax_live_slots ")))


def test_concurrent_completions_each_equal_generate_alone(server, client, tiny_loaded):
    rng = np.random.default_rng(0)
    prompts = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, rng.integers(1, 8)))
               for _ in range(16)]
    lengths = [int(m) for m in rng.integers(1, 8, len(prompts))]

    async def ask_all():
        async with openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="unused",
                                      timeout=TIMEOUT, max_retries=0) as aclient:
            async def ask(prompt, max_tokens, delay):
                await asyncio.sleep(delay)  # arriving at random times
                return await aclient.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)

            return await asyncio.gather(*(
                ask(p, m, float(d)) for p, m, d in zip(prompts, lengths,
                                                     rng.uniform(0, 0.2, len(prompts)),
                                                     strict=True)))

    answers = asyncio.run(ask_all())
    for prompt, max_tokens, answer in zip(prompts, lengths, answers, strict=True):
        assert answer.choices[0].text == greedy_text(tiny_loaded, prompt, max_tokens)
        assert answer.usage.prompt_tokens == len(prompt) + 1  # the document prefix
    assert live_slots(server[0]) == 0


def test_chat_streams_the_text_it_answers_whole_with_usage_last(client):
    settings = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                    temperature=0.9, seed=3, n=2)
    whole = client.chat.completions.create(**settings)
    chunks = list(client.chat.completions.create(**settings, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    # "user: hi\nassistant:" after the document prefix
    assert whole.usage.prompt_tokens == 1 + len("user: hi\nassistant:")


def test_the_responses_api_answers_what_the_chat_answers(client):
    """POST /v1/responses through the official client: the chat's answer to the same
    conversation, whole or as events that add up to it."""
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0.9, seed=5,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi."}])
    settings = dict(model=MODEL, instructions="Be brief.", input="Hi.",
                    max_output_tokens=6, temperature=0.9, extra_body={"seed": 5})
    whole = client.responses.create(**settings)
    assert whole.output_text == chat.choices[0].message.content
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert whole.status == {"length": "incomplete", "stop": "completed"}[
        chat.choices[0].finish_reason]
    events = list(client.responses.create(**settings, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text
    assert events[-1].type == f"response.{whole.status}"
    assert events[-1].response.output_text == whole.output_text
    # The next turn goes on from the kept response as a chat sent the whole conversation.
    turn = [{"role": "assistant", "content": whole.output_text},
            {"role": "user", "content": "Go"}]
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0.9, seed=5,
        messages=[{"role": "user", "content": "Hi."}, *turn])
    then = client.responses.create(model=MODEL, previous_response_id=whole.id,
                                   input="Go", max_output_tokens=6, temperature=0.9,
                                   extra_body={"seed": 5})
    assert then.output_text == chat.choices[0].message.content
    assert then.previous_response_id == whole.id
    assert client.responses.retrieve(then.id).output_text == then.output_text
    # Its input items, one a page: the first turn's input and answer, then its own input.
    items = list(client.responses.input_items.list(then.id, order="asc", limit=1))
    assert [item.id for item in items[1:2]] == [whole.output[0].id]
    assert [(item.role, item.content[0].text) for item in items] == [
        ("user", "Hi."), ("assistant", whole.output_text), ("user", "Go")]
    assert [item.id for item in client.responses.input_items.list(then.id).data] == [
        item.id for item in items[::-1]]
    client.responses.delete(then.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(then.id)
    with pytest.raises(openai.NotFoundError, match="Previous response with id 'resp_gone'"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_gone")
    # Too long for a slot: refused, or with truncation auto its earliest turns dropped.
    long = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y"},
            {"role": "user", "content": "Hi."}]
    with pytest.raises(openai.BadRequestError, match="leaves no room in a slot of 64"):
        client.responses.create(**{**settings, "input": long})
    cut = client.responses.create(**{**settings, "input": long}, truncation="auto")
    assert (cut.output_text, cut.truncation) == (whole.output_text, "auto")
    # What the chat path refuses names the Responses request's own field.
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=10_000)
    assert refused.value.body["param"] == "max_output_tokens"


def test_logprobs_are_the_models_and_include_the_chosen_token(client, tiny_loaded):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the likeliest
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    completion = client.completions.create(model=MODEL, prompt="abc", max_tokens=4,
                                           temperature=0, logprobs=2)
    assert len(completion.choices[0].logprobs.token_logprobs) == 4


def test_echo_scores_a_text_as_cached_decoding_does(client, tiny_loaded):
    """The prompt logprobs of a text that greedy decoding wrote equal decoding's own."""
    start = prompt_tokens(tiny_loaded, "ab")
    made = decode.generate(tiny_loaded.net, tiny_loaded.params, [start], max_new_tokens=4,
                           return_logprobs=True)
    assert made.lengths[0] == 4
    text = start + made.tokens[0].tolist()
    answer = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True,
                                       logprobs=1)
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text == FakeTokenizer.decode(text)  # echo: the prompt as given
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(text)
    np.testing.assert_allclose(logprobs.token_logprobs[-4:], made.logprobs[0], atol=1e-4)
    for chosen, top in zip(logprobs.token_logprobs[-4:], logprobs.top_logprobs[-4:],
                           strict=True):
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy took the top


def test_stream_framing_is_server_sent_events_ending_with_done(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body,
                      timeout=TIMEOUT) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] <= 5
    finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-2]]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])


def test_continuous_usage_stats_count_the_tokens_streamed_so_far(server, tiny_loaded):
    """vLLM's `continuous_usage_stats`: every chunk's usage counts the prompt and the tokens
    streamed up to it (its `logprobs` list them), the last one all of them."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body,
                      timeout=TIMEOUT) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line and line != "data: [DONE]"]
    prompt = len(prompt_tokens(tiny_loaded, "abc"))
    streamed = 0
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            streamed += len((choice["logprobs"] or {}).get("tokens", []))
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": streamed,
                                  "total_tokens": prompt + streamed,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == streamed


def test_under_load_every_request_is_answered_once_and_no_slot_leaks(server):
    url, count, clients = server[0], 120, 24
    rng = np.random.default_rng(1)
    bodies = [{"model": MODEL, "prompt": "x" * int(rng.integers(1, 8)),
               "max_tokens": int(rng.integers(1, 8)), "temperature": 0.7, "seed": i,
               "stream": bool(i % 2)} for i in range(count)]

    async def load():
        gate = asyncio.Semaphore(clients)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            async def send(body):
                async with gate:
                    response = await http.post("/v1/completions", json=body)
                    if not body["stream"]:
                        return response.status_code, [response.json()["choices"][0]]
                    events = [line[6:] for line in response.text.splitlines() if line]
                    assert events[-1] == "[DONE]"
                    return response.status_code, [json.loads(e)["choices"][0]
                                                  for e in events[:-1]]

            return await asyncio.gather(*(send(b) for b in bodies))

    answers = asyncio.run(load())
    assert all(status == 200 for status, _ in answers)
    for body, (_, choices) in zip(bodies, answers, strict=True):
        finishes = [c["finish_reason"] for c in choices if c["finish_reason"]]
        assert len(finishes) == 1 and finishes[0] in ("stop", "length")
        assert len("".join(c["text"] for c in choices)) <= body["max_tokens"]
    assert live_slots(url) == 0
    assert metric(url, "kvjax_queue_length") == 0


@pytest.mark.parametrize("body, status, message", [
    ("{not json", 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "a", "temperature": "hot"}, 400, "temperature='hot' must be "
                                                                 "a number"),
    ({"model": MODEL, "prompt": "a", "top_p": 1.5}, 400, "top_p=1.5 must be in (0, 1]"),
    ({"model": MODEL, "prompt": "a" * 60, "max_tokens": 8}, 400, "61 tokens and max_tokens "
                                                                 "is 8"),
    ({"model": MODEL, "prompt": "a", "suffix": "b"}, 400, "suffix='b' is not supported"),
    ({"model": MODEL, "prompt": "a", "n": 0}, 400, "n=0 must be >= 1"),
    ({"model": MODEL, "prompt": "a", "stop": [1]}, 400, "stop=[1] must be a string"),
    ({"model": MODEL, "prompt": "a", "target_language": "a"}, 400, "target_language is a "
                                                                   "translator's"),
    ({"model": "gpt-4", "prompt": "a"}, 404, "The model `gpt-4` does not exist"),
])
def test_bad_requests_get_openai_errors_naming_the_value(server, body, status, message):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{server[0]}/v1/completions", content=content, timeout=TIMEOUT,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    assert message in response.json()["error"]["message"]


def test_chat_uses_the_tokenizers_template_or_the_plain_one():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert chat.render(FakeTokenizer(), messages) == (
        "system: Be brief.\nuser: hi\nassistant:", False)

    class Templated(FakeTokenizer):
        chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")

    assert chat.render(Templated(), messages) == (
        "<system>Be brief.<user>hi<assistant>", True)
    with pytest.raises(ValueError, match=r"messages\[1\].role='robot' must be one of"):
        chat.render(FakeTokenizer(), [messages[0], {"role": "robot", "content": "x"}])


def test_the_client_sees_an_unknown_model_as_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                 "content": "hi"}])
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL) == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.models.retrieve("gpt-4")


def test_tokenize_counts_the_prompt_tokens_a_request_is_charged_for(server, client,
                                                                   tiny_loaded):
    """vLLM's /tokenize and /detokenize on the running server: a prompt's count is the
    `prompt_tokens` its completion's usage reports, a chat's those of its chat completion;
    its tokens detokenize to its text; errors are OpenAI's, naming the field."""
    url = server[0]
    completion = client.completions.create(model=MODEL, prompt="The cache", max_tokens=2)
    said = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "The cache"},
                      timeout=TIMEOUT).json()
    assert said["count"] == completion.usage.prompt_tokens == len(said["tokens"])
    assert said["tokens"] == prompt_tokens(tiny_loaded, "The cache")
    assert said["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    chat_answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=TIMEOUT).json()[
        "count"] == chat_answer.usage.prompt_tokens
    bare = httpx.post(f"{url}/tokenize", json={"prompt": "abc", "add_special_tokens": False},
                      timeout=TIMEOUT).json()["tokens"]
    unframed = client.completions.create(model=MODEL, prompt="abc", max_tokens=1,
                                         extra_body={"add_special_tokens": False})
    assert unframed.usage.prompt_tokens == len(bare) < len(prompt_tokens(tiny_loaded, "abc"))
    assert httpx.post(f"{url}/detokenize", json={"tokens": bare}, timeout=TIMEOUT).json() == {
        "prompt": FakeTokenizer.decode(bare)}
    spelled = httpx.post(f"{url}/tokenize", json={"prompt": "abc", "return_token_strs": True},
                         timeout=TIMEOUT).json()
    assert spelled["token_strs"] == FakeTokenizer.pieces(spelled["tokens"])


def test_version_is_kvjaxs(server):
    assert httpx.get(f"{server[0]}/version", timeout=TIMEOUT).json() == {
        "version": kvjax.__version__}


def test_a_chat_continues_its_final_message_as_generate_continues_that_text(client,
                                                                            tiny_loaded):
    """vLLM's `continue_final_message` (with `add_generation_prompt` false): the answer
    goes on from inside the assistant's begun reply, no new answer's start in between."""
    messages = [{"role": "user", "content": "Name a cache."},
                {"role": "assistant", "content": "The KV"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    prompt = chat.plain_prompt([("user", "Name a cache."), ("assistant", "The KV")],
                               add_generation_prompt=False).removesuffix("\n")
    assert answer.choices[0].message.content == greedy_text(tiny_loaded, prompt, 6)
    assert answer.usage.prompt_tokens == len(prompt_tokens(tiny_loaded, prompt))
    # vLLM's echo: the begun reply comes first, streamed or whole.
    echo = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           temperature=0, extra_body=echo)
    assert whole.choices[0].message.content == "The KV" + answer.choices[0].message.content
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        answer.usage.prompt_tokens, answer.usage.completion_tokens)
    # The same prompt again: the prefix cache serves its whole blocks (all but its last
    # token is kept in blocks of 16), and its usage says so.
    assert whole.usage.prompt_tokens_details.cached_tokens == \
        (whole.usage.prompt_tokens - 1) // 16 * 16 > 0
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                              temperature=0, extra_body=echo, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == \
        whole.choices[0].message.content


def test_a_full_queue_answers_429_with_retry_after(tiny_loaded):
    # An app whose engine is not running (no lifespan): what is queued stays queued.
    app = build_app(tiny_loaded, max_slots=4, max_queue=2, chunk_size=4)
    engine = app.state.engine
    for _ in range(2):
        engine.submit(GenerationRequest((5, 6)), lambda delta: None)

    async def post():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/v1/completions", json={"model": MODEL, "prompt": "a"})

    response = asyncio.run(post())
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert "max_queue=2" in response.json()["error"]["message"]


@pytest.fixture
def slow_engine(server, monkeypatch):
    """The server's engine taking 50 ms more per turn, so a request outlives a disconnect."""
    engine = server[1].state.engine
    turn = engine._turn

    def slow(**kwargs):
        time.sleep(0.05)
        turn(**kwargs)

    monkeypatch.setattr(engine, "_turn", slow)
    return engine


def metric(url, name):
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name))


def wait_for_free_slots(url):
    deadline = time.monotonic() + TIMEOUT
    while live_slots(url) != 0:
        assert time.monotonic() < deadline, "a slot stayed taken"
        time.sleep(0.02)


def test_a_client_that_disconnects_frees_its_slot(server, slow_engine):
    url = server[0]
    generated = metric(url, "kvjax_generated_tokens_total")
    # Greedy: this prompt makes no stop id in 56 tokens, so only a disconnect ends it early.
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 56, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        next(response.iter_lines())  # the first token's chunk: the request holds a slot
    wait_for_free_slots(url)
    # Not streaming: the client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=0.3)
    wait_for_free_slots(url)
    assert metric(url, 'kvjax_requests_total{outcome="disconnected"}') == 2
    assert metric(url, "kvjax_generated_tokens_total") - generated < 2 * 56


def test_a_thinking_models_choice_is_answered_as_its_reasoning(tiny_loaded):
    """With a reasoning parser, a template that opens `<think>` makes a choice cut short
    inside its thought all reasoning, whole and streamed (serve/reasoning.py)."""
    class Thinking(FakeTokenizer):
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}<think>\n"

    loaded = dataclasses.replace(tiny_loaded, tokenizer=Thinking())
    app = build_app(loaded, max_slots=4, max_queue=64, chunk_size=4, prefill_batch=4,
                    reasoning_parser="deepseek_r1")
    url, stop = serve_app(app, TIMEOUT)
    try:
        settings = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                        max_tokens=5, temperature=0)
        client = openai_client(url, TIMEOUT)
        whole = client.chat.completions.create(**settings).choices[0]
        chunks = list(client.chat.completions.create(**settings, stream=True))
    finally:
        stop()
    thought = whole.message.model_extra["reasoning"]
    assert len(thought) == 5 and whole.message.content is None
    assert whole.message.model_extra["reasoning_content"] == thought
    assert whole.finish_reason == "length"
    assert "".join(c.choices[0].delta.model_extra.get("reasoning") or "" for c in chunks
                   if c.choices) == thought

