"""The Open Inference Protocol v2 REST app (Starlette): routes, errors, auth, metrics.

The app only moves bytes: `partrain.serve.protocol` decodes and encodes tensors,
one `partrain.serve.Batcher` per model batches and runs them. Build it with
`create_app` and serve it with any ASGI server (``partrain serve`` uses uvicorn).

Endpoints (``{m}`` a model name; every model route also exists under
``/v2/models/{m}/versions/{v}``):

==========================  =====  =================================================
``/v2``                     GET    server metadata (name, version, extensions)
``/v2/health/live``         GET    200 ``{"live": true}`` while the process runs
``/v2/health/ready``        GET    200 when every model's batcher runs, else 503
``/v2/models``              GET    ``{"models": [...]}``: every served model (name, version,
                                   platform, state READY / UNAVAILABLE), as KServe lists them
``/v2/repository/index``    POST   the same entries as a bare list (Triton's repository index)
``/v2/models/{m}``          GET    model metadata: inputs/outputs, -1 = variable dim
``/v2/models/{m}/ready``    GET    200 ``{"name", "ready": true}`` or 503
``/v2/models/{m}/infer``    POST   inference (JSON or binary tensor data extension)
``.../{m}/generate``        POST   generation, one JSON answer (generative models; `generate_http`)
``.../{m}/generate_stream`` POST   generation as Server-Sent Events, one per token
``/metrics``                GET    Prometheus text format
==========================  =====  =================================================

Request bodies may be gzip-compressed (``Content-Encoding: gzip``; `partrain.serve.body`).

Errors are ``{"error": "Expected ... Received: ..."}``: 400 bad request (JSON, shape,
datatype, size, values out of the datatype's range, missing input, corrupt gzip), 401
missing/wrong bearer token, 404 unknown model, version or path, 405 wrong method, 413
body larger than ``max_body_bytes`` (compressed or decompressed), 415 a
``Content-Encoding`` other than gzip, 503 with ``Retry-After`` when a model's queue is
full or the server is stopping, 504 when the request's ``timeout`` parameter expired
before its batch ran, 500 when the model raised or returned NaN/Infinity for a JSON
answer (JSON cannot carry them; binary outputs can). With a token, only the two health endpoints stay open (probes of
orchestrators carry no credentials); metadata, inference and ``/metrics`` need
``Authorization: Bearer TOKEN``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..batching import Batcher, BatcherClosed, QueueFull
from .body import DEFAULT_MAX_BODY_BYTES, body_decoder
from .generate_http import GenerateRoutes, generate_metadata
from .generation import GenerationEngine
from .protocol import (
    HEADER,
    ProtocolError,
    ServedModel,
    decode_infer_request,
    encode_infer_response,
)

OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")
PATHS = ("/v2, /v2/health/live, /v2/health/ready, /v2/models, /v2/models/NAME[/versions/V], "
         ".../ready, .../infer, .../generate, .../generate_stream, /v2/repository/index, /metrics")

Handler = Callable[[Request], Awaitable[Response]]


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    """The protocol's error body: ``{"error": message}``."""
    return Response(json.dumps({"error": message}), status_code=status, headers=dict(headers or {}),
                    media_type="application/json")


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status_code=status, media_type="application/json")


class ServeMetrics:
    """Prometheus metrics of one app, in its own registry (no global state)."""

    def __init__(self, registry: CollectorRegistry, max_batch_size: int):
        self.registry = registry
        labels = ["model"]
        self.requests = Counter("partrain_inference_requests", "Inference requests received", labels,
                                registry=registry)
        self.errors = Counter("partrain_inference_errors", "Inference requests answered with an error",
                              ["model", "code"], registry=registry)
        self.latency = Histogram(
            "partrain_request_latency_seconds", "Inference request latency (body read to response)",
            labels, registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
        )
        sizes = sorted({1 << k for k in range(max(1, max_batch_size).bit_length() + 1)} | {max_batch_size})
        self.batch_size = Histogram("partrain_batch_size", "Rows per model call", labels,
                                    registry=registry, buckets=[float(s) for s in sizes])
        self.batch_latency = Histogram(
            "partrain_batch_latency_seconds", "Model time per batch", labels, registry=registry,
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1, 5),
        )
        self.queue_depth = Gauge("partrain_queue_depth", "Requests waiting for a batch", labels,
                                 registry=registry)

    def watch(self, model: str, batcher: Batcher) -> None:
        """Hook ``batcher`` up: batch sizes and latency, queue depth on scrape."""
        self.queue_depth.labels(model).set_function(lambda: batcher.queue_depth)
        size = self.batch_size.labels(model)
        seconds = self.batch_latency.labels(model)

        def on_batch(rows: int, requests: int, t: float) -> None:
            size.observe(rows)
            seconds.observe(t)

        batcher.on_batch = on_batch


class _Server:
    """State shared by the route handlers of one app."""

    def __init__(self, models: Sequence[ServedModel], token: str | None, max_body_bytes: int,
                 registry: CollectorRegistry, server_name: str):
        self.models = {m.name: m for m in models}
        self.token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.server_name = server_name
        self.metrics = ServeMetrics(registry, max((m.max_batch_size for m in models), default=1))
        self.batchers: dict[str, Batcher] = {}
        self.started = False
        for m in models:
            b = Batcher(m.fn, max_batch_size=m.max_batch_size, policy=m.policy, max_queue=m.max_queue,
                        pad=m.pad, pad_value=m.pad_value, name=m.name)
            self.metrics.watch(m.name, b)
            self.batchers[m.name] = b
        # generative models: one engine each, built here (per app, so per replica), started with the batchers
        self.engines: dict[str, GenerationEngine] = {m.name: m.generator() for m in models if m.generator}
        self.generate = GenerateRoutes(self.engines, registry, lookup=self.lookup, read_body=self.read_body,
                                       ensure_started=self.ensure_started)

    async def start(self) -> None:
        self.started = True
        for e in self.engines.values():
            if not e.running:
                e.start()  # allocates its KV cache; no await before: a request may come at once
        for b in self.batchers.values():
            if b._task is None:
                await b.start()

    async def ensure_started(self) -> None:
        if not self.started:
            await self.start()  # an ASGI client that skips the lifespan (httpx ASGITransport)

    async def stop(self) -> None:
        for b in self.batchers.values():
            await b.stop(drain=True)
        for e in self.engines.values():
            await e.astop(drain=True)

    def model_running(self, name: str) -> bool:
        """The model's batcher runs, and its generation engine when it has one."""
        engine = self.engines.get(name)
        return self.batchers[name].running and (engine is None or engine.running)

    # ------------------------------------------------------------ helpers

    def authorized(self, request: Request) -> bool:
        return bearer_ok(request, self.token)

    def lookup(self, request: Request) -> ServedModel:
        name = request.path_params["name"]
        model = self.models.get(name)
        if model is None:
            raise ProtocolError(f"Expected a model among {sorted(self.models)}. Received: {name!r}", 404)
        version = request.path_params.get("version")
        if version is not None and version != model.version:
            raise ProtocolError(
                f"Expected version {model.version!r} of model {name!r}. Received: {version!r}", 404)
        return model

    async def read_body(self, request: Request) -> bytes:
        """The request body, decompressed when ``Content-Encoding: gzip``; 413 beyond the limit."""
        limit = self.max_body_bytes
        decoder = body_decoder(request.headers.get("content-encoding"), limit)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ProtocolError(f"Expected a body of at most {limit} bytes. Received: {declared} bytes", 413)
        async for chunk in request.stream():
            decoder.feed(chunk)
        return decoder.finish()

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """One entry per served model, as Triton's repository index has them (plus platform)."""
        entries = []
        for name, model in self.models.items():
            ready = self.model_running(name)  # as GET /v2/models/{name}/ready says
            if ready_only and not ready:
                continue
            reason = "" if ready else "stopping" if self.started else "not started"
            entries.append({"name": name, "version": model.version, "versions": [model.version],
                            "platform": model.platform, "state": "READY" if ready else "UNAVAILABLE",
                            "reason": reason})
        return entries

    # ------------------------------------------------------------ handlers

    async def server_metadata(self, request: Request) -> Response:
        from .. import __version__

        extensions = ["binary_tensor_data", "classification"] + (["generate"] if self.engines else [])
        return json_response({"name": self.server_name, "version": __version__, "extensions": extensions})

    async def live(self, request: Request) -> Response:
        return json_response({"live": True})

    async def ready(self, request: Request) -> Response:
        ready = all(self.model_running(name) for name in self.models)
        return json_response({"ready": ready}, 200 if ready else 503)

    async def list_models(self, request: Request) -> Response:
        return json_response({"models": self.index()})

    async def repository_index(self, request: Request) -> Response:
        body = await self.read_body(request)
        ready_only = False
        if body.strip():
            try:
                options = json.loads(body)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ProtocolError(f"Expected a JSON object like {{\"ready\": true}} or no body. "
                                    f"Received invalid JSON: {exc}") from None
            ready_only = options.get("ready", False) if isinstance(options, dict) else None
            if not isinstance(ready_only, bool):
                raise ProtocolError(f"Expected a JSON object like {{\"ready\": true}} or no body. "
                                    f"Received: {body[:80]!r}")
        return json_response(self.index(ready_only))

    async def model_metadata(self, request: Request) -> Response:
        model = self.lookup(request)
        meta = model.metadata()
        engine = self.engines.get(model.name)
        if engine is not None:
            meta.setdefault("parameters", {})["generate"] = generate_metadata(engine)
        return json_response(meta)

    async def model_ready(self, request: Request) -> Response:
        model = self.lookup(request)
        ready = self.model_running(model.name)
        return json_response({"name": model.name, "ready": ready}, 200 if ready else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def infer(self, request: Request) -> Response:
        t0 = time.perf_counter()
        model = self.lookup(request)
        m = self.metrics
        m.requests.labels(model.name).inc()
        try:
            response = await self._infer(request, model)
        except ProtocolError as exc:
            headers = {"Retry-After": "1", **exc.headers} if exc.status == 503 else exc.headers
            response = error_response(exc.status, str(exc), headers)
        if response.status_code >= 400:
            m.errors.labels(model.name, str(response.status_code)).inc()
        m.latency.labels(model.name).observe(time.perf_counter() - t0)
        return response

    async def _infer(self, request: Request, model: ServedModel) -> Response:
        body = await self.read_body(request)
        req = decode_infer_request(body, request.headers.get(HEADER), model)
        batcher = self.batchers[model.name]
        await self.ensure_started()
        deadline = None if req.timeout is None else time.monotonic() + req.timeout
        x = req.inputs[0] if len(req.inputs) == 1 else req.inputs
        try:
            result = await batcher.submit(x, deadline=deadline)
        except QueueFull as exc:
            raise ProtocolError(str(exc), 503) from None
        except BatcherClosed as exc:
            raise ProtocolError(str(exc), 503) from None
        except TimeoutError:
            raise ProtocolError(f"Request timeout of {req.timeout * 1e6:.0f} us expired before its batch ran",
                                504) from None
        except Exception as exc:  # noqa: BLE001 - the model failed: 500 for this batch's callers
            raise ProtocolError(f"Model {model.name!r} failed: {type(exc).__name__}: {exc}", 500) from None
        body_out, headers = encode_infer_response(model, req, result)
        return Response(body_out, headers=headers)


def bearer_ok(request: Request, secret: bytes | None) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <secret>`` (always, without a secret)."""
    if secret is None:
        return True
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), secret)


def guard(authorized: Callable[[Request], bool], handler: Handler, open_: bool = False) -> Handler:
    """``handler`` behind the bearer token (401 otherwise), its `ProtocolError` as the error response."""
    async def endpoint(request: Request) -> Response:
        if not open_ and not authorized(request):
            return error_response(401, "Expected 'Authorization: Bearer TOKEN'. Received: no valid token",
                                  {"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except ProtocolError as exc:
            return error_response(exc.status, str(exc), exc.headers)

    return endpoint


def create_app(models: Mapping[str, ServedModel] | Sequence[ServedModel], *, token: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, registry: CollectorRegistry | None = None,
               server_name: str = "partrain") -> Starlette:
    """Build the OIP v2 app serving ``models`` (each with its own `Batcher`).

    Batchers start in the app's lifespan and drain on shutdown (every accepted
    request is answered); so do the generation engines of models with a
    ``generator`` (built here, one per app). ``app.state.batchers`` maps model name
    -> Batcher, ``app.state.engines`` name -> `GenerationEngine` (generative models
    only) and ``app.state.registry`` is the app's Prometheus registry.
    """
    items = list(models.values()) if isinstance(models, Mapping) else list(models)
    if not items:
        raise ValueError("Expected at least one model to serve. Received: none")
    if isinstance(models, Mapping):
        for key, m in models.items():
            if key != m.name:
                raise ValueError(f"Expected models keyed by their name. Received: key {key!r} for model {m.name!r}")
    names = [m.name for m in items]
    if len(set(names)) != len(names):
        raise ValueError(f"Expected distinct model names. Received: {names}")
    if max_body_bytes < 1:
        raise ValueError(f"Expected max_body_bytes >= 1. Received: {max_body_bytes}")
    server = _Server(items, token, max_body_bytes, registry or CollectorRegistry(), server_name)

    def route(path: str, handler: Handler, methods: list[str], open_: bool = False) -> list[Route]:
        wrapped = guard(server.authorized, handler, open_)
        paths = [path]
        if path.startswith("/v2/models/{name}"):
            paths.append(path.replace("/v2/models/{name}", "/v2/models/{name}/versions/{version}"))
        return [Route(p, wrapped, methods=methods) for p in paths]

    routes = [
        *route("/v2", server.server_metadata, ["GET"]),
        *route("/v2/health/live", server.live, ["GET"], open_=True),
        *route("/v2/health/ready", server.ready, ["GET"], open_=True),
        *route("/v2/models", server.list_models, ["GET"]),
        *route("/v2/repository/index", server.repository_index, ["POST"]),
        *route("/v2/models/{name}", server.model_metadata, ["GET"]),
        *route("/v2/models/{name}/ready", server.model_ready, ["GET"]),
        *route("/v2/models/{name}/infer", server.infer, ["POST"]),
        *route("/v2/models/{name}/generate", server.generate.generate, ["POST"]),
        *route("/v2/models/{name}/generate_stream", server.generate.generate_stream, ["POST"]),
        *route("/metrics", server.metrics_endpoint, ["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        asked = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"Expected a path of the Open Inference Protocol v2 ({PATHS}). Received: {asked}"
        elif exc.status_code == 405:
            allowed = " or ".join((exc.headers or {}).get("Allow", "another method").split(", "))
            message = f"Expected method {allowed} for {request.url.path}. Received: {request.method}"
        else:
            message = exc.detail
        return error_response(exc.status_code, message, exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(500, f"Internal error: {type(exc).__name__}: {exc}")

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.batchers = server.batchers
    app.state.engines = server.engines
    app.state.registry = server.metrics.registry
    app.state.models = server.models
    return app
