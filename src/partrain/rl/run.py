"""A learner process on a gymnasium environment: build, serve, train, report, linger, stop.

What ``partrain rl serve`` and ``partrain rl train`` share. ``rl train`` also starts
``--actors`` processes with `subprocess` running ``partrain rl act URL``: each
connects by URL exactly as an outside process would.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..env import pick_device
from ..errors import UsageError
from .algorithms import PPO, ActorCritic, VTrace
from .app import LearnerServer
from .envs import env_spec
from .learner import Learner, percentile

TOKEN_ENV = "PARTRAIN_RL_TOKEN"
#: PPO's epochs per batch in partrain's runtime: 20 (the RL Zoo's) needed a few more frames
#: less, but twice the learner's time per frame (CartPole-v1, single process, 4 seeds each)
PPO_EPOCHS = 10


@dataclass
class LearnerConfig:
    """Settings of one learner on a gymnasium environment (the CLI's options)."""

    env: str = "CartPole-v1"
    hidden: int = 64
    lr: float = 1e-3
    unroll: int = 16
    batch_segments: int | None = None  # None: one per actor acting, at least 2 (`Learner.batch_target`)
    max_queue: int = 8
    max_lag: int = 10
    algorithm: str = "vtrace"  # see ALGORITHMS
    gamma: float | None = None  # None: the algorithm's own default
    entropy_coef: float = 0.0
    epochs: int | None = None  # passes per batch (None: the algorithm's: VTrace's 1, PPO_EPOCHS)
    min_epochs: int | None = None  # PPO: fewer passes allowed once the next batch waits (None: fixed)
    seed: int = 0
    checkpoint: str | None = None
    checkpoint_every: int = 100
    resume: bool = False
    max_batch_size: int = 256
    threads: int = 1
    device: str = "cpu"  # where the learner's model trains: cpu, cuda, cuda:N or auto (actors act on CPUs)


ALGORITHMS = ("vtrace", "ppo")


def make_algorithm(name: str, gamma: float | None = None, entropy_coef: float = 0.0, epochs: int | None = None,
                   min_epochs: int | None = None) -> Any:
    """``vtrace`` (`VTrace`, one step per batch: the default) or ``ppo`` (`PPO`, 10 epochs per batch);
    ``epochs`` (None: those defaults) sets the steps per batch of either.

    Measured on CartPole-v1 (2 cores): in one process PPO reached 475 in 39-55k frames
    (4-7 s) against V-trace's ~240k; behind the runtime with 2 actors the learner's 10
    epochs per batch made it the bottleneck, the segments waited (policy lag 5 versions
    against 1) and PPO needed 74-166k frames, one run of 3 not solving in 400k, where
    V-trace needed 60-133k. So V-trace stays the runtime's default; PPO suits a learner
    with cores to spare (or a GPU).
    """
    if name not in ALGORITHMS:
        raise UsageError(f"Expected an algorithm among {list(ALGORITHMS)}. Received: {name!r}")
    extra = {} if gamma is None else {"gamma": gamma}
    if name == "ppo":
        return PPO(epochs=epochs or PPO_EPOCHS, min_epochs=min_epochs, entropy_coef=entropy_coef, **extra)
    if epochs is not None:
        extra["epochs"] = epochs
    return VTrace(entropy_coef=entropy_coef, **extra)


def build_learner(cfg: LearnerConfig) -> Learner:
    # a small policy: one torch thread. More would spin-wait against the actors for the cores
    # (OpenMP's busy-waiting under oversubscription made updates 100x slower on 2 cores).
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    obs_dim, num_actions = env_spec(cfg.env)
    model = ActorCritic(obs_dim, num_actions, cfg.hidden).to(pick_device(0, cfg.device))
    return Learner(model, make_algorithm(cfg.algorithm, cfg.gamma, cfg.entropy_coef, cfg.epochs, cfg.min_epochs), obs_shape=(obs_dim,),
                   num_actions=num_actions, unroll=cfg.unroll, batch_segments=cfg.batch_segments,
                   max_queue=cfg.max_queue, max_lag=cfg.max_lag, lr=cfg.lr, env=cfg.env,
                   checkpoint=cfg.checkpoint, checkpoint_every=cfg.checkpoint_every, resume=cfg.resume,
                   seed=cfg.seed)


@contextlib.contextmanager
def serving(learner: Learner, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
            max_batch_size: int = 256, linger: float = 5.0) -> Iterator[LearnerServer]:
    """Serve ``learner`` for the duration of the block; afterwards answer 410 to the actors still
    sending (at most ``linger`` seconds) so that they end on their own, then stop the server."""
    server = LearnerServer(learner, host=host, port=port, token=token, max_batch_size=max_batch_size)
    server.start()
    try:
        yield server
    finally:
        learner.finished = True
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline and learner.actors_still_sending(within=3.0):
            time.sleep(0.05)  # polling the condition (actors told), bounded by `linger`
        server.stop()


#: How much lower the CPU priority of the actors partrain starts is than the learner's (``nice``
#: increment; `partrain rl train --actor-nice`). When the actors and the learner share too few
#: cores, the learner's update is what every actor waits for (its next weights): on the 2-core
#: host, 2 local actors at +10 left segments a mean 1.23 versions behind at training against 1.52
#: at +0 (median 1 against 2), at the same frames/s (14.1k against 13.4k; 4 alternating 5-s
#: windows each; 4 actors: 1.21 against 1.47). With a core to spare it changes nothing.
ACTOR_NICE = 10


def start_actor(url: str, env: str, *, num_envs: int, mode: str, seed: int, token: str | None,
                name: str, capture: bool = False, nice: int = ACTOR_NICE) -> subprocess.Popen:
    """``python -m partrain rl act URL``: an actor process, as anyone could start one, ``nice`` lower
    in CPU priority than this process (`ACTOR_NICE`)."""
    cmd = [sys.executable, "-m", "partrain", "rl", "act", url, "--env", env, "--num-envs", str(num_envs),
           "--mode", mode, "--seed", str(seed), "--name", name]
    env_vars = dict(os.environ)
    if token:
        env_vars[TOKEN_ENV] = token
    out = subprocess.PIPE if capture else None  # capture: the caller reads it once the actor ended
    proc = subprocess.Popen(cmd, env=env_vars, stdin=subprocess.DEVNULL, stdout=out, stderr=out, text=True)
    # Popen returns once the child has exec'd, long before its Python starts a thread: every thread
    # it starts inherits this priority (a preexec_fn would do the same, but is unsafe in a threaded caller)
    if nice and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):  # gone already, or not allowed here: it runs at our priority
            os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
    return proc


def stop_actors(procs: list[subprocess.Popen], timeout: float = 10.0) -> list[int | None]:
    """Wait for actors to end (bounded), then terminate, then kill; their exit codes."""
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)
    return [p.returncode for p in procs]


def format_row(row: dict[str, Any], batch_sizes: dict[int, int] | None = None) -> str:
    """One progress line: version, frames, frames/s, return, policy lag, inference batches."""
    ret = row["mean_return"]
    line = (f"version {row['version']:>6}  frames {row['frames']:>8}  fps {row['fps']:>8.0f}  "
            f"return {'-' if math.isnan(ret) else f'{ret:.1f}':>6}  lag p50/p99 "
            f"{_num(row['lag_p50'])}/{_num(row['lag_p99'])}")
    if batch_sizes:
        rows = sum(k * v for k, v in batch_sizes.items())
        calls = sum(batch_sizes.values())
        line += f"  infer batch mean {rows / calls:.1f} (max {max(batch_sizes)})"
    return line


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:g}"


def curve_rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The learner's reports in `partrain.metrics.MetricsWriter`'s shape (``epoch`` = report)."""
    rows = []
    for i, r in enumerate(history, 1):
        rows.append({"epoch": i, "seconds": r["seconds"], "frames": r["frames"], "version": r["version"],
                     "train_loss": r.get("loss", math.nan), "train_return": r["mean_return"],
                     "train_fps": r["fps"], "train_lag_p50": r["lag_p50"], "lag_p99": r["lag_p99"],
                     "episodes": r["episodes"], "rejected_full": r["rejected_full"],
                     "rejected_stale": r["rejected_stale"]})
    return rows


def summary(learner: Learner) -> dict[str, Any]:
    st = learner.stats
    seconds = time.perf_counter() - st.started
    return {"versions": learner.version, "frames": st.frames, "seconds": seconds,
            "fps": st.frames / seconds if seconds > 0 else 0.0, "mean_return": st.mean_return(),
            "episodes": st.episodes, "solved_seconds": st.solved_at, "solved_frames": st.solved_frames,
            "lag_p50": percentile(st.lags, 50), "lag_p99": percentile(st.lags, 99)}
