"""What one load test is: `LoadConfig` and where it sends (`parse_target`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ...errors import UsageError


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
        """Seconds the whole run may take before requests still in flight are cancelled."""
        if self.max_time is not None:
            return self.max_time
        if self.duration is not None:
            return self.duration + 2 * self.timeout
        return 600.0


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
