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
from partrain.rl.algorithms import ActorCritic, policy_logits

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


def test_on_policy_vtrace_with_lambda_is_gae():
    """pi = mu, lam < 1: vs_t - V(x_t) is GAE(lambda)'s advantage, summed by hand."""
    lam = 0.8
    vs, _ = vtrace(column(BEHAVIOUR), column(BEHAVIOUR), column(REWARDS), column(VALUES),
                   torch.tensor([BOOTSTRAP], dtype=torch.float64), column(DISCOUNTS), lam=lam)
    nxt = VALUES[1:] + [BOOTSTRAP]
    delta = [REWARDS[t] + DISCOUNTS[t] * nxt[t] - VALUES[t] for t in range(len(REWARDS))]
    gae, acc = [], 0.0
    for t in reversed(range(len(REWARDS))):
        acc = delta[t] + DISCOUNTS[t] * lam * acc
        gae.append(acc)
    want = [v + a for v, a in zip(VALUES, gae[::-1])]
    assert torch.allclose(vs.squeeze(1), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def _batch(steps: int, envs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(steps + 1, envs, 4, dtype=torch.float64, generator=g),
            "actions": torch.randint(0, 2, (steps, envs), generator=g),
            "logp": torch.log(torch.rand(steps, envs, dtype=torch.float64, generator=g) * 0.8 + 0.1),
            "rewards": torch.rand(steps, envs, dtype=torch.float64, generator=g),
            "dones": (torch.rand(steps, envs, generator=g) < 0.2).double(),
            "versions": torch.zeros(steps, envs, dtype=torch.int64)}


def test_one_ppo_step_is_the_clipped_surrogate_written_by_hand():
    from partrain.rl import PPO

    torch.manual_seed(0)
    model = ActorCritic(4, 2).double()
    ref = ActorCritic(4, 2).double()
    ref.load_state_dict(model.state_dict())
    batch = _batch(6, 3)
    algo = PPO(epochs=1, minibatches=1, max_grad_norm=1e9, value_coef=0.5, entropy_coef=0.01)
    algo.update(model, torch.optim.SGD(model.parameters(), lr=0.1), batch)

    # by hand: V-trace(lambda) targets and rho-weighted advantages from the weights before the step
    steps, envs = 6, 3
    with torch.no_grad():
        logits, values = ref(batch["obs"].reshape(-1, 4))
        logits, values = logits.reshape(steps + 1, envs, 2)[:-1], values.reshape(steps + 1, envs)
        prox = torch.log_softmax(logits, -1).gather(-1, batch["actions"].unsqueeze(-1)).squeeze(-1)
        vs, _ = vtrace(batch["logp"], prox, batch["rewards"], values[:-1], values[-1],
                       algo.gamma * (1 - batch["dones"]), lam=algo.lam)
        adv = (torch.exp(prox - batch["logp"]).clamp(max=1.0) * (vs - values[:-1])).reshape(-1)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    new_logits, new_values = ref(batch["obs"][:-1].reshape(-1, 4))
    log_probs = torch.log_softmax(new_logits, -1)
    logp = log_probs.gather(-1, batch["actions"].reshape(-1, 1)).squeeze(-1)
    ratio = torch.exp(logp - prox.reshape(-1))
    surrogate = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    loss = -surrogate + 0.5 * 0.5 * (vs.reshape(-1) - new_values).pow(2).mean() - 0.01 * entropy
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for got, want in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_ppo_reuses_each_batch_for_its_epochs_and_refuses_bad_settings():
    from partrain.rl import PPO

    torch.manual_seed(0)
    model = ActorCritic(4, 2).double()
    steps = []
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt.register_step_post_hook(lambda *_: steps.append(1))
    figures = PPO(epochs=3, minibatches=2).update(model, opt, _batch(4, 4))
    assert len(steps) == 3 * 2 and all(math.isfinite(v) for v in figures.values())
    for bad, line in (({"epochs": 0}, "Expected epochs >= 1"), ({"clip": 1.5}, "Expected 0 < clip < 1"),
                      ({"epochs": 3, "min_epochs": 4}, "Expected 1 <= min_epochs <= epochs (3)")):
        try:
            PPO(**bad)
        except ValueError as e:
            assert str(e).startswith(line)
        else:
            raise AssertionError(f"PPO({bad}) was accepted")


def test_ppo_cuts_its_passes_short_once_enough_but_never_below_min_epochs():
    """What the learner asks between passes ("is the next batch waiting?") ends the update early."""
    from partrain.rl import PPO

    def passes(algo: PPO, enough) -> tuple[int, float]:  # noqa: ANN001
        torch.manual_seed(0)
        model = ActorCritic(4, 2).double()
        steps = []
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        opt.register_step_post_hook(lambda *_: steps.append(1))
        figures = algo.update(model, opt, _batch(4, 4), enough=enough)
        return len(steps), figures["epochs"]

    asked = []
    assert passes(PPO(epochs=5, min_epochs=2), lambda: asked.append(1) or len(asked) >= 2) == (3, 3.0)
    assert len(asked) == 2  # asked after passes 2 and 3 only, not before min_epochs
    assert passes(PPO(epochs=5, min_epochs=2), lambda: True) == (2, 2.0)
    assert passes(PPO(epochs=5, min_epochs=2), lambda: False) == (5, 5.0)
    assert passes(PPO(epochs=5, min_epochs=2), None) == (5, 5.0)
    assert passes(PPO(epochs=5), lambda: True) == (5, 5.0)  # no min_epochs: a fixed count


def test_vtrace_epochs_are_that_many_steps_each_under_the_weights_it_updates():
    import copy

    import pytest

    torch.manual_seed(0)
    model = ActorCritic(4, 2).double()
    twin = copy.deepcopy(model)
    batch = _batch(4, 4)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(twin.parameters(), lr=0.05)
    steps = []
    opt.register_step_post_hook(lambda *_: steps.append(1))
    figures = VTrace(epochs=3).update(model, opt, batch)
    for _ in range(3):  # the reference: one-step updates, one after another, on the same batch
        want = VTrace(epochs=1).update(twin, twin_opt, batch)
    assert len(steps) == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert figures == want  # the figures of the last step
    with pytest.raises(ValueError, match=r"^Expected epochs >= 1\. Received: epochs=0$"):
        VTrace(epochs=0)


def test_acting_logits_are_the_forwards_with_or_without_a_policy_head_of_their_own():
    torch.manual_seed(0)
    model, obs = ActorCritic(4, 3, hidden=8), torch.randn(5, 4)

    class ForwardOnly(torch.nn.Module):  # a user's model that keeps only the forward contract
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(x)

    want = model(obs)[0].detach()
    assert torch.equal(policy_logits(model, obs), want)  # the policy head alone: the same arithmetic
    assert torch.equal(policy_logits(ForwardOnly(), obs), want)
    assert not policy_logits(model, obs).requires_grad
