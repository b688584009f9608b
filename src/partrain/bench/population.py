"""Populations: 32 LeNet-5s in one process (vmap / loop / auto) against a process per member.

For each per-member batch size it measures steady-state training samples/s of
the vectorized engine, the loop engine and the automatic choice (after its
calibration steps, which are real training steps), and of the usual approach: a
pool of processes, one model each, one thread each (startup reported apart).
Memory: resident-set growth per additional member when a process goes from N
to 2N members, against that member's parameters + optimizer state, and the
resident set of one pool process.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import torch

from .common import format_table

MEMBERS = 32
BATCHES = (8, 64, 256)
IMAGE = (1, 28, 28)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--members", type=int, default=MEMBERS, help=f"population size (default {MEMBERS})")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCHES)),
                        help="per-member batch sizes (default 8,64,256)")
    parser.add_argument("--pool-processes", type=int, default=None,
                        help="processes in the baseline pool (default: one per member; --quick: 4)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of the population process (default: torch's, one per core)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds per timing window (default 2; --quick: 0.3)")


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _lenet() -> torch.nn.Module:
    from ..models import lenet5

    return lenet5(in_channels=1, num_classes=10, image_size=IMAGE[1])


def _data(members: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An MNIST-sized synthetic batch per member (content does not change the speed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(members, batch, *IMAGE, generator=g), torch.randint(0, 10, (members, batch), generator=g)


def _population(members: int, engine: str, calibration_steps: int = 3) -> Any:
    from ..population import Population

    lrs = torch.logspace(-3, -1, members).tolist()
    return Population(_lenet, members, "sgd", {"lr": lrs, "momentum": 0.9}, engine=engine,
                      calibration_steps=calibration_steps)


def _rate(pop: Any, x: torch.Tensor, y: torch.Tensor, seconds: float, min_steps: int) -> float:
    """Samples/s over whole steps, at least ``min_steps`` and ``seconds``."""
    steps, t0 = 0, time.perf_counter()
    while steps < min_steps or time.perf_counter() - t0 < seconds:
        pop.step(x, y)
        steps += 1
    return steps * x.shape[0] * x.shape[1] / (time.perf_counter() - t0)


def measure_engines(members: int, batch: int, seconds: float, min_steps: int, calibration: int,
                    rounds: int) -> dict[str, Any]:
    """Samples/s of vmap, loop and auto at one batch size.

    The three populations are timed in turns, ``rounds`` times, keeping each one's
    best window: a burst of load from other processes then hits all three alike.
    """
    x, y = _data(members, batch)
    pops = {"vmap": _population(members, "vmap"), "loop": _population(members, "loop"),
            "auto": _population(members, "auto", calibration)}
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    calib_steps = 0
    while pops["auto"].engine == "auto":  # auto's calibration: real training steps, timed apart
        pops["auto"].step(x, y)
        calib_steps += 1
    out["calibration_s"] = time.perf_counter() - t0
    out["calibration_steps"] = calib_steps
    pops["vmap"].step(x, y)  # warm-up
    pops["loop"].step(x, y)
    for _ in range(rounds):
        for name, pop in pops.items():
            out[name] = max(out.get(name, 0.0), _rate(pop, x, y, seconds, min_steps))
    out["chosen"] = pops["auto"].engine
    out["report"] = pops["auto"].engine_report
    return out


# ------------------------------------------------------------------------------ process pool
def _pool_worker(index: int, batches: list[int], seconds: float, barrier: Any, results: Any) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(index)
    model = _lenet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.functional.cross_entropy
    barrier.wait()  # everyone started: the parent notes the startup time
    for batch in batches:
        x, y = _data(1, batch, seed=index)
        x, y = x[0], y[0]
        loss_fn(model(x), y).backward()  # warm-up
        opt.step()
        opt.zero_grad()
        barrier.wait()  # all processes train at the same time
        steps, t0 = 0, time.perf_counter()
        while steps < 1 or time.perf_counter() - t0 < seconds:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
        results.put((index, batch, steps * batch, time.perf_counter() - t0))
        barrier.wait()
    results.put((index, "rss", rss_bytes(), 0.0))


def measure_pool(processes: int, batches: list[int], seconds: float) -> dict[str, Any]:
    """A process per member, one thread each: startup, samples/s per batch size, RSS per process."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes + 1, timeout=600)
    results = ctx.Queue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_pool_worker, args=(i, batches, seconds, barrier, results), daemon=True)
             for i in range(processes)]
    for p in procs:
        p.start()
    try:
        barrier.wait()
        out: dict[str, Any] = {"startup_s": time.perf_counter() - t0}
        for batch in batches:
            barrier.wait()
            got = [results.get(timeout=600) for _ in range(processes)]
            # processes ran concurrently: aggregate rate = total samples / the longest elapsed time
            out[batch] = sum(g[2] for g in got) / max(g[3] for g in got)
            barrier.wait()
        rss = [results.get(timeout=600)[2] for _ in range(processes)]
        out["rss_per_process"] = sum(rss) / len(rss)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.terminate()
    return out


# --------------------------------------------------------------------------------- memory
def _memory_child(members: int, engine: str, batch: int, results: Any) -> None:
    torch.set_num_threads(1)
    x, y = _data(members, batch)
    a = _population(members, engine)
    for _ in range(2):
        a.step(x, y)
    gc.collect()
    first = rss_bytes()
    b = _population(members, engine)  # N more members in the same process
    for _ in range(2):
        a.step(x, y)
        b.step(x, y)
    gc.collect()
    second = rss_bytes()
    store = a.store
    state_bytes = (store.flat.numel() + sum(v.numel() for k, v in store.opt.items() if k != "step")) \
        * store.flat.element_size() // members
    results.put(((second - first) / members, state_bytes))


def measure_memory(members: int, engine: str, batch: int) -> tuple[float, int]:
    """RSS growth per member from N to 2N members (fresh process), and params+optimizer bytes per member."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_memory_child, args=(members, engine, batch, results), daemon=True)
    p.start()
    try:
        return results.get(timeout=600)
    finally:
        p.join(timeout=10)


# ------------------------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> dict[str, float]:
    quick = bool(getattr(args, "quick", False))
    if args.threads:
        torch.set_num_threads(args.threads)
    members = args.members
    batches = [int(b) for b in str(args.batch_sizes).split(",")]
    seconds = args.seconds if args.seconds is not None else (0.3 if quick else 2.0)
    min_steps = 1 if quick else 2
    calibration = 1 if quick else 3
    rounds = 1 if quick else 3
    pool_procs = args.pool_processes or (min(4, members) if quick else members)
    figures: dict[str, float] = {"members": members, "pool_processes": pool_procs}
    print(f"{members} LeNet-5 members, 1x28x28 synthetic data, SGD momentum, {torch.get_num_threads()} "
          f"threads, {os.cpu_count()} cores{' (--quick)' if quick else ''}", flush=True)

    rows = []
    engines = {}
    for batch in batches:
        m = measure_engines(members, batch, seconds, min_steps, calibration, rounds)
        engines[batch] = m
        print(f"  batch {batch}: vmap {m['vmap']:,.0f}, loop {m['loop']:,.0f}, auto ({m['chosen']}) "
              f"{m['auto']:,.0f} samples/s", flush=True)
    print(f"  pool of {pool_procs} processes...", flush=True)
    pool = measure_pool(pool_procs, batches, seconds * 2)
    scale_note = ""
    if pool_procs != members:
        scale_note = (f"pool: {pool_procs} processes measured; on {os.cpu_count()} cores the pool is "
                      f"CPU-bound, so a {members}-process pool is credited with the same aggregate "
                      f"samples/s ({members / pool_procs:g}x fewer per member) - favourable to the pool")
    for batch in batches:
        m = engines[batch]
        best = max(m["vmap"], m["loop"])
        pool_rate = pool[batch]
        rows.append([batch, m["vmap"], m["loop"], m["auto"], m["chosen"], pool_rate,
                     m["auto"] / best, m["auto"] / pool_rate, m["calibration_s"]])
        key = f"b{batch}"
        figures.update({f"{key}_vmap_samples_per_s": m["vmap"], f"{key}_loop_samples_per_s": m["loop"],
                        f"{key}_auto_samples_per_s": m["auto"], f"{key}_pool_samples_per_s": pool_rate,
                        f"{key}_auto_chose_vmap": float(m["chosen"] == "vmap"),
                        f"{key}_auto_over_best": m["auto"] / best, f"{key}_auto_over_pool": m["auto"] / pool_rate,
                        f"{key}_auto_calibration_s": m["calibration_s"],
                        f"{key}_auto_measured_vmap_step_s": m["report"]["vmap_step_s"],
                        f"{key}_auto_measured_loop_step_s": m["report"]["loop_step_s"]})
    print()
    print(format_table(["batch/member", "vmap samples/s", "loop samples/s", "auto samples/s", "auto chose",
                        "pool samples/s", "auto/max(vmap,loop)", "auto/pool", "calibration s"], rows))
    print("goals: auto/max(vmap,loop) >= 0.9; auto/pool >= 2")
    if scale_note:
        print(scale_note)
    print(f"pool startup (spawn {pool_procs} processes, import torch, build model): {pool['startup_s']:.1f} s "
          f"(not in its samples/s)")
    figures["pool_startup_s"] = pool["startup_s"]

    mem_batches = [min(batches)] if quick else batches
    mem_rows = []
    for batch in mem_batches:
        for engine in ("vmap", "loop"):
            per_member, state = measure_memory(members, engine, batch)
            mem_rows.append([engine, batch, per_member / 2**20, state / 2**20, per_member / state,
                             pool["rss_per_process"] / 2**20, pool["rss_per_process"] / max(per_member, 1.0)])
            key = f"mem_{engine}_b{batch}"
            figures.update({f"{key}_per_member_mib": per_member / 2**20, f"{key}_over_state": per_member / state,
                            f"{key}_pool_process_over_member": pool["rss_per_process"] / max(per_member, 1.0)})
            figures["state_per_member_mib"] = state / 2**20
    figures["pool_rss_per_process_mib"] = pool["rss_per_process"] / 2**20
    print()
    print(format_table(["engine", "batch/member", "RSS per added member MiB", "params+opt MiB",
                        "RSS/(params+opt)", "pool RSS/process MiB", "pool process/member"], mem_rows))
    print(f"goal: RSS per added member <= 3x params+opt state (RSS growth from {members} to "
          f"{2 * members} members in one fresh process, after training steps)")
    return figures
