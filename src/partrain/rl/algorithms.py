"""Learner algorithms: one update of the model from a batch of trajectory segments.

The runtime (`partrain.rl.Learner`) is algorithm-agnostic. An *algorithm* is any
object with ``update(model, optimizer, batch) -> dict[str, float]``: it trains the
model on ``batch`` (see `Batch`) and returns figures worth logging. Each call makes
one new weights version; what happens inside (one gradient step, several PPO epochs)
is the algorithm's business.

Vocabulary: a *segment* is ``T`` consecutive steps of ``E`` environments of one actor;
tensors are time-major (``[T, E, ...]``). ``obs`` has ``T + 1`` rows: the last is the
observation after the segment, whose value bootstraps the returns. ``logp`` is the
log-probability of the action taken under the *behaviour* policy (the weights that
acted), which may lag the learner's: V-trace corrects for that lag.

The model contract: ``model(obs) -> (logits, value)`` with ``logits`` ``[N, A]`` for
a discrete action space and ``value`` ``[N]``. `ActorCritic` is a small MLP that keeps it.
A model may also have ``policy_logits(obs) -> logits``: acting (`policy_logits`) then
skips the value head, which only the learner needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Batch = dict[str, Tensor]
"""``obs [T+1, E, *obs_shape]``, ``actions [T, E]`` int64, ``logp [T, E]``, ``rewards [T, E]``,
``dones [T, E]`` (1.0 where the episode ended at that step), ``versions [T, E]`` int64."""


class Algorithm(Protocol):
    """What `Learner` needs of an algorithm: one update per call, figures back."""

    def update(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> dict[str, float]:
        ...


class ActorCritic(nn.Module):
    """A policy MLP and a value MLP over flat observations: ``forward(obs) -> (logits, value)``.

    Two separate bodies, as stable-baselines3 builds them: with one shared body the
    value loss (returns of ~100 on CartPole) dwarfs the policy gradient, and gradient
    clipping then all but stops the policy from learning.
    """

    def __init__(self, obs_dim: int, num_actions: int, hidden: int = 64):
        super().__init__()
        self.obs_dim, self.num_actions, self.hidden = obs_dim, num_actions, hidden
        self.policy = _mlp(obs_dim, hidden, num_actions, last_gain=0.01)  # a near-uniform first policy
        self.value = _mlp(obs_dim, hidden, 1, last_gain=1.0)

    def forward(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        return self.policy(obs), self.value(obs).squeeze(-1)

    def policy_logits(self, obs: Tensor) -> Tensor:
        """The policy head alone: what acting needs (half the forward's work)."""
        return self.policy(obs)

    def spec(self) -> dict[str, int | str]:
        """What an actor needs to build the same module (``GET /rl/v1/info``)."""
        return {"kind": "ActorCritic", "obs_dim": self.obs_dim, "num_actions": self.num_actions,
                "hidden": self.hidden}


def policy_logits(model: nn.Module, obs: Tensor) -> Tensor:
    """The logits ``model`` acts with, without gradients: its ``policy_logits(obs)`` where it has
    one (no value head computed), else the first output of ``model(obs)``."""
    head = getattr(model, "policy_logits", None)
    with torch.inference_mode():
        return head(obs) if callable(head) else model(obs)[0]


def default_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Adam for the learner: fused (one kernel over every parameter) where the parameters allow it.

    The learner steps a small model many times per second, so per-parameter dispatch counts: one
    20-pass PPO update of `ActorCritic` on 256 frames took 48 ms fused against 69 ms with the
    default per-tensor loop (one thread, this project's 2-core CI host), one V-trace update 2.6 ms
    against 3.9 ms. Same update rule; the sums run in another order, so not bit-identical.
    """
    params = list(model.parameters())
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.Adam(params, lr=lr, fused=fused or None)


def _mlp(inputs: int, hidden: int, outputs: int, last_gain: float) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                        nn.Linear(hidden, outputs))
    for layer in net:
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, 2 ** 0.5)
            nn.init.zeros_(layer.bias)
    nn.init.orthogonal_(net[-1].weight, last_gain)
    return net


def vtrace(behaviour_logp: Tensor, target_logp: Tensor, rewards: Tensor, values: Tensor,
           bootstrap: Tensor, discounts: Tensor, rho_bar: float = 1.0, c_bar: float = 1.0,
           lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """V-trace targets ``vs`` and policy-gradient advantages (Espeholt et al. 2018, eq. 1 and 4).

    All inputs ``[T, E]`` except ``bootstrap`` (``[E]``, the value after the last step);
    ``discounts`` is ``gamma * (1 - done)``. With ``rho_t = min(rho_bar, pi/mu)`` and
    ``c_t = min(c_bar, pi/mu)``::

        delta_t = rho_t (r_t + discount_t V(x_{t+1}) - V(x_t))
        vs_t    = V(x_t) + delta_t + discount_t c_t (vs_{t+1} - V(x_{t+1}))
        adv_t   = rho_t (r_t + discount_t vs_{t+1} - V(x_t))

    ``lam`` < 1 multiplies every ``c_t`` (the paper's lambda, section 4.2): on-policy
    (``pi = mu``) the targets are then GAE(lambda)'s returns and ``vs_t - V(x_t)`` its
    advantages. No gradient flows through the result.
    """
    with torch.no_grad():
        ratio = torch.exp(target_logp - behaviour_logp)
        rho = ratio.clamp(max=rho_bar)
        c = lam * ratio.clamp(max=c_bar)
        next_values = torch.cat([values[1:], bootstrap.unsqueeze(0)], dim=0)
        deltas = rho * (rewards + discounts * next_values - values)
        acc = torch.zeros_like(bootstrap)
        corrections = []
        for t in range(values.shape[0] - 1, -1, -1):  # vs_t - V(x_t), backwards in time
            acc = deltas[t] + discounts[t] * c[t] * acc
            corrections.append(acc)
        vs = values + torch.stack(corrections[::-1])
        next_vs = torch.cat([vs[1:], bootstrap.unsqueeze(0)], dim=0)
        advantages = rho * (rewards + discounts * next_vs - values)
    return vs, advantages


def _check_counts(settings: object, *names: str) -> None:
    """Each named setting is an int >= 1 (one line otherwise)."""
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Expected {name} >= 1. Received: {name}={value!r}")


@dataclass
class VTrace:
    """IMPALA's actor-critic with V-trace off-policy corrections: ``epochs`` gradient steps per update.

    Tolerates policy lag: segments acted by older weights are reweighted by the
    truncated importance ratios ``rho``/``c`` instead of being thrown away.
    """

    gamma: float = 0.99
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    rho_bar: float = 1.0
    c_bar: float = 1.0
    max_grad_norm: float = 0.5
    normalize_advantages: bool = True  # per batch: the step size stops depending on the return's scale
    #: gradient steps per batch, each with V-trace recomputed under the weights it updates (the
    #: truncated ratios correct for the batch growing off-policy as the learner moves). In one
    #: process (`train_single`, 16 envs, CartPole-v1) 2 halved the frames to 475 (46-82k over 7
    #: seeds, against 91-243k with 1, one seed unsolved in 200k) and 3 or 4 left half the seeds
    #: unsolved. Behind the runtime (2 actors, policy lag ~1 version) 2 did worse than 1: 1 of 3
    #: seeds solved in 300k frames, one collapsed to a return of 9.5, where 1 solved all 3 in
    #: 108-139k. So 1 stays the default.
    epochs: int = 1

    def __post_init__(self) -> None:
        _check_counts(self, "epochs")

    def update(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> dict[str, float]:
        """``epochs`` gradient steps of the V-trace actor-critic loss on ``batch``."""
        figures: dict[str, float] = {}
        for _ in range(self.epochs):
            figures = self._step(model, optimizer, batch)
        return figures

    def _step(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> dict[str, float]:
        obs = batch["obs"]
        steps, envs = batch["actions"].shape
        logits, values = model(obs.reshape(-1, *obs.shape[2:]))
        logits = logits.reshape(steps + 1, envs, -1)[:-1]
        values = values.reshape(steps + 1, envs)
        log_probs = F.log_softmax(logits, dim=-1)
        target_logp = log_probs.gather(-1, batch["actions"].unsqueeze(-1)).squeeze(-1)
        discounts = self.gamma * (1.0 - batch["dones"])
        vs, advantages = vtrace(batch["logp"], target_logp.detach(), batch["rewards"], values[:-1].detach(),
                                values[-1].detach(), discounts, self.rho_bar, self.c_bar)
        if self.normalize_advantages and advantages.numel() > 1:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        pg_loss = -(target_logp * advantages).mean()
        value_loss = 0.5 * (vs - values[:-1]).pow(2).mean()
        entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
        loss = pg_loss + self.value_coef * value_loss - self.entropy_coef * entropy
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        optimizer.step()
        return {"loss": loss.item(), "pg_loss": pg_loss.item(), "value_loss": value_loss.item(),
                "entropy": entropy.item(), "grad_norm": grad_norm.item()}


@dataclass
class PPO:
    """PPO's clipped surrogate over several epochs of each batch, with V-trace targets for lag.

    Each update: the learner's current weights score the batch once (the *proximal*
    policy, as decoupled PPO calls it); V-trace with ``lam`` turns the segments, acted
    by weights that may lag, into value targets and advantages (truncated importance
    ratios, GAE(lambda) when nothing lags); then ``epochs`` passes of ``minibatches``
    gradient steps each on ``min(r A, clip(r, 1 - clip, 1 + clip) A)``, where ``r`` is
    the new policy over the proximal one. Reusing each frame for several steps is what
    makes it need fewer frames than `VTrace`'s one step per batch.

    The defaults follow the RL Zoo's PPO settings for CartPole-v1 (gamma 0.98, lambda
    0.8, 20 epochs, clip 0.2).

    ``min_epochs`` (default: ``epochs``, a fixed count) lets the caller cut the passes
    short: after each pass from the ``min_epochs``-th on, ``update``'s ``enough()`` is
    asked and a true answer ends the update. `Learner` answers "the next batch is
    waiting", so the learner runs extra passes only while the actors collect the next
    batch (epochs overlapped with collection), and a slow learner never makes segments
    wait longer than ``min_epochs`` passes.
    """

    gamma: float = 0.98
    lam: float = 0.8
    clip: float = 0.2
    epochs: int = 20
    minibatches: int = 1
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    rho_bar: float = 1.0
    c_bar: float = 1.0
    max_grad_norm: float = 0.5
    normalize_advantages: bool = True
    min_epochs: int | None = None

    def __post_init__(self) -> None:
        _check_counts(self, "epochs", "minibatches")
        if self.min_epochs is not None and (isinstance(self.min_epochs, bool) or not isinstance(self.min_epochs, int)
                                            or not 1 <= self.min_epochs <= self.epochs):
            raise ValueError(f"Expected 1 <= min_epochs <= epochs ({self.epochs}). "
                             f"Received: min_epochs={self.min_epochs!r}")
        if not 0 < self.clip < 1:
            raise ValueError(f"Expected 0 < clip < 1. Received: clip={self.clip!r}")

    def update(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
               enough: Callable[[], bool] | None = None) -> dict[str, float]:
        """``epochs`` x ``minibatches`` clipped-surrogate steps on ``batch`` (fewer passes, not
        under ``min_epochs``, once ``enough()`` is true)."""
        obs = batch["obs"]
        steps, envs = batch["actions"].shape
        flat_obs = obs.reshape(-1, *obs.shape[2:])
        with torch.no_grad():
            logits, values = model(flat_obs)
            log_probs = F.log_softmax(logits.reshape(steps + 1, envs, -1)[:-1], dim=-1)
            prox_logp = log_probs.gather(-1, batch["actions"].unsqueeze(-1)).squeeze(-1)
            values = values.reshape(steps + 1, envs)
            discounts = self.gamma * (1.0 - batch["dones"])
            vs, _ = vtrace(batch["logp"], prox_logp, batch["rewards"], values[:-1], values[-1], discounts,
                           self.rho_bar, self.c_bar, self.lam)
            # the lambda-return advantage, reweighted by the truncated ratio of the acting policy
            rho = torch.exp(prox_logp - batch["logp"]).clamp(max=self.rho_bar)
            advantages = rho * (vs - values[:-1])
        n = steps * envs
        samples = {"obs": obs[:-1].reshape(n, *obs.shape[2:]), "actions": batch["actions"].reshape(n),
                   "prox_logp": prox_logp.reshape(n), "advantages": advantages.reshape(n), "vs": vs.reshape(n)}
        size = max(1, n // self.minibatches)
        # summed as tensors, read once at the end: no device sync per minibatch
        sums = torch.zeros(5, dtype=torch.float64, device=obs.device)
        count = 0
        least = self.epochs if self.min_epochs is None else self.min_epochs
        passes = 0
        for epoch in range(self.epochs):
            if epoch >= least and enough is not None and enough():
                break
            passes += 1
            order = torch.randperm(n)
            for start in range(0, n - size + 1, size):
                idx = order[start:start + size]
                adv = samples["advantages"][idx]
                if self.normalize_advantages and adv.numel() > 1:
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                new_logits, new_values = model(samples["obs"][idx])
                new_log_probs = F.log_softmax(new_logits, dim=-1)
                logp = new_log_probs.gather(-1, samples["actions"][idx].unsqueeze(-1)).squeeze(-1)
                ratio = torch.exp(logp - samples["prox_logp"][idx])
                clipped = ratio.clamp(1 - self.clip, 1 + self.clip)
                pg_loss = -torch.min(ratio * adv, clipped * adv).mean()
                value_loss = 0.5 * (samples["vs"][idx] - new_values).pow(2).mean()
                entropy = -(new_log_probs.exp() * new_log_probs).sum(-1).mean()
                loss = pg_loss + self.value_coef * value_loss - self.entropy_coef * entropy
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
                optimizer.step()
                count += 1
                with torch.no_grad():
                    clip_fraction = ((ratio - 1).abs() > self.clip).double().mean()
                    sums += torch.stack([loss, pg_loss, value_loss, entropy, clip_fraction]).double()
        means = (sums / max(count, 1)).tolist()
        figures = dict(zip(("loss", "pg_loss", "value_loss", "entropy", "clip_fraction"), means))
        figures["epochs"] = float(passes)
        return figures
