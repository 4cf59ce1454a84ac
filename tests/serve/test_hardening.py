"""The server against hostile and careless clients, on 127.0.0.1 only, with bounded requests:
each bad request gets the status that says whose fault it is and OpenAI's error body naming
the field; nothing it does reaches another request; the server's memory stays bounded; good
requests before, during and after are answered as `decode.generate` answers them alone."""

import asyncio
import json
import resource
import socket
import time

import httpx
import pytest
from conftest import SERVED_MODEL, greedy_text, serve_app

from kvjax.serve.limits import Limits, header_timeout_protocol
from kvjax.serve.server import build_app

MODEL = SERVED_MODEL
TIMEOUT = 30.0
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def url(tiny_loaded):
    # Steps checked two at a time, as an accelerator may run them: the answers stay generate's.
    app = build_app(tiny_loaded, max_slots=2, max_queue=MAX_QUEUE, chunk_size=4, prefill_batch=2,
                    steps_per_check=2)
    base, stop = serve_app(app)
    yield base
    stop()


def completion(**fields):
    return {"model": MODEL, "prompt": "abc", "max_tokens": 6, "temperature": 0, **fields}


def chat(content):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


# (path, body as JSON text, status, param, part of the message)
DEEP = "[" * 100_000 + "]" * 100_000
BAD_REQUESTS = [
    ("completions", completion(top_k=10**12), 400, "top_k", "must be <= 2147483647"),
    ("completions", completion(top_k=2**31), 400, "top_k", "2147483648"),
    ("completions", completion(no_repeat_ngram_size=2**40), 400, "no_repeat_ngram_size", "<="),
    ("completions", completion(top_p=1e-50), 400, "top_p", "as float32"),
    ("completions", completion(repetition_penalty=1e-50), 400, "repetition_penalty", "float32"),
    ("completions", completion(temperature=1e300), 400, "temperature", "float32"),
    ("completions", completion(presence_penalty=2.5), 400, "presence_penalty", "in [-2, 2]"),
    ("completions", completion(min_tokens=-1), 400, "min_tokens", ">= 0"),
    ("completions", completion(stop_token_ids=[10**6]), 400, "stop_token_ids", "vocabulary"),
    ("completions", completion(stop_token_ids=list(range(3, 12))), 400, "stop_token_ids",
     "at most 8 stop ids"),
    ("completions", completion(logit_bias={"5": 101}), 400, "logit_bias", "in [-100, 100]"),
    ("completions", completion(logit_bias={"5": "up"}), 400, "logit_bias", "a real number"),
    ("completions", completion(logit_bias={"10000000": 1}), 400, "logit_bias", "vocabulary"),
    ("completions", completion(logit_bias={str(i): 1 for i in range(301)}), 400, "logit_bias",
     "at most 300"),
    ("completions", completion(n=1_000_000), 400, "n", "more than the engine's 2 slots"),
    ("completions", completion(echo=True, max_tokens=0, n=100_000), 400, "n", "slots"),
    ("completions", completion(echo=True, max_tokens=0, temperature=-1), 400, "temperature",
     ">= 0"),
    ("completions", completion(echo=True, max_tokens=0, top_k=10**12), 400, "top_k", "<="),
    ("completions", completion(stop="x" * 1_000_000), 400, "stop", "1000000 characters"),
    ("completions", completion(stop=["a"] * 17), 400, "stop", "at most 16"),
    ("completions", completion(prompt=["ab"] * (MAX_QUEUE + 1)), 400, "prompt",
     f"at most {MAX_QUEUE}"),
    ("completions", completion(prompt=["ab"] * 2_000_000), 400, "prompt", "at most"),
    ("completions", completion(logprobs=10**12), 400, "logprobs", "logprobs"),
    ("completions", completion(max_tokens=10**6), 400, "max_tokens", "do not fit a slot"),
    ("completions", completion(prompt=[1, 10**6]), 400, "prompt", "outside the vocabulary"),
    ("completions", DEEP, 400, None, "nested more than"),
    ("completions", '{"model": "' + MODEL + '", "prompt": ' + "[" * 40 + "]" * 40 + "}", 400,
     "prompt", "nested more than"),
    ("completions", completion(model="\ud800"), 400, "model", "lone surrogate"),
    ("completions", completion(prompt="ab\udfffc"), 400, "prompt", "lone surrogate"),
    ("completions", completion(stop=["\ud800"]), 400, "stop", "lone surrogate"),
    ("chat/completions", chat("hi \ud800"), 400, "messages", "lone surrogate"),
    ("chat/completions", {**chat("hi"), "top_logprobs": 10**6, "logprobs": True}, 400,
     "top_logprobs", "must be <="),
    ("completions", '{"model": 1e999999, "prompt": "a"}', 400, "model", "must be a string"),
]


def post(url, path, body, **headers):
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{url}/v1/{path}", content=content.encode("utf-8", "surrogatepass"),
                      headers={"content-type": "application/json", **headers},
                      timeout=TIMEOUT)


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_bad_requests_are_refused_alone_while_good_ones_stream(url, tiny_loaded):
    expected = greedy_text(tiny_loaded, "abc", 6)
    assert post(url, "completions", completion()).json()["choices"][0]["text"] == expected
    peak_before = rss_bytes()

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            async def good(delay):
                await asyncio.sleep(delay)
                body = completion(stream=True, max_tokens=12, prompt="xyz")
                text = ""
                async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text

            async def bad(path, body):
                content = body if isinstance(body, str) else json.dumps(body)
                return await http.post(f"{url}/v1/{path}",
                                       content=content.encode("utf-8", "surrogatepass"),
                                       headers={"content-type": "application/json"})

            async def health_while(task):
                """The longest wait for /health while `task` runs."""
                longest = 0.0
                while not task.done():
                    began = time.perf_counter()
                    assert (await http.get(f"{url}/health")).status_code == 200
                    longest = max(longest, time.perf_counter() - began)
                    await asyncio.sleep(0.02)
                return longest

            goods = [asyncio.ensure_future(good(0.01 * i)) for i in range(4)]
            answers = []
            for path, body, *_ in BAD_REQUESTS:
                task = asyncio.ensure_future(bad(path, body))
                health_waits.append(await health_while(task))
                answers.append(await task)
            return await asyncio.gather(*goods), answers

    health_waits = []
    streamed, answers = asyncio.run(run())
    assert streamed == [greedy_text(tiny_loaded, "xyz", 12)] * 4
    # The heaviest bodies (2,000,000 prompts, 100,000 levels) are decoded, checked and refused
    # off the event loop: the server keeps answering meanwhile (a bound that only a stalled
    # loop misses, not a timing).
    assert max(health_waits) < 5.0, health_waits
    for (path, body, status, param, message), response in zip(BAD_REQUESTS, answers,
                                                              strict=True):
        case = f"{path} {str(body)[:80]}"
        assert response.status_code == status, (case, response.text[:300])
        error = response.json()["error"]
        assert error["param"] == param, (case, error)
        assert message in error["message"], (case, error["message"][:300])
        assert len(response.content) < 2000, case  # an answer no bigger than the question's
    assert post(url, "completions", completion()).json()["choices"][0]["text"] == expected
    assert rss_bytes() < 2 * peak_before
    health = httpx.get(f"{url}/health", timeout=TIMEOUT).json()
    assert health["live_slots"] == 0 and health["queue_length"] == 0


def test_only_json_bodies_are_taken(url):
    body = json.dumps(completion())
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {} if kind is None else {"content-type": kind}
        response = httpx.post(f"{url}/v1/completions", content=body, headers=headers,
                              timeout=TIMEOUT)
        assert response.status_code == 415, kind
        assert "application/json" in response.json()["error"]["message"]
    answer = post(url, "completions", completion(), **{"content-type":
                                                       "application/json; charset=utf-8"})
    assert answer.status_code == 200
    assert "access-control-allow-origin" not in {k.lower() for k in answer.headers}


def test_a_body_past_the_limit_is_413_and_the_app_keeps_serving(tiny_loaded):
    app = build_app(tiny_loaded, max_slots=2, max_queue=4, chunk_size=4,
                    limits=Limits(max_body_bytes=2000))

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            big = await http.post("/v1/completions", json=completion(prompt="a" * 5000))
            # Echo alone never reaches the engine, which is not running here (no lifespan).
            small = await http.post("/v1/completions",
                                    json=completion(echo=True, max_tokens=0))
            return big, small

    big, small = asyncio.run(run())
    assert big.status_code == 413 and "2000 bytes" in big.json()["error"]["message"]
    assert small.status_code == 200 and small.json()["choices"][0]["text"] == "abc"


def test_an_api_key_is_required_where_one_is_set(tiny_loaded):
    app = build_app(tiny_loaded, max_slots=2, max_queue=4, chunk_size=4, api_key="s3cret")
    base, stop = serve_app(app)
    try:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            response = post(base, "completions", completion(), **headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(f"{base}/v1/models", headers=headers,
                             timeout=TIMEOUT).status_code == 401
            assert httpx.post(f"{base}/tokenize", json={"prompt": "abc"}, headers=headers,
                              timeout=TIMEOUT).status_code == 401
        answer = post(base, "completions", completion(), authorization="Bearer s3cret")
        assert answer.status_code == 200
        assert httpx.post(f"{base}/tokenize", json={"prompt": "abc"}, timeout=TIMEOUT,
                          headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{base}/health", timeout=TIMEOUT).status_code == 200
    finally:
        stop()


def test_idle_and_half_sent_connections_are_closed(tiny_loaded):
    app = build_app(tiny_loaded, max_slots=2, max_queue=4, chunk_size=4)
    base, stop = serve_app(app, http=header_timeout_protocol(0.5))
    host, port = base.removeprefix("http://").split(":")
    try:
        started = time.monotonic()
        for first_bytes in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
            with socket.create_connection((host, int(port)), timeout=10) as connection:
                connection.sendall(first_bytes)
                assert connection.recv(1024) == b""  # closed by the server, not timed out
        assert time.monotonic() - started < 8
        answer = post(base, "completions", completion())
        assert answer.status_code == 200
    finally:
        stop()


def test_an_error_in_one_requests_host_work_ends_that_request_alone(url, tiny_loaded, monkeypatch):
    # A stop-string matcher that fails for one request's stop string, on the engine's thread.
    from kvjax import detokenize

    held = detokenize.StopStart.held

    def failing(self, text_so_far):
        if self.pattern.startswith("BOOM"):
            raise RuntimeError("the matcher failed")
        return held(self, text_so_far)

    monkeypatch.setattr(detokenize.StopStart, "held", failing)

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            async def ask(body):
                return await http.post(f"{url}/v1/completions", json=body)

            return await asyncio.gather(
                ask(completion(prompt="xyz", max_tokens=12)),
                ask(completion(prompt="abc", max_tokens=12, stop=["BOOM!"])),
                ask(completion(prompt="qrs", max_tokens=12)))

    good, failed, other = asyncio.run(run())
    assert failed.status_code == 500 and "the matcher failed" in failed.json()["error"][
        "message"]
    assert good.json()["choices"][0]["text"] == greedy_text(tiny_loaded, "xyz", 12)
    assert other.json()["choices"][0]["text"] == greedy_text(tiny_loaded, "qrs", 12)
    health = httpx.get(f"{url}/health", timeout=TIMEOUT).json()
    assert health["live_slots"] == 0


def test_a_failing_prefill_ends_its_request_with_an_error_and_the_server_serves_on(
        url, tiny_loaded, monkeypatch):
    # An unexpected error on the engine's thread ends every request it holds, among them
    # the one being prefilled at that moment (off the queue, not yet on the device).
    from kvjax.serve import staging

    def failing(*args):
        raise RuntimeError("the prefill failed")

    monkeypatch.setattr(staging, "prefill_state", failing)
    failed = post(url, "completions", completion(prompt="xyz", max_tokens=5))
    assert failed.status_code == 500
    assert "the prefill failed" in failed.json()["error"]["message"]
    monkeypatch.undo()
    answer = post(url, "completions", completion(prompt="xyz", max_tokens=5))
    assert answer.json()["choices"][0]["text"] == greedy_text(tiny_loaded, "xyz", 5)


def test_an_engine_that_cannot_free_its_slots_refuses_every_later_request_at_once(
        tiny_loaded, monkeypatch):
    # A failure, and then no memory to start again from free slots: nothing may wait for an
    # engine that will never serve it.
    from kvjax.serve import engine as engine_module
    from kvjax.serve import staging

    app = build_app(tiny_loaded, max_slots=2, max_queue=4, chunk_size=4)
    base, stop = serve_app(app)
    try:
        assert httpx.get(f"{base}/health", timeout=TIMEOUT).status_code == 200

        def failing(*args):
            raise RuntimeError("the prefill failed")

        def no_memory(self):
            raise MemoryError("no memory for the slots")

        monkeypatch.setattr(staging, "prefill_state", failing)
        monkeypatch.setattr(engine_module.Engine, "_reset", no_memory)
        failed = post(base, "completions", completion(prompt="xyz", max_tokens=5))
        assert failed.status_code == 500
        assert "the prefill failed" in failed.json()["error"]["message"]
        for body in (completion(prompt="abc"), completion(echo=True, logprobs=1, max_tokens=0)):
            refused = post(base, "completions", body)
            assert refused.status_code == 503, refused.text
            assert "cannot serve again: no memory for the slots" in refused.json()["error"][
                "message"]
        health = httpx.get(f"{base}/health", timeout=TIMEOUT)
        assert health.status_code == 503 and health.json()["status"] == "failed"
    finally:
        stop()
