"""Running and timing a load test: closed or open loop, one outcome recorded per request.

Every wait is bounded: each request has ``cfg.timeout``, the metadata query
``cfg.connect_timeout``, and the whole run stops at ``cfg.run_limit()`` (requests
still in flight then are counted as cancelled).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence

import numpy as np

from ...errors import UsageError
from ..protocol import ProtocolError
from .checking import AnswerChecker, load_reference_model
from .client import ConnectionPool
from .config import LoadConfig, parse_target
from .inputs import npz_inputs, random_inputs
from .report import LoadReport
from .target import ModelInfo, query_model_info
from .wire import RequestEncoder, read_answer


class Recorder:
    """One outcome per request: latency or error kind, and the answer to check later."""

    def __init__(self) -> None:
        self.seen: Counter = Counter()
        self.latencies: list[float] = []
        self.errors: Counter = Counter()
        self.id_mismatches = 0
        self.answers: list[tuple[int, dict[str, np.ndarray]]] = []
        self.first_error = ""  # the first failure seen, with what the server said

    def answered(self, index: int, latency: float, sample: int, outputs: dict[str, np.ndarray],
                 keep: bool) -> None:
        self.seen[index] += 1
        self.latencies.append(latency)
        if keep:
            self.answers.append((sample, outputs))

    def failed(self, index: int, kind: str, detail: str = "") -> None:
        self.seen[index] += 1
        self.errors[kind] += 1
        if not self.first_error:
            self.first_error = f"request {index}: {kind}" + (f": {detail}" if detail else "")


def error_detail(content: bytes) -> str:
    """What an error answer says: its ``{"error": ...}`` message, else the start of the body."""
    try:
        message = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError):
        message = content[:200].decode("utf-8", "replace")
    return " ".join(str(message).split())[:300]


async def exchange(pool: ConnectionPool, path: str, body: bytes, headers: dict[str, str], index: int,
                   timeout: float, recorder: Recorder,
                   on_data: Callable[[bytes], None] | None = None) -> tuple[dict[str, str], bytes] | None:
    """One POST within ``timeout``: a 200 answer's headers and body, or None when there is no 200
    answer (a timeout, a connection failure or another status, recorded as request ``index``'s
    outcome; cancellation is recorded and raised). ``on_data`` takes a streamed answer's pieces
    (`ConnectionPool.post`)."""
    import h11

    try:
        status, response_headers, content = await asyncio.wait_for(pool.post(path, body, headers, on_data), timeout)
    except asyncio.TimeoutError:
        recorder.failed(index, "timeout", f"no answer within {timeout:g} s")
        return None
    except asyncio.CancelledError:
        recorder.failed(index, "cancelled", "still unanswered when the run's time limit passed")
        raise
    except (OSError, h11.ProtocolError) as exc:  # refused, reset, closed mid-answer, garbled HTTP
        recorder.failed(index, "connection error", f"{type(exc).__name__}: {exc}")
        return None
    if status != 200:
        recorder.failed(index, f"HTTP {status}", error_detail(content))
        return None
    return response_headers, content


async def _send(pool: ConnectionPool, path: str, encoder: RequestEncoder, index: int, sample: int,
                start: float, timeout: float, recorder: Recorder, keep: bool) -> None:
    request_id = str(index)
    body, headers = encoder.encode(request_id, sample)
    answer = await exchange(pool, path, body, headers, index, timeout, recorder)
    if answer is None:
        return
    response_headers, content = answer
    latency = time.perf_counter() - start
    try:
        answer_id, outputs = read_answer(content, response_headers)
    except (ProtocolError, ValueError, KeyError, TypeError) as exc:
        recorder.failed(index, "malformed answer", f"{type(exc).__name__}: {exc}"[:300])
        return
    if answer_id is not None and answer_id != request_id:
        recorder.id_mismatches += 1
    recorder.answered(index, latency, sample, outputs, keep)


Send = Callable[[ConnectionPool, int, float], Awaitable[None]]
"""``send(pool, index, start)``: request number ``index`` over ``pool``, timed from ``start``; it
records its own outcome and raises nothing but cancellation."""


async def _closed_loop(make_pool: Callable[[int], ConnectionPool], send: Send, cfg: LoadConfig, t0: float) -> int:
    counter = iter(range(cfg.requests if cfg.requests is not None else 2**62))
    end = t0 + cfg.duration if cfg.duration is not None else math.inf
    sent = 0

    async def client_loop() -> None:
        # each client owns one connection, like N independent users
        nonlocal sent
        async with make_pool(1) as pool:
            for index in counter:
                now = time.perf_counter()
                if now >= end:
                    return
                sent += 1
                await send(pool, index, now)

    assert cfg.concurrency is not None
    await asyncio.gather(*(client_loop() for _ in range(cfg.concurrency)))
    return sent


async def _open_loop(pool: ConnectionPool, send: Send, cfg: LoadConfig, t0: float) -> int:
    assert cfg.rate is not None
    rng = random.Random(cfg.seed)
    count = cfg.requests if cfg.requests is not None else 2**62
    horizon = cfg.duration if cfg.duration is not None else math.inf
    tasks: set[asyncio.Task] = set()
    arrival, index = 0.0, 0
    try:
        while index < count and arrival < horizon:
            delay = t0 + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(send(pool, index, t0 + arrival))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
            gap = rng.expovariate(cfg.rate) if cfg.arrivals == "poisson" else 1.0 / cfg.rate
            arrival += gap
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    return index


async def drive(cfg: LoadConfig, base: str, send: Send, recorder: Recorder) -> tuple[str, int, float]:
    """Run ``cfg``'s closed or open loop of ``send`` calls, bounded by ``cfg.run_limit()``.

    Returns the mode's description, the requests sent and the seconds it took. The
    infer and the generate load share it: only what one request is differs.
    """

    def make_pool(size: int) -> ConnectionPool:
        return ConnectionPool(base, size, cfg.headers)

    async with make_pool(cfg.connections or 256) as shared:
        t0 = time.perf_counter()
        if cfg.concurrency is not None:
            mode = f"closed loop, concurrency {cfg.concurrency}"
            loop = _closed_loop(make_pool, send, cfg, t0)
        else:
            mode = f"open loop, {cfg.arrivals} arrivals at {cfg.rate:g}/s"
            loop = _open_loop(shared, send, cfg, t0)
        task = asyncio.ensure_future(loop)
        try:
            sent = await asyncio.wait_for(asyncio.shield(task), cfg.run_limit())
        except asyncio.TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sent = max(recorder.seen, default=-1) + 1
        return mode, sent, time.perf_counter() - t0


async def run_load_async(cfg: LoadConfig, samples: Sequence[Mapping[str, np.ndarray]] | None = None,
                         checker: AnswerChecker | None = None,
                         info: ModelInfo | None = None) -> LoadReport:
    """Run one load test (see `LoadConfig`) and return what it saw.

    ``samples`` default to random inputs shaped by the model's metadata (or
    ``cfg.npz``); ``info`` skips the metadata query; ``checker`` compares answers.
    """
    cfg.validate()
    base, model = parse_target(cfg.url, cfg.model)
    if samples is None:
        if info is None:
            info = await query_model_info(base, model, cfg.connect_timeout, cfg.headers)
        samples = _samples(cfg, info)
    if checker is not None and len(checker.expected) != len(samples):
        raise UsageError(f"Expected a checker built on the {len(samples)} samples sent. "
                         f"Received: one built on {len(checker.expected)}")
    encoder = RequestEncoder(samples, binary=cfg.binary)
    path = f"/v2/models/{model}/infer"
    recorder = Recorder()
    keep = checker is not None

    async def send(pool: ConnectionPool, index: int, start: float) -> None:
        await _send(pool, path, encoder, index, index % len(encoder), start, cfg.timeout, recorder, keep)

    mode, sent, elapsed = await drive(cfg, base, send, recorder)

    report = LoadReport(mode=mode, elapsed=elapsed, sent=sent, latencies=recorder.latencies,
                        errors=recorder.errors, id_mismatches=recorder.id_mismatches,
                        first_error=recorder.first_error)
    report.duplicates = sum(1 for n in recorder.seen.values() if n > 1)
    report.missing = sum(1 for i in range(sent) if i not in recorder.seen)
    if checker is not None:
        for sample, outputs in recorder.answers:
            problem = checker.compare(sample, outputs)
            report.checked += 1
            if problem:
                report.wrong += 1
                report.first_wrong = report.first_wrong or f"sample {sample}: {problem}"
    return report


def run_load(cfg: LoadConfig, samples: Sequence[Mapping[str, np.ndarray]] | None = None,
             checker: AnswerChecker | None = None, info: ModelInfo | None = None) -> LoadReport:
    """Blocking `run_load_async` (starts its own event loop)."""
    return asyncio.run(run_load_async(cfg, samples, checker, info))


def prepare(cfg: LoadConfig, check: str | None = None, atol: float = 1e-4,
            rtol: float = 1e-4) -> tuple[ModelInfo, list[dict[str, np.ndarray]], AnswerChecker | None]:
    """Query the model's metadata, build the samples and (with ``check``) the checker.

    Separate from the run so that a bad URL, model or input fails before any load
    is sent, and so the reference model runs before the clock starts.
    """
    cfg.validate()
    base, model = parse_target(cfg.url, cfg.model)
    info = asyncio.run(query_model_info(base, model, cfg.connect_timeout, cfg.headers))
    samples = _samples(cfg, info)
    checker = None
    if check:
        checker = AnswerChecker(load_reference_model(check), samples, atol=atol, rtol=rtol)
    return info, samples, checker


def _samples(cfg: LoadConfig, info: ModelInfo) -> list[dict[str, np.ndarray]]:
    if cfg.npz:
        return npz_inputs(cfg.npz, info, cfg.shape)
    return random_inputs(info, cfg.samples, cfg.shape, cfg.seed)
