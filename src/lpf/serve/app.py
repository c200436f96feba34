"""The FastAPI app of `lpf serve`: vLLM's OpenAI routes and SGLang's /generate over one engine loop.

Contract: `create_app(engine, tokenizer, info, sink)` returns an ASGI app whose lifespan starts the
`EngineLoop` and stops it (flushing the trace sink) on shutdown. Routes:
  GET  /health          200 with an empty body while the engine lives, 500 once it has died
  GET  /v1/models       the one served model, as vLLM lists it, plus `lpf_configuration` (dtype, KV cache
                        dtype, flash attention, weight quantization, sampling defaults, injected faults)
  POST /v1/completions  OpenAI completions (vLLM's response shape, see openai_api.py)
  POST /v1/chat/completions  OpenAI chat (the model's chat template renders the messages, see chat_api.py)
  both with `stream: true` answered as vLLM's server-sent events (see streaming.py)
  POST /generate        SGLang's native API (a dict, or a list for batched input or n > 1)
  GET  /metrics         Prometheus text: steps, largest batch, requests, tokens, preemptions, cancelled
                        requests, free state slots
Every error is JSON {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status: an unknown
model is 404 NotFoundError, a malformed body or an unsupported parameter 400, a request the cache can
never hold 400 with the engine's reason. A client that disconnects before its answer takes its requests
back: they are dropped from the engine (slot freed) and nothing is answered. A request id sent as X-Request-Id (or `request_id`, or SGLang
`rid`) becomes the engine request id, so the trace rows of --trace-dir name the client's requests.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from lpf.serve.chat_api import ChatRequest, plan_chat, render_chat
from lpf.serve.engine_loop import EngineLoop, TraceSink
from lpf.serve.openai_api import CompletionRequest, plan_completion, render_completion
from lpf.serve.protocol import ApiError, ModelInfo
from lpf.serve.sglang_api import GenerateRequest, plan_generate, render_generate
from lpf.serve.streaming import sse


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body ({err.get('ctx', {}).get('error', 'JSON decode error')})"
        loc = ".".join(str(p) for p in err.get("loc", ()) if not str(p).startswith("function-"))
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request body"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _disconnected(http: HttpRequest) -> None:
    """Returns once the client has gone (the body is already read: ASGI's next message is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def create_app(engine, tokenizer, info: ModelInfo, sink: TraceSink | None = None) -> FastAPI:
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = EngineLoop(engine, sink)
        loop.start()
        app.state.loop = loop
        try:
            yield
        finally:
            await loop.stop()

    app = FastAPI(title="lpf serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def _gone(_: HttpRequest, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: HttpRequest, exc: RequestValidationError):
        return JSONResponse(ApiError(_validation_message(exc), 400, "Bad Request").body(), status_code=400)

    def check_model(name: str | None) -> None:
        if name is not None and name != info.name:
            raise ApiError(
                f"The model `{name}` does not exist. Valid aliases: {info.name}.", 404, "NotFoundError", "model"
            )

    async def run(plans, http: HttpRequest) -> None:
        submit = asyncio.ensure_future(app.state.loop.submit([r for p in plans for r in p.requests]))
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({submit, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not submit.done():  # the client left: the loop takes its requests out of the engine
            submit.cancel()
            with suppress(asyncio.CancelledError):
                await submit
            raise ClientGone()
        done = submit.result()
        failed = next((r for r in done if r.error is not None), None)
        if failed is not None:
            raise ApiError(f"request {failed.request_id}: {failed.error}")

    @app.get("/health")
    async def health():
        if app.state.loop.dead is not None:
            return JSONResponse(
                ApiError(f"the engine is dead: {app.state.loop.dead}", 500, "InternalServerError").body(),
                status_code=500,
            )
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": info.name,
                    "object": "model",
                    "created": started,
                    "owned_by": "lpf",
                    "root": info.root,
                    "parent": None,
                    "max_model_len": info.max_context,
                    # what the engine computes with (lpf.adapters.engine_config.from_lpf_models reads it)
                    "lpf_configuration": info.configuration,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                            "object": "model_permission",
                            "created": started,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }

    async def answer(body, http: HttpRequest, prefix: str, plan, render, chat: bool):
        """One OpenAI route: plan the request, then stream it or run it and render the whole answer."""
        check_model(body.model)
        base = http.headers.get("X-Request-Id") or body.request_id or uuid.uuid4().hex[:16]
        response_id = f"{prefix}-{base}"
        plans = plan(body, tokenizer, info, response_id)
        created = int(time.time())
        if body.stream:
            return stream(plans, body, response_id, created, chat=chat)
        await run(plans, http)
        return render(body, plans, tokenizer, info, response_id, created)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        return await answer(body, http, "cmpl", plan_completion, render_completion, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest):
        return await answer(body, http, "chatcmpl", plan_chat, render_chat, chat=True)

    def stream(plans, body, response_id: str, created: int, chat: bool) -> StreamingResponse:
        if app.state.loop.dead is not None:
            raise ApiError(f"the engine is dead: {app.state.loop.dead}", 500, "InternalServerError")
        events = sse(app.state.loop, plans, body, tokenizer, info, response_id, created, chat)
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/generate")
    async def generate(body: GenerateRequest, http: HttpRequest):
        plans, batch = plan_generate(body, tokenizer, info)
        await run(plans, http)
        out = render_generate(plans, tokenizer, body.return_text_in_logprobs)
        return out if batch else out[0]

    @app.get("/metrics")
    async def metrics():
        s, loop = app.state.loop.stats, app.state.loop
        lines = [
            ("lpf_steps_total", "counter", "engine steps run", s.steps),
            ("lpf_batch_size_max", "gauge", "largest number of requests scheduled in one step", s.max_batch_size),
            ("lpf_scheduled_requests_total", "counter", "sum over steps of requests scheduled", s.scheduled_sum),
            (
                "lpf_requests_submitted_total",
                "counter",
                "requests received (each ends finished, rejected or cancelled)",
                s.requests_submitted,
            ),
            ("lpf_requests_added_total", "counter", "requests handed to the engine", s.requests_added),
            ("lpf_requests_finished_total", "counter", "requests finished", s.requests_finished),
            ("lpf_requests_rejected_total", "counter", "requests refused by the engine", s.requests_rejected),
            ("lpf_generation_tokens_total", "counter", "output tokens generated", s.tokens_generated),
            ("lpf_preemptions_total", "counter", "preemptions by recompute", s.preemptions),
            ("lpf_requests_in_flight", "gauge", "requests submitted and not yet finished", loop.running),
            (
                "lpf_requests_cancelled_total",
                "counter",
                "requests taken back by clients that went away",
                s.requests_cancelled,
            ),
            ("lpf_state_slots_free", "gauge", "state slots no request holds", loop.engine.num_free_slots),
        ]
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in lines)
        return PlainTextResponse(text)

    return app
