"""Actor-learner RL on CartPole-v1: partrain's runtime vs stable-baselines3 PPO vs a single-process loop.

Variants, all on this machine's cores, one torch thread per process:

- ``partrain N local`` / ``partrain N central``: a `partrain.rl.Learner` (in this
  process, serving HTTP) and N actor processes started as ``python -m partrain rl act
  URL`` (8 environments each), acting with local copies of the policy or through the
  learner's batched OIP inference;
- ``single``: the same V-trace actor-critic in one process (`partrain.rl.train_single`,
  16 environments): no HTTP, no lag;
- ``sb3 ppo``: stable-baselines3's PPO with the RL Zoo's tuned CartPole-v1 settings
  (8 environments, n_steps 32, 20 epochs; what most users would pick instead). Needs
  the ``rl-bench`` extra; without it its figures and the goals against it are null.

Two phases. *Throughput*: every variant runs for a fixed window in alternating rounds;
frames/s counts environment frames that reached the learner (SB3: timesteps). For
partrain the policy lag (learner version minus the version that acted, per segment) and
the central-inference batch sizes and p50 latency (as the actors measure it) are
recorded too. *Time to 475*: partrain (2 local actors: the goal's; 1 and 4 local and 2 central
shown too), ``partrain 2 local ppo`` (the runtime with `PPO_ADAPTIVE`), ``single``,
``single ppo`` (`partrain.rl.PPO` in one process; these three are shown, not a
goal's) and ``sb3 ppo`` train from scratch
until the mean return of the last 20 episodes reaches 475 (bounded by a frame budget;
a run that does not get there counts as not reached, and in partrain's ratios as
slower than any run that did: an infinite time, not a round left out), one run each
per round, alternating; round r uses seed r for every variant.

The clocks of time to 475 (`_CLOCKS`, printed with the table): partrain's actors are
processes "started by anyone", so its clock starts once every actor is up and acting
(first segment sent) with the learner's model still fresh, the earlier segments
dropped; SB3's starts in ``model.learn()`` once its environments and model are built;
``single``'s once its model and environments are built. Each run's time including its
start-up (partrain: from launching the actor processes, each importing torch; SB3: from
building its environments, its import not counted) is printed beside it.

Goals (issue 13): rl.time_to_475_vs_sb3 (partrain's wall time to 475 / SB3 PPO's) <=
0.5; rl.fps_vs_sb3 (partrain's best frames/s / SB3 PPO's) >= 2; rl.policy_lag_p50
(median policy lag of the partrain runs, versions) <= 1.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..rl.algorithms import PPO
from ..rl.learner import percentile
from .harness import Report, Spread, alternate, paired_ratio, pick_size, positive_int

ENV = "CartPole-v1"
TARGET = 475.0
#: the runtime with PPO: up to 10 passes per batch, at least 2, more only while the next
#: batch is still being collected; a queue of 4 segments (2 batches) bounds the lag
PPO_ADAPTIVE: dict[str, Any] = {"algorithm": "ppo", "epochs": 10, "min_epochs": 2, "max_queue": 4}


@dataclass(frozen=True)
class Size:
    window: float  # seconds of one throughput measurement
    actor_counts: tuple[int, ...]
    modes: tuple[str, ...]
    rounds: int
    solve_rounds: int  # time-to-475 rounds (0: not measured)
    solve_frames: int  # the frame budget of one time-to-475 run
    sb3: bool = True  # the toy size (the test suite's) leaves SB3 out: importing it costs seconds of CI


FULL = Size(5.0, (1, 2, 4), ("local", "central"), 3, 3, 300_000)
QUICK = Size(3.0, (2,), ("local", "central"), 1, 0, 0)
TOY = Size(0.5, (1,), ("local",), 1, 0, 0, sb3=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help="alternating throughput rounds (default 3; --quick 1)")
    parser.add_argument("--solve-rounds", type=int, default=None,
                        help="time-to-475 rounds (default 3; --quick 0: not measured)")


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    """One variant's run: frames/s, and what partrain runs record besides."""

    fps: float
    lags: list[int] = field(default_factory=list)
    batch_sizes: dict[int, int] = field(default_factory=dict)
    infer_p50_ms: float = math.nan
    seconds_to_target: float = math.nan  # nan: not reached (or not a solve run); clock: see _CLOCKS
    frames_to_target: float = math.nan
    seconds_with_startup: float = math.nan  # the same run's time to target including its start-up


def _infer_p50(outputs: list[str]) -> float:
    values = [float(m.group(1)) for text in outputs for m in re.finditer(r"infer p50 ([0-9.]+) ms", text)]
    return statistics.median(values) if values else math.nan


def run_partrain(actors: int, mode: str, *, window: float | None, target: float | None = None,
                 max_frames: int | None = None, seed: int = 0, config: dict[str, Any] | None = None) -> Run:
    """A learner here, ``actors`` actor processes; throughput over ``window`` s, or a run to ``target``.

    A run to ``target`` is timed from the moment every actor is up and acting (each has
    sent a segment: process started, torch imported, connected, first weights pulled),
    with the learner's model still fresh and those first segments dropped; the time
    from launching the actor processes is recorded too (``seconds_with_startup``).
    ``config``: `LearnerConfig` fields other than the defaults (experiments).
    """
    from ..rl.run import LearnerConfig, build_learner, serving, start_actor, stop_actors

    learner = build_learner(LearnerConfig(env=ENV, seed=seed, **(config or {})))
    procs: list[Any] = []
    outputs: list[str] = []
    with serving(learner) as server:
        batcher = server.app.state.batchers["policy"]
        launched = time.perf_counter()
        for i in range(actors):
            procs.append(start_actor(server.url, ENV, num_envs=8, mode=mode, seed=seed * 100 + i + 1, token=None,
                                     name=f"bench-{i}", capture=True))
        try:
            if window is not None:
                trainer = threading.Thread(target=learner.train, kwargs={"timeout": 600.0}, daemon=True)
                trainer.start()
                deadline = time.monotonic() + 120.0
                while learner.stats.frames == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)  # polling: the first segment marks every actor started
                frames0, lags0 = learner.stats.frames, len(learner.stats.lags)
                sizes0 = dict(batcher.stats.batch_sizes)
                t0 = time.perf_counter()
                time.sleep(window)  # the measurement window itself
                seconds = time.perf_counter() - t0
                run = Run((learner.stats.frames - frames0) / seconds, learner.stats.lags[lags0:],
                          {k: v - sizes0.get(k, 0) for k, v in batcher.stats.batch_sizes.items()
                           if v - sizes0.get(k, 0) > 0})
                learner.stop()
                trainer.join(30)
            else:
                # the clock starts once all actors act, as for processes "started by anyone"
                st = learner.train(target=target, max_frames=max_frames, timeout=600.0, wait_actors=actors)
                run = Run(st.frames / max(1e-9, time.perf_counter() - st.started), list(st.lags))
                if st.solved_at is not None:
                    run.seconds_to_target, run.frames_to_target = st.solved_at, float(st.solved_frames or 0)
                    run.seconds_with_startup = st.started - launched + st.solved_at
        finally:
            learner.finished = True
    stop_actors(procs, timeout=20.0)
    for p in procs:
        if p.stdout is not None:
            outputs.append(p.stdout.read())
    run.infer_p50_ms = _infer_p50(outputs)
    return run


def run_single(*, window: float | None, target: float | None = None, max_frames: int | None = None,
               seed: int = 0, ppo: bool = False) -> Run:
    """The V-trace loop in one process; ``ppo``: `PPO` (10 epochs) on 8 environments x 32 steps per batch."""
    from ..rl.run import PPO_EPOCHS
    from ..rl.single import train_single

    kind = {"algorithm": PPO(epochs=PPO_EPOCHS), "num_envs": 8, "unroll": 32} if ppo else {}
    called = time.perf_counter()
    if window is not None:
        r = train_single(ENV, seed=seed, max_frames=10**9, target=None, timeout=window, **kind)
        return Run(r.frames / r.seconds)
    r = train_single(ENV, seed=seed, max_frames=max_frames or 10**9, target=target, timeout=600.0, **kind)
    ended = time.perf_counter()
    run = Run(r.frames / r.seconds)
    if r.solved:
        run.seconds_to_target, run.frames_to_target = r.seconds_to_target or math.nan, float(r.frames_to_target or 0)
        # train_single's clock starts after its model and environments are built
        run.seconds_with_startup = (ended - called) - r.seconds + run.seconds_to_target
    return run


def _seeded(fn: Any) -> Any:
    """``fn(seed=k)`` on its k-th call (k = 0, 1, ...): one seed per round."""
    calls = itertools.count()
    return lambda: fn(next(calls))


def sb3_available() -> bool:
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        return False
    return True


ZOO_TIMESTEPS = 100_000
"""The RL Zoo's ``n_timesteps`` for PPO on CartPole-v1: its linear schedules decay over this many frames."""


def run_sb3(*, window: float | None, target: float | None = None, max_frames: int | None = None,
            seed: int = 0) -> Run:
    """SB3 PPO, RL Zoo settings for CartPole-v1; stops at ``window`` s or at ``target``.

    A run to ``target`` learns for the zoo's ``n_timesteps`` (`ZOO_TIMESTEPS`), so the
    learning rate and clip range decay as in the zoo; it stops earlier at the target.
    """
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    called = time.perf_counter()  # SB3 itself was imported before: its import is not counted
    env = make_vec_env(ENV, n_envs=8, seed=seed)

    def linear(start: float):  # noqa: ANN202 - the zoo's "lin_" schedules
        return lambda progress: progress * start

    model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                ent_coef=0.0, learning_rate=linear(1e-3), clip_range=linear(0.2), seed=seed, device="cpu",
                verbose=0)
    returns: deque[float] = deque(maxlen=20)
    state = {"solved": math.nan, "frames": math.nan}
    t0 = time.perf_counter()

    class Stop(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals.get("infos", []):
                if "episode" in info:
                    returns.append(float(info["episode"]["r"]))
            now = time.perf_counter() - t0
            if window is not None:
                return now < window
            if self.num_timesteps >= budget:
                return False
            if target is not None and len(returns) == returns.maxlen and sum(returns) / len(returns) >= target:
                state["solved"], state["frames"] = now, float(self.num_timesteps)
                return False
            return True

    budget = max_frames or 10**9
    model.learn(total_timesteps=ZOO_TIMESTEPS if target is not None else budget, callback=Stop())
    seconds = time.perf_counter() - t0
    env.close()
    return Run(model.num_timesteps / seconds, seconds_to_target=state["solved"], frames_to_target=state["frames"],
               seconds_with_startup=state["solved"] + (t0 - called))


# --------------------------------------------------------------------------- the benchmark


def run(args: argparse.Namespace) -> Report:
    size, smoke = pick_size(args, FULL, QUICK, TOY)
    rounds = args.rounds or size.rounds
    solve_rounds = size.solve_rounds if args.solve_rounds is None else max(0, args.solve_rounds)
    from ..rl.run import ACTOR_NICE  # the rl extra (the learner's HTTP app): only when this runs

    report = Report("rl", smoke=smoke)
    have_sb3 = size.sb3 and sb3_available()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report.say(f"{ENV}: V-trace actor-critic (partrain) vs SB3 PPO (RL Zoo settings); one torch thread per "
                   f"process; partrain's actors at nice +{ACTOR_NICE} (as partrain rl train starts them); throughput "
                   f"windows of {size.window:g} s, {rounds} alternating round(s); {solve_rounds} time-to-{TARGET:g} "
                   "round(s)")
        if size.sb3 and not have_sb3:
            report.note("stable-baselines3 is not installed (pip install 'partrain[rl-bench]'): its figures "
                        "and the goals against it are null")
        variants: dict[str, Any] = {}
        for n in size.actor_counts:
            for mode in size.modes:
                variants[f"partrain {n} {mode}"] = (lambda n=n, mode=mode: run_partrain(n, mode, window=size.window))
        variants["single"] = lambda: run_single(window=size.window)
        if have_sb3:
            variants["sb3 ppo"] = lambda: run_sb3(window=size.window)
        fps = alternate(variants, rounds, on_result=lambda r, name, res: report.progress(
            f"round {r + 1} {name}: {res.fps:.0f} frames/s"))
        solve: dict[str, list[Run]] = {}
        if solve_rounds:
            budget = size.solve_frames
            # round r runs every variant with seed r: the spread is over seeds, not only timing noise
            solvers: dict[str, Any] = {
                "partrain 2 local": _seeded(lambda seed: run_partrain(2, "local", window=None, target=TARGET,
                                                                      max_frames=budget, seed=seed)),
            }
            # the other actor counts (the goal's is 2 local), and central inference with 2 actors: at
            # its ~4x lower frames/s one run takes ~30 s, so 1 and 4 central (whose frames/s the
            # throughput table shows) are not timed
            for n, mode in [(n, "local") for n in size.actor_counts if n != 2] + (
                    [(2, "central")] if "central" in size.modes and 2 in size.actor_counts else []):
                solvers[f"partrain {n} {mode}"] = _seeded(
                    lambda seed, n=n, mode=mode: run_partrain(n, mode, window=None, target=TARGET,
                                                              max_frames=budget, seed=seed))
            solvers |= {
                # not the goal's: the runtime with PPO whose passes overlap collection (see PPO_ADAPTIVE)
                "partrain 2 local ppo": _seeded(lambda seed: run_partrain(2, "local", window=None, target=TARGET,
                                                                          max_frames=budget, seed=seed,
                                                                          config=PPO_ADAPTIVE)),
                "single": _seeded(lambda seed: run_single(window=None, target=TARGET, max_frames=budget, seed=seed)),
                # not the goal's: PPO in one process
                "single ppo": _seeded(lambda seed: run_single(window=None, target=TARGET, max_frames=budget,
                                                              seed=seed, ppo=True)),
            }
            if have_sb3:
                solvers["sb3 ppo"] = _seeded(lambda seed: run_sb3(window=None, target=TARGET, max_frames=budget,
                                                                  seed=seed))
            solve = alternate(solvers, solve_rounds, on_result=lambda r, name, res: report.progress(
                f"solve round {r + 1} {name}: {res.seconds_to_target:.1f} s, {res.frames_to_target:.0f} frames"))
    finally:
        torch.set_num_threads(prev_threads)
    _report(report, fps, solve, have_sb3)
    return report


def _report(report: Report, fps: dict[str, list[Run]], solve: dict[str, list[Run]], have_sb3: bool) -> None:
    rows = []
    partrain_lags: list[int] = []
    for name, runs in fps.items():
        speed = Spread.of([r.fps for r in runs])
        lags = [lag for r in runs for lag in r.lags]
        sizes: dict[int, int] = {}
        for r in runs:
            for k, v in r.batch_sizes.items():
                sizes[k] = sizes.get(k, 0) + v
        calls = sum(sizes.values())
        hist = " ".join(f"{k}:{v}" for k, v in sorted(sizes.items())[:8]) + (" ..." if len(sizes) > 8 else "")
        p50 = statistics.median([r.infer_p50_ms for r in runs if not math.isnan(r.infer_p50_ms)] or [math.nan])
        if name.startswith("partrain"):
            partrain_lags += lags
        key = name.replace(" ", "_")
        report.figure(f"fps.{key}", speed)
        report.figure(f"lag_p50.{key}", percentile(lags, 50))
        report.figure(f"lag_p99.{key}", percentile(lags, 99))
        if calls:
            report.figure(f"infer_batch_mean.{key}", sum(k * v for k, v in sizes.items()) / calls)
            report.figure(f"infer_p50_ms.{key}", p50)
        rows.append([name, speed.cell(), _n(percentile(lags, 50)), _n(percentile(lags, 99)),
                     f"{sum(k * v for k, v in sizes.items()) / calls:.1f}" if calls else "-", hist or "-",
                     _n(p50, "{:.2f}")])
    report.table(["variant", "frames/s median (min-max)", "lag p50", "lag p99", "infer batch mean",
                  "infer batch sizes (size:calls)", "infer p50 ms"], rows,
                 title="throughput (environment frames that reached the learner; policy lag in versions)")

    partrain_names = [n for n in fps if n.startswith("partrain")]
    best = max(partrain_names, key=lambda n: Spread.of([r.fps for r in fps[n]]).median)
    fps_ratio = paired_ratio([r.fps for r in fps[best]], [r.fps for r in fps["sb3 ppo"]]) if have_sb3 else None
    single_ratio = paired_ratio([r.fps for r in fps[best]], [r.fps for r in fps["single"]])
    report.figure("ratio.best_partrain_fps_over_single", single_ratio)
    ratio_rows = [[f"{best} / single frames/s", single_ratio.cell()]]
    if fps_ratio is not None:
        report.figure("ratio.best_partrain_fps_over_sb3", fps_ratio)
        ratio_rows.append([f"{best} / sb3 ppo frames/s", fps_ratio.cell()])

    time_ratio = math.nan
    if solve:
        rows = []
        for name, runs in solve.items():
            secs = Spread.of([r.seconds_to_target for r in runs])
            with_startup = Spread.of([r.seconds_with_startup for r in runs])
            frames = Spread.of([r.frames_to_target for r in runs])
            reached = sum(not math.isnan(r.seconds_to_target) for r in runs)
            report.figure(f"time_to_475.{name.replace(' ', '_')}", secs)
            report.figure(f"time_to_475_with_startup.{name.replace(' ', '_')}", with_startup)
            report.figure(f"frames_to_475.{name.replace(' ', '_')}", frames)
            rows.append([name, secs.cell(), with_startup.cell(), frames.cell(), f"{reached}/{len(runs)}"])
            if name.startswith("partrain"):
                partrain_lags += [lag for r in runs for lag in r.lags]
        report.table(["variant", "seconds to 475 median (min-max)", "incl. start-up", "frames to 475", "reached"],
                     rows, title=f"time to a mean return of {TARGET:g} over the last 20 episodes, from scratch, "
                                 f"seed r in round r (goal and ratios: the first column)")
        for name, (clock, startup) in _CLOCKS.items():
            report.say(f"  {name} clock: from {clock}; incl. start-up: from {startup}")
        if have_sb3:
            ratio = paired_ratio(_unreached_last(solve["partrain 2 local"]),
                                 [r.seconds_to_target for r in solve["sb3 ppo"]])
            time_ratio = ratio.median
            report.figure("ratio.time_to_475_partrain_over_sb3", ratio)
            ratio_rows.append(["partrain 2 local / sb3 ppo seconds to 475", ratio.cell()])
        single = paired_ratio(_unreached_last(solve["partrain 2 local"]),
                              [r.seconds_to_target for r in solve["single"]])
        report.figure("ratio.time_to_475_partrain_over_single", single)
        ratio_rows.append(["partrain 2 local / single seconds to 475", single.cell()])
    report.table(["ratio", "median (min-max)"], ratio_rows, title="ratios, round by round")

    report.goal("rl.time_to_475_vs_sb3", None if math.isnan(time_ratio) else time_ratio, "<=", 0.5,
                "partrain (2 local actors) / SB3 PPO wall time to return 475")
    report.goal("rl.fps_vs_sb3", None if fps_ratio is None else fps_ratio.median, ">=", 2.0,
                f"{best} / SB3 PPO environment frames/s")
    lag = percentile(partrain_lags, 50)
    report.goal("rl.policy_lag_p50", None if math.isnan(lag) else lag, "<=", 1.0,
                "median policy lag of partrain's segments (versions)")


def _unreached_last(runs: list[Run]) -> list[float]:
    """Seconds to the target, a run that never got there as infinitely slow: a ratio's round,
    not one left out (left out, a seed that fails would make the median look better)."""
    return [math.inf if math.isnan(r.seconds_to_target) else r.seconds_to_target for r in runs]


#: what each time-to-475 clock covers: (first column, incl. start-up column)
_CLOCKS = {
    "partrain": ("every actor acting (each sent a segment), the learner's model fresh",
                 "launching the actor processes (python, torch import, connect, first weights)"),
    "single": ("its model and environments built", "the train_single call"),
    "sb3 ppo": ("model.learn(), its environments and model built",
                "building its environments and model (SB3's import not counted)"),
}


def _n(x: float, fmt: str = "{:g}") -> str:
    return "-" if math.isnan(x) else fmt.format(x)
