"""Populations: 32 LeNet-5s in one process (vmap / loop / auto) against a process per member.

For each per-member batch size, four variants train in alternating rounds,
each for a timing window per round: the vectorized engine, the loop engine, the
automatic choice (after its calibration steps, which are real training steps,
timed apart) and the usual approach, a pool of processes, one model each, one
thread each, all training at once (started once and kept for every round;
startup reported apart). Figures are steady-state samples/s: medians over rounds
with their min-max spread; ratios are taken round by round. Memory: resident-set
growth per additional member from a process of N members to one of 2N (each fresh,
after the same training steps), against that member's parameters + optimizer
state, and the resident set of one pool process.

With ``--device cuda`` the one-process populations (vmap, loop, auto) live on the GPU,
their windows end with a synchronisation, and the pool stays what a user without
partrain would run: a CPU process per member. The split over a process per core is a
CPU layout and is not measured there; memory is measured on the CPU in both cases.

Goals (the worst batch size counts): population.auto_vs_best (auto /
max(vmap, loop)) >= 0.9; population.vs_pool (auto / pool) >= 1 on CPU (issue 17;
2 with --device cuda); population.memory_vs_pool (RSS per added member / RSS of one pool
process) <= 1/50. Check: RSS per added member <= 3x its parameters + optimizer
state. The pool's windows are checked for plausibility and re-run (`Pool.rate`).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..env import available_cores
from .harness import (
    Report,
    Spread,
    alternate,
    device_option,
    paired_ratio,
    pick_size,
    positive_int,
    torch_threads,
)

IMAGE = (1, 28, 28)


@dataclass(frozen=True)
class Size:
    members: int
    batches: tuple[int, ...]  # per-member batch sizes
    seconds: float  # timing window of one variant in one round
    min_steps: int  # at least this many steps per window
    calibration: int  # auto's calibration steps per engine
    rounds: int
    pool_processes: int  # 0: one per member
    memory_engines: tuple[str, ...]
    memory_batches: tuple[int, ...]  # () : every batch size
    per_core: bool = True  # measure (and let auto choose) the population split over a process per core
    device: str = "cpu"  # where the one-process populations live (the pool is always on the CPU)


FULL = Size(32, (8, 64, 256), 2.5, 2, 2, 4, 0, ("vmap", "loop"), (64,))
QUICK = Size(32, (8, 64, 256), 0.3, 1, 1, 3, 4, ("vmap", "loop"), (8,))
TOY = Size(4, (4,), 0.05, 1, 1, 1, 2, ("vmap",), (4,), per_core=False)  # CI: two process starts fewer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--members", type=positive_int, default=None, help="population size (default 32)")
    parser.add_argument("--batch-sizes", default=None, help="per-member batch sizes (default 8,64,256)")
    parser.add_argument("--pool-processes", type=positive_int, default=None,
                        help="processes in the baseline pool (default: one per member; --quick: 4)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="intra-op threads of the population process (default: torch's, one per core)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds per timing window (default 2.5; --quick: 0.3)")
    parser.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 4; --quick: 3)")
    parser.add_argument("--device", default="cpu",
                        help="where the one-process populations live: cpu (default) or cuda (the pool stays on CPU)")


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _lenet() -> torch.nn.Module:
    from ..models import lenet5

    return lenet5(in_channels=1, num_classes=10, image_size=IMAGE[1])


def _data(members: int, batch: int, seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """An MNIST-sized synthetic batch per member (content does not change the speed)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(members, batch, *IMAGE, generator=g), torch.randint(0, 10, (members, batch), generator=g)
    return x.to(device), y.to(device)


def _population(members: int, engine: str, calibration_steps: int = 3, device: str = "cpu") -> Any:
    from ..population import Population

    lrs = torch.logspace(-3, -1, members).tolist()
    return Population(_lenet, members, "sgd", {"lr": lrs, "momentum": 0.9}, engine=engine,
                      calibration_steps=calibration_steps, device=device)


def _rate(pop: Any, x: torch.Tensor, y: torch.Tensor, seconds: float, min_steps: int) -> float:
    """Samples/s over whole steps, at least ``min_steps`` and ``seconds`` (a GPU's queued work included)."""
    steps, t0 = 0, time.perf_counter()
    while steps < min_steps or time.perf_counter() - t0 < seconds:
        pop.step(x, y)
        steps += 1
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return steps * x.shape[0] * x.shape[1] / (time.perf_counter() - t0)


def calibrate(pop: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """Run auto's calibration (real training steps) to its end: seconds and steps it took."""
    t0, steps = time.perf_counter(), 0
    while pop.engine == "auto":
        pop.step(x, y)
        steps += 1
    return time.perf_counter() - t0, steps


# ------------------------------------------------------------------------------ process pool
def _pool_worker(index: int, seconds: float, min_steps: int, commands: Any, barrier: Any, results: Any) -> None:
    """One pool process: for each batch size it is told, train one window alongside the others."""
    torch.set_num_threads(1)
    torch.manual_seed(index)
    model = _lenet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.functional.cross_entropy
    data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    barrier.wait()  # everyone started: the parent notes the startup time
    while (batch := commands.get(timeout=600)) is not None:
        if batch not in data:
            x, y = _data(1, batch, seed=index)
            data[batch] = x[0], y[0]
            loss_fn(model(x[0]), y[0]).backward()  # warm-up at this shape
            opt.step()
            opt.zero_grad(set_to_none=True)
        x, y = data[batch]
        barrier.wait()  # every process (and the parent) ready: all train at the same time
        steps, t0 = 0, time.perf_counter()
        while steps < min_steps or time.perf_counter() - t0 < seconds:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
        results.put((steps * batch, time.perf_counter() - t0))
    results.put(rss_bytes())


class Pool:
    """The usual approach: a process per member, one thread each, kept alive across rounds.

    Between windows its processes wait on a queue (no CPU), so it can take its turn
    in the same rounds as the one-process engines.
    """

    def __init__(self, processes: int, seconds: float, min_steps: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.processes = processes
        self.rejected = 0  # pool windows measured again (see `rate`)
        self.barrier = ctx.Barrier(processes + 1, timeout=600)
        self.commands = ctx.Queue()
        self.results = ctx.Queue()
        t0 = time.perf_counter()
        self.procs = [ctx.Process(target=_pool_worker, daemon=True,
                                  args=(i, seconds, min_steps, self.commands, self.barrier, self.results))
                      for i in range(processes)]
        for p in self.procs:
            p.start()
        try:
            self.barrier.wait()
        except BaseException:
            self._stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def rate(self, batch: int, attempts: int = 3) -> float:
        """One window at ``batch`` per member: aggregate samples/s (total samples / longest elapsed).

        Checked for plausibility and re-run (up to ``attempts`` windows): the processes train
        together, so each one's window should last about as long as the others'. When one
        was starved (a process descheduled by other load on the machine) the longest window
        runs far past the median one and the aggregate would be credited to nothing: such a
        window is measured again. ``rejected`` counts the windows thrown away.
        """
        for attempt in range(attempts):
            for _ in range(self.processes):
                self.commands.put(batch)  # each process takes one: the barrier holds it until all have
            self.barrier.wait()
            got = [self.results.get(timeout=600) for _ in range(self.processes)]
            elapsed = sorted(t for _, t in got)
            if elapsed[-1] <= 2.0 * elapsed[len(elapsed) // 2] or attempt == attempts - 1:
                return sum(n for n, _ in got) / elapsed[-1]
            self.rejected += 1
        raise AssertionError("unreachable")

    def close(self) -> float:
        """Stop the processes; the mean resident set of one of them, in bytes."""
        try:
            for _ in range(self.processes):
                self.commands.put(None)
            rss = [self.results.get(timeout=600) for _ in range(self.processes)]
            return sum(rss) / len(rss)
        finally:
            self._stop()

    def _stop(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.terminate()


# --------------------------------------------------------------- one process per core
def _per_core_worker(rank: int, world: int, store_path: str, members: int, calibration: int, seconds: float,
                     min_steps: int, commands: Any, barrier: Any, results: Any) -> None:
    """One of ``world`` processes of a distributed population (``distributed=True``), one thread each.

    Each owns a contiguous slice of the members; a step trains only that slice and
    needs no communication (only auto's engine choice all-reduces its timings).
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        pops: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        barrier.wait()
        while (batch := commands.get(timeout=600)) is not None:
            if batch not in pops:
                from ..population import Population

                pop = Population(_lenet, members, "sgd", {"lr": torch.logspace(-3, -1, members).tolist(),
                                                          "momentum": 0.9},
                                 engine="auto", calibration_steps=calibration, distributed=True)
                x, y = _data(members, batch)
                x, y = x[pop.members.start:pop.members.stop], y[pop.members.start:pop.members.stop]
                while pop.engine == "auto":  # calibration: every process takes the same steps
                    pop.step(x, y)
                pops[batch] = pop, x, y
            pop, x, y = pops[batch]
            barrier.wait()
            steps, t0 = 0, time.perf_counter()
            while steps < min_steps or time.perf_counter() - t0 < seconds:
                pop.step(x, y)
                steps += 1
            results.put((steps * x.shape[0] * batch, time.perf_counter() - t0, pop.engine))
    finally:
        dist.destroy_process_group()


class PerCore:
    """The population split over one process per core (``distributed=True``), kept alive across rounds."""

    def __init__(self, processes: int, members: int, calibration: int, seconds: float, min_steps: int) -> None:
        import tempfile

        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.processes = processes
        self.engine = "?"
        self._dir = tempfile.TemporaryDirectory(prefix="partrain-bench-percore-")
        self.barrier = ctx.Barrier(processes + 1, timeout=600)
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=_per_core_worker, daemon=True,
                                  args=(r, processes, os.path.join(self._dir.name, "store"), members, calibration,
                                        seconds, min_steps, self.commands, self.barrier, self.results))
                      for r in range(processes)]
        for p in self.procs:
            p.start()
        try:
            self.barrier.wait()
        except BaseException:
            self.close()
            raise

    def rate(self, batch: int) -> float:
        """One window at ``batch`` per member: samples/s of the whole population (slowest process's time)."""
        for _ in range(self.processes):
            self.commands.put(batch)
        self.barrier.wait()
        got = [self.results.get(timeout=600) for _ in range(self.processes)]
        self.engine = got[0][2]
        return sum(n for n, _, _ in got) / max(t for _, t, _ in got)

    def close(self) -> None:
        try:
            for p in self.procs:
                if p.is_alive():
                    self.commands.put(None)
            for p in self.procs:
                p.join(timeout=30)
                if p.exitcode is None:
                    p.terminate()
        finally:
            self._dir.cleanup()


# --------------------------------------------------------------------------------- memory
def _memory_child(members: int, engine: str, batch: int, results: Any) -> None:
    """In a fresh process: a population of ``members`` after a few training steps, its RSS and its
    parameters + optimizer state per member."""
    torch.set_num_threads(1)
    x, y = _data(members, batch)
    population = _population(members, engine)
    for _ in range(3):
        population.step(x, y)
    gc.collect()
    _trim_heap()
    store = population.store
    state_bytes = (store.flat.numel() + sum(v.numel() for k, v in store.opt.items() if k != "step")) \
        * store.flat.element_size() // members
    results.put((rss_bytes(), state_bytes))


def _trim_heap() -> None:
    """Give the heap's free memory back to the OS (glibc), so that RSS counts live memory: freed
    activations otherwise stay resident or not by the allocator's own timing (the vmap engine's
    growth per member read -1.2 to 3.4 MiB over four runs without it)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it is
        pass


def _memory_of(sizes: list[int], engine: str, batch: int) -> list[tuple[int, int]]:
    """`_memory_child` for each population size, each in a fresh process, started together
    (RSS is per process; one start-up, ~4 s of importing torch, instead of one per size)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    runs = []
    try:
        for members in sizes:
            results = ctx.Queue()
            p = ctx.Process(target=_memory_child, args=(members, engine, batch, results), daemon=True)
            p.start()
            runs.append((p, results))
        return [results.get(timeout=600) for _, results in runs]
    finally:
        for p, _ in runs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def measure_memory(members: int, engine: str, batch: int) -> tuple[float, int]:
    """RSS growth per member from N to 2N members, and params+optimizer bytes per member.

    Each population lives in its own fresh process (N, then 2N members, the same steps), as a
    user would scale one up. (Adding N members beside N others in one process measured the
    allocator's reuse of the first population's freed blocks: its growth came out negative.)
    """
    (small, state), (large, _) = _memory_of([members, 2 * members], engine, batch)
    return (large - small) / members, state


# ------------------------------------------------------------------------------------ run
def _size(args: argparse.Namespace) -> tuple[Size, bool]:
    size, smoke = pick_size(args, FULL, QUICK, TOY)
    device = device_option(args)
    members = args.members or size.members
    batches = tuple(int(b) for b in args.batch_sizes.split(",")) if args.batch_sizes else size.batches
    return Size(members, batches, args.seconds if args.seconds is not None else size.seconds, size.min_steps,
                size.calibration, args.rounds or size.rounds,
                args.pool_processes or min(size.pool_processes or members, members), size.memory_engines,
                size.memory_batches or batches, size.per_core and device == "cpu", device), smoke


def run(args: argparse.Namespace) -> Report:
    size, smoke = _size(args)
    with torch_threads(args.threads):
        return _run(size, smoke)


def _run(size: Size, smoke: bool) -> Report:
    report = Report("population", smoke=smoke)
    members, cores = size.members, available_cores()
    on = f"on {torch.cuda.get_device_name(0)} (the pool on the CPU)" if size.device == "cuda" else "on the CPU"
    report.say(f"partrain bench population: {members} LeNet-5 members {on}, 1x28x28 synthetic data, SGD "
               f"momentum, {torch.get_num_threads()} threads, {cores} cores, {size.rounds} alternating rounds of "
               f"{size.seconds:g} s windows; pool of {size.pool_processes} processes x 1 thread")
    pool = Pool(size.pool_processes, size.seconds, size.min_steps)
    per_core = None
    try:
        if cores > 1 and size.per_core:
            per_core = PerCore(min(cores, members), members, size.calibration, size.seconds, size.min_steps)
        results = {batch: _measure_batch(size, batch, pool, per_core, report) for batch in size.batches}
    finally:
        pool_rss = pool.close()
        if per_core is not None:
            per_core.close()
    report.figure("pool_startup_s", pool.startup_s)
    report.figure("pool_windows_rejected", pool.rejected)
    report.figure("pool_rss_per_process_mib", pool_rss / 2**20)

    rows = []
    vs_best, vs_pool = [], []
    for batch, (rates, calibration) in results.items():
        candidates = [rates[k] for k in ("vmap", "loop", "per-core") if k in rates]
        best = [max(values) for values in zip(*candidates)]
        auto_vs_best = paired_ratio(rates["auto"], best)
        auto_vs_pool = paired_ratio(rates["auto"], rates["pool"])
        vs_best.append(auto_vs_best.median)
        vs_pool.append(auto_vs_pool.median)
        spreads = {k: Spread.of(v) for k, v in rates.items()}
        rows.append([batch, spreads["vmap"].cell(), spreads["loop"].cell(),
                     spreads["per-core"].cell() if "per-core" in spreads else "not measured",
                     spreads["auto"].cell(), calibration["chosen"], spreads["pool"].cell(), auto_vs_best.cell(),
                     auto_vs_pool.cell(), calibration["seconds"]])
        key = f"b{batch}"
        for name, spread in spreads.items():
            report.figure(f"{key}_{name}_samples_per_s", spread)
        report.figure(f"{key}_auto_chose", calibration["chosen"])
        report.figure(f"{key}_auto_over_best", auto_vs_best)
        report.figure(f"{key}_auto_over_pool", auto_vs_pool)
        report.figure(f"{key}_auto_calibration_s", calibration["seconds"])
        report.figure(f"{key}_auto_measured_vmap_step_s", calibration["report"]["vmap_step_s"])
        report.figure(f"{key}_auto_measured_loop_step_s", calibration["report"]["loop_step_s"])
    report.table(["batch/member", "vmap samples/s", "loop samples/s", "per-core samples/s", "auto samples/s",
                  "auto chose", "pool samples/s", "auto/best", "auto/pool", "calibration s"], rows,
                 title="medians over rounds, (min-max) where rounds differ; ratios round by round")
    if size.pool_processes != members:
        report.say(f"pool: {size.pool_processes} processes measured; on {cores} cores the pool is CPU-bound, so "
                   f"a {members}-process pool is credited with the same aggregate samples/s "
                   f"({members / size.pool_processes:g}x fewer per member) - favourable to the pool")
    report.say(f"pool startup (spawn {size.pool_processes} processes, import torch, build model): "
               f"{pool.startup_s:.1f} s (not in its samples/s); pool windows measured again after a "
               f"starved process (longest > 2x median): {pool.rejected}")

    mem_rows = []
    worst_memory = None
    worst_vs_pool = None  # RSS per added member / RSS of one pool process (one model each)
    for batch in size.memory_batches:
        for engine in size.memory_engines:
            per_member, state = measure_memory(members, engine, batch)
            over_state = per_member / state
            worst_memory = over_state if worst_memory is None else max(worst_memory, over_state)
            member_vs_pool = per_member / pool_rss
            worst_vs_pool = member_vs_pool if worst_vs_pool is None else max(worst_vs_pool, member_vs_pool)
            # a growth at or below 0 is noise (the allocator's cache): no ratio is made of it
            pool_over_member = pool_rss / per_member if per_member > 0 else math.nan
            mem_rows.append([engine, batch, per_member / 2**20, state / 2**20, over_state, pool_rss / 2**20,
                             pool_over_member])
            key = f"mem_{engine}_b{batch}"
            report.figure(f"{key}_per_member_mib", per_member / 2**20)
            report.figure(f"{key}_over_state", over_state)
            report.figure(f"{key}_pool_process_over_member", pool_over_member)
            report.figure("state_per_member_mib", state / 2**20)
    report.table(["engine", "batch/member", "RSS per added member MiB", "params+opt MiB", "RSS/(params+opt)",
                  "pool RSS/process MiB", "pool process/member"], mem_rows,
                 title=f"memory: RSS growth from {members} to {2 * members} members (each in a fresh process), "
                       f"after training steps")

    def worst(values: list[float]) -> float | None:
        return min(values) if values and not any(v != v for v in values) else None

    report.goal("population.auto_vs_best", worst(vs_best), ">=", 0.9,
                "auto / max(vmap, loop, per-core), samples/s (worst batch size)")
    report.goal("population.vs_pool", worst(vs_pool), ">=", 2.0 if size.device == "cuda" else 1.0,
                "auto / a process per member, samples/s (worst batch size)")
    report.goal("population.memory_vs_pool", worst_vs_pool, "<=", 1 / 50,
                "RSS per added member / RSS of one pool process (worst engine)")
    report.check("population.memory_per_member", worst_memory, "<=", 3.0,
                 "RSS per added member / its params + optimizer state (worst)")
    return report


def _measure_batch(size: Size, batch: int, pool: Pool, per_core: PerCore | None,
                   report: Report) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """vmap, loop, auto, one process per core and the pool at one batch size, in alternating rounds.

    ``auto`` is the choice a user gets without knowing the machine: after the
    one-process population's own engine calibration (vmap or loop), one window of that
    and one of the population split over a process per core are timed, and the faster
    layout is kept for every round.
    """
    x, y = _data(size.members, batch, device=size.device)
    pops = {"vmap": _population(size.members, "vmap", device=size.device),
            "loop": _population(size.members, "loop", device=size.device),
            "auto": _population(size.members, "auto", size.calibration, size.device)}
    t0 = time.perf_counter()
    seconds, steps = calibrate(pops["auto"], x, y)
    one_process = functools.partial(_rate, pops["auto"], x, y, size.seconds, size.min_steps)
    chosen, auto = f"1 process, {pops['auto'].engine}", one_process
    if per_core is not None:
        split = functools.partial(per_core.rate, batch)
        if split() > one_process():  # one window each, the per-core processes calibrating their engine first
            chosen, auto = f"{per_core.processes} processes, {per_core.engine}", split
    seconds = time.perf_counter() - t0
    pops["vmap"].step(x, y)  # warm-up
    pops["loop"].step(x, y)
    variants: dict[str, Callable[[], float]] = {
        "vmap": functools.partial(_rate, pops["vmap"], x, y, size.seconds, size.min_steps),
        "loop": functools.partial(_rate, pops["loop"], x, y, size.seconds, size.min_steps),
        "auto": auto}
    if per_core is not None:
        variants["per-core"] = functools.partial(per_core.rate, batch)
    variants["pool"] = functools.partial(pool.rate, batch)
    rates = alternate(variants, size.rounds, on_result=lambda r, name, v: report.progress(
        f"batch {batch}, round {r + 1}: {name} {v:,.0f} samples/s"))
    return rates, {"seconds": seconds, "steps": steps, "chosen": chosen, "report": pops["auto"].engine_report}
