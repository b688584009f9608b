"""The same algorithm in one process: act, update, repeat (no HTTP, no policy lag).

The reference the actor-learner runtime is measured against (``partrain bench rl``)
and the quickest way to check an algorithm's settings on an environment.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .algorithms import ActorCritic, Algorithm, VTrace, default_optimizer, policy_logits
from .envs import EnvRunner, env_spec, sample_actions


@dataclass
class RunResult:
    """What a training run reached: frames, updates, seconds, the recent mean return."""

    frames: int
    versions: int
    seconds: float
    mean_return: float  # of the last ``window`` episodes (nan before any ended)
    solved: bool  # mean_return reached the target
    seconds_to_target: float | None = None
    frames_to_target: int | None = None
    history: list[dict[str, float]] = field(default_factory=list)


def mean_recent(returns: deque[float]) -> float:
    return sum(returns) / len(returns) if returns else float("nan")


def train_single(env: str = "CartPole-v1", *, num_envs: int = 16, unroll: int = 16, lr: float = 1e-3,
                 hidden: int = 64, seed: int = 0, max_frames: int = 200_000, target: float | None = 475.0,
                 window: int = 20, algorithm: Algorithm | None = None, timeout: float = 600.0) -> RunResult:
    """Train an `ActorCritic` on ``env`` in this process until the recent mean return reaches ``target``."""
    torch.manual_seed(seed)
    obs_dim, num_actions = env_spec(env)
    model = ActorCritic(obs_dim, num_actions, hidden)
    optimizer = default_optimizer(model, lr)
    algo = algorithm if algorithm is not None else VTrace()
    runner = EnvRunner(env, num_envs, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    returns: deque[float] = deque(maxlen=window)
    version = 0

    def act(obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        actions, logp = sample_actions(policy_logits(model, obs), generator)
        return actions, logp, version

    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    result = RunResult(0, 0, 0.0, float("nan"), False)
    try:
        while runner.frames < max_frames and time.monotonic() < deadline:
            segment, finished = runner.rollout(act, unroll)
            returns.extend(finished)
            algo.update(model, optimizer, segment)
            version += 1
            if target is not None and len(returns) == window and mean_recent(returns) >= target:
                result.solved = True
                result.seconds_to_target = time.perf_counter() - t0
                result.frames_to_target = runner.frames
                break
    finally:
        runner.close()
    result.frames, result.versions = runner.frames, version
    result.seconds = time.perf_counter() - t0
    result.mean_return = mean_recent(returns)
    return result
