"""Load generator for Open Inference Protocol v2 servers (``partrain loadtest``).

It sends ``POST {url}/v2/models/{model}/infer`` requests, JSON or with the binary
tensor data extension, and measures what a client sees: throughput, latency
percentiles, errors by kind. It also checks the two things a batching server can
get wrong without anyone noticing: every request gets exactly one answer (the
answer echoes the request's ``id``), and the answer is right (each request's
input is run through a local copy of the model and compared).

Vocabulary:

- *closed loop*: ``concurrency`` clients, each sends its next request when the
  previous one is answered (the load adapts to the server's speed).
- *open loop*: requests arrive at ``rate`` per second whatever the server does
  (Poisson or evenly spaced arrivals); latency counts from the scheduled arrival,
  so a slow server cannot hide its queueing delay (no coordinated omission).
- *sample*: one input, a dict ``{input name: array}`` with a leading batch
  dimension of 1. Requests cycle through a pool of samples so the reference
  model runs once per sample, not once per request.

Every wait is bounded: each request has ``timeout``, the server must answer the
metadata query within ``connect_timeout``, and the whole run stops at
``max_time`` (requests still in flight then are counted as cancelled).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import socket
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ..errors import UsageError

# Open Inference Protocol datatype -> numpy dtype (little-endian, as the binary extension sends)
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor of a model, as its metadata describes it (-1: any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /v2/models/{name}`` says about a model."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...] = ()


@dataclass
class LoadConfig:
    """One load test. Exactly one of ``concurrency`` / ``rate``; at least one of ``requests`` / ``duration``."""

    url: str
    model: str | None = None
    concurrency: int | None = None
    rate: float | None = None
    arrivals: str = "poisson"  # open loop: "poisson" | "uniform"
    requests: int | None = None
    duration: float | None = None
    timeout: float = 10.0  # per request, seconds
    connect_timeout: float = 5.0  # the metadata query before the run
    max_time: float | None = None  # the whole run; default: duration + 2 * timeout, or 600 s
    binary: bool = False  # binary tensor data extension for inputs and outputs
    shape: tuple[int, ...] | None = None  # replaces the metadata's shape (of the only input)
    npz: str | None = None  # inputs from a file instead of random ones
    samples: int = 64  # size of the pool of random inputs
    seed: int = 0
    connections: int | None = None  # open loop: HTTP connections (default 256); closed: one per client
    headers: dict[str, str] = field(default_factory=dict)  # e.g. Authorization

    def validate(self) -> None:
        """Raise `UsageError` for settings that cannot describe a run."""
        if (self.concurrency is None) == (self.rate is None):
            raise UsageError(
                "Expected exactly one of a concurrency (closed loop) or a rate (open loop). "
                f"Received: concurrency={self.concurrency}, rate={self.rate}"
            )
        if self.concurrency is not None and self.concurrency < 1:
            raise UsageError(f"Expected a positive concurrency. Received: concurrency={self.concurrency}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise UsageError(f"Expected a positive rate in requests per second. Received: rate={self.rate}")
        if self.arrivals not in ("poisson", "uniform"):
            raise UsageError(f"Expected arrivals 'poisson' or 'uniform'. Received: {self.arrivals!r}")
        if self.requests is None and self.duration is None:
            raise UsageError("Expected a number of requests or a duration to bound the run. Received: neither")
        if self.requests is not None and self.requests < 1:
            raise UsageError(f"Expected a positive number of requests. Received: requests={self.requests}")
        if self.duration is not None and not self.duration > 0:
            raise UsageError(f"Expected a positive duration in seconds. Received: duration={self.duration}")
        for name in ("timeout", "connect_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise UsageError(f"Expected a positive {name} in seconds. Received: {name}={value}")
        if self.samples < 1:
            raise UsageError(f"Expected a positive number of samples. Received: samples={self.samples}")
        if self.shape is not None and any(d < 1 for d in self.shape):
            raise UsageError(f"Expected a shape of positive sizes. Received: shape={list(self.shape)}")

    def run_limit(self) -> float:
        if self.max_time is not None:
            return self.max_time
        if self.duration is not None:
            return self.duration + 2 * self.timeout
        return 600.0


@dataclass
class LoadReport:
    """What one load test saw. ``outcomes`` has one entry per request sent."""

    mode: str  # "closed loop, concurrency 16" / "open loop, poisson 200/s"
    elapsed: float
    sent: int
    latencies: list[float]  # seconds, answered requests only
    errors: Counter  # kind -> count: "HTTP 503", "timeout", "connection error", ...
    duplicates: int = 0  # requests that recorded more than one outcome (must be 0)
    missing: int = 0  # requests with no outcome at all (must be 0)
    id_mismatches: int = 0  # answers that echoed another request's id
    checked: int = 0  # answers compared with the local model
    wrong: int = 0  # answers that differ from the local model beyond atol/rtol
    first_wrong: str = ""  # a description of the first wrong answer

    @property
    def ok(self) -> int:
        return len(self.latencies)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    @property
    def throughput(self) -> float:
        return self.ok / self.elapsed if self.elapsed > 0 else float("nan")

    def percentile(self, q: float) -> float:
        """Latency percentile in milliseconds (nan when nothing was answered)."""
        if not self.latencies:
            return float("nan")
        return float(np.percentile(np.asarray(self.latencies), q) * 1e3)

    @property
    def lost(self) -> int:
        """Requests without exactly one answer of their own."""
        return self.missing + self.duplicates + self.id_mismatches

    def figures(self) -> dict[str, float]:
        """Every figure as a flat dict (``--json``); errors as ``errors.<kind>``."""
        out: dict[str, float] = {
            "sent": self.sent, "ok": self.ok, "failed": self.failed, "elapsed_s": self.elapsed,
            "throughput_rps": self.throughput, "p50_ms": self.percentile(50),
            "p90_ms": self.percentile(90), "p99_ms": self.percentile(99),
            "mean_ms": float(np.mean(self.latencies) * 1e3) if self.latencies else float("nan"),
            "lost": self.lost, "duplicates": self.duplicates, "missing": self.missing,
            "id_mismatches": self.id_mismatches, "checked": self.checked, "wrong": self.wrong,
        }
        for kind, n in sorted(self.errors.items()):
            out[f"errors.{kind}"] = n
        return out

    def format(self) -> str:
        """A few readable lines for the terminal."""
        lines = [
            f"{self.mode}: {self.sent} requests in {self.elapsed:.2f} s",
            f"  answered  {self.ok}  ({self.throughput:,.1f} requests/s)",
            f"  latency   p50 {self.percentile(50):.2f} ms  p90 {self.percentile(90):.2f} ms  "
            f"p99 {self.percentile(99):.2f} ms",
            "  errors    " + (", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"),
            f"  exactly one answer each: {'yes' if self.lost == 0 else 'NO'} "
            f"(missing {self.missing}, duplicated {self.duplicates}, wrong id {self.id_mismatches})",
        ]
        if self.checked:
            verdict = "all right" if self.wrong == 0 else f"{self.wrong} WRONG ({self.first_wrong})"
            lines.append(f"  answers checked against the local model: {self.checked}, {verdict}")
        else:
            lines.append("  answers not checked (no --check model)")
        return "\n".join(lines)


# --------------------------------------------------------------------------- targets and inputs


def parse_target(url: str, model: str | None) -> tuple[str, str]:
    """Split ``url`` into the server's base URL and the model name.

    ``url`` is either the server (``http://host:port``, model given separately) or
    a model's own URL (``http://host:port/v2/models/NAME``).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"Expected an http:// or https:// URL. Received: {url!r}")
    path = parts.path.rstrip("/")
    base = f"{parts.scheme}://{parts.netloc}"
    marker = "/v2/models/"
    if marker in path:
        prefix, _, rest = path.partition(marker)
        name = rest.split("/")[0]
        if model is not None and model != name:
            raise UsageError(f"Expected one model name. Received: {name!r} in the URL and --model {model!r}")
        return base + prefix, name
    if model is None:
        raise UsageError(
            "Expected a model name: --model NAME or a URL ending in /v2/models/NAME. "
            f"Received: {url!r} and no --model"
        )
    return base + path, model


def _tensor_specs(items: Any, where: str) -> tuple[TensorSpec, ...]:
    try:
        return tuple(
            TensorSpec(str(t["name"]), str(t["datatype"]).upper(), tuple(int(d) for d in t["shape"]))
            for t in items
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"Expected tensor metadata with name, datatype and shape in {where}. "
                         f"Received: {str(items)[:200]} ({exc})") from None


def parse_metadata(body: Any, model: str) -> ModelInfo:
    """Read the model metadata object of the Open Inference Protocol."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or not body["inputs"]:
        raise UsageError(f"Expected model metadata with a list of inputs for model {model!r}. "
                         f"Received: {str(body)[:200]}")
    inputs = _tensor_specs(body["inputs"], "inputs")
    outputs = _tensor_specs(body.get("outputs") or [], "outputs")
    for t in inputs:
        if t.datatype not in DATATYPES:
            raise UsageError(f"Expected input datatypes among {sorted(DATATYPES)}. "
                             f"Received: {t.datatype!r} for input {t.name!r}")
    return ModelInfo(str(body.get("name", model)), inputs, outputs)


async def fetch_model_info(client: Any, base: str, model: str, timeout: float) -> ModelInfo:
    """``GET {base}/v2/models/{model}``; unreachable server or unknown model -> `UsageError`."""
    import httpx

    url = f"{base}/v2/models/{model}"
    try:
        response = await asyncio.wait_for(client.get(url), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise UsageError(f"Expected a server answering at {base} within {timeout:g} s. Received: no answer") from None
    except httpx.HTTPError as exc:
        raise UsageError(f"Expected a reachable server at {base}. Received: {type(exc).__name__}: {exc}") from None
    if response.status_code == 404:
        raise UsageError(f"Expected a model named {model!r} on the server at {base}. "
                         f"Received: HTTP 404 {_error_text(response.content)}")
    if response.status_code != 200:
        raise UsageError(f"Expected model metadata from {url}. "
                         f"Received: HTTP {response.status_code} {_error_text(response.content)}")
    try:
        body = response.json()
    except ValueError:
        raise UsageError(f"Expected JSON model metadata from {url}. Received: {response.text[:200]!r}") from None
    return parse_metadata(body, model)


def _error_text(content: bytes) -> str:
    try:
        return str(json.loads(content).get("error", ""))[:200]
    except (ValueError, AttributeError):
        return content[:200].decode("utf-8", "replace")


def concrete_shape(spec: TensorSpec, override: Sequence[int] | None = None) -> tuple[int, ...]:
    """The shape of one request's tensor: ``override`` if given, else the metadata's with -1 -> 1."""
    if override is not None:
        return tuple(override)
    return tuple(1 if d < 0 else d for d in spec.shape)


def random_inputs(info: ModelInfo, count: int, shape: Sequence[int] | None = None,
                  seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``count`` random samples for the model's inputs: normal floats, small integers, coin flips."""
    if shape is not None and len(info.inputs) != 1:
        raise UsageError(f"Expected --shape only for a model with one input. "
                         f"Received: model {info.name!r} with inputs {[t.name for t in info.inputs]}")
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(count):
        sample = {}
        for t in info.inputs:
            dims = concrete_shape(t, shape)
            dtype = DATATYPES[t.datatype]
            if dtype.kind == "f":
                a = rng.standard_normal(dims).astype(dtype)
            elif dtype.kind == "b":
                a = rng.random(dims) < 0.5
            else:
                a = rng.integers(0, 10, size=dims).astype(dtype)
            sample[t.name] = a
        samples.append(sample)
    return samples


def npz_inputs(path: str, info: ModelInfo, shape: Sequence[int] | None = None,
               limit: int | None = None) -> list[dict[str, np.ndarray]]:
    """Samples from an .npz file: one array per input name (or one array for a one-input model).

    Each row of the arrays (first dimension) is one request, sent with a batch
    dimension of 1 (or reshaped to ``shape``).
    """
    if not os.path.exists(path):
        raise UsageError(f"Expected an existing .npz file. Received: {path!r} (no such file)")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as exc:
        raise UsageError(f"Expected {path!r} to be an .npz archive. Received: {type(exc).__name__}: {exc}") from None
    names = [t.name for t in info.inputs]
    if all(n in arrays for n in names):
        chosen = {n: arrays[n] for n in names}
    elif len(names) == 1 and ("x" in arrays or len(arrays) == 1):
        chosen = {names[0]: arrays["x"] if "x" in arrays else next(iter(arrays.values()))}
    else:
        raise UsageError(f"Expected arrays named {names} in {path!r}. Received: {sorted(arrays)}")
    rows = {len(a) for a in chosen.values()}
    if len(rows) != 1 or 0 in rows or any(a.ndim == 0 for a in chosen.values()):
        raise UsageError(f"Expected arrays with the same positive number of rows in {path!r}. "
                         f"Received: { {k: list(a.shape) for k, a in chosen.items()} }")
    n = rows.pop() if limit is None else min(rows.pop(), limit)
    specs = {t.name: t for t in info.inputs}
    samples = []
    for i in range(n):
        sample = {}
        for name, a in chosen.items():
            row = np.ascontiguousarray(a[i], dtype=DATATYPES[specs[name].datatype])
            dims = tuple(shape) if shape is not None else (1, *row.shape)
            try:
                sample[name] = row.reshape(dims)
            except ValueError:
                raise UsageError(f"Expected rows of {path!r} to fit shape {list(dims)}. "
                                 f"Received: rows of shape {list(row.shape)}") from None
        samples.append(sample)
    return samples


# --------------------------------------------------------------------------- the wire format


def _datatype_of(a: np.ndarray) -> str:
    for name, dtype in DATATYPES.items():
        if a.dtype == dtype or (a.dtype.kind == dtype.kind and a.dtype.itemsize == dtype.itemsize):
            return name
    raise UsageError(f"Expected an array of a datatype among {sorted(DATATYPES)}. Received: {a.dtype}")


class RequestEncoder:
    """Builds infer request bodies; the tensor part of each sample is encoded once.

    JSON: ``{"id": ..., "inputs": [{"name", "shape", "datatype", "data": [flat]}]}``.
    Binary extension: the same JSON header with ``parameters.binary_data_size``
    instead of ``data``, followed by the raw little-endian bytes, and the header's
    length in ``Inference-Header-Content-Length``; outputs are asked for as binary.
    """

    def __init__(self, samples: Sequence[dict[str, np.ndarray]], binary: bool = False):
        self.binary = binary
        self._parts: list[tuple[bytes, bytes]] = []
        for sample in samples:
            inputs, raw = [], []
            for name, a in sample.items():
                entry: dict[str, Any] = {"name": name, "shape": list(a.shape), "datatype": _datatype_of(a)}
                if binary:
                    data = np.ascontiguousarray(a).tobytes()
                    entry["parameters"] = {"binary_data_size": len(data)}
                    raw.append(data)
                else:
                    entry["data"] = a.reshape(-1).tolist()
                inputs.append(entry)
            tail = {"inputs": inputs}
            if binary:
                tail["parameters"] = {"binary_data_output": True}
            # '{"id": "<id>", ' is prepended per request; the rest never changes
            self._parts.append((json.dumps(tail, separators=(",", ":"))[1:].encode(), b"".join(raw)))

    def __len__(self) -> int:
        return len(self._parts)

    def encode(self, request_id: str, sample: int) -> tuple[bytes, dict[str, str]]:
        """Body and headers of request ``request_id`` carrying sample number ``sample``."""
        tail, raw = self._parts[sample]
        header = b'{"id":"' + request_id.encode() + b'",' + tail
        if not self.binary:
            return header, {"Content-Type": "application/json"}
        return header + raw, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}


def decode_response(content: bytes, headers: Any) -> tuple[str | None, dict[str, np.ndarray]]:
    """The ``id`` and the output arrays of an infer response (JSON or binary extension)."""
    length = None
    if headers is not None:
        length = headers.get(HEADER_LENGTH) or headers.get(HEADER_LENGTH.lower())
    raw = b""
    if length is not None:
        n = int(length)
        content, raw = content[:n], content[n:]
    body = json.loads(content)
    outputs: dict[str, np.ndarray] = {}
    offset = 0
    for out in body["outputs"]:
        dtype = DATATYPES[str(out["datatype"]).upper()]
        shape = tuple(int(d) for d in out["shape"])
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            a = np.frombuffer(raw[offset:offset + int(size)], dtype=dtype)
            offset += int(size)
        else:
            a = np.asarray(out["data"], dtype=dtype)
        outputs[str(out["name"])] = a.reshape(shape)
    request_id = body.get("id")
    return (None if request_id is None else str(request_id)), outputs


# --------------------------------------------------------------------------- checking answers


def load_reference_model(spec: str) -> Any:
    """The model to check answers with, in the forms ``partrain serve`` takes.

    ``[name=]MODEL`` where MODEL is a partrain checkpoint, a TorchScript or
    ``torch.export`` (.pt2) file, or ``module:factory`` (called with no
    arguments; it must build the same weights as the server's, e.g. by seeding).
    """
    import torch

    from ..models import build_model
    from ..train.checkpoint import load_model

    name, sep, rest = spec.partition("=")
    if sep and name.isidentifier() and not os.path.exists(spec):
        spec = rest
    if os.path.exists(spec):
        if spec.endswith(".pt2"):
            return torch.export.load(spec).module()
        try:
            model, _ = load_model(spec)
            return model
        except UsageError as first:
            try:
                return torch.jit.load(spec, map_location="cpu").eval()
            except Exception:
                raise first from None
    if ":" in spec:
        return build_model(spec).eval()
    raise UsageError(f"Expected a model file or 'module:factory' to check answers with. Received: {spec!r}")


class AnswerChecker:
    """Runs each sample through a local model once and compares the server's answers with it."""

    def __init__(self, model: Any, samples: Sequence[dict[str, np.ndarray]], atol: float = 1e-4,
                 rtol: float = 1e-4):
        import torch

        self.atol, self.rtol = atol, rtol
        self.expected: list[list[np.ndarray]] = []
        with torch.inference_mode():
            for sample in samples:
                try:
                    out = model(*(torch.from_numpy(np.array(a)) for a in sample.values()))
                except Exception as exc:
                    shapes = {k: list(a.shape) for k, a in sample.items()}
                    raise UsageError(f"Expected the --check model to accept the inputs sent {shapes}. "
                                     f"Received: {type(exc).__name__}: {exc}") from None
                if isinstance(out, dict):
                    out = list(out.values())
                elif not isinstance(out, (list, tuple)):
                    out = [out]
                self.expected.append([o.detach().cpu().numpy() for o in out])

    def compare(self, sample: int, outputs: dict[str, np.ndarray]) -> str:
        """'' when ``outputs`` are right for ``sample``, else what is wrong."""
        expected = self.expected[sample]
        got = list(outputs.values())
        if len(got) != len(expected):
            return f"{len(got)} outputs instead of {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            if e.shape != g.shape:
                return f"output {i} has shape {list(g.shape)} instead of {list(e.shape)}"
            if not np.allclose(g.astype(np.float64), e.astype(np.float64), atol=self.atol, rtol=self.rtol):
                diff = float(np.max(np.abs(g.astype(np.float64) - e.astype(np.float64))))
                return f"output {i} differs by up to {diff:.3g}"
        return ""


# --------------------------------------------------------------------------- the run


class _Recorder:
    """One outcome per request: latency or error kind, and the answer to check later."""

    def __init__(self) -> None:
        self.seen: Counter = Counter()
        self.latencies: list[float] = []
        self.errors: Counter = Counter()
        self.id_mismatches = 0
        self.answers: list[tuple[int, dict[str, np.ndarray]]] = []

    def answered(self, index: int, latency: float, sample: int, outputs: dict[str, np.ndarray],
                 keep: bool) -> None:
        self.seen[index] += 1
        self.latencies.append(latency)
        if keep:
            self.answers.append((sample, outputs))

    def failed(self, index: int, kind: str) -> None:
        self.seen[index] += 1
        self.errors[kind] += 1


class _Connection:
    """One HTTP/1.1 keep-alive connection: h11's state machine over asyncio streams.

    The load loop's hot path. httpx (used for the metadata query) spends 1-2.5 ms of
    client CPU per request here, measured against a trivial server on 2 cores, which
    caps a one-process load generator below what a batching server sustains; h11
    alone (the HTTP/1.1 parser httpx itself uses) spends about 0.2 ms.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        import h11

        self._h11 = h11
        self.reader, self.writer, self.host = reader, writer, host
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, host: str, port: int, tls: bool, host_header: str) -> _Connection:
        reader, writer = await asyncio.open_connection(host, port, ssl=True if tls else None)
        sock = writer.get_extra_info("socket")
        if sock is not None:  # never let Nagle hold a request back waiting for an ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, host_header)

    def reusable(self) -> bool:
        return (self.conn.our_state is self._h11.IDLE and not self.reader.at_eof()
                and not self.writer.is_closing())

    async def post(self, target: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        h11 = self._h11
        head = [("Host", self.host), ("Content-Length", str(len(body))), *headers.items()]
        self.writer.write(self.conn.send(h11.Request(method="POST", target=target, headers=head))
                          + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
        status, response_headers, chunks = 0, {}, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await self.reader.read(1 << 16)
                self.conn.receive_data(data)  # b"" = the server closed: h11 raises if mid-answer
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                response_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection without an answer")
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return status, response_headers, b"".join(chunks)

    def close(self) -> None:
        self.writer.close()


class ConnectionPool:
    """At most ``size`` connections to one server; each request takes an idle one or opens one.

    A connection that fails or is interrupted (timeout, cancellation) mid-request is
    closed, never reused: its next answer could belong to the abandoned request.
    """

    def __init__(self, base: str, size: int, headers: dict[str, str] | None = None):
        parts = urlsplit(base)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = parts.netloc
        self.prefix = parts.path.rstrip("/")
        self.headers = dict(headers or {})
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        async with self._slots:
            conn = None
            while self._idle and conn is None:
                candidate = self._idle.pop()
                if candidate.reusable():
                    conn = candidate
                else:
                    candidate.close()
            if conn is None:
                conn = await _Connection.open(self.host, self.port, self.tls, self.host_header)
            try:
                result = await conn.post(self.prefix + path, body, {**self.headers, **headers})
            except BaseException:
                conn.close()
                raise
            if conn.reusable():
                self._idle.append(conn)
            else:
                conn.close()
            return result

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _send(pool: ConnectionPool, path: str, encoder: RequestEncoder, index: int, sample: int,
                start: float, timeout: float, recorder: _Recorder, keep: bool) -> None:
    import h11

    request_id = str(index)
    body, headers = encoder.encode(request_id, sample)
    try:
        status, response_headers, content = await asyncio.wait_for(pool.post(path, body, headers), timeout)
    except asyncio.TimeoutError:
        recorder.failed(index, "timeout")
        return
    except asyncio.CancelledError:
        recorder.failed(index, "cancelled")
        raise
    except (OSError, h11.ProtocolError):  # refused, reset, closed mid-answer, garbled HTTP
        recorder.failed(index, "connection error")
        return
    latency = time.perf_counter() - start
    if status != 200:
        recorder.failed(index, f"HTTP {status}")
        return
    try:
        answer_id, outputs = decode_response(content, response_headers)
    except (ValueError, KeyError, TypeError):
        recorder.failed(index, "malformed answer")
        return
    if answer_id is not None and answer_id != request_id:
        recorder.id_mismatches += 1
    recorder.answered(index, latency, sample, outputs, keep)


async def _closed_loop(make_pool: Any, path: str, cfg: LoadConfig, encoder: RequestEncoder,
                       recorder: _Recorder, keep: bool, t0: float) -> int:
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
                await _send(pool, path, encoder, index, index % len(encoder), now, cfg.timeout, recorder,
                            keep)

    assert cfg.concurrency is not None
    await asyncio.gather(*(client_loop() for _ in range(cfg.concurrency)))
    return sent


async def _open_loop(pool: ConnectionPool, path: str, cfg: LoadConfig, encoder: RequestEncoder,
                     recorder: _Recorder, keep: bool, t0: float) -> int:
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
            task = asyncio.ensure_future(_send(pool, path, encoder, index, index % len(encoder),
                                               t0 + arrival, cfg.timeout, recorder, keep))
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


async def run_load_async(cfg: LoadConfig, samples: Sequence[dict[str, np.ndarray]] | None = None,
                         checker: AnswerChecker | None = None,
                         info: ModelInfo | None = None) -> LoadReport:
    """Run one load test (see `LoadConfig`) and return what it saw.

    ``samples`` default to random inputs shaped by the model's metadata (or
    ``cfg.npz``); ``info`` skips the metadata query; ``checker`` compares answers.
    """
    import httpx

    cfg.validate()
    base, model = parse_target(cfg.url, cfg.model)
    if samples is None:
        if info is None:
            async with httpx.AsyncClient(timeout=cfg.connect_timeout, headers=cfg.headers,
                                         trust_env=False) as client:
                info = await fetch_model_info(client, base, model, cfg.connect_timeout)
        if cfg.npz:
            samples = npz_inputs(cfg.npz, info, cfg.shape)
        else:
            samples = random_inputs(info, cfg.samples, cfg.shape, cfg.seed)
    if checker is not None and len(checker.expected) != len(samples):
        raise UsageError(f"Expected a checker built on the {len(samples)} samples sent. "
                         f"Received: one built on {len(checker.expected)}")
    encoder = RequestEncoder(samples, binary=cfg.binary)
    path = f"/v2/models/{model}/infer"
    recorder = _Recorder()
    keep = checker is not None

    def make_pool(size: int) -> ConnectionPool:
        return ConnectionPool(base, size, cfg.headers)

    async with make_pool(cfg.connections or 256) as shared:
        t0 = time.perf_counter()
        if cfg.concurrency is not None:
            mode = f"closed loop, concurrency {cfg.concurrency}"
            loop = _closed_loop(make_pool, path, cfg, encoder, recorder, keep, t0)
        else:
            mode = f"open loop, {cfg.arrivals} arrivals at {cfg.rate:g}/s"
            loop = _open_loop(shared, path, cfg, encoder, recorder, keep, t0)
        task = asyncio.ensure_future(loop)
        try:
            sent = await asyncio.wait_for(asyncio.shield(task), cfg.run_limit())
        except asyncio.TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sent = max(recorder.seen, default=-1) + 1
        elapsed = time.perf_counter() - t0

    report = LoadReport(mode=mode, elapsed=elapsed, sent=sent, latencies=recorder.latencies,
                        errors=recorder.errors, id_mismatches=recorder.id_mismatches)
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


def run_load(cfg: LoadConfig, samples: Sequence[dict[str, np.ndarray]] | None = None,
             checker: AnswerChecker | None = None, info: ModelInfo | None = None) -> LoadReport:
    """Blocking `run_load_async` (starts its own event loop)."""
    return asyncio.run(run_load_async(cfg, samples, checker, info))


def prepare(cfg: LoadConfig, check: str | None = None, atol: float = 1e-4,
            rtol: float = 1e-4) -> tuple[ModelInfo, list[dict[str, np.ndarray]], AnswerChecker | None]:
    """Query the model's metadata, build the samples and (with ``check``) the checker.

    Separate from the run so that a bad URL, model or input fails before any load
    is sent, and so the reference model runs before the clock starts.
    """
    import httpx

    cfg.validate()
    base, model = parse_target(cfg.url, cfg.model)

    async def query() -> ModelInfo:
        async with httpx.AsyncClient(timeout=cfg.connect_timeout, headers=cfg.headers, trust_env=False) as c:
            return await fetch_model_info(c, base, model, cfg.connect_timeout)

    info = asyncio.run(query())
    if cfg.npz:
        samples = npz_inputs(cfg.npz, info, cfg.shape)
    else:
        samples = random_inputs(info, cfg.samples, cfg.shape, cfg.seed)
    checker = None
    if check:
        checker = AnswerChecker(load_reference_model(check), samples, atol=atol, rtol=rtol)
    return info, samples, checker
