"""The one harness every benchmark runs on: rounds, spreads, goals, tables, JSON, server processes.

Vocabulary, kept throughout ``partrain.bench``:

- a *variant* is one way of doing the job (``fit`` with ``allreduce``, a raw DDP
  script, ``partrain serve`` with batching off, ...); a *figure* is a number it yields;
- a *round* measures every variant once; variants take turns inside a round and
  the turn order rotates from round to round (`alternate`), so a burst of load from
  other processes, or a slow drift, hits every variant alike instead of whichever ran
  last;
- a variant's result over the rounds is a `Spread`: the median, with the minimum and
  maximum next to it so a reader sees how much the machine moved;
- a *ratio* compares two variants round by round (`paired_ratio`): each round's
  ratio is taken between measurements made moments apart, then the median of those;
- a *goal* is a ratio (or figure) with a target under a stable name from the issue
  that set it (`GOALS`); a *check* is a target outside that list (correctness counts,
  latency and memory bounds) printed and written the same way.

A benchmark builds a `Report`, prints its tables through it, records goals and
checks, and returns it; ``partrain bench NAME --json FILE`` then writes
``{"benchmark", "smoke", "figures", "goals", "checks"}`` where every goal reads
``{"value": v, "op": ">=" or "<=", "target": t, "met": bool}``. A goal that could
not be measured (a competitor not installed, a variant that failed) has value
``null`` and is never met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..tables import format_number, format_table

T = TypeVar("T")

# The stable goal names of each benchmark (issue 9): tests and readers of --json rely on them.
GOALS: dict[str, tuple[str, ...]] = {
    "core": ("core.fit_vs_plain", "core.allreduce_vs_ddp", "core.scaling", "core.startup_s"),
    "async": ("async.hogwild_scaling", "async.ps_vs_allreduce", "async.ps_straggler_time", "async.diloco_bytes",
              "async.diloco_loss"),
    "syncbn": ("syncbn.step_ratio",),
    "serve": ("serve.batched_vs_unbatched", "serve.batched_vs_limit", "serve.p99_over_p50",
              "serve.vs_litserve"),
    "population": ("population.auto_vs_best", "population.vs_pool", "population.memory_vs_pool"),
    "engines": ("engines.torchrun_vs_launch", "engines.ray_vs_launch", "engines.recovery_s"),
    "pipeline": ("pipeline.utilisation_vs_ideal", "pipeline.memory_per_stage", "pipeline.vs_raw_torch",
                 "pipeline.serve_memory_per_stage", "pipeline.serve_vs_unsplit"),
    "stream": ("stream.vs_per_item", "stream.vs_hand_queue", "stream.p99_vs_step", "stream.mqtt_vs_bare",
               "stream.mqtt_burst_loss", "stream.mqtt_p99_ms"),
    "data": ("data.overlap_speedup", "data.resident_vs_dataloader", "data.padding_vs_random"),
    "compare": ("compare.regret_max", "compare.prediction_error", "compare.budget_overrun"),
    "rl": ("rl.time_to_475_vs_sb3", "rl.fps_vs_sb3", "rl.policy_lag_p50"),
    "lm": ("lm.fit_vs_plain", "lm.scaling", "lm.activation_memory", "lm.loss_vs_plain"),
    "generate": ("generate.vs_sequential", "generate.vs_static", "generate.ttft_p99_over_p50", "generate.vs_hf"),
    "sharded": ("sharded.state_memory", "sharded.peak_memory", "sharded.largest_model", "sharded.step_vs_allreduce",
                "tp.scaling"),
}

SMOKE_NOTE = "smoke run: figures are noise"
OPS: dict[str, Callable[[float, float], bool]] = {">=": lambda v, t: v >= t, "<=": lambda v, t: v <= t}


# --------------------------------------------------------------------------- tables


# --------------------------------------------------------------------------- rounds and spreads


@dataclass(frozen=True)
class Spread:
    """One variant's figure over the rounds: median, minimum, maximum, and the values themselves.

    NaN values (a round where the figure did not exist, e.g. a target never reached)
    are left out of the median; a spread of no values is NaN throughout.
    """

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        kept = [float(v) for v in values if not math.isnan(float(v))]
        if not kept:
            return cls(math.nan, math.nan, math.nan, tuple(float(v) for v in values))
        return cls(statistics.median(kept), min(kept), max(kept), tuple(float(v) for v in values))

    def median_interval(self, confidence: float = 0.95) -> tuple[float, float]:
        """A distribution-free interval for the median at ``confidence``: the k-th lowest and k-th
        highest value, k the largest rank whose binomial tail stays within (1 - confidence) / 2.

        It needs no assumption about the machine's noise (rounds interrupted by other tenants make
        it skewed). Where the rounds are too few for one (fewer than 6 at 95%), the min-max.
        """
        kept = sorted(v for v in self.values if not math.isnan(v))
        n, k, tail = len(kept), 0, 0.0
        while k < n // 2:
            tail += math.comb(n, k) / 2 ** n  # P(fewer than k + 1 of n values below the median)
            if tail > (1 - confidence) / 2:
                break
            k += 1
        if not kept:
            return (math.nan, math.nan)
        k = max(k, 1)
        return (kept[k - 1], kept[n - k])

    def cell(self) -> str:
        """``median (min-max)`` for a table cell; the bare median when every round agreed."""
        if math.isnan(self.median):
            return "-"
        if self.low == self.high:
            return format_number(self.median)
        return f"{format_number(self.median)} ({format_number(self.low)}-{format_number(self.high)})"

    def to_json(self) -> dict[str, Any]:
        return {"median": _finite(self.median), "min": _finite(self.low), "max": _finite(self.high),
                "rounds": [_finite(v) for v in self.values]}


def alternate(variants: Mapping[str, Callable[[], T]], rounds: int,
              on_result: Callable[[int, str, T], None] | None = None) -> dict[str, list[T]]:
    """Run every variant once per round, in turns; return each variant's results in round order.

    Round ``r`` starts at variant ``r mod n`` and goes on in the given order, so no
    variant always runs first (right after the machine was idle, or a warm-up) or
    last. ``on_result(round, name, result)`` is called after each measurement
    (progress lines).
    """
    if rounds < 1:
        raise ValueError(f"Expected at least one round. Received: {rounds}")
    names = list(variants)
    results: dict[str, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            result = variants[name]()
            results[name].append(result)
            if on_result is not None:
                on_result(r, name, result)
    return results


def alternate_pairs(variants: Mapping[str, Callable[[], T]], pairs: Sequence[tuple[str, str]], rounds: int,
                    on_result: Callable[[int, str, T], None] | None = None) -> dict[str, list[T]]:
    """Like `alternate`, for variants compared two by two: each round runs every pair's two
    variants back to back, the pair's first variant alternating from round to round and the pairs'
    order rotating. A ratio taken round by round then compares two runs made seconds apart, not
    minutes, and neither side always runs first."""
    if rounds < 1:
        raise ValueError(f"Expected at least one round. Received: {rounds}")
    missing = sorted({name for pair in pairs for name in pair} - set(variants))
    if missing:
        raise ValueError(f"Expected pairs of the variants {sorted(variants)}. Received: {missing}")
    results: dict[str, list[T]] = {name: [] for pair in pairs for name in pair}
    for r in range(rounds):
        for i in range(len(pairs)):
            pair = pairs[(r + i) % len(pairs)]
            for name in (pair if r % 2 == 0 else pair[::-1]):
                result = variants[name]()
                results[name].append(result)
                if on_result is not None:
                    on_result(r, name, result)
    return results


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """Round-by-round ratios of two variants measured in the same rounds, as a `Spread`."""
    if len(numerator) != len(denominator):
        raise ValueError(f"Expected figures from the same rounds. Received: {len(numerator)} and "
                         f"{len(denominator)} rounds")
    return Spread.of([divide(a, b) for a, b in zip(numerator, denominator)])


def divide(a: float, b: float) -> float:
    """``a / b``, NaN where either is NaN or ``b`` is zero (a missing figure stays missing)."""
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


# --------------------------------------------------------------------------- goals


@dataclass(frozen=True)
class Goal:
    """A figure and its target: ``value op target``. ``value`` None or NaN: not measured, never met."""

    name: str
    value: float | None
    op: str
    target: float
    about: str = ""
    #: where the value is a median over rounds: its 95% interval (`Spread.median_interval`; the
    #: lowest and highest round where the rounds are too few for one)
    interval: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Expected op among {sorted(OPS)}. Received: {self.op!r}")

    @property
    def measured(self) -> bool:
        return self.value is not None and not math.isnan(self.value)

    @property
    def met(self) -> bool:
        return self.measured and OPS[self.op](float(self.value), self.target)  # type: ignore[arg-type]

    @property
    def straddles(self) -> bool:
        """The value's interval lies on both sides of the target: the verdict is the rounds'
        majority, not a difference the rounds resolve."""
        return self.interval is not None and self.measured and \
            OPS[self.op](self.interval[0], self.target) != OPS[self.op](self.interval[1], self.target)

    def verdict(self) -> str:
        if not self.measured:
            return "not measured"
        return ("yes" if self.met else "NO") + (" (interval spans the target)" if self.straddles else "")

    def cell(self) -> str:
        """The value for the goals table, with its rounds' interval where it has one."""
        if not self.measured:
            return "-"
        text = format_number(self.value)  # type: ignore[arg-type]
        if self.interval is not None and self.interval[0] != self.interval[1]:
            text += f" ({format_number(self.interval[0])}-{format_number(self.interval[1])})"
        return text

    def to_json(self) -> dict[str, Any]:
        interval = [_finite(v) for v in self.interval] if self.interval is not None else None
        return {"value": float(self.value) if self.measured else None, "op": self.op,  # type: ignore[arg-type]
                "target": float(self.target), "met": self.met, "interval": interval}


# --------------------------------------------------------------------------- the report


@dataclass
class Report:
    """What one benchmark prints and writes: tables and lines as it goes, goals and checks at the end.

    ``smoke`` (``--quick`` and the test-only toy size) says so first and last: such
    runs check that the benchmark works, their figures mean nothing.
    """

    benchmark: str
    smoke: bool = False
    figures: dict[str, Any] = field(default_factory=dict)
    goals: dict[str, Goal] = field(default_factory=dict)
    checks: dict[str, Goal] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.benchmark not in GOALS:
            raise ValueError(f"Expected a benchmark among {sorted(GOALS)}. Received: {self.benchmark!r}")
        if self.smoke:
            self.say(f"partrain bench {self.benchmark}: {SMOKE_NOTE} (it checks that the benchmark runs)")

    @staticmethod
    def say(text: str = "") -> None:
        print(text, flush=True)

    @staticmethod
    def progress(text: str) -> None:
        """A line on stderr while the run goes on (the tables go to stdout)."""
        print(f"  {text}", file=sys.stderr, flush=True)

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
        self.say()
        if title:
            self.say(title)
        self.say(format_table(headers, rows))

    def figure(self, name: str, value: float | Spread | str) -> None:
        """Record a figure for --json (a `Spread` keeps its median, min, max and rounds)."""
        self.figures[name] = value

    def note(self, text: str) -> None:
        """A line printed now and again under the goals (e.g. a competitor not installed)."""
        self.notes.append(text)
        self.say(text)

    def goal(self, name: str, value: float | Spread | None, op: str, target: float, about: str) -> Goal:
        """Record one of this benchmark's named goals (`GOALS`). A `Spread` (a figure over rounds)
        gives its median as the value and the median's 95% interval (`Spread.median_interval`) as
        the goal's interval."""
        if name not in GOALS[self.benchmark]:
            raise ValueError(f"Expected a goal among {GOALS[self.benchmark]}. Received: {name!r}")
        interval = None
        if isinstance(value, Spread):
            interval = value.median_interval() if len(value.values) > 1 else None
            value = value.median
        self.goals[name] = Goal(name, value, op, target, about, interval)
        return self.goals[name]

    def check(self, name: str, value: float | None, op: str, target: float, about: str) -> Goal:
        """Record a target outside the named goals (correctness counts, latency, memory)."""
        self.checks[name] = Goal(name, value, op, target, about)
        return self.checks[name]

    def finish(self) -> None:
        """Print the goals (every named goal of this benchmark, measured or not) and the checks."""
        missing = [n for n in GOALS[self.benchmark] if n not in self.goals]
        if missing:  # a benchmark must state every goal, measured or not
            raise RuntimeError(f"benchmark {self.benchmark} did not report goals {missing}")
        for title, entries in (("goals", [self.goals[n] for n in GOALS[self.benchmark]]),
                               ("checks", list(self.checks.values()))):
            if not entries:
                continue
            rows = [[g.name, g.about, g.cell(), f"{g.op} {format_number(float(g.target))}", g.verdict()]
                    for g in entries]
            self.table([title[:-1], "what", "value", "target", "met"], rows,
                       title=f"{title} ({SMOKE_NOTE})" if self.smoke else title)
        if self.notes:
            self.say()
            for text in self.notes:
                self.say(text)

    def to_json(self) -> dict[str, Any]:
        def value(v: Any) -> Any:
            if isinstance(v, Spread):
                return v.to_json()
            if isinstance(v, float):
                return _finite(v)
            return v

        return {
            "benchmark": self.benchmark,
            "smoke": self.smoke,
            "figures": {k: value(v) for k, v in self.figures.items()},
            "goals": {n: g.to_json() for n, g in self.goals.items()},
            "checks": {n: g.to_json() for n, g in self.checks.items()},
        }

    def write_json(self, path: str | None) -> None:
        if path:
            with open(path, "w") as f:
                json.dump(self.to_json(), f, indent=2, sort_keys=True, allow_nan=False)
                f.write("\n")


def _finite(v: float) -> float | None:
    """JSON has no NaN or infinity: a missing (or never reached) figure is written as null."""
    return float(v) if math.isfinite(v) else None


# --------------------------------------------------------------------------- sizes and threads


def device_option(args: Any) -> str:
    """A benchmark's ``--device``: "cpu" (the default) or "cuda"; one line for anything else, or for
    cuda on a machine without it."""
    from ..env import check_cuda
    from ..errors import UsageError

    device = getattr(args, "device", "cpu")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"Expected --device cpu or cuda. Received: {device!r}")
    if device == "cuda":
        check_cuda("--device cuda")
    return device


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts (rounds, epochs, samples): bad input is one clear line."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"Expected a positive integer. Received: {text!r}")
    return value



def pick_size(args: Any, full: T, quick: T, toy: T) -> tuple[T, bool]:
    """The preset for ``--quick`` / the hidden test-only ``--toy`` / a full run; and whether it is a smoke run."""
    if getattr(args, "toy", False):
        return toy, True
    if getattr(args, "quick", False):
        return quick, True
    return full, False


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (None: leave them), and give the caller's setting back."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- server processes


@dataclass
class ServerProcess:
    """A server in its own subprocess and session (its children die with it), at the URL it announced."""

    label: str
    url: str
    process: subprocess.Popen
    log_path: str

    def log_tail(self, lines: int = 15) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])


@contextlib.contextmanager
def server_process(label: str, command: Sequence[str], announce: re.Pattern[str], *,
                   ready_path: str | None = None, env: Mapping[str, str] | None = None,
                   start_timeout: float = 90.0) -> Iterator[ServerProcess]:
    """Start ``command``, learn its URL from the first stdout line ``announce`` matches, stop it on exit.

    The server picks its own port (``--port 0`` or its own free-port choice) and
    says where it listens; there is no port chosen here that another process could
    take first. ``announce`` must have a group named ``url``. With ``ready_path``,
    the server is also polled until ``GET ready_path`` answers 200 (for servers
    that announce before they accept connections). Output goes to a log file whose
    tail is shown if the server exits or stays silent past ``start_timeout`` seconds.
    On exit: SIGTERM to its process group, SIGKILL 10 s later; every wait bounded.
    """
    log_fd, log_path = tempfile.mkstemp(prefix=f"partrain-bench-{label.split()[0]}-", suffix=".log")
    log = os.fdopen(log_fd, "w", buffering=1)
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=log, text=True, errors="replace",
                               env=dict(env) if env is not None else None, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()
    pump = threading.Thread(target=_pump, args=(process.stdout, log, lines), daemon=True)
    pump.start()
    server = ServerProcess(label, "", process, log_path)
    try:
        deadline = time.monotonic() + start_timeout
        server.url = _await_announcement(server, announce, lines, deadline, start_timeout)
        if ready_path is not None:
            _await_ready(server, ready_path, deadline, start_timeout)
        yield server
    finally:
        stop_process_group(process)
        pump.join(timeout=10)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log_path)


def _pump(stream: Any, log: Any, lines: queue.Queue) -> None:
    """Copy the server's stdout into its log, and hand each line to the waiting parent."""
    for line in stream:
        log.write(line)
        lines.put(line)
    lines.put(None)  # end of output: the server exited or closed stdout


def _await_announcement(server: ServerProcess, announce: re.Pattern[str], lines: queue.Queue,
                        deadline: float, start_timeout: float) -> str:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{server.label} did not say where it listens within {start_timeout:g} s:\n"
                               f"{server.log_tail()}")
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if line is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.process.wait(timeout=10)
            raise RuntimeError(f"{server.label} exited with status {server.process.returncode} before it "
                               f"was ready:\n{server.log_tail()}")
        found = announce.search(line)
        if found:
            return found.group("url").rstrip("/")


def _await_ready(server: ServerProcess, ready_path: str, deadline: float, start_timeout: float) -> None:
    import httpx

    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.label} exited with status {server.process.returncode} before it "
                               f"was ready:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + ready_path, timeout=1.0, trust_env=False).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.label} was not ready within {start_timeout:g} s:\n{server.log_tail()}")
        time.sleep(0.1)  # polling interval of a readiness probe, not a synchronisation guess


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process's group, SIGKILL if it is still there 10 s later; then its leftovers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; children it started (inference workers) may not be
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return


def start_servers(stack: contextlib.ExitStack, servers: list[Any]) -> list[Any]:
    """Enter every server's context at once (their start-ups overlap), each left on ``stack``.

    A server imports torch and builds its model before it listens: on a GPU host with
    CUDA to initialise, seven of them one after another took most of a minute. When
    one fails to start, the others that did are stopped (by the stack) and its error
    is raised.
    """
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max(1, len(servers))) as pool:
        futures = [pool.submit(cm.__enter__) for cm in servers]
    entered, failure = [], None
    for cm, future in zip(servers, futures):
        if future.exception() is None:
            stack.push(cm)
            entered.append(future.result())
        elif failure is None:
            failure = future.exception()
    if failure is not None:
        raise failure
    return entered


def child_processes(pid: int) -> list[int]:
    """Live child processes of ``pid``, from /proc (what a benchmark's launcher or server started)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(entry))
    return sorted(found)
