"""Engines: the same training job under partrain's launcher, torchrun (1 and 2 nodes) and Ray Train.

One job, ``partrain train --model mlp --dataset synthetic`` with 2 workers of one
intra-op thread each and a checkpoint every STEPS optimizer steps (``--resume auto``),
runs as a fresh process tree per measurement, in alternating rounds:

  partrain.launch      ``partrain train --workers 2`` (partrain starts its own workers)
  torchrun standalone  ``torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m partrain train``
  torchrun 2 nodes     two torchrun agents on 127.0.0.1, ``--nnodes 2 --node-rank 0/1
                       --rdzv-backend c10d``, one worker each
  Ray Train            ``ray.train.torch.TorchTrainer`` with 2 CPU workers whose train
                       function runs the same ``partrain train`` command (only where ray
                       imports; otherwise not measured, and said so)
  torchrun, 1 killed   torchrun standalone as above, one worker SIGKILLed mid-run; torchrun
                       restarts both and the job resumes from its last checkpoint

Figures of a run: steady samples/s, the median of the epochs after the first as
rank 0 wrote them to ``OUT/metrics.jsonl`` (start-up excluded); start-up seconds, from
starting the command to the start of the first epoch: the moment the first epoch's
row appears in ``metrics.jsonl`` minus that epoch's training seconds (so it includes
the first epoch's evaluation and file writes, the same for every engine); wall seconds.

Recovery (the killed run): the kill comes half a checkpoint interval after a
checkpoint of the second epoch (the interval: the longest gap between the checkpoints
seen since the first epoch's row). *Restart* is the time from the kill to training
again: the first checkpoint written after the kill (its mtime and optimizer step, read
back) minus the kill time, minus the time the steps since the resumed checkpoint take
at the paired uninterrupted torchrun run's samples/s. *Since checkpoint* is the time
from the last checkpoint's write to the kill: the work that is redone. *Time lost* =
restart + since checkpoint. The killed run's wall time minus the paired uninterrupted
run's is shown too (it says the same, with both runs' start-up noise in it).

Goals: engines.torchrun_vs_launch (torchrun standalone / partrain.launch samples/s)
>= 0.9, engines.ray_vs_launch (Ray Train / partrain.launch) >= 0.9,
engines.recovery_s (time lost, median) <= 30 + the median seconds since checkpoint
(i.e. a restart within 30 s).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import UsageError
from .harness import (
    Report,
    Spread,
    alternate,
    child_processes,
    paired_ratio,
    pick_size,
    positive_int,
    stop_process_group,
)

RUN_TIMEOUT = 600.0  # seconds one measured run may take before it is stopped
POLL = 0.02  # seconds between looks at a run's files (a cheap stat)


@dataclass(frozen=True)
class Workload:
    samples: int  # synthetic samples (5% held out for evaluation)
    epochs: int
    batch: int  # per worker
    checkpoint_every: int  # optimizer steps


@dataclass(frozen=True)
class Size:
    work: Workload
    rounds: int
    two_nodes: bool  # measure torchrun with 2 nodes
    recovery: bool  # measure the killed-worker run
    ray: bool = True  # measure Ray Train where ray imports (its start-up alone is ~20 s)
    torchrun: bool = True  # the suite's toy run leaves it out (tests/test_elastic.py runs torchrun)


FULL = Size(Workload(40000, 5, 32, 150), rounds=3, two_nodes=True, recovery=True)
QUICK = Size(Workload(8000, 3, 32, 30), rounds=1, two_nodes=True, recovery=True)
TOY = Size(Workload(512, 2, 32, 4), rounds=1, two_nodes=False, recovery=False, ray=False, torchrun=False)

LAUNCH = "partrain.launch"
TORCHRUN = "torchrun standalone"
TWO_NODES = "torchrun 2 nodes (127.0.0.1)"
RAY = "Ray Train (TorchTrainer)"
KILLED = "torchrun standalone, 1 worker killed"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=positive_int, default=None,
                   help="synthetic samples (default 40000, quick 8000)")
    p.add_argument("--epochs", type=positive_int, default=None, help="epochs per run, >= 3 for the recovery "
                   "run (default 5, quick 3)")
    p.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 3, quick 1)")
    p.add_argument("--checkpoint-every", type=positive_int, default=None,
                   help="optimizer steps between checkpoints (default 150, quick 30)")
    p.add_argument("--no-ray", action="store_true", help="skip Ray Train")


def _size(args: argparse.Namespace) -> tuple[Size, bool]:
    size, smoke = pick_size(args, FULL, QUICK, TOY)
    changes = {k: v for k, v in (("samples", args.samples), ("epochs", args.epochs),
                                 ("checkpoint_every", args.checkpoint_every)) if v}
    return replace(size, work=replace(size.work, **changes), rounds=args.rounds or size.rounds), smoke


# ----- one run ---------------------------------------------------------------------
@dataclass
class Run:
    """What one measured run left: its epoch rows, wall seconds, first-row time (s after start)."""

    rows: list[dict[str, Any]]
    wall: float
    first_row_at: float
    killed: dict[str, float] | None = None  # since_checkpoint (s) where a worker was killed
    #: the synthetic samples the run trained on (a killed run ends longer when the kill came too late)
    samples: int = 0

    @property
    def rate(self) -> float:
        """Median samples/s over the epochs after the first (all epochs when there is one)."""
        steady = [r["samples_per_s"] for r in self.rows[1:]] or [r["samples_per_s"] for r in self.rows]
        return statistics.median(steady) if steady else float("nan")

    @property
    def startup(self) -> float:
        return self.first_row_at - self.rows[0]["seconds"] if self.rows else float("nan")


def _train_args(work: Workload, out: str) -> list[str]:
    return ["train", "--model", "mlp", "--dataset", "synthetic", "--synthetic-samples", str(work.samples),
            "--synthetic-shape", "1,8,8", "--test-fraction", "0.05", "--epochs", str(work.epochs),
            "--batch-size", str(work.batch), "--threads", "1", "--seed", "0", "--quiet", "--timeout", "120",
            "--checkpoint-every", str(work.checkpoint_every), "--resume", "auto", "--out", out]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *options, "-m", "partrain"]


def _commands(engine: str, work: Workload, out: str) -> list[list[str]]:
    train = _train_args(work, out)
    if engine == LAUNCH:
        return [[sys.executable, "-m", "partrain", *train, "--workers", "2"]]
    if engine in (TORCHRUN, KILLED):
        return [_torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1") + train]
    if engine == TWO_NODES:
        # the port is free now; the c10d store on node 0 binds it moments later (`measure`
        # tries again on a new port when another process took it in between)
        endpoint = f"127.0.0.1:{_free_port()}"
        return [_torchrun("--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "bench",
                          "--max-restarts", "1") + train for rank in (0, 1)]
    if engine == RAY:
        return [[sys.executable, "-m", "partrain.bench.engines", "ray-driver", *train]]
    raise ValueError(f"Expected an engine. Received: {engine!r}")


def measure(engine: str, work: Workload) -> Run:
    """Run ``engine`` once in a fresh output directory; kill a worker when ``engine`` is `KILLED`.

    A killed run that ended before its kill landed (a machine fast enough for the whole run
    to fit between the checkpoints the kill waits for) runs again with twice the samples, up to
    twice; after that its ``killed`` is None (the recovery is then reported as not measured)."""
    for attempt in range(3):
        try:
            return _measure(engine, work)
        except _PortTaken:
            if attempt == 2:
                raise
        except _NoKill as exc:
            if attempt == 2:
                return exc.run
            work = replace(work, samples=2 * work.samples)
    raise AssertionError("unreachable")


class _PortTaken(RuntimeError):
    """The rendezvous port chosen for the 2-node run was taken before its store bound it."""


class _NoKill(RuntimeError):
    """The killed run ended before a worker was killed and a checkpoint written after it."""

    def __init__(self, run: Run) -> None:
        super().__init__("the run ended before its kill")
        self.run = run


def _measure(engine: str, work: Workload) -> Run:
    with tempfile.TemporaryDirectory(prefix="partrain-bench-engines-") as tmp:
        out = os.path.join(tmp, "run")
        logs = [open(os.path.join(tmp, f"log{i}"), "w+") for i in range(2)]  # noqa: SIM115
        start = time.monotonic()
        procs = [subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                 for cmd, log in zip(_commands(engine, work, out), logs)]
        try:
            watch = _Watch(out, start)
            killed = None
            deadline = start + RUN_TIMEOUT
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{engine}: no end within {RUN_TIMEOUT:g} s:\n{_tail(logs)}")
                watch.look()
                if engine == KILLED:
                    if killed is None:
                        killed = _maybe_kill(procs[0].pid, watch)
                    elif "back_at" not in killed:
                        _back(watch, killed)
                time.sleep(POLL)  # polling interval of the files' watcher
            wall = time.monotonic() - start
            watch.look()
            failed = [p.returncode for p in procs if p.returncode != 0]
            if failed and engine == TWO_NODES and "address already in use" in _tail(logs, 200).lower():
                raise _PortTaken(_tail(logs))
            if failed:
                raise RuntimeError(f"{engine}: exit status {failed[0]}:\n{_tail(logs)}")
            rows = _rows(os.path.join(out, "metrics.jsonl"))
            if watch.first_row_at is None or len(rows) != work.epochs:
                raise RuntimeError(f"{engine}: expected {work.epochs} epoch rows, found {len(rows)}:\n{_tail(logs)}")
            if engine == KILLED and (killed is None or "back_at" not in killed):
                raise _NoKill(Run(rows, wall, watch.first_row_at, None, work.samples))
            return Run(rows, wall, watch.first_row_at, killed, work.samples)
        finally:
            for p in procs:
                if p.poll() is None:
                    stop_process_group(p)
            for log in logs:
                log.close()


class _Watch:
    """The times (s after the start) at which metrics.jsonl first appeared and checkpoint.pt changed."""

    def __init__(self, out: str, start: float) -> None:
        self.metrics = os.path.join(out, "metrics.jsonl")
        self.checkpoint = os.path.join(out, "checkpoint.pt")
        self.start = start
        self.first_row_at: float | None = None
        self.checkpoints: list[float] = []  # wall-clock mtimes (time.time) of checkpoints seen after row 1
        self._last_mtime: float | None = None

    def look(self) -> None:
        if self.first_row_at is None:
            if not os.path.exists(self.metrics):
                return
            self.first_row_at = time.monotonic() - self.start
        with contextlib.suppress(OSError):
            mtime = os.stat(self.checkpoint).st_mtime
            if mtime != self._last_mtime:
                self.checkpoints.append(mtime)
                self._last_mtime = mtime


def _maybe_kill(agent: int, watch: _Watch) -> dict[str, float] | None:
    """SIGKILL one worker of ``agent`` half a checkpoint interval after the third checkpoint seen
    since the first epoch's row (two intervals into epoch 2); return the seconds since that checkpoint."""
    if len(watch.checkpoints) < 3:
        return None
    last = watch.checkpoints[-1]
    # the longest gap seen: an epoch's end checkpoint can come a step or two before a mid-epoch one
    interval = max(b - a for a, b in zip(watch.checkpoints, watch.checkpoints[1:]))
    if time.time() < last + interval / 2:
        return None
    workers = child_processes(agent)
    if len(workers) != 2:
        return None  # between attempts or at the end: look again
    os.kill(workers[-1], signal.SIGKILL)
    killed_at = time.time()
    step = _checkpoint_step(watch.checkpoint, last)
    if step is None:  # a checkpoint came between the look and the kill: measure from that one
        last = os.stat(watch.checkpoint).st_mtime
        step = _checkpoint_step(watch.checkpoint, last)
    return {"since_checkpoint": killed_at - last, "killed_at": killed_at, "step": float(step or 0)}


def _back(watch: _Watch, killed: dict[str, float]) -> None:
    """Record the first checkpoint written after the kill: its time and optimizer step."""
    with contextlib.suppress(OSError):
        mtime = os.stat(watch.checkpoint).st_mtime
        if mtime > killed["killed_at"] and (step := _checkpoint_step(watch.checkpoint, mtime)) is not None:
            killed["back_at"], killed["back_step"] = mtime, float(step)


def _checkpoint_step(path: str, mtime: float) -> int | None:
    """The optimizer step of the checkpoint at ``path`` if it is still the one of ``mtime``."""
    from ..checkpoint import load_checkpoint

    step = load_checkpoint(path)["step"]
    return int(step) if os.stat(path).st_mtime == mtime else None


def _rows(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _tail(logs: Sequence[Any], lines: int = 15) -> str:
    text = []
    for log in logs:
        log.flush()
        log.seek(0)
        text.append("".join(log.readlines()[-lines:]))
    return "\n".join(t for t in text if t)


# ----- Ray Train ---------------------------------------------------------------------
def _ray_train(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function: the same ``partrain train`` command (which calls partrain.fit)."""
    from partrain.cli import main

    code = main(config["argv"])
    if code != 0:
        raise RuntimeError(f"partrain {' '.join(config['argv'])} exited with status {code}")


def _ray_driver(argv: list[str]) -> None:
    """Run ``partrain <argv>`` as a TorchTrainer with 2 CPU workers on a local Ray of 2 CPUs."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    try:
        with tempfile.TemporaryDirectory(prefix="partrain-bench-ray-") as storage:
            trainer = TorchTrainer(_ray_train, train_loop_config={"argv": argv},
                                   scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                                resources_per_worker={"CPU": 1}),
                                   run_config=RunConfig(storage_path=storage, name="engines"))
            trainer.fit()
    finally:
        ray.shutdown()


# ----- the benchmark -------------------------------------------------------------------
def run(args: argparse.Namespace) -> Report:
    size, smoke = _size(args)
    work = size.work
    report = Report("engines", smoke=smoke)
    installed = importlib.util.find_spec("ray") is not None
    with_ray = size.ray and not args.no_ray and installed
    report.say(f"partrain bench engines: mlp on {work.samples} synthetic samples, {work.epochs} epochs, batch "
               f"{work.batch}/worker, 2 workers x 1 thread, checkpoint every {work.checkpoint_every} steps, "
               f"{size.rounds} alternating rounds")
    engines = [LAUNCH] + ([TORCHRUN] if size.torchrun else []) + ([TWO_NODES] if size.two_nodes else []) \
        + ([RAY] if with_ray else []) \
        + ([KILLED] if size.recovery else [])
    if work.epochs < 3 and size.recovery:
        report.note("recovery: not measured (it needs --epochs >= 3)")
        engines.remove(KILLED)
    steps = int(work.samples * 0.95) // (2 * work.batch) * (work.epochs - 1)  # steps after the first epoch
    if KILLED in engines and 4 * work.checkpoint_every > steps:
        raise UsageError(f"Expected --checkpoint-every at most {steps // 4} (a quarter of the {steps} steps after "
                         f"the first epoch: the killed run needs checkpoints before and after the kill). "
                         f"Received: {work.checkpoint_every}")
    variants: dict[str, Callable[[], Run]] = {e: (lambda e=e: measure(e, work)) for e in engines}
    runs = alternate(variants, size.rounds, on_result=lambda r, name, v: report.progress(
        f"round {r + 1}: {name}: {v.rate:,.0f} samples/s, start-up {v.startup:.1f} s, wall {v.wall:.1f} s"))

    launch_rates = [r.rate for r in runs[LAUNCH]]
    ratios = {e: paired_ratio([r.rate for r in runs[e]], launch_rates) for e in engines if e != KILLED}
    rows = []
    for engine in engines:
        if engine == KILLED:
            continue
        rate, startup = Spread.of([r.rate for r in runs[engine]]), Spread.of([r.startup for r in runs[engine]])
        wall = Spread.of([r.wall for r in runs[engine]])
        key = _key(engine)
        report.figure(f"{key}_samples_per_s", rate)
        report.figure(f"{key}_startup_s", startup)
        report.figure(f"{key}_wall_s", wall)
        report.figure(f"ratio_{key}_vs_launch", ratios[engine])
        rows.append([engine, rate.cell(), ratios[engine].cell() if engine != LAUNCH else "", startup.cell(),
                     wall.cell()])
    report.table(["engine", "samples/s median (min-max)", "/ partrain.launch", "start-up s", "wall s"], rows)

    if TORCHRUN in engines:
        report.goal("engines.torchrun_vs_launch", ratios[TORCHRUN].median, ">=", 0.9,
                    "torchrun standalone / partrain.launch, samples/s")
    else:
        report.note("torchrun: not measured at this size; engines.torchrun_vs_launch not measured")
        report.goal("engines.torchrun_vs_launch", None, ">=", 0.9, "torchrun standalone / partrain.launch, samples/s")
    if with_ray:
        report.goal("engines.ray_vs_launch", ratios[RAY].median, ">=", 0.9, "Ray Train / partrain.launch, samples/s")
    else:
        why = ("skipped (--no-ray)" if args.no_ray
               else "not measured: ray not installed (pip install 'partrain[ray]')" if not installed
               else "not measured at this size (its start-up alone is ~20 s)")
        report.note(f"Ray Train: {why}; engines.ray_vs_launch not measured")
        report.goal("engines.ray_vs_launch", None, ">=", 0.9, "Ray Train / partrain.launch, samples/s")

    if KILLED in engines:
        landed = [(k, t) for k, t in zip(runs[KILLED], runs[TORCHRUN]) if k.killed is not None]
        longer = sorted({k.samples for k, _ in landed if k.samples != work.samples})
        if longer:
            report.note(f"recovery: at {work.samples:,} samples the killed run ended before its kill landed on this "
                        f"machine; it ran again with {', '.join(f'{s:,}' for s in longer)} samples (its wall "
                        "difference then compares runs of different lengths)")
        if not landed:
            report.note(f"recovery: not measured: even at {4 * work.samples:,} samples every killed run ended before "
                        "a worker was killed and a checkpoint written after it (more --samples)")
            engines.remove(KILLED)
    if KILLED in engines:
        kills = [k.killed for k, _ in landed]
        runs_killed, runs_whole = [k for k, _ in landed], [t for _, t in landed]
        # seconds per optimizer step (2 workers x batch samples) at the paired uninterrupted run's rate
        step_s = [2 * work.batch / t.rate for t in runs_whole]
        restart = [k["back_at"] - k["killed_at"] - (k["back_step"] - k["step"]) * s  # type: ignore[index]
                   for k, s in zip(kills, step_s)]
        since = [k["since_checkpoint"] for k in kills]  # type: ignore[index]
        lost = [a + b for a, b in zip(restart, since)]
        wall = [k.wall - t.wall for k, t in zip(runs_killed, runs_whole)]
        lost_s, since_s, restart_s, wall_s = Spread.of(lost), Spread.of(since), Spread.of(restart), Spread.of(wall)
        report.figure("recovery_time_lost_s", lost_s)
        report.figure("recovery_since_checkpoint_s", since_s)
        report.figure("recovery_restart_s", restart_s)
        report.figure("recovery_wall_difference_s", wall_s)
        report.table(["killed worker (torchrun --max-restarts 1)", "seconds median (min-max)"],
                     [["restart: kill to training again", restart_s.cell()],
                      ["since the last checkpoint at the kill (redone)", since_s.cell()],
                      ["time lost: restart + redone", lost_s.cell()],
                      ["wall - uninterrupted wall (noisier)", wall_s.cell()]])
        target = 30.0 + since_s.median
        report.goal("engines.recovery_s", lost_s.median, "<=", target,
                    f"time lost to 1 killed worker, s (target 30 + {since_s.median:.2f} s since checkpoint)")
    else:
        if not (size.recovery and work.epochs >= 3):  # else the line above said why
            report.note("recovery: not measured at this size; engines.recovery_s not measured")
        report.goal("engines.recovery_s", None, "<=", 30.0, "time lost to 1 killed worker, s (30 + since checkpoint)")
    return report


def _key(label: str) -> str:
    return "_".join("".join(c if c.isalnum() else " " for c in label.lower()).split())


if __name__ == "__main__":  # python -m partrain.bench.engines ray-driver TRAIN-ARGS: the Ray variant's driver
    if sys.argv[1:2] != ["ray-driver"]:
        raise SystemExit("usage: python -m partrain.bench.engines ray-driver train ARGS...")
    _ray_driver(sys.argv[2:])
