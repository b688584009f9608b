"""V-trace against its definition, written out by hand in float64.

`partrain.rl.vtrace` computes the targets with the backward recursion of the
IMPALA paper (eq. 4); the reference here is the paper's eq. 1, the explicit sum
``vs_s = V(x_s) + sum_t gamma^(t-s) (prod_{i<t} c_i) delta_t``, computed with plain
Python floats. If the recursion, the clipping or the bootstrap is off by one step,
the two disagree.
"""

from __future__ import annotations

import math

import torch

from partrain.rl import VTrace, vtrace
from partrain.rl.algorithms import ActorCritic

REWARDS = [1.0, 0.5, -1.0, 2.0]
VALUES = [0.3, -0.2, 0.7, 0.1]
BOOTSTRAP = 0.4
DISCOUNTS = [0.9, 0.0, 0.9, 0.9]  # an episode ends after step 1
BEHAVIOUR = [math.log(0.5), math.log(0.2), math.log(0.9), math.log(0.4)]
TARGET = [math.log(0.7), math.log(0.1), math.log(0.3), math.log(0.8)]


def reference(rho_bar: float, c_bar: float) -> tuple[list[float], list[float]]:
    n = len(REWARDS)
    ratio = [math.exp(t - b) for t, b in zip(TARGET, BEHAVIOUR)]
    rho = [min(rho_bar, r) for r in ratio]
    c = [min(c_bar, r) for r in ratio]
    nxt = VALUES[1:] + [BOOTSTRAP]
    delta = [rho[t] * (REWARDS[t] + DISCOUNTS[t] * nxt[t] - VALUES[t]) for t in range(n)]
    vs = []
    for s in range(n):
        total, weight = 0.0, 1.0
        for t in range(s, n):
            total += weight * delta[t]
            weight *= DISCOUNTS[t] * c[t]
        vs.append(VALUES[s] + total)
    next_vs = vs[1:] + [BOOTSTRAP]
    adv = [rho[t] * (REWARDS[t] + DISCOUNTS[t] * next_vs[t] - VALUES[t]) for t in range(n)]
    return vs, adv


def column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).unsqueeze(1)  # [T, E=1]


def test_vtrace_matches_the_explicit_sum():
    for rho_bar, c_bar in ((1.0, 1.0), (2.0, 0.5)):
        vs, adv = vtrace(column(BEHAVIOUR), column(TARGET), column(REWARDS), column(VALUES),
                         torch.tensor([BOOTSTRAP], dtype=torch.float64), column(DISCOUNTS), rho_bar, c_bar)
        want_vs, want_adv = reference(rho_bar, c_bar)
        assert torch.allclose(vs.squeeze(1), torch.tensor(want_vs, dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.allclose(adv.squeeze(1), torch.tensor(want_adv, dtype=torch.float64), rtol=0, atol=1e-12)


def test_on_policy_targets_are_bootstrapped_returns():
    """pi = mu: every ratio is 1 and vs_s is the discounted return bootstrapped from the last value."""
    vs, _ = vtrace(column(BEHAVIOUR), column(BEHAVIOUR), column(REWARDS), column(VALUES),
                   torch.tensor([BOOTSTRAP], dtype=torch.float64), column(DISCOUNTS))
    ret, want = BOOTSTRAP, []
    for r, d in zip(reversed(REWARDS), reversed(DISCOUNTS)):
        ret = r + d * ret
        want.append(ret)
    assert torch.allclose(vs.squeeze(1), torch.tensor(want[::-1], dtype=torch.float64), rtol=0, atol=1e-12)


def test_update_changes_the_model_and_reports_finite_figures():
    torch.manual_seed(0)
    model = ActorCritic(4, 2).double()
    before = [p.detach().clone() for p in model.parameters()]
    steps, envs = 5, 3
    batch = {"obs": torch.randn(steps + 1, envs, 4, dtype=torch.float64),
             "actions": torch.randint(0, 2, (steps, envs)),
             "logp": torch.full((steps, envs), math.log(0.5), dtype=torch.float64),
             "rewards": torch.ones(steps, envs, dtype=torch.float64),
             "dones": torch.zeros(steps, envs, dtype=torch.float64),
             "versions": torch.zeros(steps, envs, dtype=torch.int64)}
    figures = VTrace().update(model, torch.optim.SGD(model.parameters(), lr=0.1), batch)
    assert all(math.isfinite(v) for v in figures.values())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
