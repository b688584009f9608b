"""Population engines against the reference: N ordinary modules trained with torch.optim.

Start with `test_vmap_matches_torch_optim`: it is the contract of the vectorized
engine (same seeds, same batches, same numbers as independent training).
The other tests check that both engines agree, that per-member hyperparameters,
batch sizes and dropout rates are honoured, that the automatic choice follows
its measurement, that PBT's exploit copies a member exactly and that a
population checkpoint round-trips through ``torch.load(weights_only=True)``.

Precision: members and batches are float64, and engines are compared with
torch.optim and with each other to `F64_ATOL` = 1e-10. The vmap engine runs
batched kernels (a grouped convolution, batched matrix products) where the
reference runs one module at a time: the same sums in another order, which
differs by CPU and thread count. In float32 that is about 1e-6 after these few
steps; in float64 about 1e-14 (see `tests.helpers`). A copy within one
population is compared bit for bit.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partrain.errors import UsageError
from partrain.models import cnn, mlp
from partrain.population import Population, member_seed
from tests.helpers import F64_ATOL

SEED = 5


def small_cnn() -> nn.Module:
    return cnn(width=4).double()


def reference(model_fn, n: int, optimizer: str, hparams: list[dict], nesterov: bool = False):
    """N independent modules + torch.optim optimizers, seeded like the population's members."""
    out = []
    for i in range(n):
        torch.manual_seed(member_seed(SEED, i))
        m = model_fn()
        h = hparams[i]
        if optimizer == "sgd":
            o = torch.optim.SGD(m.parameters(), lr=h["lr"], momentum=h.get("momentum", 0.0),
                                weight_decay=h.get("weight_decay", 0.0), nesterov=nesterov)
        elif optimizer == "adam":
            o = torch.optim.Adam(m.parameters(), lr=h["lr"], weight_decay=h.get("weight_decay", 0.0),
                                 betas=(h.get("beta1", 0.9), h.get("beta2", 0.999)))
        else:
            o = torch.optim.AdamW(m.parameters(), lr=h["lr"], weight_decay=h.get("weight_decay", 0.01))
        out.append((m, o))
    return out


def batches(n: int, steps: int, batch: int = 16, shape=(1, 8, 8), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, batch, *shape, generator=g, dtype=torch.float64),
             torch.randint(0, 10, (n, batch), generator=g)) for _ in range(steps)]


def ref_step(refs, x, y, sizes=None):
    for i, (m, o) in enumerate(refs):
        b = x.shape[1] if sizes is None else sizes[i]
        F.cross_entropy(m(x[i, :b]), y[i, :b]).backward()
        o.step()
        o.zero_grad()


def max_param_diff(pop: Population, refs) -> float:
    err = 0.0
    for i, (m, _) in enumerate(refs):
        got = pop.member_model(i)
        for a, b in zip(got.parameters(), m.parameters()):
            err = max(err, (a - b).abs().max().item())
    return err


CASES = {
    "sgd-momentum-wd": ("sgd", False, [{"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
                                       {"lr": 0.05, "momentum": 0.0, "weight_decay": 0.0},
                                       {"lr": 0.02, "momentum": 0.5, "weight_decay": 1e-2}]),
    "sgd-nesterov": ("sgd", True, [{"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
                                   {"lr": 0.05, "momentum": 0.8, "weight_decay": 0.0},
                                   {"lr": 0.02, "momentum": 0.5, "weight_decay": 1e-2}]),
    "adam": ("adam", False, [{"lr": 1e-3, "weight_decay": 0.0}, {"lr": 2e-3, "weight_decay": 1e-2},
                             {"lr": 5e-4, "weight_decay": 0.0, "beta1": 0.8, "beta2": 0.99}]),
    "adamw": ("adamw", False, [{"lr": 1e-3, "weight_decay": 0.01}, {"lr": 2e-3, "weight_decay": 0.1},
                               {"lr": 5e-4, "weight_decay": 0.0}]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("engine", ["vmap", "loop"])
def test_vmap_matches_torch_optim(case: str, engine: str) -> None:
    optimizer, nesterov, hp = CASES[case]
    pop = Population(small_cnn, 3, optimizer, hp, engine=engine, seed=SEED, nesterov=nesterov)
    refs = reference(small_cnn, 3, optimizer, hp, nesterov)
    for x, y in batches(3, 5):
        pop.step(x, y)
        ref_step(refs, x, y)
    assert max_param_diff(pop, refs) < F64_ATOL
    # the optimizer state, as torch.optim state_dicts, matches too
    for i, (_, o) in enumerate(refs):
        _, got = pop.member_state(i)
        want = o.state_dict()
        assert got["param_groups"][0]["lr"] == pytest.approx(want["param_groups"][0]["lr"])
        assert set(got["state"]) == set(want["state"])
        for k, st in want["state"].items():
            for name, value in st.items():
                assert torch.allclose(got["state"][k][name], value, atol=F64_ATOL, rtol=0), (i, k, name)


def test_both_engines_agree_and_share_state() -> None:
    hp = {"lr": [0.1, 0.03, 0.01, 0.2], "momentum": [0.9, 0.0, 0.5, 0.9]}
    a = Population(small_cnn, 4, "sgd", hp, engine="vmap", seed=SEED)
    b = Population(small_cnn, 4, "sgd", hp, engine="loop", seed=SEED)
    for x, y in batches(4, 4):
        la, lb = a.step(x, y), b.step(x, y)
        assert torch.allclose(la, lb, atol=F64_ATOL, rtol=0)
    for k, v in a.state_dict()["params"].items():
        assert torch.allclose(v, b.state_dict()["params"][k], atol=F64_ATOL, rtol=0)
    # switching engine mid-run continues from the very same numbers
    a.use_engine("loop")
    b.use_engine("vmap")
    for x, y in batches(4, 2, seed=1):
        a.step(x, y)
        b.step(x, y)
    for k, v in a.state_dict()["params"].items():
        assert torch.allclose(v, b.state_dict()["params"][k], atol=F64_ATOL, rtol=0)


@pytest.mark.parametrize("engine", ["vmap", "loop"])
def test_lr_zero_member_is_unchanged(engine: str) -> None:
    pop = Population(small_cnn, 3, "sgd", {"lr": [0.1, 0.0, 0.05], "momentum": 0.9}, engine=engine, seed=SEED)
    before = [pop.member_tensors(i)[0] for i in range(3)]
    for x, y in batches(3, 3):
        pop.step(x, y)
    after = [pop.member_tensors(i)[0] for i in range(3)]
    assert torch.equal(after[1], before[1])
    assert not torch.equal(after[0], before[0]) and not torch.equal(after[2], before[2])


@pytest.mark.parametrize("engine", ["vmap", "loop"])
def test_per_member_batch_sizes(engine: str) -> None:
    hp = [{"lr": 0.1, "momentum": 0.9}] * 3
    pop = Population(small_cnn, 3, "sgd", hp, engine=engine, seed=SEED)
    refs = reference(small_cnn, 3, "sgd", hp)
    sizes = [16, 5, 1]
    for x, y in batches(3, 3):
        pop.step(x, y, sizes)
        ref_step(refs, x, y, sizes)
    assert max_param_diff(pop, refs) < F64_ATOL


def test_per_member_dropout() -> None:
    def with_dropout() -> nn.Module:
        return mlp(in_features=64, hidden=32, depth=1, dropout=0.5).double()

    def without_dropout() -> nn.Module:
        return mlp(in_features=64, hidden=32, depth=1, dropout=0.0).double()

    hp = {"lr": 0.1, "dropout": [0.0, 0.9]}
    for engine in ("vmap", "loop"):
        pop = Population(with_dropout, 2, "sgd", hp, engine=engine, seed=SEED)
        refs = reference(without_dropout, 2, "sgd", [{"lr": 0.1}] * 2)
        for x, y in batches(2, 3):
            pop.step(x, y)
            ref_step(refs, x, y)
        # rate 0 is exactly no dropout; rate 0.9 trains differently
        m0, m1 = pop.member_model(0), pop.member_model(1)
        assert all(torch.allclose(a, b, atol=F64_ATOL, rtol=0) for a, b in zip(m0.parameters(), refs[0][0].parameters()))
        assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(m1.parameters(), refs[1][0].parameters()))
        # the standalone member carries a plain nn.Dropout with its own rate
        rates = [m.p for m in m1.modules() if isinstance(m, nn.Dropout)]
        assert rates == [pytest.approx(0.9)]
    with pytest.raises(UsageError, match="nn.Dropout"):
        Population(small_cnn, 2, "sgd", hp)


def test_auto_engine_measures_both_and_keeps_training() -> None:
    hp = {"lr": [0.1, 0.02], "momentum": 0.9}
    auto = Population(small_cnn, 2, "sgd", hp, engine="auto", seed=SEED, calibration_steps=2)
    forced = Population(small_cnn, 2, "sgd", hp, engine="vmap", seed=SEED)
    for x, y in batches(2, 8):
        auto.step(x, y)
        forced.step(x, y)
    report = auto.engine_report
    assert auto.engine == report["chosen"] in ("vmap", "loop")
    faster = "vmap" if report["vmap_step_s"] <= report["loop_step_s"] else "loop"
    assert report["chosen"] == faster
    # the timed steps were real training steps: same result as a forced engine
    for k, v in auto.state_dict()["params"].items():
        assert torch.allclose(v, forced.state_dict()["params"][k], atol=F64_ATOL, rtol=0)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_copy_member_is_exact(optimizer: str) -> None:
    hp = {"lr": [0.01, 0.001, 0.005]}
    pop = Population(small_cnn, 3, optimizer, hp, engine="vmap", seed=SEED)
    for x, y in batches(3, 3):
        pop.step(x, y)
    pop.copy_member(0, 2)
    for a, b in zip(pop.member_tensors(0), pop.member_tensors(2)):
        assert torch.equal(a, b)
    # same hyperparameters and batch from here on: the copy stays identical
    pop.set_hparams(2, pop.member_hparams(0))
    x, y = batches(1, 1, seed=3)[0]
    pop.step(x.expand(3, *x.shape[1:]), y.expand(3, -1))
    assert torch.equal(pop.member_tensors(0)[0], pop.member_tensors(2)[0])


def test_checkpoint_round_trip() -> None:
    hp = {"lr": [0.003, 0.001], "weight_decay": [0.0, 0.1]}
    a = Population(small_cnn, 2, "adamw", hp, engine="loop", seed=SEED)
    data = batches(2, 6)
    for x, y in data[:3]:
        a.step(x, y)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    b = Population(small_cnn, 2, "adamw", {"lr": 0.5}, engine="vmap", seed=99)
    b.load_state_dict(state)
    assert b.hparams == a.hparams and b.steps == 3
    for x, y in data[3:]:
        a.step(x, y)
        b.step(x, y)
    for k, v in a.state_dict()["params"].items():
        assert torch.allclose(v, b.state_dict()["params"][k], atol=F64_ATOL, rtol=0)
    with pytest.raises(UsageError, match="optimizer"):
        Population(small_cnn, 2, "sgd").load_state_dict(state)


@pytest.mark.parametrize("kwargs, match", [
    ({"size": 0}, "positive population size"),
    ({"engine": "gpu"}, "engine among"),
    ({"optimizer": "rmsprop"}, "optimizer among"),
    ({"hparams": {"lr": [0.1]}}, "2 values"),
    ({"hparams": {"momentum": -1.0}}, "negative"),
    ({"hparams": {"betas": 0.9}}, "hyperparameters among"),
])
def test_bad_input_is_a_usage_error(kwargs: dict, match: str) -> None:
    args = {"size": 2, "optimizer": "sgd", **kwargs}
    with pytest.raises(UsageError, match=match):
        Population(small_cnn, **args)


def test_step_checks_shapes() -> None:
    pop = Population(small_cnn, 2, "sgd", engine="vmap")
    x, y = batches(3, 1)[0]
    with pytest.raises(UsageError, match="Expected x shaped"):
        pop.step(x, y)


@pytest.mark.parametrize("engine", ["vmap", "loop"])
def test_momentum_switched_on_later_matches_torch(engine: str) -> None:
    """PBT may give momentum to a member that had none: torch.optim then starts a fresh buffer."""
    hp = [{"lr": 0.1, "momentum": 0.0}, {"lr": 0.05, "momentum": 0.9}]
    pop = Population(small_cnn, 2, "sgd", hp, engine=engine, seed=SEED)
    refs = reference(small_cnn, 2, "sgd", hp)
    data = batches(2, 4)
    for i, (x, y) in enumerate(data):
        if i == 2:
            pop.set_hparams(0, {"momentum": 0.9})
            pop.set_hparams(1, {"momentum": 0.0})
            refs[0][1].param_groups[0]["momentum"] = 0.9
            refs[1][1].param_groups[0]["momentum"] = 0.0
            # torch.optim.SGD ignores the old buffer while momentum is 0; a later non-zero
            # momentum would reuse it - our population drops it, as a fresh optimizer would
        pop.step(x, y)
        ref_step(refs, x, y)
    assert max_param_diff(pop, refs) < F64_ATOL
