"""serve/background.py, through the official `openai` client: a background response is
queued at once, polled to the answer the same request gets in the foreground, and kept;
cancelled while it runs it frees its slot and stays cancelled; deleted while it runs it is
gone; an engine failure ends it failed, and kept so."""

import asyncio
import time

import httpx
import pytest
from conftest import SERVED_MODEL, openai_client, serve_app

from kvjax.serve.background import BackgroundResponses
from kvjax.serve.protocol import parse
from kvjax.serve.response_answers import ResponseAnswer
from kvjax.serve.response_store import ResponseStore
from kvjax.serve.responses import chat_body
from kvjax.serve.server import build_app

openai = pytest.importorskip("openai")
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def served(tiny_loaded):
    """(base URL, engine, official client) of a running server."""
    app = build_app(tiny_loaded, max_slots=2, max_queue=8, chunk_size=4, prefill_batch=2)
    url, stop = serve_app(app, TIMEOUT)
    yield url, app.state.engine, openai_client(url, TIMEOUT)
    stop()


def metric(url, name):
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def poll(client, response_id, statuses):
    """The response once its status is none of `statuses`."""
    deadline = time.monotonic() + TIMEOUT
    while (response := client.responses.retrieve(response_id)).status in statuses:
        assert time.monotonic() < deadline, f"{response_id} stayed {response.status}"
        time.sleep(0.02)
    return response


def test_a_background_response_is_polled_to_what_the_foreground_answers(served):
    client = served[2]
    settings = dict(model=SERVED_MODEL, input="Hi.", max_output_tokens=6, temperature=0)
    foreground = client.responses.create(**settings)
    queued = client.responses.create(**settings, background=True)
    assert queued.background and queued.status in ("queued", "in_progress")
    assert queued.output == [] and queued.usage is None
    done = poll(client, queued.id, ("queued", "in_progress"))
    assert (done.status, done.output_text) == (foreground.status, foreground.output_text)
    assert done.usage.output_tokens == foreground.usage.output_tokens and done.background
    # Cancelling an answer that ended changes nothing; a foreground one cannot be.
    assert client.responses.cancel(done.id).model_dump() == done.model_dump()
    with pytest.raises(openai.BadRequestError, match="only a background response can be"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.BadRequestError, match="neither stream nor store false"):
        client.responses.create(**settings, background=True, store=False)


def test_a_cancelled_background_response_frees_its_slot_and_stays_cancelled(served,
                                                                             monkeypatch):
    url, engine, client = served
    turn = engine._turn

    def slow(**kwargs):  # 50 ms more per turn: the answer outlives the cancel
        time.sleep(0.05)
        turn(**kwargs)

    monkeypatch.setattr(engine, "_turn", slow)
    generated = metric(url, "kvjax_generated_tokens_total")
    # Long enough (greedy, 40 tokens) to outlive the cancel.
    settings = dict(model=SERVED_MODEL, input="abc", max_output_tokens=40, temperature=0,
                    background=True)
    running = poll(client, client.responses.create(**settings).id, ("queued",))
    assert running.status == "in_progress"
    with pytest.raises(openai.BadRequestError, match="has not ended: a request goes on from a "
                                                     "completed or incomplete one"):
        client.responses.create(model=SERVED_MODEL, input="go on",
                                previous_response_id=running.id)
    cancelled = client.responses.cancel(running.id)
    assert (cancelled.status, cancelled.output) == ("cancelled", [])
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="is cancelled"):
        client.responses.create(model=SERVED_MODEL, input="go on",
                                previous_response_id=running.id)
    # Deleted while it runs: gone.
    deleted = poll(client, client.responses.create(**settings).id, ("queued",))
    assert client.responses.delete(deleted.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)
    deadline = time.monotonic() + TIMEOUT
    while engine.live_slots or engine.queue_length:
        assert time.monotonic() < deadline, "a slot stayed taken"
        time.sleep(0.02)
    assert metric(url, 'kvjax_requests_total{outcome="cancelled"}') == 2
    assert metric(url, "kvjax_generated_tokens_total") - generated < 2 * 40


def answer_of(loaded, store: ResponseStore) -> ResponseAnswer:
    body = {"model": SERVED_MODEL, "input": "Hi.", "background": True}
    chat = chat_body(body, store)
    parsed = parse(chat, loaded, SERVED_MODEL, capacity=64, chat_api=True)
    return ResponseAnswer(parsed, loaded.tokenizer, body, chat["messages"], store)


def test_a_shutdown_cancels_every_running_background_response(tiny_loaded):
    store, cancelled = ResponseStore(capacity=4), []

    class Ticket:
        def cancel(self):
            cancelled.append(self)

    async def never():
        await asyncio.Event().wait()

    async def run():
        running = BackgroundResponses(lambda outcome: None)
        answers = [answer_of(tiny_loaded, store) for _ in range(2)]
        for answer in answers:
            answer.tickets = [Ticket()]
            running.start(answer, never)
        await asyncio.sleep(0)
        running.cancel_all()
        await asyncio.sleep(0)
        return answers, running

    answers, running = asyncio.run(run())
    assert len(cancelled) == 2 and all(running.get(a.id) is None for a in answers)
    assert [store.get(a.id).response["status"] for a in answers] == ["cancelled"] * 2


def test_an_engine_failure_ends_a_background_response_failed_and_kept(tiny_loaded):
    store, counted = ResponseStore(capacity=4), []
    answer = answer_of(tiny_loaded, store)
    running = BackgroundResponses(counted.append)

    async def engine_fails():
        raise RuntimeError("boom")

    async def run():
        assert running.start(answer, engine_fails)["status"] == "queued"
        while running.get(answer.id) is not None:
            await asyncio.sleep(0)

    asyncio.run(run())
    failed = store.get(answer.id).response
    assert (failed["status"], failed["error"]["code"], failed["output"]) == (
        "failed", "server_error", [])
    assert "boom" in failed["error"]["message"] and counted == ["error"]
