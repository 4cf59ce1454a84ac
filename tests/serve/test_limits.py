"""serve/limits.py on requests made by hand (no server): a body is JSON sent as JSON, within
its size, time and depth, with no lone surrogate; each refusal has the status that says whose
fault it is and names the field at fault; an API key is checked as OpenAI's clients send it."""

import asyncio
import json

import pytest
from starlette.requests import Request

from kvjax.serve.limits import Limits, authorized, read_json
from kvjax.serve.protocol import APIError


def request(chunks=(b"{}",), headers=None, delay: float = 0.0) -> Request:
    """A POST whose body arrives in `chunks`, each `delay` seconds after the last."""
    headers = {"content-type": "application/json", **(headers or {})}
    pending = list(chunks)

    async def receive():
        await asyncio.sleep(delay)
        chunk = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope, receive)


def refusal(req: Request, **limits) -> APIError:
    with pytest.raises(APIError) as error:
        asyncio.run(read_json(req, Limits(**limits)))
    return error.value


def read(req: Request, **limits):
    return asyncio.run(read_json(req, Limits(**limits)))


def test_a_json_body_in_pieces_is_read_whole():
    body = {"model": "m", "prompt": "é" * 10, "stop": ["a", "b"]}
    raw = json.dumps(body).encode()
    assert read(request([raw[:7], raw[7:20], raw[20:]])) == body
    assert read(request([raw], {"content-type": "Application/JSON; charset=utf-8"})) == body


@pytest.mark.parametrize("headers, shown", [({"content-type": "text/plain"}, "'text/plain'"),
                                            ({"content-type": ""}, "'none'")])
def test_a_body_that_is_not_sent_as_json_is_415(headers, shown):
    error = refusal(request(headers=headers))
    assert error.status == 415 and shown in error.message


def test_a_body_past_the_limit_is_413_declared_or_not():
    declared = refusal(request([b"{}"], {"content-length": "5000"}), max_body_bytes=4000)
    assert declared.status == 413 and "5000 bytes, more than the 4000" in declared.message
    streamed = refusal(request([b"[" + b"1," * 1000, b"1]"]), max_body_bytes=1500)
    assert streamed.status == 413 and "longer than the 1500 bytes" in streamed.message
    assert read(request([b"[" + b"1," * 10 + b"1]"]), max_body_bytes=23) == [1] * 11


def test_a_body_that_does_not_arrive_in_time_is_408():
    error = refusal(request([b"{", b"}"], delay=0.3), read_timeout=0.1)
    assert error.status == 408 and "within 0.1 s" in error.message


def test_depth_and_bad_json_are_400():
    assert read(request([b"[" * 4 + b"]" * 4]), max_json_depth=4) == [[[[]]]]
    deep = refusal(request([json.dumps({"messages": [[[[1]]]]}).encode()]), max_json_depth=4)
    assert deep.status == 400 and "nested more than 4 levels" in deep.message
    assert deep.param == "messages"
    past_the_stack = refusal(request([b"[" * 200_000 + b"]" * 200_000]))
    assert past_the_stack.status == 400 and "nested more than 32" in past_the_stack.message
    broken = refusal(request([b'{"model": ']))
    assert broken.status == 400 and "not valid JSON" in broken.message


def test_a_lone_surrogate_is_refused_naming_its_field():
    in_value = refusal(request([b'{"prompt": ["ok", "a\\ud800b"]}']))
    assert in_value.status == 400 and in_value.param == "prompt"
    assert "lone surrogate ('\\ud800') at character 1" in in_value.message
    in_key = refusal(request([b'{"x\\udfff": 1}']))
    assert in_key.param == "x\\udfff"  # escaped, so the answer can be sent
    json.dumps(in_key.body()).encode("utf-8")


@pytest.mark.parametrize("header, allowed", [
    (None, False), ("Bearer s3cret", True), ("bearer  s3cret ", True), ("Bearer wrong", False),
    ("s3cret", False), ("Basic s3cret", False)])
def test_an_api_key_is_checked_as_openais_clients_send_it(header, allowed):
    req = request(headers={} if header is None else {"authorization": header})
    authorized(req, None)  # no key set: every request is let in
    if allowed:
        authorized(req, "s3cret")
        return
    with pytest.raises(APIError) as error:
        authorized(req, "s3cret")
    assert error.value.status == 401 and error.value.code == "invalid_api_key"
