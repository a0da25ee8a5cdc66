"""The OpenAI-compatible API server: FastAPI routes in front of one ``AsyncLLM``.

``run_server`` starts the engine (its own process), then serves with uvicorn until SIGTERM /
Ctrl-C, or until the engine core dies: then in-flight requests fail at once (503 / an SSE
error event), ``/health`` answers 503 for ``ENGINE_DEAD_GRACE_S``, and the server exits with
code 1. Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{model}`` (the base model and its LoRA adapters), ``POST /v1/embeddings`` (the
pooling runner), ``GET /health``, ``GET /metrics``, vLLM's ``POST /tokenize``,
``POST /detokenize``, ``GET /version``, ``GET /openapi.json`` (the OpenAPI schema) and, while
``MM_SERVE_TORCH_PROFILER_DIR`` is set, ``POST /start_profile`` and ``/stop_profile``; while
``MM_SERVE_ALLOW_RUNTIME_LORA_UPDATING`` is true, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (``serving_models``); and the web page ``web/`` at ``/`` when it
exists.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.resources
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.routing import Match, Mount
from starlette.types import Scope

from mm_serve.config import EngineArgs
from mm_serve.entrypoints.openai.errors import (
    bad_request,
    engine_dead_error,
    install_error_handlers,
)
from mm_serve.entrypoints.openai.media import MediaConfig, MediaResolver
from mm_serve.entrypoints.openai.metrics import ServerMetrics
from mm_serve.entrypoints.openai.middleware import RequestGuard, until_disconnected
from mm_serve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from mm_serve.entrypoints.openai.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from mm_serve.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest
from mm_serve.entrypoints.openai.serving_chat import ServingChat
from mm_serve.entrypoints.openai.serving_common import Admission, ModelInfo
from mm_serve.entrypoints.openai.serving_completion import ServingCompletion
from mm_serve.entrypoints.openai.serving_embeddings import ServingEmbedding
from mm_serve.entrypoints.openai.serving_models import (
    LoRAModulePath,
    ServingModels,
    add_lora_routes,
    runtime_lora_updating,
)
from mm_serve.entrypoints.openai.serving_responses import ServingResponses
from mm_serve.entrypoints.openai.serving_tokenization import ServingTokenization
from mm_serve.frontend.async_llm import AsyncLLM
from mm_serve.frontend.engine_process import EngineProcess
from mm_serve.frontend.exceptions import EngineDeadError
from mm_serve.messages.stats import EngineStats, RequestStats
from mm_serve.utils.profiler import DIR_ENV as PROFILER_DIR_ENV

if TYPE_CHECKING:
    from mm_serve.entrypoints.openai.multi_api_server import ApiServerRole

logger = logging.getLogger(__name__)

ENGINE_DEAD_GRACE_S = 1.0  # /health says 503 this long after the engine died, then exit
ENGINE_WATCH_INTERVAL_S = 0.1
STATS_TIMEOUT_S = 5.0
WEB_DIR = Path(str(importlib.resources.files("mm_serve.web")))  # the repository's web/
API_PATHS = ("/v1/", "/health", "/metrics", "/tokenize", "/detokenize", "/version", "/openapi.json")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of ``mm-serve serve`` (engine options are ``EngineArgs``).

    ``served_model_names``: names clients use in ``model`` (empty: the model as given; the
    first is reported in responses); ``max_request_body_bytes``: larger bodies get a 413;
    ``max_concurrent_requests``: generation sequences (a request's ``n``) in flight beyond it
    get a 429; ``max_n``: a larger ``n`` is a 400; ``lora_modules``: LoRA adapters served by
    name beside the model (the engine needs ``enable_lora``);
    ``web_dir``: served at ``/`` when it holds an ``index.html``; ``log_level``: uvicorn's
    (debug, info, warning, error); ``otlp_traces_endpoint``: an OTLP/HTTP collector that gets
    a span per request (``tracing``), None: no tracing; ``shutdown_timeout``: seconds the
    requests in flight at SIGTERM get to finish (new connections are refused), then the rest
    are cut and the engine stops; ``api_server_count``: API-server processes sharing the
    port and the one engine core (``multi_api_server``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    media: MediaConfig = MediaConfig()
    max_request_body_bytes: int = 64 << 20
    max_concurrent_requests: int = 1024
    max_n: int = 128
    web_dir: Path = WEB_DIR
    log_level: str = "info"
    otlp_traces_endpoint: str | None = None
    shutdown_timeout: float = 5.0
    lora_modules: tuple[LoRAModulePath, ...] = ()
    api_server_count: int = 1


def served_model(llm: AsyncLLM, config: ServerConfig) -> ModelInfo:
    """The names clients may give in ``model``, and the checkpoint as given."""
    model_name = llm.config.model.model
    return ModelInfo(config.served_model_names or (model_name,), model_name)


@dataclass(frozen=True)
class Handlers:
    """The request handlers of the routes and of ``run-batch`` (one admission limit)."""

    chat: ServingChat
    completion: ServingCompletion
    tokenization: ServingTokenization
    responses: ServingResponses
    embedding: ServingEmbedding
    models: ServingModels


def serving_handlers(llm: AsyncLLM, config: ServerConfig, media: MediaResolver) -> Handlers:
    """The handlers of one served model and its ``config.lora_modules``.

    Raises:
        LoRAAdapterError: a LoRA module that cannot be served (or LoRA is off).
    """
    model = served_model(llm, config)
    models = ServingModels(llm, model)
    models.add_static(config.lora_modules)
    admission = Admission(config.max_concurrent_requests, config.max_n)
    chat = ServingChat(llm, model, admission, media)
    return Handlers(
        chat,
        ServingCompletion(llm, model, admission),
        ServingTokenization(llm, model, media),
        ServingResponses(llm, model, admission, chat),
        ServingEmbedding(llm, model, admission, media),
        models,
    )


def build_app(
    llm: AsyncLLM, config: ServerConfig, metrics: ServerMetrics, media: MediaResolver
) -> FastAPI:
    """The FastAPI app serving ``llm`` (which must outlive it).

    Raises:
        LoRAAdapterError: see ``serving_handlers``.
    """
    handlers = serving_handlers(llm, config, media)
    chat, completion, tokenization = handlers.chat, handlers.completion, handlers.tokenization
    # The OpenAPI schema at /openapi.json (vLLM's); no /docs: its page loads from a CDN.
    app = FastAPI(title="mm_serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await until_disconnected(request, chat.handle(body, time.monotonic()))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await until_disconnected(request, completion.handle(body, time.monotonic()))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await until_disconnected(request, handlers.responses.handle(body, time.monotonic()))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> ResponseObject:
        return ResponseObject(**handlers.responses.store.get(response_id)[0])

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=handlers.models.cards())

    @app.get("/v1/models/{name:path}")
    async def retrieve_model(name: str) -> ModelCard:
        return handlers.models.card(name)  # 404 for a model not served

    @app.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> TokenizeResponse:
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(body)

    add_embeddings_route(app, handlers.embedding)
    if runtime_lora_updating():
        add_lora_routes(app, handlers.models)
    add_operational_routes(app, llm, metrics)
    if os.environ.get(PROFILER_DIR_ENV):
        add_profiler_routes(app, llm)
    if (config.web_dir / "index.html").is_file():
        web = StaticFiles(directory=config.web_dir, html=True)
        app.router.routes.append(_WebMount("/", app=web, name="web"))
    app.add_middleware(
        RequestGuard,
        api_key=config.api_key,
        max_body_bytes=config.max_request_body_bytes,
        metrics=metrics,
    )
    if config.otlp_traces_endpoint:
        from mm_serve.entrypoints.openai.tracing import TraceContext

        app.add_middleware(TraceContext)
    return app


def add_embeddings_route(app: FastAPI, embedding: ServingEmbedding) -> None:
    """``POST /v1/embeddings``: the pooling runner's (a generating server answers a 400)."""

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        return await until_disconnected(request, embedding.handle(body, time.monotonic()))


def add_profiler_routes(app: FastAPI, llm: AsyncLLM) -> None:
    """``POST /start_profile`` and ``/stop_profile`` (vLLM's, there only while
    ``MM_SERVE_TORCH_PROFILER_DIR`` is set): the torch profiler in the engine's processes. A
    start while it runs, or a stop while it does not, is a 400."""

    async def call(method: Callable[[], Awaitable[None]]) -> JSONResponse:
        try:
            await method()
        except EngineDeadError:
            raise  # a 503, as for every request
        except RuntimeError as e:
            raise bad_request(str(e)) from e
        return JSONResponse({"status": "ok"})

    @app.post("/start_profile")
    async def start_profile() -> JSONResponse:
        return await call(llm.start_profile)

    @app.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        return await call(llm.stop_profile)


def add_operational_routes(app: FastAPI, llm: AsyncLLM, metrics: ServerMetrics) -> None:
    """``GET /version``, ``/health`` (503 once the engine core is gone) and ``/metrics``."""

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("mm_serve")}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine core runs; 503 once it is gone."""
        if llm.is_dead:
            return engine_dead_error().response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        stats = None
        if not llm.is_dead:
            try:
                stats = await asyncio.wait_for(llm.get_replica_stats(), STATS_TIMEOUT_S)
            except Exception:  # the engine died meanwhile: the front end's metrics still count
                logger.warning("Reading the engine's stats failed", exc_info=True)
        return Response(metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


class _WebMount(Mount):
    """The web page at ``/``, under every path but the API's: a wrong method on an API path
    stays a 405 and an unknown ``/v1/`` path a JSON 404. Paths with a ``/__`` segment (the
    folder's package marker ``__init__.py`` and its ``__pycache__/``) are no page files: 404."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        path = scope["path"]
        if scope["type"] == "http" and (path.startswith(API_PATHS) or "/__" in path):
            return Match.NONE, {}
        return super().matches(scope)


async def run_server(
    engine_args: EngineArgs,
    config: ServerConfig,
    engine_process: EngineProcess | None = None,
    role: ApiServerRole | None = None,
) -> int:
    """Start the engine and serve until stopped; returns the process exit code: 0 after
    SIGTERM / SIGINT, 1 when the engine core died. ``engine_process``: the engine core
    process if already started (``start_engine_core``). ``role``: this process's part in a
    server of several API-server processes (``multi_api_server``: the shared socket and
    engine core, multiprocess metrics); None: the only one.

    Raises:
        ValueError: an unusable checkpoint or option.
        EngineStartupError: the engine core failed to start.
    """
    metrics = ServerMetrics(role.metrics_dir if role else None)
    on_request_finished, tracer = metrics.observe_request, None
    if config.otlp_traces_endpoint:
        from mm_serve.entrypoints.openai.tracing import RequestTracer

        tracer = RequestTracer.otlp(config.otlp_traces_endpoint)

        def on_request_finished(stats: RequestStats) -> None:
            metrics.observe_request(stats)
            tracer.record(stats)

    llm = await AsyncLLM.create(
        engine_args,
        engine_process=role.engine if role else engine_process,
        on_request_finished=on_request_finished,
        on_inter_token_latency=metrics.observe_inter_token_latency,
    )
    if role:  # this API server's processor cache, for the whole server's counts
        metrics.front_end_stats = lambda: llm.add_front_end_stats(EngineStats())
    media = MediaResolver(config.media)
    try:
        # Before /health answers: the first request is as fast as the next.
        await (role.warm_up(llm) if role else llm.warm_up())
        app = build_app(llm, config, metrics, media)
        if role:
            role.add_served_by_header(app)
        uvicorn_config = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            lifespan="off",
            timeout_graceful_shutdown=config.shutdown_timeout,
            log_level=config.log_level,
        )
        server = uvicorn.Server(uvicorn_config)
        stop_signals: list[int] = []
        # uvicorn re-raises the signal that stopped it once it is done; record it instead of
        # dying from it, so that the engine is shut down below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: stop_signals.append(signum))
        watchdog = asyncio.ensure_future(_watch(server, llm, config))
        try:
            await server.serve(sockets=[role.listener] if role else None)
        finally:
            watchdog.cancel()
        engine_died = llm.is_dead
    finally:
        await media.aclose()
        llm.shutdown()
        if tracer is not None:
            tracer.shutdown()
    if engine_died and not stop_signals:
        logger.error("Exiting: the engine core died.")
        return 1
    return 0


async def _watch(server: uvicorn.Server, llm: AsyncLLM, config: ServerConfig) -> None:
    """Announce the URL once serving; stop the server when the engine core dies."""
    while not server.started and not server.should_exit:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    if server.started:
        logger.info("Ready at http://%s:%d (%s)", config.host, config.port, llm.config.model.model)
    while not llm.is_dead:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    logger.error("The engine core died; the server stops in %.1f s.", ENGINE_DEAD_GRACE_S)
    await asyncio.sleep(ENGINE_DEAD_GRACE_S)
    server.should_exit = True
