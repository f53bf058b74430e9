"""The HTTP front on rank 0: an ASGI app (FastAPI) with the OpenAI endpoints, run by uvicorn in a thread.

    POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events with "stream": true),
    POST /tokenize, POST /detokenize (vLLM's), GET /v1/models, GET /health, GET /metrics (Prometheus text)

A request is checked here (`tensorpar.serving.protocol`; a bad one gets its 4xx without reaching the engine), handed
to the engine's inbox, and answered from the events the engine's thread sends back through the request's event loop.
A client that goes away (a closed stream, or a closed connection while waiting for a whole answer) cancels its
request: its sequences leave the batch and free their KV blocks before the next step.
"""

import asyncio
import importlib.util
import json
import threading
import time

from tensorpar.errors import TensorparError
from tensorpar.serving.engine import Accepted, Engine, RequestDone
from tensorpar.serving.protocol import (ApiError, ModelInfo, chat_request, completion_request, detokenize_request,
                                        tokenize_request)
from tensorpar.serving.responses import Answer

INSTALL_LINE = "pip install 'tensorpar[serve]'"
DISCONNECT_POLL_S = 0.5


def check_serve_extra() -> None:
    """Refuse, with the install line, when the HTTP stack (the `serve` extra) is missing."""
    missing = [name for name in ("fastapi", "uvicorn", "jinja2") if importlib.util.find_spec(name) is None]
    if missing:
        raise TensorparError(f"tensorpar serve needs {', '.join(missing)} (the 'serve' extra): {INSTALL_LINE}")


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        raise ApiError("the request body is not valid JSON") from None


class Handler:
    """What the endpoints do, independent of the web framework's objects."""

    def __init__(self, engine: Engine, tokenizer, info: ModelInfo, template):
        self.engine, self.tokenizer, self.info, self.template = engine, tokenizer, info, template

    def parse(self, kind: str, raw: bytes):
        if not self.engine.accepting:
            raise ApiError("the server is shutting down", status=503, type="service_unavailable")
        body = _json(raw)
        if kind == "chat":
            return chat_request(body, self.tokenizer, self.info, self.template)
        return completion_request(body, self.tokenizer, self.info)

    def tokenize(self, raw: bytes) -> dict:
        return tokenize_request(_json(raw), self.tokenizer, self.info, self.template)

    def detokenize(self, raw: bytes) -> dict:
        return detokenize_request(_json(raw), self.tokenizer, self.info)

    def prompt_texts(self, body_prompts: list[list[int]]) -> list[str]:
        return [self.tokenizer.decode(p) for p in body_prompts]

    async def start(self, kind: str, raw: bytes):
        """(request, options, event queue, answer) of an accepted request; ApiError otherwise."""
        request, options = self.parse(kind, raw)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request.sink = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        self.engine.submit(request)
        first = await events.get()
        if isinstance(first, RequestDone):
            if first.status == 429:
                raise ApiError(first.error, status=429, type="server_overloaded", code="queue_full")
            if first.status == 503:
                raise ApiError(first.error, status=503, type="service_unavailable")
            raise ApiError(first.error, status=first.status, param="n")
        assert isinstance(first, Accepted)
        answer = Answer(kind, self.info.name, request, options, self.tokenizer,
                        self.prompt_texts(request.prompts) if options["echo"] else [])
        return request, options, events, answer

    async def whole(self, request, events, answer, is_disconnected) -> dict | None:
        """The whole answer; None when the client went away (the request is cancelled)."""
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await is_disconnected():
                    self.engine.cancel(request)
                    return None
                continue
            if isinstance(event, RequestDone):
                return answer.whole(event)
            answer.choices[event.index].add(event)

    async def stream(self, request, events, answer):
        """The server-sent events of the answer; closing the stream early cancels the request."""
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, RequestDone):
                    finished = True
                    for line in answer.end(event):
                        yield line
                    return
                for line in answer.chunk(event):
                    yield line
        finally:
            if not finished:
                self.engine.cancel(request)


def create_app(handler: Handler):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="tensorpar serve")

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health():
        ok = handler.engine.accepting
        return JSONResponse({"status": "ok" if ok else "draining"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": handler.info.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tensorpar", "max_model_len": handler.info.context_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(handler.engine.metrics_text(), media_type="text/plain; version=0.0.4")

    async def generate(kind: str, http: Request):
        request, options, events, answer = await handler.start(kind, await http.body())
        if options["stream"]:
            return StreamingResponse(handler.stream(request, events, answer), media_type="text/event-stream")
        whole = await handler.whole(request, events, answer, http.is_disconnected)
        return JSONResponse(whole if whole is not None else {}, status_code=200 if whole is not None else 499)

    @app.post("/tokenize")
    async def tokenize(http: Request):
        return handler.tokenize(await http.body())

    @app.post("/detokenize")
    async def detokenize(http: Request):
        return handler.detokenize(await http.body())

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await generate("completion", http)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        return await generate("chat", http)

    return app


class HttpServer:
    """uvicorn serving the app on a thread of its own (rank 0's main thread runs the engine)."""

    def __init__(self, app, host: str, port: int):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise TensorparError("the HTTP server did not start (is the port free?)")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
