"""Stepping environments into trajectory segments: the one loop every actor runs.

`EnvRunner` holds ``E`` gymnasium environments and their current observations;
``rollout(act, T)`` steps all of them ``T`` times with actions chosen by ``act``
(local weights, a central inference server, or the learner's own model in the
single-process loop) and returns a segment (see `partrain.rl.algorithms.Batch`)
plus the returns of the episodes that ended in it. Environments reset themselves
when an episode ends; the segment's ``dones`` marks where.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import UsageError

ActFn = Callable[[Tensor], tuple[Tensor, Tensor, int]]
"""``act(obs [E, *obs_shape] float32) -> (actions [E] int64, logp [E] float32, version)``."""


def make_env(name: str, seed: int | None = None) -> Any:
    """``gymnasium.make(name)``, with one clear line when gymnasium or the name is missing."""
    try:
        import gymnasium
    except ImportError:
        raise UsageError("Expected gymnasium for RL environments (pip install 'partrain[rl]'). "
                         "Received: no module named 'gymnasium'") from None
    try:
        env = gymnasium.make(name)
    except gymnasium.error.Error as exc:
        raise UsageError(f"Expected a gymnasium environment id such as CartPole-v1. Received: {name!r} "
                         f"({type(exc).__name__}: {exc})") from None
    if not hasattr(env.action_space, "n"):
        raise UsageError(f"Expected an environment with discrete actions. Received: {name!r} with "
                         f"action space {env.action_space}")
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


def env_spec(name: str) -> tuple[int, int]:
    """``(obs_dim, num_actions)`` of environment ``name`` (flat observations)."""
    env = make_env(name)
    try:
        return int(np.prod(env.observation_space.shape)), int(env.action_space.n)
    finally:
        env.close()


class EnvRunner:
    """``num_envs`` copies of one environment, stepped in lock-step into segments."""

    def __init__(self, name: str, num_envs: int, seed: int = 0):
        if num_envs < 1:
            raise UsageError(f"Expected num_envs >= 1. Received: num_envs={num_envs}")
        self.envs = [make_env(name) for _ in range(num_envs)]
        first = [env.reset(seed=seed + i)[0] for i, env in enumerate(self.envs)]
        self.obs = torch.as_tensor(np.stack(first), dtype=torch.float32).reshape(num_envs, -1)
        self._flat = len(self.envs[0].observation_space.shape) <= 1  # else each observation is flattened
        self.returns = np.zeros(num_envs)
        self.frames = 0

    def rollout(self, act: ActFn, steps: int) -> tuple[dict[str, Tensor], list[float]]:
        """``steps`` steps of every environment; the segment and the returns of finished episodes.

        The per-environment loop touches only numpy and Python values (a torch element write
        costs ~8 us, as much as a CartPole step) and hands each environment an action of its
        space's own dtype (a Python int costs gymnasium's ``Discrete.contains`` an ``np.iinfo``
        per step). The segment is built in numpy arrays, each observation written into its row
        as it comes, and handed out as tensors sharing their memory: a rollout of 8 CartPoles
        cost 16% less per frame (42 against 50 us, 1,500 alternating rollouts) than with torch
        buffers and a tensor made of each step's observations.
        """
        num_envs = len(self.envs)
        obs = np.empty((steps + 1, *self.obs.shape), dtype=np.float32)
        actions = np.empty((steps, num_envs), dtype=np.int64)
        logp = np.empty((steps, num_envs), dtype=np.float32)
        versions = np.empty((steps, num_envs), dtype=np.int64)
        rewards = np.zeros((steps, num_envs), dtype=np.float32)
        dones = np.zeros((steps, num_envs), dtype=np.float32)
        action_dtype = self.envs[0].action_space.dtype
        finished: list[float] = []
        obs[0] = self.obs.numpy()
        for t in range(steps):
            a, lp, version = act(torch.from_numpy(obs[t]))  # a view: written once, never changed after
            chosen = a.detach().cpu().numpy().astype(action_dtype, copy=False)
            actions[t], logp[t], versions[t] = chosen, lp.detach().cpu().numpy(), version
            nxt = obs[t + 1]
            for i, env in enumerate(self.envs):
                o, r, terminated, truncated, _ = env.step(chosen[i])
                self.returns[i] += r
                rewards[t, i] = r
                # A time limit (truncated) is not an end: the return goes on from the next
                # episode's first state, whose value stands in for the cut-off state's (both are
                # ~1 / (1 - gamma) for a policy good enough to reach the limit). Marking it an end
                # would teach the value that identical states are worth 0 near the limit, and
                # destabilises a policy that already reaches it.
                if terminated:
                    dones[t, i] = 1.0
                if terminated or truncated:
                    finished.append(float(self.returns[i]))
                    self.returns[i] = 0.0
                    o, _ = env.reset()
                nxt[i] = o if self._flat else np.reshape(o, -1)
        self.obs = torch.from_numpy(obs[steps].copy())
        self.frames += steps * num_envs
        segment = {"obs": torch.from_numpy(obs), "actions": torch.from_numpy(actions), "logp": torch.from_numpy(logp),
                   "rewards": torch.from_numpy(rewards), "dones": torch.from_numpy(dones),
                   "versions": torch.from_numpy(versions)}
        return segment, finished

    def close(self) -> None:
        for env in self.envs:
            env.close()


def sample_actions(logits: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Actions drawn from ``softmax(logits)`` and their log-probabilities.

    The Gumbel-max trick: the argmax of the log-probabilities plus ``-log(-log(u))`` noise, ``u``
    uniform, is distributed exactly as ``softmax(logits)``. On an actor's few rows it costs about
    60% of ``torch.multinomial``'s time, which checks its input on every call.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    device = generator.device if generator is not None else log_probs.device
    uniform = torch.rand(log_probs.shape, generator=generator, device=device).to(log_probs.device)
    actions = (log_probs - torch.log(-torch.log(uniform))).argmax(-1)
    return actions, log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
