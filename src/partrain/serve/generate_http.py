"""The Open Inference Protocol's generate extension (Triton's) over a `GenerationEngine`.

Two routes per generative model (also under ``/versions/{v}``), behind the app's token:

- ``POST /v2/models/{m}/generate``: one JSON answer once the generation ends;
- ``POST /v2/models/{m}/generate_stream``: Server-Sent Events, one ``data: {json}``
  event per engine event (a token and the text that became final with it), the last
  one with ``finish_reason`` and ``usage``.

A request is a JSON object: the prompt as ``text_input`` (a string, for a model with a
tokenizer) or ``input_ids`` (token ids, for clients without the tokenizer), exactly one;
generation parameters (`SamplingParams.KEYS`) inside ``"parameters"`` or at the top
level, as Triton maps them (a key in both is refused); an optional ``"id"`` echoed back.
Everything is checked and the request submitted to the engine before the answer starts,
so a bad request is a 400, a full queue a 503, never a stream that fails at once.

A client that goes away frees its slot at the engine's next step: each handler watches
the ASGI receive channel for ``http.disconnect`` while it waits, and cancels its request.

No routing or auth here: `partrain.serve.app` mounts these handlers; they raise
`ProtocolError` with the status an error deserves, which the app turns into its error body.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..batching import BatcherClosed, QueueFull
from .generation import Event, GenerationEngine, RequestError, SamplingParams
from .protocol import ProtocolError, ServedModel

T = TypeVar("T")

PROMPT_KEYS = ("text_input", "input_ids")
REQUEST_KEYS = (*PROMPT_KEYS, "id", "parameters", *SamplingParams.KEYS)
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"


# --------------------------------------------------------------------------- requests (no HTTP)


@dataclass(frozen=True)
class GenerateRequest:
    """A checked generate request: the prompt's token ids, how to continue it, its id."""

    prompt: list[int]
    params: SamplingParams
    id: str | None = None


def parse_generate_request(body: bytes, engine: GenerationEngine) -> GenerateRequest:
    """Decode and check a generate request for ``engine``; `RequestError` (one line) when it cannot run."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f'Expected a JSON object like {{"text_input": "...", "max_tokens": 16}}. '
                           f"Received invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RequestError(f'Expected a JSON object like {{"text_input": "...", "max_tokens": 16}}. '
                           f"Received: a JSON {type(obj).__name__}")
    unknown = [k for k in obj if k not in REQUEST_KEYS]
    if unknown:
        raise RequestError(f"Expected keys among {', '.join(REQUEST_KEYS)}. Received: {', '.join(map(repr, unknown))}")
    request_id = obj.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError(f"Expected id as a string. Received: id={request_id!r}")
    params = _params(obj)
    return GenerateRequest(prompt=_prompt(obj, engine, params), params=params, id=request_id)


def _params(obj: Mapping[str, Any]) -> SamplingParams:
    """The generation parameters, from ``"parameters"`` and the top level (Triton maps top-level keys)."""
    nested = obj.get("parameters")
    if nested is None:
        nested = {}
    if not isinstance(nested, dict):
        raise RequestError(f"Expected parameters as a JSON object. Received: parameters={nested!r:.80}")
    top = {k: obj[k] for k in SamplingParams.KEYS if k in obj}
    both = [k for k in top if k in nested]
    if both:
        raise RequestError(f"Expected each generation parameter once, at the top level or in parameters. "
                           f"Received: {', '.join(map(repr, both))} in both")
    return SamplingParams.from_json({**nested, **top})


def _prompt(obj: Mapping[str, Any], engine: GenerationEngine, params: SamplingParams) -> list[int]:
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise RequestError(f"Expected exactly one of text_input (a string) or input_ids (a list of token ids). "
                           f"Received: {'both' if given else 'neither'}")
    if given[0] == "text_input":
        text = obj["text_input"]
        if not isinstance(text, str):
            raise RequestError(f"Expected text_input as a string. Received: text_input={text!r:.80}")
        if engine.tokenizer is None:
            raise RequestError(f"Expected input_ids for model {engine.name!r}: it has no tokenizer to read text "
                               f"with. Received: text_input")
        prompt = engine.tokenizer.encode(text)
    else:
        ids = obj["input_ids"]
        if not isinstance(ids, list):
            raise RequestError(f"Expected input_ids as a list of token ids. Received: input_ids={ids!r:.80}")
        prompt = ids
    engine.check(prompt, params)
    return prompt


def generate_metadata(engine: GenerationEngine) -> dict[str, Any]:
    """What the model metadata's ``parameters.generate`` says about ``engine``."""
    tok = engine.tokenizer
    return {"max_running": engine.max_running, "block_size": engine.runner.block_size,
            "vocab_size": engine.runner.vocab_size, "tokenizer": tok.name if tok is not None else None}


# --------------------------------------------------------------------------- metrics


class GenerateMetrics:
    """Prometheus metrics of generation, per model (label ``model``), in the app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model"]
        self.requests = Counter("partrain_generate_requests", "Generate requests received", labels,
                                registry=registry)
        self.errors = Counter("partrain_generate_errors", "Generate requests answered with an error",
                              ["model", "code"], registry=registry)
        self.tokens = Counter("partrain_generated_tokens", "Tokens handed to generate callers", labels,
                              registry=registry)
        self.running = Gauge("partrain_generate_running", "Sequences holding a KV cache slot", labels,
                             registry=registry)
        self.waiting = Gauge("partrain_generate_waiting", "Generate requests waiting for a slot", labels,
                             registry=registry)
        self.ttft = Histogram("partrain_time_to_first_token_seconds",
                              "Request received to its first token", labels, registry=registry,
                              buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30))
        self.step_seconds = Histogram("partrain_decode_step_seconds", "Model time of one decode step", labels,
                                      registry=registry,
                                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1))
        self.batch_size = Histogram("partrain_decode_batch_size", "Sequences decoded together per step", labels,
                                    registry=registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))

    def watch(self, model: str, engine: GenerationEngine) -> None:
        """Hook ``engine`` up: running and waiting on scrape, each decode step's size and time."""
        self.running.labels(model).set_function(lambda: engine.active)
        self.waiting.labels(model).set_function(lambda: engine.queue_depth)
        size, seconds = self.batch_size.labels(model), self.step_seconds.labels(model)
        previous = engine.on_step

        def on_step(rows: int, t: float) -> None:
            size.observe(rows)
            seconds.observe(t)
            if previous is not None:
                previous(rows, t)

        engine.on_step = on_step


# --------------------------------------------------------------------------- one submitted request


class _Pending:
    """One request submitted to the engine: its events in order (`next`); `cancel` frees its slot.

    Submitting happens here, before any answer starts: `RequestError`, `QueueFull` and
    `BatcherClosed` reach the handler while it can still choose the status.

    ``whole`` (``/generate``: nothing is sent before the end) keeps the events on the
    engine's thread until the last one and hands them over at once: one wake-up of the
    event loop per request instead of one per token. ``first_at`` is when the first
    event came (``time.perf_counter``), for the time-to-first-token metric.
    """

    def __init__(self, engine: GenerationEngine, req: GenerateRequest, whole: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.first_at: float | None = None
        held: list[Event] = []

        def hand_over(events: list[Event]) -> None:
            for event in events:
                self._events.put_nowait(event)

        def sink(event: Event) -> None:  # on the engine's thread
            if self.first_at is None:
                self.first_at = time.perf_counter()
            if whole and event.finish_reason is None:
                held.append(event)
                return
            loop.call_soon_threadsafe(hand_over, [*held, event])
            held.clear()

        self._handle = engine.submit(req.prompt, req.params, sink)
        self.finished = False

    async def next(self) -> Event:
        event = await self._events.get()
        self.finished = event.finish_reason is not None
        return event

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self._handle.cancel()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work: Coroutine[Any, Any, T], receive: Receive) -> tuple[bool, T | None]:
    """Run ``work`` until it ends or the client disconnects (``work`` is then cancelled).

    Returns ``(True, result)``, or ``(False, None)`` after a disconnect; ``work``'s own
    exception propagates. Call it once the request body is read: the receive channel
    then carries nothing but the disconnect.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)  # their cleanup ran before we go on
    if task.cancelled():
        return False, None
    return True, task.result()


class _EventStream(StreamingResponse):
    """An SSE answer that stops when the client goes away and always cancels its request.

    Starlette's own streaming answer notices a disconnect only when a write fails (ASGI
    2.4) or only while writing; a request still waiting for its first token would hold
    its place. Watching the receive channel throughout frees it at the next step.
    """

    def __init__(self, content: Any, pending: _Pending) -> None:
        super().__init__(content, media_type=SSE_MEDIA_TYPE, headers={"Cache-Control": "no-cache"})
        self.pending = pending

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _unless_disconnected(self.stream_response(send), receive)
        except OSError:
            pass  # the client went away while an event was written: nobody is left to tell
        finally:
            self.pending.cancel()


# --------------------------------------------------------------------------- handlers


class GenerateRoutes:
    """The ``generate`` and ``generate_stream`` handlers over the app's engines.

    ``lookup(request)`` finds the model (404 otherwise), ``read_body(request)`` reads the
    body (413, gzip), ``ensure_started()`` starts the app's batchers and engines when no
    lifespan did (an ASGI client that skips it).
    """

    def __init__(self, engines: Mapping[str, GenerationEngine], registry: CollectorRegistry, *,
                 lookup: Callable[[Request], ServedModel], read_body: Callable[[Request], Awaitable[bytes]],
                 ensure_started: Callable[[], Awaitable[None]]) -> None:
        self.engines = engines
        self.metrics = GenerateMetrics(registry)
        self.lookup = lookup
        self.read_body = read_body
        self.ensure_started = ensure_started
        for name, engine in engines.items():
            self.metrics.watch(name, engine)

    async def generate(self, request: Request) -> Response:
        """One JSON answer once the generation ends."""
        model, engine = self._engine(request)
        return await self._counted(model, self._generate(request, model, engine))

    async def generate_stream(self, request: Request) -> Response:
        """Server-Sent Events: one per engine event, the last with the finish reason and usage."""
        model, engine = self._engine(request)
        return await self._counted(model, self._stream(request, model, engine))

    # ------------------------------------------------------------ steps

    def _engine(self, request: Request) -> tuple[ServedModel, GenerationEngine]:
        model = self.lookup(request)
        engine = self.engines.get(model.name)
        if engine is None:
            raise ProtocolError(f"Expected a model that generates, among {sorted(self.engines)}. Received: "
                                f"{model.name!r} (it answers infer only)", 404)
        return model, engine

    async def _counted(self, model: ServedModel, handler: Awaitable[Response]) -> Response:
        m = self.metrics
        m.requests.labels(model.name).inc()
        try:
            return await handler
        except ProtocolError as exc:
            m.errors.labels(model.name, str(exc.status)).inc()
            raise

    async def _submit(self, request: Request, engine: GenerationEngine,
                      whole: bool = False) -> tuple[GenerateRequest, _Pending]:
        body = await self.read_body(request)
        await self.ensure_started()
        try:
            req = parse_generate_request(body, engine)
            return req, _Pending(engine, req, whole)
        except RequestError as exc:
            raise ProtocolError(str(exc), 400) from None
        except (QueueFull, BatcherClosed) as exc:
            raise ProtocolError(str(exc), 503, {"Retry-After": "1"}) from None

    def _observe(self, model: ServedModel, event: Event, first: bool, t0: float, pending: _Pending) -> None:
        if first and event.finish_reason not in ("error", "cancelled"):
            self.metrics.ttft.labels(model.name).observe((pending.first_at or time.perf_counter()) - t0)
        if event.token is not None:
            self.metrics.tokens.labels(model.name).inc()

    async def _generate(self, request: Request, model: ServedModel, engine: GenerationEngine) -> Response:
        t0 = time.perf_counter()
        req, pending = await self._submit(request, engine, whole=True)

        async def collect() -> list[Event]:
            events: list[Event] = []
            while not events or events[-1].finish_reason is None:
                events.append(await pending.next())
                self._observe(model, events[-1], len(events) == 1, t0, pending)
            return events

        try:
            finished, events = await _unless_disconnected(collect(), request.receive)
        finally:
            pending.cancel()
        if not finished or events is None:
            raise ProtocolError(f"Expected the client of model {model.name!r} to wait for its answer. Received: a "
                                f"disconnect (the request was cancelled)", 499)
        last = events[-1]
        if last.finish_reason == "error":
            raise _failure(model, last.error)
        tokens = [e.token for e in events if e.token is not None]
        text = "".join(e.text for e in events) if engine.tokenizer is not None else None
        answer = _answer(model, req, text, tokens, last.finish_reason)
        answer["usage"] = {"prompt_tokens": len(req.prompt), "completion_tokens": len(tokens)}
        return Response(json.dumps(answer, separators=(",", ":")), media_type="application/json")

    async def _stream(self, request: Request, model: ServedModel, engine: GenerationEngine) -> Response:
        t0 = time.perf_counter()
        req, pending = await self._submit(request, engine)
        has_text = engine.tokenizer is not None

        async def events() -> Any:
            completion = 0
            first = True
            while True:
                event = await pending.next()
                self._observe(model, event, first, t0, pending)
                first = False
                if event.finish_reason == "error":
                    error = _failure(model, event.error)
                    self.metrics.errors.labels(model.name, str(error.status)).inc()
                    yield _sse({"error": str(error)})
                    return
                tokens = [event.token] if event.token is not None else []
                completion += len(tokens)
                out = _answer(model, req, event.text if has_text else None, tokens, event.finish_reason)
                if event.finish_reason is not None:
                    out["usage"] = {"prompt_tokens": len(req.prompt), "completion_tokens": completion}
                yield _sse(out)
                if event.finish_reason is not None:
                    return

        return _EventStream(events(), pending)


def _answer(model: ServedModel, req: GenerateRequest, text: str | None, tokens: list[int],
            finish_reason: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
    if req.id is not None:
        out["id"] = req.id
    if text is not None:
        out["text_output"] = text
    out["output_ids"] = tokens
    out["finish_reason"] = finish_reason
    return out


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _failure(model: ServedModel, error: BaseException | None) -> ProtocolError:
    """The error a generation that ended with ``error`` answers: 503 when the server stopped, else 500."""
    if isinstance(error, BatcherClosed):
        return ProtocolError(str(error), 503, {"Retry-After": "1"})
    what = f"{type(error).__name__}: {error}" if error is not None else "unknown error"
    return ProtocolError(f"Model {model.name!r} failed: {what}", 500)
