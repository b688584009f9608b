"""What an online trainer measures, and where it goes: rows over time (CSV), Prometheus, curves.

The trainer's worker thread records each step (`StreamMetrics.record_step`), the
answer callbacks record each prediction's latency (`record_latency`), and every
``interval`` seconds the figures since the previous row become one row of
``history`` (and of ``metrics.csv``, appended and flushed at once: a stream has
no end at which to write a file whole). `prometheus_collector` exposes the same
counters, gauges and histograms at scrape time for ``/metrics``.
"""

from __future__ import annotations

import bisect
import csv
import math
import os
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

from .._stats import quantiles

COLUMNS = ("time_s", "version", "items_trained", "items_per_s", "steps", "mean_batch", "max_batch",
           "queue_depth", "loss", "lr", "latency_p50_ms", "latency_p99_ms", "accepted", "dropped",
           "rejected", "duplicates", "failed", "malformed")
#: counts of steps, not items: exposed as partrain_stream_steps_total{kind=...}
STEP_COUNTS = {"steps": "all", "updates": "updated", "skipped_updates": "skipped_non_finite",
               "failed_updates": "failed_after_answer"}
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class StreamMetrics:
    """Thread-safe accumulators of one trainer; rows every ``interval`` seconds to ``csv_path``."""

    def __init__(self, csv_path: str | None = None, interval: float = 1.0, max_batch: int = 256):
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError(f"Expected a metrics interval > 0 seconds. Received: {interval!r}")
        self.csv_path = csv_path
        self.interval = float(interval)
        self.history: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._row_start = self._started
        self._steps = self._items = self._max_batch = 0
        self._loss_sum = 0.0
        self._loss_n = 0
        self._latencies = array("d")  # this interval's, in seconds: a flat buffer, not a float object each
        self.batch_buckets = tuple(float(b) for b in sorted({1 << k for k in range(max_batch.bit_length())}
                                                            | {max_batch}))
        self.batch_counts = [0] * (len(self.batch_buckets) + 1)
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.batch_sum = 0.0
        self.latency_sum = 0.0
        self.last: dict[str, Any] = {"version": 0, "items_trained": 0, "lr": math.nan, "loss": math.nan}
        if csv_path is not None and os.path.exists(csv_path):
            os.unlink(csv_path)  # a new run's curve; a resumed one starts its own file too

    def record_step(self, *, items: int, loss: float, lr: float, version: int, items_trained: int) -> None:
        with self._lock:
            self._steps += 1
            self._items += items
            self._max_batch = max(self._max_batch, items)
            if not math.isnan(loss):
                self._loss_sum += loss
                self._loss_n += 1
            self.batch_counts[bisect.bisect_left(self.batch_buckets, items)] += 1
            self.batch_sum += items
            self.last = {"version": version, "items_trained": items_trained, "lr": lr, "loss": loss}

    def record_latencies(self, seconds: list[float]) -> None:
        """Submit-to-prediction times of one step's items."""
        ordered = sorted(seconds)  # then one search per bucket, not one per item (thousands a second)
        with self._lock:
            self._latencies.extend(seconds)
            counts, below = self.latency_counts, 0
            for i, bound in enumerate(LATENCY_BUCKETS):
                at_most = bisect.bisect_right(ordered, bound, below)
                counts[i] += at_most - below
                below = at_most
                if below == len(ordered):
                    break
            counts[-1] += len(ordered) - below
            self.latency_sum += sum(seconds)

    def due(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) - self._row_start >= self.interval

    def row(self, counts: dict[str, int], queue_depth: int) -> dict[str, Any]:
        """Close the interval: one row of the figures since the previous one (appended to the CSV)."""
        now = time.monotonic()
        with self._lock:
            latencies, self._latencies = self._latencies, array("d")
        # outside the lock, and without sorting (a sort of a second's latencies, twice, held the
        # GIL for ~5 ms at 15,000 items/s: a stall of a step or two in the thread that runs them)
        p50, p99 = quantiles(latencies, (0.50, 0.99))
        with self._lock:
            seconds = max(now - self._row_start, 1e-9)
            row = {
                "time_s": round(now - self._started, 3),
                "version": self.last["version"],
                "items_trained": self.last["items_trained"],
                "items_per_s": self._items / seconds,
                "steps": self._steps,
                "mean_batch": self._items / self._steps if self._steps else 0.0,
                "max_batch": self._max_batch,
                "queue_depth": queue_depth,
                "loss": self._loss_sum / self._loss_n if self._loss_n else math.nan,
                "lr": self.last["lr"],
                "latency_p50_ms": 1000 * p50,
                "latency_p99_ms": 1000 * p99,
                **{k: counts.get(k, 0) for k in COLUMNS[12:]},
            }
            self._row_start = now
            self._steps = self._items = self._max_batch = self._loss_n = 0
            self._loss_sum = 0.0
            self.history.append(row)
        if self.csv_path is not None:
            self._append(row)
        return row

    def _append(self, row: dict[str, Any]) -> None:
        new = not os.path.exists(self.csv_path)  # type: ignore[arg-type]
        with open(self.csv_path, "a", newline="") as f:  # type: ignore[arg-type]
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            if new:
                writer.writeheader()
            writer.writerow(row)


def plot_curves(history: list[dict[str, Any]], path: str) -> None:
    """Loss, items/s and p99 latency over time to a PNG (written whole, then renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("loss", "loss"), ("items_per_s", "items/s"), ("latency_p99_ms", "p99 latency (ms)"))
    times = [r["time_s"] for r in history]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        ax.plot(times, [r[key] for r in history], marker=".")
        ax.set(title=title, xlabel="seconds")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)


def prometheus_collector(metrics: StreamMetrics, counts: Callable[[], dict[str, int]],
                         gauges: Callable[[], dict[str, float]]) -> Any:
    """A prometheus-client collector reading the trainer at scrape time (no second bookkeeping)."""
    from prometheus_client.metrics_core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    def histogram(name: str, doc: str, bounds: tuple[float, ...], counts_: list[int],
                  total: float) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, n in zip((*bounds, math.inf), counts_):
            running += n
            cumulative.append(("+Inf" if math.isinf(bound) else repr(float(bound)), running))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)

    class Collector:
        def collect(self) -> Iterator[Any]:
            items = CounterMetricFamily("partrain_stream_items", "Stream items by outcome", labels=["outcome"])
            steps = CounterMetricFamily("partrain_stream_steps", "Steps by kind", labels=["kind"])
            for name, n in counts().items():
                if name in STEP_COUNTS:
                    steps.add_metric([STEP_COUNTS[name]], n)
                else:
                    items.add_metric([name], n)
            yield items
            yield steps
            for name, value in gauges().items():
                yield GaugeMetricFamily(f"partrain_stream_{name}", name.replace("_", " "), value=value)
            with metrics._lock:
                yield histogram("partrain_stream_batch_size", "Items per step", metrics.batch_buckets,
                                list(metrics.batch_counts), metrics.batch_sum)
                yield histogram("partrain_stream_prediction_latency_seconds",
                                "Submit to prediction, per item", LATENCY_BUCKETS,
                                list(metrics.latency_counts), metrics.latency_sum)

    return Collector()


def serve_prometheus(collector: Any, host: str = "127.0.0.1", port: int = 0) -> tuple[Any, str]:
    """``/metrics`` over HTTP on a thread; returns the server (``.shutdown()``) and its URL."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound_host, bound_port = server.server_address[:2]
    return server, f"http://{bound_host!s}:{bound_port}/metrics"
