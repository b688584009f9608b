"""How ``partrain bench generate`` loads the partrain variant: its clients (HTTP or the engine in this
process), closed-loop callers and open-loop (Poisson) arrivals.

Vocabulary as in `partrain.bench._generate_baselines`: a request, a `Run` (tokens, seconds,
answers by request index). A client's `generate` returns a request's new token ids; its
`stream` yields them as they come (a list per event: one token, or none on a last event).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ._generate_baselines import Request, Run, account

# --------------------------------------------------------------------------- clients


class Client(Protocol):
    """What a caller of the partrain variant does: `generate` a request's answer, or `stream` its tokens."""

    async def generate(self, request: Request) -> list[int]: ...

    def stream(self, request: Request) -> AsyncIterator[list[int]]: ...


class HTTPClient:
    """The generate extension over HTTP (httpx): ``/generate`` for the answer, ``/generate_stream``
    (server-sent events, one per token) for its tokens as they come."""

    def __init__(self, http: Any, name: str) -> None:
        self.http = http
        self.path = f"/v2/models/{name}"

    @staticmethod
    def _body(request: Request) -> dict[str, Any]:
        return {"input_ids": list(request.prompt),
                "parameters": {"max_tokens": request.max_tokens, "temperature": 0, "ignore_eos": True}}

    async def generate(self, request: Request) -> list[int]:
        response = await self.http.post(f"{self.path}/generate", json=self._body(request))
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        return list(response.json()["output_ids"])

    async def stream(self, request: Request) -> AsyncIterator[list[int]]:
        async with self.http.stream("POST", f"{self.path}/generate_stream", json=self._body(request)) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                yield list(event.get("output_ids", ()))
                if event.get("finish_reason"):
                    return


class EngineClient:
    """The engine in this process (`GenerationEngine.stream`), no HTTP."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @staticmethod
    def _params(request: Request) -> Any:
        from ..serve.generation import SamplingParams

        return SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)

    async def generate(self, request: Request) -> list[int]:
        return [t for tokens in [x async for x in self.stream(request)] for t in tokens]

    async def stream(self, request: Request) -> AsyncIterator[list[int]]:
        async for event in self.engine.stream(request.prompt, self._params(request)):
            if event.finish_reason == "error":
                raise RuntimeError(f"generation failed: {event.error}")
            yield [event.token] if event.token is not None else []


# --------------------------------------------------------------------------- load


async def closed_loop(generate: Callable[[Request], Awaitable[list[int]]], requests: Sequence[Request],
                      clients: int) -> Run:
    """``clients`` callers, each sending its next request (in list order) when its answer came."""
    run = Run(0, 0.0)
    order = iter(range(len(requests)))  # shared: every request is sent once

    async def caller() -> None:
        for i in order:
            try:
                answer = await generate(requests[i])
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, and the first one said
                run.errors += 1
                run.first_error = run.first_error or f"{type(exc).__name__}: {exc}"
                continue
            account(run, requests, i, answer)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(clients)))
    run.seconds = time.perf_counter() - start
    return run


@dataclass
class OpenLoop:
    """The open-loop run: arrival rate, and per answered request its TTFT and TPOT (seconds)."""

    rate: float
    run: Run
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)

    def percentile(self, values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else math.nan


async def open_loop(stream: Callable[[Request], AsyncIterator[list[int]]], requests: Sequence[Request], count: int,
                    rate: float, seed: int = 1) -> OpenLoop:
    """``count`` requests (the list's, cycled) arriving as a Poisson process of ``rate`` per second,
    each streamed; TTFT from its scheduled arrival, so a client that starts late counts against it."""
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    for _ in range(count):
        at += rng.expovariate(rate)
        arrivals.append(at)
    result = OpenLoop(rate, Run(0, 0.0))
    start = time.perf_counter()

    async def one(i: int, due: float) -> None:
        await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
        first: float | None = None
        last = 0.0
        answer: list[int] = []
        try:
            async for tokens in stream(requests[i % len(requests)]):
                if tokens:
                    last = time.perf_counter()
                    first = first or last
                answer += tokens
        except Exception as exc:  # noqa: BLE001 - counted
            result.run.errors += 1
            result.run.first_error = result.run.first_error or f"{type(exc).__name__}: {exc}"
            return
        account(result.run, requests, i % len(requests), answer)
        if first is not None:
            result.ttft.append(first - (start + due))
            if len(answer) > 1:
                result.tpot.append((last - first) / (len(answer) - 1))

    await asyncio.gather(*(one(i, due) for i, due in enumerate(arrivals)))
    result.run.seconds = time.perf_counter() - start
    return result
