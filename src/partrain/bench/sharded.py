"""Sharded data parallel (fsdp) against allreduce on the built-in GPT, and tensor parallel (tp) scaling.

Every job runs 2 processes of 1 thread on the CPU, Adam, random tokens (vocabulary 256):

- *step job* (one job, both variants in alternating rounds): ``allreduce`` (DDP) and ``fsdp``
  (FSDP2, ZeRO-3, the GPT's blocks as units; the strategy maps blocks from 8 MiB up, see
  `partrain.strategies.fsdp.SHARD_MMAP_THRESHOLD`) train the same GPT on the same global batch.
  A round's figure is the slower rank's mean step time; samples/s = global batch / it. After
  the rounds each process counts its persistent state (`partrain.memory.state_bytes`:
  parameters, gradients, Adam's moments, as the run's ``memory_*`` columns count them).
- *memory jobs* (fresh processes per measurement: peak RSS is a process's lifetime high):
  a larger GPT, 3 steps on a small batch, built as `fit` builds it (the strategy's
  ``build_model``: whole under allreduce, each process its shards under fsdp; then its
  ``prepare``). The figure is each process's peak RSS above its RSS before the model was
  built (the interpreter and torch are the same in both), and the raw peak. No allocator
  setting is changed by the benchmark: the processes run with what `launch` gives a user.
- *largest model*: the same job, under a fixed per-process budget of memory. The budget is
  enforced by measurement: a width fits when every process's peak RSS above its start stays
  within it (RLIMIT_AS is not a budget of memory with torch: a process that imported it has
  reserved about 3x the address space it touches - 713 MB against 229 MB resident here - and
  each thread's glibc arena reserves 64 MiB more, so such a limit fails runs that fit). A job stops at
  the first step after which a process is over the budget; a width whose float32 parameters
  alone exceed it is over without a run. Widths are searched per strategy from ``first_width`` by
  doubling until one does not fit, then by bisection to ``resolution`` (a multiple of the
  heads), each trial in fresh processes. Note: with a fixed depth the state grows with the
  square of the width, so 2 shards (at most half the state) let the width grow by at most
  about sqrt(2); the parameter ratio is shown beside it.
- *tp job*: a wide GPT block stack (compute dominates: wide matrices, few tokens moved)
  trained by one process (rank 0; rank 1 waits) and by ``tp`` over both processes
  (attention heads and the MLP split column/row-wise), alternating rounds.

Goals: ``sharded.state_memory`` (fsdp's per-rank bytes of parameters + gradients + Adam state
/ allreduce's, the largest rank of each) <= 0.55; ``sharded.peak_memory`` (fsdp's peak RSS above
start / allreduce's, the largest rank of each) <= 0.65; ``sharded.largest_model`` (largest
width that fits the budget with fsdp / with allreduce) >= 1.8; ``sharded.step_vs_allreduce``
(fsdp samples/s / allreduce's, round by round) >= 0.8; ``tp.scaling`` (tp on 2 processes /
one process, samples/s) >= 1.4.
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..launch import launch
from ..memory import current_rss_bytes, peak_rss_bytes, state_bytes
from ..models import gpt
from ..strategies import get_strategy
from .harness import Report, Spread, alternate, paired_ratio, pick_size, positive_int

VOCAB = 256
WORKERS = 2
MiB = 2**20
TIMEOUT = 900  # seconds for every rendezvous and collective of a job


@dataclass(frozen=True)
class Shape:
    """One GPT and the batch it trains on."""

    width: int
    layers: int
    heads: int
    seq: int
    batch: int  # global batch (sequences); each of the 2 data-parallel workers takes half

    def model(self, width: int | None = None) -> Any:
        torch.manual_seed(0)
        return gpt(vocab_size=VOCAB, n_layer=self.layers, n_head=self.heads, n_embd=width or self.width,
                   block_size=self.seq)

    def parameters(self, width: int | None = None) -> int:
        """The GPT's parameter count at ``width`` (counted on the meta device: nothing allocated)."""
        with torch.device("meta"):
            model = gpt(vocab_size=VOCAB, n_layer=self.layers, n_head=self.heads, n_embd=width or self.width,
                        block_size=self.seq)
        return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class Size:
    step: Shape  # the step job
    steps: int  # timed steps per round
    rounds: int
    memory: Shape  # the memory jobs' GPT (and the largest-model search's depth, sequence and batch)
    memory_steps: int
    budget_mb: float  # the largest-model search's per-process budget (peak RSS above start)
    first_width: int
    resolution: int
    max_trials: int  # per strategy
    tp: Shape  # the tp job's GPT (one batch on both processes)


FULL = Size(step=Shape(512, 4, 8, 128, 16), steps=4, rounds=5,
            memory=Shape(1024, 8, 8, 64, 4), memory_steps=3,
            budget_mb=1000, first_width=128, resolution=32, max_trials=14,
            tp=Shape(1024, 2, 8, 128, 8))
QUICK = Size(step=Shape(256, 2, 4, 64, 8), steps=2, rounds=2,
             memory=Shape(512, 4, 4, 32, 4), memory_steps=2,
             budget_mb=150, first_width=64, resolution=64, max_trials=7,
             tp=Shape(512, 2, 8, 64, 8))
TOY = Size(step=Shape(32, 2, 2, 16, 4), steps=1, rounds=1,
           memory=Shape(64, 2, 2, 16, 4), memory_steps=1,
           budget_mb=30, first_width=32, resolution=32, max_trials=2,
           tp=Shape(64, 1, 2, 16, 4))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 5)")
    parser.add_argument("--steps", type=positive_int, default=None, help="timed steps per round (default 4)")
    parser.add_argument("--budget-mb", type=positive_int, default=None,
                        help="the largest-model search's per-process budget, MiB of peak RSS above start "
                             "(default 1000)")


# ----- pieces every job uses ------------------------------------------------------------------
def tokens(shape: Shape, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of random token sequences: inputs and the next tokens."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, VOCAB, (shape.batch, shape.seq + 1), generator=g)
    return seqs[:, :-1], seqs[:, 1:]


def per_sequence_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean next-token loss (per-sample losses, as `Strategy.train_step` takes)."""
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)


def _half(t: torch.Tensor, rank: int) -> torch.Tensor:
    n = len(t) // WORKERS
    return t[rank * n:(rank + 1) * n]


class _Variant:
    """One strategy's model and optimizer on this process; `step` is one training step."""

    def __init__(self, strategy: Any, shape: Shape, x: torch.Tensor, y: torch.Tensor, active: bool = True) -> None:
        torch.manual_seed(0)  # as `fit` seeds every worker
        model = strategy.build_model(shape.model) if active else shape.model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        self.strategy, self.active, self.x, self.y = strategy, active, x, y
        self.model, self.optimizer = strategy.prepare(model, optimizer) if active else (model, optimizer)
        self.scale = 1.0 / shape.batch

    def step(self) -> None:
        if self.active:
            self.strategy.train_step(self.model, self.optimizer, self.x, self.y, per_sequence_ce,
                                     loss_scale=self.scale)

    def timed(self, steps: int) -> float:
        dist.barrier()  # both processes start the variant together: its collectives pair up
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - start) / steps


# ----- the step job ------------------------------------------------------------------------------
def _step_worker(strategy: Any, size: Size) -> dict[str, Any]:
    env = strategy.env
    x, y = tokens(size.step)
    x, y = _half(x, env.rank), _half(y, env.rank)
    sharded = get_strategy("fsdp")
    sharded.setup(env, timeout=TIMEOUT)
    variants = {"allreduce": _Variant(strategy, size.step, x, y), "fsdp": _Variant(sharded, size.step, x, y)}
    for variant in variants.values():
        variant.step()  # warm-up: Adam's state, DDP's buckets, FSDP's buffers
    results = alternate({name: functools.partial(v.timed, size.steps) for name, v in variants.items()},
                        size.rounds)
    state = {name: state_bytes(v.model, v.optimizer) for name, v in variants.items()}
    return {"seconds": results, "state": state}


# ----- the memory jobs (fresh processes each) -------------------------------------------------------
def _memory_worker(strategy: Any, shape: Shape, steps: int, budget: float | None) -> dict[str, float]:
    """Peak RSS above the RSS before the model was built, and the raw peak, in bytes, after ``steps``
    steps of `fit`'s order: the strategy's ``build_model``, then its ``prepare``. With a
    ``budget`` the job stops as soon as a process is over it (both decide together: one small
    all-reduce after the build and after each step)."""
    x, y = tokens(shape)
    x, y = _half(x, strategy.rank), _half(y, strategy.rank)
    before = current_rss_bytes()

    def over() -> bool:
        if budget is None:
            return False
        flag = torch.tensor([float(peak_rss_bytes() - before > budget)])
        return strategy.all_reduce_sum(flag).item() > 0

    variant = _Variant(strategy, shape, x, y)
    done = 0
    while done < steps and not over():
        variant.step()
        done += 1
    peak = peak_rss_bytes()
    state = state_bytes(variant.model, variant.optimizer)
    return {"above_start": float(peak - before), "peak": float(peak), "state": float(sum(state.values())),
            "steps": float(done)}


def memory_job(name: str, shape: Shape, steps: int, budget: float | None = None) -> list[dict[str, float]]:
    """Every process's figures from a fresh job of ``name`` on ``shape`` (worker rank order)."""
    return launch(_memory_worker, shape, steps, budget, workers=WORKERS, strategy=name, threads=1,
                  timeout=TIMEOUT, device="cpu")


def largest_width(fits: Any, first: int, resolution: int, max_trials: int) -> tuple[int, list[tuple[int, bool]]]:
    """The largest multiple of ``resolution`` for which ``fits(width)`` holds, searched from ``first``
    by doubling until a width does not fit, then by bisection; at most ``max_trials`` calls.
    Returns it (0: not even ``first`` fits) and the trials ``(width, fitted)`` in order."""
    trials: list[tuple[int, bool]] = []

    def trial(width: int) -> bool:
        ok = bool(fits(width))
        trials.append((width, ok))
        return ok

    low, high = 0, None
    width = first
    while len(trials) < max_trials:
        if not trial(width):
            high = width
            break
        low, width = width, width * 2
    if high is None:
        return low, trials
    while high - low > resolution and len(trials) < max_trials:
        mid = (low + high) // 2 // resolution * resolution
        if mid <= low:
            break
        if trial(mid):
            low = mid
        else:
            high = mid
    return low, trials


# ----- the tp job ----------------------------------------------------------------------------------------
def _tp_worker(strategy: Any, size: Size) -> dict[str, list[float]]:
    x, y = tokens(size.tp)
    single = _Variant(get_strategy("single"), size.tp, x, y, active=strategy.env.rank == 0)
    split = _Variant(strategy, size.tp, x, y)
    single.step()
    split.step()
    return alternate({"one process": functools.partial(single.timed, size.steps),
                      "tp, 2 processes": functools.partial(split.timed, size.steps)}, size.rounds)


# ----- the report --------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> Report:
    preset, smoke = pick_size(args, FULL, QUICK, TOY)
    size = replace(preset, rounds=args.rounds or preset.rounds, steps=args.steps or preset.steps,
                   budget_mb=args.budget_mb or preset.budget_mb)
    report = Report("sharded", smoke=smoke)
    s = size.step
    report.say(f"partrain bench sharded: GPT (vocabulary {VOCAB}), {WORKERS} processes x 1 thread, CPU, Adam; "
               f"{size.rounds} alternating rounds x {size.steps} steps; step job: width {s.width}, {s.layers} "
               f"layers, {s.heads} heads, sequence {s.seq}, global batch {s.batch}")
    _steps(report, size)
    _peak(report, size)
    _largest(report, size)
    _tensor_parallel(report, size)
    return report


def _steps(report: Report, size: Size) -> None:
    report.progress("step job (allreduce and fsdp in turns)")
    out = launch(_step_worker, size, workers=WORKERS, strategy="allreduce", threads=1, timeout=TIMEOUT,
                 device="cpu")
    rows, samples = [], {}
    for name in ("allreduce", "fsdp"):
        seconds = [max(per_rank) for per_rank in zip(*(o["seconds"][name] for o in out))]
        samples[name] = [size.step.batch / t for t in seconds]
        state = [o["state"][name] for o in out]
        largest = max(sum(st.values()) for st in state)
        sps = Spread.of(samples[name])
        report.figure(f"samples_per_s[{name}]", sps)
        report.figure(f"state_bytes[{name}]", largest)
        rows.append([f"{name}, 2 processes", sps.cell(),
                     " / ".join(f"{st['params'] / MiB:.1f}+{st['grads'] / MiB:.1f}+{st['optimizer'] / MiB:.1f}"
                                for st in state), f"{largest / MiB:.1f}"])
    report.table(["variant", "samples/s median (min-max)", "params+grads+Adam MiB per rank", "largest rank MiB"],
                 rows, title="training step (forward + backward + Adam), the step job's GPT")
    state_ratio = report.figures["state_bytes[fsdp]"] / report.figures["state_bytes[allreduce]"]
    report.goal("sharded.state_memory", state_ratio, "<=", 0.55,
                "fsdp's per-rank bytes of parameters + gradients + Adam state / allreduce's")
    ratio = paired_ratio(samples["fsdp"], samples["allreduce"])
    report.figure("step_vs_allreduce", ratio)
    report.goal("sharded.step_vs_allreduce", ratio, ">=", 0.8, "fsdp samples/s / allreduce's, round by round")


def _peak(report: Report, size: Size) -> None:
    m = size.memory
    report.progress("memory jobs (fresh processes: allreduce, then fsdp)")
    rounds = 1 if report.smoke else 2
    jobs = alternate({name: functools.partial(memory_job, name, m, size.memory_steps)
                      for name in ("allreduce", "fsdp")}, rounds)
    rows, above = [], {}
    for name, runs in jobs.items():
        above[name] = [max(r["above_start"] for r in ranks) for ranks in runs]
        last = runs[-1]
        rows.append([name, ", ".join(f"{r['above_start'] / MiB:.0f}" for r in last),
                     ", ".join(f"{r['peak'] / MiB:.0f}" for r in last),
                     ", ".join(f"{r['state'] / MiB:.0f}" for r in last)])
        report.figure(f"peak_above_start_mb[{name}]", Spread.of([v / MiB for v in above[name]]))
    report.table(["variant", "peak RSS above start MiB per rank", "peak RSS MiB per rank",
                  "params+grads+Adam MiB per rank"], rows,
                 title=f"memory: GPT width {m.width}, {m.layers} layers ({m.parameters() / 1e6:.1f}M parameters), "
                       f"{size.memory_steps} Adam steps, fresh processes")
    ratio = paired_ratio(above["fsdp"], above["allreduce"])
    report.figure("peak_memory", ratio)
    report.goal("sharded.peak_memory", ratio, "<=", 0.65,
                "fsdp's peak RSS above start / allreduce's (the largest rank of each)")


def _largest(report: Report, size: Size) -> None:
    m, budget = size.memory, size.budget_mb * MiB
    found: dict[str, tuple[int, list[tuple[int, bool]]]] = {}
    for name in ("allreduce", "fsdp"):
        report.progress(f"largest model: {name} under {size.budget_mb:.0f} MiB per process")

        def fits(width: int, name: str = name) -> bool:
            weights = 4 * m.parameters(width)  # float32: every process builds the whole model first, as fit does
            if weights > budget:
                report.progress(f"  {name} width {width}: over (its {weights / MiB:.0f} MiB of parameters alone)")
                return False
            ranks = memory_job(name, replace(m, width=width), size.memory_steps, budget)
            used = max(r["above_start"] for r in ranks)
            fitted = used <= budget and all(r["steps"] == size.memory_steps for r in ranks)
            report.progress(f"  {name} width {width}: {used / MiB:.0f} MiB {'fits' if fitted else 'over'}")
            return fitted

        found[name] = largest_width(fits, size.first_width, size.resolution, size.max_trials)
    rows = []
    for name, (width, trials) in found.items():
        params = m.parameters(width) if width else 0
        report.figure(f"largest_width[{name}]", width)
        report.figure(f"largest_params[{name}]", params)
        rows.append([name, str(width) if width else "none", f"{params / 1e6:.1f}M",
                     " ".join(f"{w}{'+' if ok else '-'}" for w, ok in trials)])
    report.table(["variant", "largest width", "parameters", "trials (+ fits, - over)"], rows,
                 title=f"largest GPT ({m.layers} layers, sequence {m.seq}, batch {m.batch}) under "
                       f"{size.budget_mb:.0f} MiB of peak RSS above start per process")
    whole, sharded = found["allreduce"][0], found["fsdp"][0]
    value = sharded / whole if whole else None
    if whole and sharded:
        report.figure("largest_params_ratio", m.parameters(sharded) / m.parameters(whole))
    report.goal("sharded.largest_model", value, ">=", 1.8,
                "the largest width that fits the budget with fsdp / with allreduce")


def _tensor_parallel(report: Report, size: Size) -> None:
    t = size.tp
    report.progress("tp job (one process and tp in turns)")
    out = launch(_tp_worker, size, workers=WORKERS, strategy="tp", threads=1, timeout=TIMEOUT, device="cpu")
    one = out[0]["one process"]  # rank 1 only waits
    split = [max(a, b) for a, b in zip(out[0]["tp, 2 processes"], out[1]["tp, 2 processes"])]
    rows = []
    for name, seconds in (("one process", one), ("tp, 2 processes", split)):
        sps = Spread.of([t.batch / v for v in seconds])
        report.figure(f"samples_per_s[{name}]", sps)
        rows.append([name, sps.cell()])
    report.table(["variant", "samples/s median (min-max)"], rows,
                 title=f"tensor parallel: GPT width {t.width}, {t.layers} layers, {t.heads} heads, sequence "
                       f"{t.seq}, batch {t.batch} (the same batch on both processes)")
    scaling = paired_ratio(one, split)
    report.figure("tp_scaling", scaling)
    report.goal("tp.scaling", scaling, ">=", 1.4, "tp on 2 processes / one process, samples/s")
