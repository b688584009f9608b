"""Pipeline (model parallel) training vs one process and vs data parallel, and memory per stage.

One 2-process job trains the same model - ``layers`` blocks of ``Linear(width, width) + ReLU``
and a 10-way head - on the same global batch under every variant, in alternating rounds:

- ``single``: the whole model in one process (rank 0; rank 1 waits), 1 thread;
- ``allreduce``: 2 workers with half the batch each (DistributedDataParallel);
- ``pipeline``: 2 stages (cut by parameter count), each schedule at m = 8 micro-batches,
  ``gpipe`` and ``1f1b`` at every m in {1, 2, 4, 8, 16};
- ``raw torch``: a hand-written ``torch.distributed.pipelining`` script (``PipelineStage``,
  ``Schedule1F1B``, a mean loss, SGD) on the same cut at m = 8: what partrain's step costs on top.

A round's figure of a variant is the slower rank's mean step time (a pipeline step and an
all-reduce step finish together); tables show medians over rounds with their min-max spread.
*Utilisation* is the share of a pipeline step each stage spends computing (forward,
backward, loss; the rest is the bubble and messages), averaged over the stages, against the
ideal ``m / (m + p - 1)`` of a pipeline of p stages.

Memory: two more jobs in fresh processes (peak RSS is a process's lifetime high) train a
larger model of the same shape with Adam: every process holding the whole model, and a
2-stage pipeline whose processes build only their own stages (`Strategy.build_model`, as `fit`
builds). The figure is each process's peak RSS above its RSS before the model was built (the
interpreter and torch are the same in both; the pipeline's own imports count), and the raw
peak. Both jobs run as a user's do: partrain's allocator settings, nothing set for the
benchmark.

Serving: ``partrain serve --stages 2`` against the unsplit server, 16 closed-loop clients,
twice: the training rows' model from a ``module:factory``, and a model whose weights dominate
its processes (8 x ``Linear(8192)``: 2.1 GB of float32) from a ``partrain train``-format
checkpoint, where each stage process reads only its own layers' weights.

Goals: ``pipeline.utilisation_vs_ideal`` (1f1b at m = 8) >= 0.9; ``pipeline.memory_per_stage``
(a stage's peak / one process's) <= 0.6; ``pipeline.vs_raw_torch`` (raw step time / partrain's)
>= 0.95; ``pipeline.serve_memory_per_stage`` (the weight-dominated model: the largest stage
process's peak RSS / the unsplit server's) <= 0.6; ``pipeline.serve_vs_unsplit`` (its req/s
with 2 stages / unsplit) >= 0.5.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..checkpoint import save_checkpoint
from ..errors import UsageError
from ..launch import launch
from ..strategies.allreduce import AllReduce
from ..strategies.pipeline import Pipeline
from .harness import (
    Report,
    Spread,
    alternate,
    child_processes,
    paired_ratio,
    pick_size,
    positive_int,
    server_process,
)

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble",
                  "dualpipev")
MICROBATCHES = (1, 2, 4, 8, 16)
STAGES = 2


@dataclass(frozen=True)
class Size:
    width: int
    layers: int
    batch: int  # global batch
    steps: int  # timed steps per round
    rounds: int
    memory_width: int  # the memory jobs' model
    served_width: int  # the weight-dominated model served from a checkpoint (8 layers: 2.1 GB at 8192)
    sweep: tuple[int, ...]  # micro-batch counts for gpipe and 1f1b
    schedules: tuple[str, ...]


FULL = Size(width=1024, layers=8, batch=128, steps=4, rounds=5, memory_width=2048, served_width=8192,
            sweep=MICROBATCHES, schedules=SCHEDULE_NAMES)
QUICK = Size(width=512, layers=8, batch=64, steps=2, rounds=2, memory_width=1024, served_width=2048,
             sweep=(1, 8), schedules=SCHEDULE_NAMES)
TOY = Size(width=32, layers=8, batch=16, steps=1, rounds=1, memory_width=64, served_width=64, sweep=(8,),
           schedules=("1f1b",))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=positive_int, default=None, help="features of every layer (default 1024)")
    parser.add_argument("--layers", type=positive_int, default=None, help="Linear+ReLU blocks (default 8)")
    parser.add_argument("--batch", type=positive_int, default=None, help="global batch (default 128)")
    parser.add_argument("--steps", type=positive_int, default=None, help="timed steps per round (default 4)")
    parser.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 5)")


def served_model() -> nn.Sequential:
    """The model `partrain serve` loads for the serving rows (a factory takes no arguments:
    its size comes from the environment the benchmark starts the servers with)."""
    torch.manual_seed(0)
    return block_model(int(os.environ["PARTRAIN_BENCH_WIDTH"]), int(os.environ["PARTRAIN_BENCH_LAYERS"])).eval()


def block_model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def per_sample_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


# ----- the throughput job ---------------------------------------------------------------------
class _PipelineVariant:
    def __init__(self, env: Any, model_fn: Any, schedule: str, m: int, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe = Pipeline(stages=STAGES, microbatches=m, schedule=schedule)
        self.pipe.setup(env, timeout=300)
        model = model_fn()
        self.model, self.opt = self.pipe.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-4))
        self.x, self.y = x, y

    def step(self) -> None:
        self.pipe.train_step(self.model, self.opt, self.x, self.y, per_sample_ce, loss_scale=1 / len(self.y))

    def figures(self) -> tuple[float, float]:
        return self.pipe.compute_seconds, self.pipe.step_seconds


class _RawVariant:
    """torch.distributed.pipelining by hand: the same cut, 1F1B, a mean loss per micro-batch."""

    def __init__(self, env: Any, model_fn: Any, m: int, x: torch.Tensor, y: torch.Tensor) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from ..nn.split import chunk_ranges, plan_cuts, sequential_children

        children = sequential_children(model_fn())
        cuts = plan_cuts(children, STAGES, "params")
        mine = chunk_ranges(cuts, len(children))[env.rank]
        self.chunk = nn.Sequential(*(children[i][1] for i in mine))
        stage = PipelineStage(self.chunk, env.rank, STAGES, torch.device("cpu"))
        self.schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=F.cross_entropy)
        self.opt = torch.optim.SGD(self.chunk.parameters(), lr=1e-4)
        self.rank, self.x, self.y = env.rank, x, y

    def step(self) -> None:
        if self.rank == 0:
            self.schedule.step(self.x)
        else:
            self.schedule.step(target=self.y)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _WholeVariant:
    """One process (rank 0) on the whole batch, or DDP with half the batch on each rank."""

    def __init__(self, env: Any, model_fn: Any, x: torch.Tensor, y: torch.Tensor, ddp: bool) -> None:
        model = model_fn()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.active = ddp or env.rank == 0
        if ddp:
            strategy = AllReduce()
            strategy.setup(env, timeout=300)
            model, opt = strategy.prepare(model, opt)
            half = len(y) // 2
            x, y = x[env.rank * half:(env.rank + 1) * half], y[env.rank * half:(env.rank + 1) * half]
        self.model, self.opt, self.x, self.y = model, opt, x, y

    def step(self) -> None:
        if not self.active:
            return
        F.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _throughput_worker(strategy: Any, size: Size) -> dict[str, Any]:
    env = strategy.env
    model_fn = functools.partial(block_model, size.width, size.layers)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(size.batch, size.width, generator=g)
    y = torch.randint(0, 10, (size.batch,), generator=g)
    variants: dict[str, Any] = {"single": _WholeVariant(env, model_fn, x, y, ddp=False),
                                "allreduce": _WholeVariant(env, model_fn, x, y, ddp=True)}
    unavailable: dict[str, str] = {}
    wanted = [(s, 8) for s in size.schedules] + [(s, m) for s in ("gpipe", "1f1b") for m in size.sweep if m != 8]
    for schedule, m in wanted:
        name = f"{schedule} m={m}"
        try:
            variant = _PipelineVariant(env, model_fn, schedule, m, x, y)
            variant.step()  # warm-up: torch infers the shapes stages exchange at the first step
        except UsageError as exc:  # the same on both ranks: a schedule that refuses these options
            unavailable[name] = str(exc)
            continue
        variants[name] = variant
    variants["raw torch 1f1b m=8"] = _RawVariant(env, model_fn, 8, x, y)
    for variant in variants.values():
        variant.step()

    def timed(variant: Any) -> tuple[float, float]:
        dist.barrier()  # every rank starts the variant together: its messages pair up
        before = variant.figures() if isinstance(variant, _PipelineVariant) else (0.0, 0.0)
        start = time.perf_counter()
        for _ in range(size.steps):
            variant.step()
        seconds = (time.perf_counter() - start) / size.steps
        after = variant.figures() if isinstance(variant, _PipelineVariant) else (0.0, 0.0)
        step = after[1] - before[1]
        return seconds, (after[0] - before[0]) / step if step > 0 else float("nan")

    results = alternate({name: functools.partial(timed, v) for name, v in variants.items()}, size.rounds)
    return {"results": results, "unavailable": unavailable}


# ----- the memory jobs -------------------------------------------------------------------------
def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _memory_worker(strategy: Any, size: Size, pipeline: bool) -> tuple[float, float]:
    """(peak RSS above the RSS before the model, raw peak RSS), in MiB, after 3 Adam steps."""
    x = torch.randn(size.batch, size.memory_width)
    y = torch.randint(0, 10, (size.batch,))
    before = _rss_mb()
    build = functools.partial(block_model, size.memory_width, size.layers)
    model = strategy.build_model(build) if pipeline else build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if pipeline:
        model, optimizer = strategy.prepare(model, optimizer)
    for _ in range(3):
        if pipeline:
            strategy.train_step(model, optimizer, x, y, per_sample_ce, loss_scale=1 / len(y))
        else:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return _peak_mb() - before, _peak_mb()


# ----- the report --------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> Report:
    preset, smoke = pick_size(args, FULL, QUICK, TOY)
    size = Size(width=args.width or preset.width, layers=args.layers or preset.layers,
                batch=args.batch or preset.batch, steps=args.steps or preset.steps,
                rounds=args.rounds or preset.rounds, memory_width=preset.memory_width,
                served_width=preset.served_width, sweep=preset.sweep, schedules=preset.schedules)
    if size.batch % 32 and not smoke:
        raise UsageError(f"Expected --batch divisible by 32 (16 micro-batches of an even size). "
                         f"Received: {size.batch}")
    report = Report("pipeline", smoke=smoke)
    report.say(f"partrain bench pipeline: {size.layers} x Linear({size.width}, {size.width}) + ReLU + head, "
               f"global batch {size.batch}, {STAGES} processes x 1 thread, CPU, {size.rounds} alternating "
               f"rounds x {size.steps} steps")
    report.progress("throughput job (every variant in turns)")
    out = launch(_throughput_worker, size, workers=2, strategy=Pipeline(stages=STAGES), threads=1, timeout=600,
                 device="cpu")
    per_rank = [o["results"] for o in out]
    unavailable = out[0]["unavailable"]

    def seconds(name: str) -> list[float]:
        if name == "single":
            return [t for t, _ in per_rank[0][name]]  # rank 1 only waits
        return [max(a[0], b[0]) for a, b in zip(per_rank[0][name], per_rank[1][name])]

    def utilisation(name: str) -> Spread:
        return Spread.of([(a[1] + b[1]) / 2 for a, b in zip(per_rank[0][name], per_rank[1][name])])

    single, ddp = seconds("single"), seconds("allreduce")
    rows = []
    for name in [*per_rank[0], *unavailable]:
        if name in unavailable:
            rows.append([name, "n/a", "-", "-", "-", "-"])
            continue
        t = seconds(name)
        sps = Spread.of([size.batch / v for v in t])
        report.figure(f"samples_per_s[{name}]", sps)
        vs_single = paired_ratio(single, t)
        vs_ddp = paired_ratio(ddp, t)
        util, ideal = "-", "-"
        if name.split()[0] in SCHEDULE_NAMES:
            m = int(name.split("m=")[1])
            u = utilisation(name)
            report.figure(f"utilisation[{name}]", u)
            util, ideal = u.cell(), f"{m / (m + STAGES - 1):.2f}"
        rows.append([name, sps.cell(), vs_single.cell(), vs_ddp.cell(), util, ideal])
    report.table(["variant", "samples/s", "x single", "x allreduce", "utilisation", "ideal m/(m+p-1)"], rows,
                 title="training step (forward + backward + SGD step), samples/s median (min-max)")
    for name, why in unavailable.items():
        report.note(f"{name}: {why}")

    if "1f1b m=8" in per_rank[0]:
        u = utilisation("1f1b m=8")
        ratio = Spread.of([v / (8 / (8 + STAGES - 1)) for v in u.values])
        report.figure("utilisation_vs_ideal", ratio)
        report.goal("pipeline.utilisation_vs_ideal", ratio.median, ">=", 0.9,
                    "1f1b, m = 8: measured utilisation / ideal m/(m+p-1)")
        raw = paired_ratio(seconds("raw torch 1f1b m=8"), seconds("1f1b m=8"))
        report.figure("vs_raw_torch", raw)
        report.goal("pipeline.vs_raw_torch", raw.median, ">=", 0.95,
                    "hand-written torch.distributed.pipelining step / partrain's (1f1b, m = 8)")

    if getattr(args, "toy", False):  # the suite's smoke run: two more pairs of fresh processes cost seconds
        report.goal("pipeline.memory_per_stage", None, "<=", 0.6,
                    "the largest stage's peak RSS above its start / one process's (not at toy size)")
        report.note("serving a split model (partrain serve --stages): not measured at toy size")
        report.goal("pipeline.serve_memory_per_stage", None, "<=", 0.6,
                    "weight-dominated model: the largest stage process's peak RSS / the unsplit server's")
        report.goal("pipeline.serve_vs_unsplit", None, ">=", 0.5,
                    "weight-dominated model: --stages 2 req/s / the unsplit server's, 16 clients")
        return report
    report.progress("memory jobs (fresh processes: whole model, then 2 stages)")
    whole = launch(_memory_worker, size, False, workers=2, strategy="allreduce", threads=1, timeout=600,
                   device="cpu")
    stages = launch(_memory_worker, size, True, workers=2, strategy=Pipeline(stages=STAGES, microbatches=8),
                    threads=1, timeout=600, device="cpu")
    whole_net, whole_raw = max(w[0] for w in whole), max(w[1] for w in whole)
    stage_net, stage_raw = max(s[0] for s in stages), max(s[1] for s in stages)
    mem_rows = [["whole model, one process", f"{whole_net:.0f}", f"{whole_raw:.0f}", "1.00"]]
    for i, (net, raw_peak) in enumerate(stages):
        mem_rows.append([f"pipeline stage {i}", f"{net:.0f}", f"{raw_peak:.0f}", f"{net / whole_net:.2f}"])
    report.table(["process", "peak MiB above start", "peak RSS MiB", "x one process"], mem_rows,
                 title=f"memory: {size.layers} x Linear({size.memory_width}) + Adam, 3 steps, batch {size.batch}")
    for name, value in (("memory_whole_mb", whole_net), ("memory_stage_mb", stage_net),
                        ("memory_whole_raw_mb", whole_raw), ("memory_stage_raw_mb", stage_raw)):
        report.figure(name, value)
    report.goal("pipeline.memory_per_stage", stage_net / whole_net, "<=", 0.6,
                "the largest stage's peak RSS above its start / one process's")
    _serving(size, report, smoke)
    return report


SERVED = "m=partrain.bench.pipeline:served_model"
ANNOUNCE = re.compile(r"serving .* at (?P<url>https?://[^\s/]+)")


def _vm_kib(pid: int, key: str) -> float:
    """``VmHWM`` (peak RSS) or ``VmRSS`` of a process, in KiB (0 when it is gone)."""
    with contextlib.suppress(OSError):
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return float(line.split()[1])
    return 0.0


def _serving_processes(pid: int) -> list[int]:
    """``pid`` and every process below it that serves. The stage processes are children of the
    fork server, itself a child of the server; the fork server holds no part of the model (its
    RSS is an interpreter with torch imported) and is left out. Its children are forks of it,
    with its command line: a process is the fork server when its command line names the fork
    server and its parent's does not."""

    def forkserver(p: int) -> bool:
        with contextlib.suppress(OSError):
            return b"forkserver" in open(f"/proc/{p}/cmdline", "rb").read()
        return False

    found, todo = [pid], [pid]
    while todo:
        parent = todo.pop(0)
        for child in child_processes(parent):
            todo.append(child)
            if not (forkserver(child) and not forkserver(parent)):
                found.append(child)
    return found


def _serving(size: Size, report: Report, smoke: bool) -> None:
    """`partrain serve --stages 2` against the unsplit model on the same 2 cores, twice: the
    training rows' model from a factory, and a model whose weights dominate its processes
    (``served_width``) from a ``partrain train``-format checkpoint (each stage reads only its
    own layers). Req/s, p50 and peak RSS per process, 16 closed-loop clients, alternating
    rounds, answers checked."""
    # the servers run with the environment a user has: their threads come from --threads alone
    env = dict(os.environ, PYTHONUNBUFFERED="1", PARTRAIN_BENCH_WIDTH=str(size.width),
               PARTRAIN_BENCH_LAYERS=str(size.layers))
    os.environ["PARTRAIN_BENCH_WIDTH"], os.environ["PARTRAIN_BENCH_LAYERS"] = str(size.width), str(size.layers)
    small = _serve_rows(report, SERVED, served_model(), size.width, env, smoke, size,
                        f"{size.layers} x Linear({size.width}) from a module:factory")
    report.figure("serve_stages_vs_unsplit", small[0])
    with tempfile.TemporaryDirectory(prefix="partrain-bench-pipeline-") as tmp:
        path = os.path.join(tmp, "served.pt")
        large = block_model(size.served_width, size.layers).eval()
        save_checkpoint(path, {"model": large.state_dict(), "model_spec": {
            "name": "partrain.bench.pipeline:block_model",
            "kwargs": {"width": size.served_width, "layers": size.layers}}})
        weights_mb = sum(p.numel() * p.element_size() for p in large.parameters()) / 2**20
        vs_unsplit, memory = _serve_rows(report, f"m={path}", large, size.served_width, env, smoke, size,
                                         f"{size.layers} x Linear({size.served_width}) from a checkpoint "
                                         f"({weights_mb:,.0f} MiB of float32 weights)")
        del large
    report.figure("serve_weights_mb", weights_mb)
    report.goal("pipeline.serve_memory_per_stage", memory, "<=", 0.6,
                "weight-dominated model: the largest stage process's peak RSS / the unsplit server's")
    report.goal("pipeline.serve_vs_unsplit", vs_unsplit, ">=", 0.5,
                "weight-dominated model: --stages 2 req/s / the unsplit server's, 16 clients")


def _serve_rows(report: Report, model_arg: str, reference: nn.Module, width: int, env: dict[str, str],
                smoke: bool, size: Size, title: str) -> tuple[Spread, float]:
    """One pair of servers (unsplit, 2 stages) of ``model_arg`` under the same load: their table, and
    (stages' req/s over the unsplit server's, round by round; the largest stage's peak RSS over the
    unsplit server's)."""
    from ..serve.loadtest import (
        AnswerChecker,
        LoadConfig,
        ModelInfo,
        TensorSpec,
        random_inputs,
        run_load,
    )

    base = (sys.executable, "-m", "partrain", "serve", model_arg, "--port", "0", "--max-batch-size", "64")
    variants = {"unsplit, 1 process x 2 threads": (*base, "--threads", "2"),
                "--stages 2 --microbatches 4, 2 x 1 thread": (*base, "--stages", "2", "--microbatches", "4",
                                                              "--threads", "1")}
    info = ModelInfo("m", (TensorSpec("input", "FP32", (-1, width)),))
    samples = random_inputs(info, 64, (1, width), seed=0)
    checker = AnswerChecker(reference, samples)
    duration = 3.0 if smoke else 8.0
    report.progress(f"serving {title}: the unsplit model and --stages 2 (16 clients, alternating rounds)")
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(server_process(name, cmd, ANNOUNCE, ready_path="/v2/health/ready",
                                                            env=env, start_timeout=300))
                   for name, cmd in variants.items()}

        def load(name: str) -> Any:
            cfg = LoadConfig(url=servers[name].url, model="m", concurrency=16, duration=duration, timeout=60.0)
            return run_load(cfg, samples=samples, checker=checker)

        for name in servers:
            load(name)  # warm-up
        runs = alternate({name: functools.partial(load, name) for name in servers}, max(2, size.rounds // 2),
                         on_result=lambda r, name, res: report.progress(
                             f"round {r + 1}: {name}: {res.throughput:,.0f} req/s"))
        peaks = {}
        for name, server in servers.items():
            pids = _serving_processes(server.process.pid)
            peaks[name] = [_vm_kib(pid, "VmHWM") / 1024 for pid in pids if _vm_kib(pid, "VmRSS") > 50 * 1024]
    rows, key = [], "small" if model_arg == SERVED else "checkpoint"
    for name in variants:
        reports = runs[name]
        rate = Spread.of([r.throughput for r in reports])
        latencies = sorted(x for r in reports for x in r.latencies)
        p50 = latencies[len(latencies) // 2] * 1e3 if latencies else float("nan")
        bad = sum(r.failed + r.lost + r.wrong for r in reports)
        rows.append([name, rate.cell(), f"{p50:.1f}", ", ".join(f"{p:.0f}" for p in peaks[name]), str(bad)])
        suffix = "" if key == "small" else f"[{key}]"
        report.figure(f"serve_req_per_s[{name}]{suffix}", rate)
        report.figure(f"serve_p50_ms[{name}]{suffix}", p50)
    report.table(["server", "req/s median (min-max)", "p50 ms", "peak RSS MiB per process", "failed/lost/wrong"],
                 rows, title=f"serving {title} over HTTP: the unsplit model vs 2 stages")
    whole_name, split_name = list(variants)
    ratio = paired_ratio([r.throughput for r in runs[split_name]], [r.throughput for r in runs[whole_name]])
    whole_peak = max(peaks[whole_name], default=float("nan"))
    memory = max(peaks[split_name], default=float("nan")) / whole_peak if whole_peak else float("nan")
    return ratio, memory
