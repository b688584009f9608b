"""Serving: partrain serve with adaptive batching vs batching off vs LitServe, at concurrency 1/16/64.

Each server runs in its own subprocess on a free loopback port with the same
number of torch threads, serving the same weights (LeNet-5 on 1x28x28 images and
an MLP on the same images). This process is the load generator
(`partrain.serve.loadtest`, closed loop): it starts all servers of a model, warms
each up, then measures them in interleaved rounds (so a drift in the machine's
load hits all of them alike): throughput, p50 and p99 latency, errors, lost
answers (a request without exactly one answer of its own) and wrong answers
(checked against a local copy of the model) at each concurrency.

LitServe speaks no Open Inference Protocol, so it is given a `LitAPI` that
decodes and encodes OIP JSON on the same path (``/v2/models/NAME/infer``), with
its own batching (``batch``/``unbatch``); it runs at every setting of a small
``max_batch_size`` x ``batch_timeout`` grid and each concurrency keeps its best
setting (the most favourable comparison for LitServe).

Ratios (goals from the serving issue): adaptive / unbatched throughput at
concurrency 64 (>= 5x), adaptive / LitServe at 64 (>= 1.2x), p50 adaptive -
unbatched at concurrency 1 (<= 1 ms), lost + wrong answers (0).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..models import build_model, lenet5, mlp
from .common import format_table

IMAGE = (1, 1, 28, 28)  # one request: one 1x28x28 image


def lenet_factory() -> nn.Module:
    """LeNet-5 for 1x28x28 images, seeded: every process builds the same weights."""
    torch.manual_seed(0)
    model = lenet5(in_channels=1, num_classes=10, image_size=28).eval()
    model.example_input_shape = IMAGE[1:]  # what partrain serve needs to describe its inputs
    return model


def mlp_factory() -> nn.Module:
    """An MLP (784-512-512-10) on 1x28x28 images, seeded like `lenet_factory`."""
    torch.manual_seed(0)
    model = mlp(in_features=28 * 28, num_classes=10, hidden=512, depth=2).eval()
    model.example_input_shape = IMAGE[1:]
    return model


MODELS = {
    "lenet": "partrain.bench.serve:lenet_factory",
    "mlp": "partrain.bench.serve:mlp_factory",
}
LITSERVE_GRID = [(16, 0.001), (64, 0.002), (64, 0.005)]
LITSERVE_GRID_QUICK = [(16, 0.001), (64, 0.002)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=None,
                        help=f"comma-separated among {sorted(MODELS)} (default: all; --quick: lenet)")
    parser.add_argument("--concurrency", default="1,16,64", help="closed-loop client counts (default 1,16,64)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds measured per point (default 4; --quick 1)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds of load before measuring "
                        "each server (default 1; --quick 0.3)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds over all servers "
                        "(default 2; --quick 1); each point's duration is split across them")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every server (default 1)")
    parser.add_argument("--max-batch-size", type=int, default=64,
                        help="max batch size of partrain serve with adaptive batching (default 64)")
    parser.add_argument("--binary", action="store_true",
                        help="binary tensor extension for partrain serve (LitServe gets JSON)")
    parser.add_argument("--no-litserve", action="store_true", help="skip LitServe")
    parser.add_argument("--start-timeout", type=float, default=90.0,
                        help="seconds a server may take to become ready (default 90)")


# --------------------------------------------------------------------------- server processes


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A server subprocess in its own session (so its children die with it)."""

    label: str
    url: str
    process: subprocess.Popen
    log: Any

    def log_tail(self, lines: int = 15) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-lines:])


@contextlib.contextmanager
def server_process(label: str, command: list[str], port: int, ready_path: str, threads: int,
                   start_timeout: float) -> Iterator[Server]:
    """Start ``command``, wait until ``GET ready_path`` answers 200, kill it (and its children) on exit."""
    import httpx

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1")
    log = tempfile.NamedTemporaryFile("w+", prefix=f"partrain-bench-{label.split()[0]}-", suffix=".log")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    server = Server(label, f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{label} exited with status {process.returncode} before it was ready:\n"
                                   f"{server.log_tail()}")
            try:
                if httpx.get(server.url + ready_path, timeout=1.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label} was not ready within {start_timeout:g} s:\n{server.log_tail()}")
            time.sleep(0.1)
        yield server
    finally:
        _kill(process)
        log.close()


def _kill(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 10 s; every wait bounded."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; its children may not be
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return


def ours_command(name: str, factory: str, port: int, max_batch_size: int, threads: int) -> list[str]:
    """``partrain serve`` as a user would start it."""
    cmd = [sys.executable, "-m", "partrain", "serve", f"{name}={factory}", "--host", "127.0.0.1",
           "--port", str(port), "--max-batch-size", str(max_batch_size)]
    cmd += ["--policy", "adaptive" if max_batch_size > 1 else "none"]
    return cmd + ["--threads", str(threads)]


def litserve_command(name: str, factory: str, port: int, max_batch_size: int, batch_timeout: float,
                     threads: int) -> list[str]:
    return [sys.executable, "-m", "partrain.bench.serve", "litserve", name, factory, str(port),
            str(max_batch_size), str(batch_timeout), str(threads)]


# --------------------------------------------------------------------------- LitServe, speaking OIP JSON


def _lit_api_class() -> type:
    """The LitAPI class, built on first use so that importing this module never imports LitServe.

    It is reachable as ``partrain.bench.serve.OIPLitAPI`` (module ``__getattr__``),
    which lets LitServe's spawned inference worker unpickle it.
    """
    cls = globals().get("_OIPLitAPI")
    if cls is not None:
        return cls
    if __name__ != "partrain.bench.serve":  # run as a script: build it in the importable module
        import importlib

        return importlib.import_module("partrain.bench.serve")._lit_api_class()
    import litserve as ls

    class OIPLitAPI(ls.LitAPI):
        """One model behind ``/v2/models/NAME/infer``: OIP JSON in and out, LitServe's batching."""

        def __init__(self, name: str, factory: str, threads: int, **kwargs: Any):
            super().__init__(api_path=f"/v2/models/{name}/infer", **kwargs)
            self.name, self.factory, self.threads = name, factory, threads

        def setup(self, device: str) -> None:
            from ..models import build_model

            torch.set_num_threads(self.threads)
            self.model = build_model(self.factory).eval()

        def decode_request(self, request):  # noqa: ANN001, ANN201 - LitServe passes the parsed JSON
            (inp,) = request["inputs"]
            x = torch.tensor(inp["data"], dtype=torch.float32).reshape(inp["shape"])
            return request.get("id"), x

        def batch(self, inputs):  # noqa: ANN001, ANN201
            ids = [i for i, _ in inputs]
            rows = [x.shape[0] for _, x in inputs]
            return ids, rows, torch.cat([x for _, x in inputs])

        def predict(self, x):  # noqa: ANN001, ANN201
            with torch.inference_mode():
                if len(x) == 2:  # not batched: (id, tensor)
                    return x[0], self.model(x[1])
                ids, rows, xs = x
                return ids, rows, self.model(xs)

        def unbatch(self, output):  # noqa: ANN001, ANN201
            ids, rows, ys = output
            return list(zip(ids, torch.split(ys, rows)))

        def encode_response(self, output):  # noqa: ANN001, ANN201
            request_id, y = output
            return {"id": request_id, "model_name": self.name, "outputs": [
                {"name": "output", "datatype": "FP32", "shape": list(y.shape), "data": y.reshape(-1).tolist()}]}

    OIPLitAPI.__module__ = "partrain.bench.serve"  # also when this file runs as __main__
    OIPLitAPI.__qualname__ = OIPLitAPI.__name__ = "OIPLitAPI"
    globals()["_OIPLitAPI"] = OIPLitAPI
    return OIPLitAPI


def __getattr__(name: str) -> Any:
    if name == "OIPLitAPI":
        return _lit_api_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def litserve_main(argv: list[str]) -> None:
    """Run LitServe for one model: ``NAME FACTORY PORT MAX_BATCH_SIZE BATCH_TIMEOUT THREADS``."""
    import litserve as ls

    name, factory, port, max_batch_size, batch_timeout, threads = argv
    torch.set_num_threads(int(threads))
    api = _lit_api_class()(name, factory, int(threads), max_batch_size=int(max_batch_size),
                           batch_timeout=float(batch_timeout))
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=30)
    metadata = {"name": name, "versions": ["1"], "platform": "pytorch",
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, *IMAGE[1:]]}],
                "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]}
    server.app.add_api_route(f"/v2/models/{name}", lambda: metadata, methods=["GET"])
    server.run(host="127.0.0.1", port=int(port), num_api_servers=1, log_level="warning",
               generate_client_file=False)


# --------------------------------------------------------------------------- measuring


@dataclass
class Point:
    model: str
    server: str
    concurrency: int
    throughput: float
    p50: float
    p99: float
    errors: int
    lost: int
    wrong: int
    client_cpu: float  # share of one core the load generator used (1.0: it may be the bottleneck)
    setting: str = ""


def _measure(url: str, name: str, samples: list, checker: Any, concurrency: int, duration: float,
             binary: bool) -> tuple[Any, float]:
    """One closed-loop load run; returns its report and the client's CPU share."""
    from ..serve.loadtest import LoadConfig, run_load

    cfg = LoadConfig(url=url, model=name, concurrency=concurrency, duration=duration, timeout=10.0,
                     binary=binary)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    report = run_load(cfg, samples=samples, checker=checker)
    return report, (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)


def _merge(reports: list[Any], cpus: list[float], concurrency: int) -> Point:
    """One point from several rounds: total answers over total time, percentiles over all latencies."""
    import numpy as np

    latencies = [x for r in reports for x in r.latencies]
    elapsed = sum(r.elapsed for r in reports)

    def pct(q: float) -> float:
        return float(np.percentile(latencies, q) * 1e3) if latencies else float("nan")

    return Point("", "", concurrency, len(latencies) / elapsed if elapsed > 0 else float("nan"),
                 pct(50), pct(99), sum(r.failed for r in reports), sum(r.lost for r in reports),
                 sum(r.wrong for r in reports), max(cpus))


@dataclass
class _Contender:
    server: str  # "adaptive" | "unbatched" | "litserve"
    setting: str
    label: str
    command: list[str]
    port: int
    ready: str
    binary: bool


def _measure_all(contenders: list[_Contender], name: str, samples: list, checker: Any,
                 args: argparse.Namespace) -> list[Point]:
    """Start every server of one model at once, then measure them in interleaved rounds.

    Round robin (every server at every concurrency, then again) spreads slow drifts
    of the machine (other jobs, thermal) over all servers instead of penalising
    whichever ran last. Idle servers cost next to nothing meanwhile.
    """
    with contextlib.ExitStack() as stack:
        urls = []
        for c in contenders:
            server = stack.enter_context(server_process(c.label, c.command, c.port, c.ready, args.threads,
                                                        args.start_timeout))
            urls.append(server.url)
        for c, url in zip(contenders, urls):
            _measure(url, name, samples, None, max(args.levels), args.warmup, c.binary)
        runs: dict[tuple[int, int], list[tuple[Any, float]]] = {}
        for _ in range(args.rounds):
            for level in args.levels:
                for i, (c, url) in enumerate(zip(contenders, urls)):
                    runs.setdefault((i, level), []).append(
                        _measure(url, name, samples, checker, level, args.duration / args.rounds, c.binary))
    points = []
    for i, c in enumerate(contenders):
        for level in args.levels:
            reports, cpus = zip(*runs[(i, level)])
            p = _merge(list(reports), list(cpus), level)
            p.model, p.server, p.setting = name, c.server, c.setting
            points.append(p)
            print(f"  {c.label:<28} c={level:<3} {p.throughput:8,.0f} req/s  p50 {p.p50:6.2f} ms  "
                  f"p99 {p.p99:6.2f} ms  errors {p.errors} lost {p.lost} wrong {p.wrong}", flush=True)
    return points


def _ours_available() -> bool:
    return importlib.util.find_spec("partrain.serve.cli") is not None


def _litserve_available() -> bool:
    return importlib.util.find_spec("litserve") is not None


def run(args: argparse.Namespace) -> dict[str, float]:
    from ..serve.loadtest import AnswerChecker, ModelInfo, TensorSpec, random_inputs

    names = (args.models or ("lenet" if args.quick else ",".join(MODELS))).split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise UsageError(f"Expected models among {sorted(MODELS)}. Received: {unknown}")
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise UsageError(f"Expected concurrencies like 1,16,64. Received: {args.concurrency!r}") from None
    if not args.levels or min(args.levels) < 1:
        raise UsageError(f"Expected positive concurrencies. Received: {args.concurrency!r}")
    if args.threads < 1:
        raise UsageError(f"Expected a positive number of threads. Received: --threads {args.threads}")
    args.duration = args.duration or (1.0 if args.quick else 4.0)
    args.warmup = args.warmup if args.warmup is not None else (0.3 if args.quick else 1.0)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.rounds < 1:
        raise UsageError(f"Expected a positive number of rounds. Received: --rounds {args.rounds}")
    grid = LITSERVE_GRID_QUICK if args.quick else LITSERVE_GRID

    torch.set_num_threads(1)
    points: list[Point] = []
    notes: list[str] = []
    ours = _ours_available()
    if not ours:
        notes.append("partrain serve: not available (partrain.serve.cli missing)")
    litserve = _litserve_available() and not args.no_litserve
    if not _litserve_available():
        notes.append("litserve: not installed (pip install litserve)")
    for note in notes:
        print(note)

    for name in names:
        factory = MODELS[name]
        info = ModelInfo(name, (TensorSpec("input", "FP32", (-1, *IMAGE[1:])),))
        samples = random_inputs(info, 64, IMAGE, seed=0)
        checker = AnswerChecker(build_model(factory), samples)
        print(f"{name}: {factory}, {args.threads} torch thread(s) per server, {args.duration:g} s per "
              f"point in {args.rounds} interleaved round(s)", flush=True)
        contenders = []
        if ours:
            for server, size in (("adaptive", args.max_batch_size), ("unbatched", 1)):
                port = free_port()
                contenders.append(_Contender(server, f"max {size}", f"partrain {server}", ours_command(
                    name, factory, port, size, args.threads), port, "/v2/health/ready", args.binary))
        if litserve:
            for size, timeout in grid:
                port = free_port()
                setting = f"max {size}, {timeout * 1e3:g} ms"
                contenders.append(_Contender("litserve", setting, f"litserve ({setting})", litserve_command(
                    name, factory, port, size, timeout, args.threads), port, "/health", False))
        measured = _measure_all(contenders, name, samples, checker, args)
        points += [p for p in measured if p.server != "litserve"]
        for c in args.levels:  # each concurrency keeps LitServe's best setting
            at_c = [p for p in measured if p.server == "litserve" and p.concurrency == c]
            if not at_c:
                continue
            best = max(at_c, key=lambda p: p.throughput)
            # wrong or lost answers at any setting count against LitServe, not only the best
            best.lost, best.wrong = sum(p.lost for p in at_c), sum(p.wrong for p in at_c)
            points.append(best)
    return _report(points, names, args.levels, notes)


def _report(points: list[Point], names: list[str], levels: list[int], notes: list[str]) -> dict[str, float]:
    figures: dict[str, float] = {}
    rows = []
    for p in points:
        rows.append([p.model, p.server, p.setting, p.concurrency, p.throughput, p.p50, p.p99,
                     p.errors, p.lost, p.wrong, round(p.client_cpu * 100)])
        key = f"{p.model}.{p.server}.c{p.concurrency}"
        figures.update({f"{key}.throughput_rps": p.throughput, f"{key}.p50_ms": p.p50,
                        f"{key}.p99_ms": p.p99, f"{key}.errors": p.errors, f"{key}.lost": p.lost,
                        f"{key}.wrong": p.wrong, f"{key}.client_cpu_pct": round(p.client_cpu * 100)})
    print()
    print(format_table(["model", "server", "setting", "conc", "req/s", "p50 ms", "p99 ms", "errors",
                        "lost", "wrong", "client cpu %"], rows))

    def find(model: str, server: str, c: int) -> Point | None:
        return next((p for p in points if (p.model, p.server, p.concurrency) == (model, server, c)), None)

    nan = float("nan")
    hi, lo = max(levels), min(levels)
    ratio_rows = []
    for name in names:
        a, u, ls = find(name, "adaptive", hi), find(name, "unbatched", hi), find(name, "litserve", hi)
        a1, u1 = find(name, "adaptive", lo), find(name, "unbatched", lo)
        speedup = a.throughput / u.throughput if a and u and u.throughput > 0 else nan
        vs_lit = a.throughput / ls.throughput if a and ls and ls.throughput > 0 else nan
        p50_diff = a1.p50 - u1.p50 if a1 and u1 else nan
        bad = sum(p.lost + p.wrong for p in points if p.model == name)
        ratio_rows += [
            [name, f"adaptive / unbatched req/s at c={hi}", f"{speedup:.2f}", ">= 5",
             _verdict(speedup, speedup >= 5)],
            [name, f"adaptive / litserve req/s at c={hi}", f"{vs_lit:.2f}", ">= 1.2",
             _verdict(vs_lit, vs_lit >= 1.2)],
            [name, f"p50 adaptive - unbatched at c={lo} (ms)", f"{p50_diff:+.2f}", "<= 1",
             _verdict(p50_diff, p50_diff <= 1)],
            [name, "lost + wrong answers (all servers)", str(bad), "0", _verdict(bad, bad == 0)],
        ]
        figures.update({f"{name}.adaptive_over_unbatched_c{hi}": speedup,
                        f"{name}.adaptive_over_litserve_c{hi}": vs_lit,
                        f"{name}.p50_adaptive_minus_unbatched_c{lo}_ms": p50_diff,
                        f"{name}.lost_plus_wrong": bad})
    print()
    print(format_table(["model", "ratio", "value", "goal", "met"], ratio_rows))
    for note in notes:
        print(note)
    return figures


def _verdict(value: float, ok: bool) -> str:
    if value != value:  # nan: a server of the comparison did not run
        return "-"
    return "yes" if ok else "NO"


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "litserve":
        litserve_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m partrain.bench.serve litserve NAME FACTORY PORT MAX_BATCH BATCH_TIMEOUT THREADS")
