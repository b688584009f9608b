"""Population-based training (Jaderberg et al. 2017), with Ray Tune's knobs.

Every ``interval`` steps the members are scored; each member of the bottom
quantile copies the weights *and optimizer state* of a member drawn at random
from the top quantile (an in-memory copy: `Population.copy_member`), then
explores: each mutated hyperparameter is resampled from its distribution with
probability ``resample_probability``, otherwise perturbed (numbers scaled by one
of ``perturbation_factors``, categorical values moved to a neighbour).

Decisions use a ``torch.Generator`` seeded identically in every process, so a
population spread over processes takes the same decisions everywhere and only
the copied member's tensors travel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import UsageError
from .population import Population
from .space import Spec, perturb, sample


class PBT:
    """Exploit and explore for a `Population`.

    Args:
        hyperparam_mutations: name -> distribution, list of values or callable (see `space`).
        interval: steps between two exploit/explore rounds (``perturbation_interval`` in Ray).
        quantile_fraction: share of members in the top and in the bottom quantile (0 to 0.5).
        perturbation_factors: factors a numeric hyperparameter is multiplied by (one drawn).
        resample_probability: chance to resample a hyperparameter instead of perturbing it.
        metric: ``"accuracy"`` (mode ``"max"``) or ``"loss"`` (mode ``"min"``); for the log.
        mode: ``"max"`` when higher scores are better, ``"min"`` otherwise.
        custom_explore_fn: optional ``dict -> dict`` applied after the mutations (as in Ray).
        seed: seeds the decisions.
    """

    def __init__(self, hyperparam_mutations: Mapping[str, Spec], *, interval: int = 100,
                 quantile_fraction: float = 0.25, perturbation_factors: Sequence[float] = (1.2, 0.8),
                 resample_probability: float = 0.25, metric: str = "accuracy", mode: str = "max",
                 custom_explore_fn: Callable[[dict[str, float]], dict[str, float]] | None = None,
                 seed: int = 0) -> None:
        if not isinstance(interval, int) or interval < 1:
            raise UsageError(f"Expected a positive PBT interval in steps. Received: interval={interval!r}")
        if not 0.0 <= quantile_fraction <= 0.5:
            raise UsageError(f"Expected quantile_fraction in [0, 0.5]. Received: {quantile_fraction!r}")
        if not 0.0 <= resample_probability <= 1.0:
            raise UsageError(f"Expected resample_probability in [0, 1]. Received: {resample_probability!r}")
        if not perturbation_factors or any(f <= 0 for f in perturbation_factors):
            raise UsageError(f"Expected positive perturbation factors. Received: {list(perturbation_factors)}")
        if mode not in ("max", "min"):
            raise UsageError(f"Expected mode 'max' or 'min'. Received: {mode!r}")
        if not hyperparam_mutations and custom_explore_fn is None:
            raise UsageError("Expected hyperparam_mutations (or custom_explore_fn). Received: none")
        self.mutations = dict(hyperparam_mutations)
        self.interval = interval
        self.quantile_fraction = quantile_fraction
        self.perturbation_factors = tuple(float(f) for f in perturbation_factors)
        self.resample_probability = resample_probability
        self.metric = metric
        self.mode = mode
        self.custom_explore_fn = custom_explore_fn
        self.generator = torch.Generator().manual_seed(seed)
        self.lineage: list[dict[str, Any]] = []
        #: the step of the last round (-1: none yet)
        self.last_round = -1

    def due(self, step: int) -> bool:
        """Whether an exploit/explore round happens after ``step`` steps."""
        return step > 0 and step % self.interval == 0

    def quantiles(self, scores: torch.Tensor) -> tuple[list[int], list[int]]:
        """Member ids of the bottom and top quantiles (Ray Tune's sizing; NaN ranks last)."""
        n = len(scores)
        if n <= 1:
            return [], []
        key = scores.to(torch.float64).clone()
        if self.mode == "min":
            key = -key
        key[torch.isnan(key)] = -math.inf
        order = sorted(range(n), key=lambda i: (float(key[i]), -i))  # worst first; ties: higher id worse
        k = int(math.ceil(n * self.quantile_fraction))
        k = min(k, n // 2)
        return order[:k], order[n - k :]

    def explore(self, hparams: Mapping[str, float]) -> dict[str, float]:
        """New hyperparameters from a copied member's, per the mutation spec."""
        new = dict(hparams)
        for name, spec in self.mutations.items():
            if name not in new:
                raise UsageError(f"Expected mutations of the population's hyperparameters {sorted(new)}. "
                                 f"Received: {name!r}")
            resample = float(torch.rand((), generator=self.generator)) < self.resample_probability
            if resample or (callable(spec) and not hasattr(spec, "clip")):
                new[name] = sample(spec, self.generator)
            else:
                new[name] = perturb(spec, new[name], self.perturbation_factors, self.generator)
        if self.custom_explore_fn is not None:
            new = dict(self.custom_explore_fn(new))
        return new

    def update(self, population: Population, scores: torch.Tensor, step: int) -> list[dict[str, Any]]:
        """One exploit/explore round from the whole population's ``scores``; returns its lineage records."""
        if len(scores) != population.size:
            raise UsageError(f"Expected one score per member ({population.size}). Received: {len(scores)}")
        bottom, top = self.quantiles(scores)
        records = []
        for dst in bottom:
            src = top[int(torch.randint(len(top), (), generator=self.generator))]
            before = population.member_hparams(dst)
            population.copy_member(src, dst)
            after = self.explore(population.member_hparams(src))
            population.set_hparams(dst, after)
            records.append({
                "step": step, "dst": dst, "src": src,
                "dst_score": float(scores[dst]), "src_score": float(scores[src]),
                "hparams_before": before, "src_hparams": population.member_hparams(src),
                "hparams_after": population.member_hparams(dst),
            })
        self.lineage.extend(records)
        self.last_round = step
        return records

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "lineage": [dict(r) for r in self.lineage],
                "last_round": self.last_round}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.lineage = [dict(r) for r in state["lineage"]]
        self.last_round = int(state.get("last_round", -1))
