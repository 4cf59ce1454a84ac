"""The OpenAI-compatible HTTP server: a Starlette app in front of one `Engine`.

  POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events ending
                                                     with `data: [DONE]`)
  POST /v1/responses (OpenAI's Responses API through the chat path: `responses.py`),
  GET and DELETE /v1/responses/{id} (the answers kept: `response_store.py`),
  GET /v1/responses/{id}/input_items (`response_items.py`), POST /v1/responses/{id}/cancel
  (a background one: `background.py`)
  GET /v1/models (and /v1/models/{model}), GET /health, GET /metrics (Prometheus)
  POST /tokenize, POST /detokenize (vLLM's: `tokenization.py`), GET /version
  POST /v1/load_lora_adapter, /v1/unload_lora_adapter (with a loader: `build_app`)

The engine runs on its own thread; each request's deltas reach the event loop through
`call_soon_threadsafe`, so nothing here blocks it. A full queue is a 429 with Retry-After;
a client that goes away (streaming or not) has its request cancelled, which frees its slots
within one chunk. Errors are OpenAI's `{"error": {...}}` objects (see `protocol.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import kvjax
from kvjax.model import lora_rows
from kvjax.text import LoadedModel, forced_start

from . import harmony, reasoning, response_items, responses, structured
from .adapter_names import ServedAdapters
from .answers import Answer
from .background import BackgroundResponses
from .engine import Engine, EngineFailed, QueueFull
from .limits import Limits, authorized, read_json
from .metrics import ServeMetrics
from .prompts import chat_prompt
from .protocol import APIError, Parsed, model_sampling_defaults, parse, requested_model
from .response_answers import ResponseAnswer
from .response_store import ResponseStore
from .tokenization import detokenize, tokenize
from .tools import parse_tools

RETRY_AFTER_SECONDS = 1
# Adapter slots and rank a server that loads adapters while serving has by default (vLLM's
# --max-lora-rank default is 16 too).
LOADING_SLOTS, LOADING_RANK = 4, 16


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def build_app(loaded: LoadedModel, *, model_name: str | None = None, max_slots: int = 16,
              max_staged: int | None = None, max_queue: int = 64, max_len: int | None = None,
              chunk_size: int | None = None, steps_per_check: int | None = None,
              prefill_batch: int = 8,
              prefix_cache_rows: int | None = None, prefill_part: int = 512,
              page_size: int | None = None, num_pages: int | None = None,
              warm_up: bool = False, mesh=None,
              api_key: str | None = None, limits: Limits | None = None,
              reasoning_parser: str | None = None, adapters: dict | None = None,
              max_adapters: int | None = None, max_adapter_rank: int | None = None,
              load_adapter=None, max_source_len: int | None = None,
              target_language: str | None = None,
              sampling_defaults: str = "model") -> Starlette:
    """The app serving `loaded` as `model_name` (default: its directory's name). The engine
    starts with the app (its lifespan), after compiling every program it can need if
    `warm_up`, and stops with it. On a `mesh` the slots are split over its devices (see
    `Engine`). With an `api_key`, /v1/ answers only requests that carry it; `limits` bound
    what a request may ask (`limits.Limits`). A `reasoning_parser` (`reasoning.PARSERS`)
    answers a chat choice's thought as its `reasoning`, apart from its content. `adapters`
    ({name: (adapters, lora)}, LoRA adapters trained on the model) are served beside it
    under their names, unmerged (`Engine`'s `adapters`), in `max_adapters` slots of rank
    `max_adapter_rank` (defaults: `adapter_stack`). With
    `load_adapter` (a directory on the server -> `(adapters, lora)`), POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter change them while it serves
    (`adapter_names.py`). `max_source_len`: an encoder-decoder's longest source (`Engine`'s).
    `target_language` (a translator's language code, one token of its tokenizer; default:
    what its generation config forces, `text.forced_start`) starts the target of every
    request that names no `target_language` or other constraint of its own.
    `sampling_defaults` ("model" or "openai", `protocol.model_sampling_defaults`): where the
    sampling settings a request leaves out come from."""
    if reasoning_parser not in (None, *reasoning.PARSERS):
        raise ValueError(f"reasoning_parser={reasoning_parser!r} is not one of "
                         f"{', '.join(reasoning.PARSERS)}")
    if reasoning_parser in reasoning.HARMONY_PARSERS:
        harmony.marker_ids(loaded.tokenizer)  # a ValueError for a tokenizer without them
    default_language = forced_start(loaded) if target_language is None else structured.language(
        target_language, loaded.tokenizer, loaded.is_translation, "target_language")
    defaults = model_sampling_defaults(loaded, sampling_defaults)
    name = model_name or os.path.basename(os.path.normpath(loaded.directory)) or "kvjax"
    if name in (adapters or {}):
        raise ValueError(f"the adapter name {name!r} is the model's own served name: requests "
                         "for it would never reach the adapter")
    metrics = ServeMetrics()
    stack = adapter_stack(loaded, adapters or {}, max_adapters, max_adapter_rank,
                          load_adapter is not None)
    engine = Engine(loaded.config, loaded.params, tokenizer=loaded.tokenizer,
                    max_slots=max_slots, max_staged=max_staged, max_len=max_len,
                    chunk_size=chunk_size, steps_per_check=steps_per_check, max_queue=max_queue,
                    prefill_batch=prefill_batch,
                    prefix_cache_rows=prefix_cache_rows, prefill_part=prefill_part,
                    page_size=page_size, num_pages=num_pages, metrics=metrics, mesh=mesh,
                    adapters=stack, max_source_len=max_source_len)
    served_adapters = ServedAdapters(engine, name, tuple(adapters or ()),
                                     0 if stack is None else stack.count, load_adapter)
    created = int(time.time())

    limits = limits or Limits()
    stored = ResponseStore(limits.max_stored_responses)
    background = BackgroundResponses(metrics.count_request)
    max_prompts = limits.max_prompts or max_queue

    async def models(request: Request) -> JSONResponse:
        """Every served name (GET /v1/models), or the one named (GET /v1/models/{model})."""
        try:
            authorized(request, api_key)
            cards = [{"id": served, "object": "model", "created": created, "owned_by": "kvjax",
                      "root": served, "parent": None if served == name else name,
                      "max_model_len": engine.capacity}
                     for served in (name, *served_adapters.served())]
            wanted = request.path_params.get("model")
            if wanted is not None:  # one not served: the 404 a generation request gets
                requested_model({"model": wanted}, tuple(card["id"] for card in cards))
        except APIError as error:
            return error_response(error)
        if wanted is None:
            return JSONResponse({"object": "list", "data": cards})
        return JSONResponse(next(card for card in cards if card["id"] == wanted))

    async def load_lora_adapter(request: Request) -> Response:
        return await _change_adapters(request, load=True)

    async def unload_lora_adapter(request: Request) -> Response:
        return await _change_adapters(request, load=False)

    async def _change_adapters(request: Request, load: bool) -> Response:
        try:
            authorized(request, api_key)
            body = await read_json(request, limits)
            if not isinstance(body, dict):
                raise APIError(400, "the request body must be a JSON object")
            if load:
                said = await served_adapters.load(body.get("lora_name"), body.get("lora_path"))
            else:
                said = await served_adapters.unload(body.get("lora_name"))
        except APIError as error:
            return error_response(error)
        except EngineFailed as error:
            return error_response(APIError(503, str(error), kind="server_error"))
        return Response(said, media_type="text/plain")

    async def health(_: Request) -> JSONResponse:
        if engine.failure is not None:  # a server to restart
            return JSONResponse({"status": "failed", "error": str(engine.failure)}, 503)
        return JSONResponse({"status": "ok", "live_slots": engine.live_slots,
                             "queue_length": engine.queue_length})

    async def tokenize_text(request: Request) -> JSONResponse:
        return await _tokenization(request, tokenize, engine.capacity)

    async def detokenize_tokens(request: Request) -> JSONResponse:
        return await _tokenization(request, detokenize)

    async def _tokenization(request: Request, answer, *args) -> JSONResponse:
        try:
            authorized(request, api_key)
            body = await read_json(request, limits)
            served = (name, *served_adapters.names)
            # Off the event loop, as a generation request's prompts are tokenized.
            return JSONResponse(await asyncio.to_thread(answer, body, loaded, served, *args))
        except APIError as error:
            return error_response(error)

    async def version(_: Request) -> JSONResponse:
        return JSONResponse({"version": kvjax.__version__})

    async def metrics_text(_: Request) -> Response:
        return Response(metrics.exposition(), media_type=metrics.content_type)

    async def completions(request: Request) -> Response:
        return await _generate(request, chat_api=False)

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, chat_api=True)

    async def create_response(request: Request) -> Response:
        return await _generate(request, chat_api=True, responses_api=True)

    async def stored_response(request: Request) -> JSONResponse:
        """GET or DELETE a Responses API answer, kept (`response_store.py`) or running in
        the background (`background.py`); GET its input items (`response_items.py`); POST
        .../cancel to stop a background one."""
        response_id, path = request.path_params["response_id"], request.url.path
        try:
            authorized(request, api_key)
            cancelled = (background.cancel(response_id)
                         if path.endswith("/cancel") or request.method == "DELETE" else None)
            running, kept = background.get(response_id), stored.get(response_id)
            if request.method == "DELETE" and (stored.delete(response_id) or cancelled):
                return JSONResponse({"id": response_id, "object": "response", "deleted": True})
            if running is None and kept is None:
                raise APIError(404, f"No response with id {response_id!r} is kept",
                               kind="not_found_error")
            response = running.current() if running else kept.response
            if path.endswith("/cancel") and not response["background"]:
                raise APIError(400, f"Response {response_id!r} was not made in the "
                                    "background: only a background response can be cancelled")
            if path.endswith("/input_items"):
                response = response_items.page((running or kept).items, request.query_params)
        except APIError as error:
            return error_response(error)
        return JSONResponse(response)

    async def _generate(request: Request, chat_api: bool, responses_api: bool = False
                        ) -> Response:
        try:
            authorized(request, api_key)
            body = await read_json(request, limits)
            # Off the event loop: tokenizing many or long prompts must not stall other
            # requests' streams, nor /health.
            chat = responses.chat_body(body, stored) if responses_api else body
            whole = chat.get("messages")  # kept whole, though a slot may take less of it
            if responses_api:
                chat = await asyncio.to_thread(responses.fitted, chat, body, lambda c: len(
                    chat_prompt(loaded, c, parse_tools(c))[0]), engine.capacity)
            parsed = await asyncio.to_thread(_parse_and_check, chat, chat_api)
            metrics.count_model_request(parsed.model)
            answer = (ResponseAnswer(parsed, loaded.tokenizer, body, whole, stored)
                      if responses_api else Answer(parsed, loaded.tokenizer))
            if answer.scores_prompts:
                for prompt, generation in enumerate(parsed.requests):
                    served_adapters.check_serves(parsed.model, generation.adapter)
                    scores = await asyncio.wrap_future(engine.score_prompt(
                        generation.prompt, max(generation.logprobs, parsed.prompt_top or 0),
                        generation.adapter))
                    answer.set_prompt_logprobs(prompt, scores)
            if (parsed.echo_prompt or parsed.prompt_top is not None) and all(
                    r.max_tokens == 0 for r in parsed.requests):
                metrics.count_request("completed")
                return JSONResponse(_echo_only(answer))
            events: asyncio.Queue = asyncio.Queue()
            # No await from the check to the engine's queue: an adapter unloaded meanwhile
            # (its slot then given to another) is a 404, not another adapter's answer.
            served_adapters.check_serves(parsed.model, parsed.requests[0].adapter)
            answer.tickets = tickets = _submit(parsed, events, asyncio.get_running_loop())
        except QueueFull as error:
            metrics.count_request("rejected")
            return error_response(APIError(
                429, f"{error}; retry after {RETRY_AFTER_SECONDS} s", kind="rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)}))
        except EngineFailed as error:
            metrics.count_request("error")
            return error_response(APIError(503, str(error), kind="server_error"))
        except (APIError, ValueError) as error:
            metrics.count_request("invalid")
            if not isinstance(error, APIError):
                error = APIError.invalid(error, chat_api)
            return error_response(responses.renamed(error) if responses_api else error)
        if responses_api and answer.background:
            return JSONResponse(background.start(answer, lambda: _next(answer, events)))
        if parsed.stream:
            return StreamingResponse(_stream(answer, events, tickets),
                                     media_type="text/event-stream")
        return await _whole(request, answer, events, tickets)

    def _parse_and_check(body, chat_api: bool) -> Parsed:
        """The parsed request with every prompt's request checked as the engine will take it
        (the echo-only answer, which never reaches the engine, included)."""
        parsed = parse(body, loaded, name, engine.capacity, chat_api=chat_api,
                       max_prompts=max_prompts, max_stop_strings=limits.max_stop_strings,
                       max_stop_chars=limits.max_stop_chars,
                       reasoning_parser=reasoning_parser,
                       adapter_names=served_adapters.names,
                       default_language=default_language, sampling_defaults=defaults)
        try:
            checked = tuple(
                dataclasses.replace(engine.check(dataclasses.replace(r, max_tokens=1)),
                                    max_tokens=r.max_tokens) if r.max_tokens == 0
                else engine.check(r) for r in parsed.requests)
        except UnicodeError as error:  # a tokenizer refusing text: the client's
            raise APIError(400, f"the text cannot be tokenized: {error}", "prompt") from None
        return dataclasses.replace(parsed, requests=checked)

    def _submit(parsed: Parsed, events: asyncio.Queue, loop) -> list:
        tickets = []
        try:
            for prompt, generation in enumerate(parsed.requests):
                def on_delta(delta, prompt=prompt):
                    loop.call_soon_threadsafe(events.put_nowait, (prompt, delta))

                tickets.append(engine.submit(generation, on_delta))
        except (QueueFull, ValueError, EngineFailed):
            for ticket in tickets:
                ticket.cancel()
            raise
        return tickets

    async def _next(answer: Answer, events: asyncio.Queue):
        """The next (prompt, delta), added to `answer`; an engine failure is raised."""
        prompt, delta = await events.get()
        if isinstance(delta, Exception):
            raise delta
        answer.add(prompt, delta)
        return prompt, delta

    async def _whole(request: Request, answer: Answer, events, tickets) -> Response:
        async def collect():
            while not answer.done:
                await _next(answer, events)

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not collector.done():
                for ticket in tickets:
                    ticket.cancel()
                metrics.count_request("disconnected")
                return Response(status_code=499)
            try:
                collector.result()
            except Exception as error:  # noqa: BLE001 - the engine failed: answer with it
                metrics.count_request("error")
                return error_response(APIError(500, f"generation failed: {error!r}",
                                               kind="server_error"))
            metrics.count_request("completed")
            return JSONResponse(answer.final())
        finally:
            collector.cancel()
            watcher.cancel()

    async def _stream(answer: Answer, events, tickets):
        outcome = "disconnected"  # unless the stream gets to its end
        try:
            for event in answer.stream_opening():
                yield event
            while not answer.done:
                try:
                    prompt, delta = await _next(answer, events)
                except Exception as error:  # noqa: BLE001 - the stream is already open
                    outcome = "error"
                    for event in answer.stream_error(APIError(
                            500, f"generation failed: {error!r}", kind="server_error")):
                        yield event
                    return
                for event in answer.stream_delta(prompt, delta):
                    yield event
            for event in answer.stream_closing():
                yield event
            outcome = "completed"
        finally:
            if not answer.done:  # the client went away (or the engine failed)
                for ticket in tickets:
                    ticket.cancel()
            metrics.count_request(outcome)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        if warm_up:
            engine.warm_up()
        engine.start()
        try:
            yield
        finally:
            background.cancel_all()
            engine.close()

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", stored_response, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", stored_response, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/tokenize", tokenize_text, methods=["POST"]),
        Route("/detokenize", detokenize_tokens, methods=["POST"]),
        *([Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
           Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
          if load_adapter is not None else []),
    ], lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_name = engine, metrics, name
    return app


def adapter_stack(loaded: LoadedModel, adapters: dict, slots: int | None, rank: int | None,
                  loading: bool):
    """The engine's stack of adapter slots: `adapters` ({name: (adapters, lora)}) first, in
    `slots` in all (default: one each, and at least `LOADING_SLOTS` if `loading`), of `rank`
    (default: the largest given, and at least `LOADING_RANK` if `loading`); for adapters
    loaded later, on every kernel they may adapt (a mixture's experts only where an adapter
    given adapts them). None for no slot."""
    given = list(adapters.values())
    if slots is None:
        slots = max(len(given), LOADING_SLOTS if loading else 0)
    if not isinstance(slots, int) or slots < len(given) or (loading and slots < 1):
        raise ValueError(f"max_adapters={slots!r} must be an int that holds the {len(given)} "
                         f"adapters given{' and room to load one' if loading else ''}")
    if not slots:
        return None
    if rank is None:
        rank = max([lora.rank for _, lora in given] + ([LOADING_RANK] if loading else []))
    targets = None
    if loading:  # what adapters loaded later may adapt: a mixture's experts if given ones do
        given_targets = {t for _, lora in given for t in lora.targets}
        outside_experts = lora_rows.servable_targets(loaded.config, loaded.params,
                                                     experts=False)
        targets = [t for t in lora_rows.servable_targets(loaded.config, loaded.params)
                   if t in outside_experts or t in given_targets]
    return lora_rows.stack(loaded.config, loaded.params, given, capacity=slots, rank=rank,
                           targets=targets)


def _echo_only(answer: Answer) -> dict:
    """max_tokens 0 (with `echo` or `prompt_logprobs`): each choice is its prompt."""
    for choice in answer.choices:
        choice.finish_reason = "length"
    return answer.final()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
