"""PBT's exploit/explore against Ray Tune's rules, and the search-space parser.

Quantile sizes follow Ray (ceil(n * fraction), at most half); a bottom member
becomes an exact copy of a top member and its hyperparameters are the donor's
perturbed by one of the factors (or resampled); every copy is in the lineage.
"""

from __future__ import annotations

import pytest
import torch

from partrain.errors import UsageError
from partrain.models import cnn
from partrain.population import PBT, Population, choice, loguniform
from partrain.population.space import parse_space_entry, perturb


def small_cnn():
    return cnn(width=4)


@pytest.mark.parametrize("n, fraction, k", [(8, 0.25, 2), (3, 0.5, 1), (5, 0.25, 2), (1, 0.5, 0), (4, 0.0, 0)])
def test_quantile_sizes_follow_ray(n: int, fraction: float, k: int) -> None:
    pbt = PBT({"lr": [0.1]}, quantile_fraction=fraction)
    bottom, top = pbt.quantiles(torch.arange(n, dtype=torch.float64))
    assert bottom == list(range(k)) and top == list(range(n - k, n))


def test_quantiles_rank_nan_last_and_mode_min() -> None:
    pbt = PBT({"lr": [0.1]}, quantile_fraction=0.25, mode="min")
    bottom, top = pbt.quantiles(torch.tensor([0.5, float("nan"), 0.1, 0.9]))
    assert bottom == [1] and top == [2]


def test_update_copies_top_into_bottom_and_perturbs() -> None:
    space = {"lr": loguniform(1e-4, 1.0), "momentum": choice((0.0, 0.5, 0.9))}
    hp = {"lr": [0.01, 0.02, 0.03, 0.04], "momentum": [0.0, 0.5, 0.9, 0.5]}
    pop = Population(small_cnn, 4, "sgd", hp, engine="vmap", seed=1)
    x, y = torch.randn(4, 8, 1, 8, 8), torch.randint(0, 10, (4, 8))
    pop.step(x, y)
    pbt = PBT(space, interval=1, quantile_fraction=0.25, perturbation_factors=(1.2, 0.8),
              resample_probability=0.0, seed=3)
    scores = torch.tensor([0.1, 0.5, 0.6, 0.9])
    donor_state = [t.clone() for t in pop.member_tensors(3)]
    records = pbt.update(pop, scores, step=10)
    assert len(records) == 1
    rec = records[0]
    assert rec["dst"] == 0 and rec["src"] == 3 and rec["step"] == 10
    for a, b in zip(pop.member_tensors(0), donor_state):
        assert torch.equal(a, b)
    after = pop.member_hparams(0)
    assert after["lr"] / 0.04 == pytest.approx(1.2) or after["lr"] / 0.04 == pytest.approx(0.8)
    assert after["momentum"] in (0.0, 0.9)  # a neighbour of 0.5 in the list
    assert rec["hparams_before"] == {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0}
    assert rec["hparams_after"] == after
    assert pbt.lineage == records


def test_resample_stays_in_the_distribution_and_state_round_trips() -> None:
    space = {"lr": loguniform(1e-3, 1e-2)}
    pbt = PBT(space, resample_probability=1.0, seed=0)
    state = pbt.state_dict()
    values = [pbt.explore({"lr": 0.5})["lr"] for _ in range(20)]
    assert all(1e-3 <= v <= 1e-2 for v in values)
    again = PBT(space, resample_probability=1.0, seed=123)
    again.load_state_dict(state)
    assert [again.explore({"lr": 0.5})["lr"] for _ in range(20)] == values


def test_perturbation_is_clipped_to_bounds() -> None:
    gen = torch.Generator().manual_seed(0)
    assert perturb(loguniform(1e-3, 1e-1), 1e-1, (1.2,), gen) == pytest.approx(1e-1)
    assert perturb([1, 2, 3], 3.0, (1.2,), gen) in (2.0, 3.0)


@pytest.mark.parametrize("text, name", [("lr=loguniform:1e-3:1e-1", "lr"), ("momentum=choice:0.0,0.9", "momentum"),
                                        ("batch_size=randint:8:64", "batch_size"), ("eps=1e-6", "eps")])
def test_space_parser(text: str, name: str) -> None:
    key, spec = parse_space_entry(text)
    assert key == name
    gen = torch.Generator().manual_seed(0)
    assert isinstance(spec.sample(gen), float)


@pytest.mark.parametrize("text", ["lr", "lr=loguniform:0:1", "lr=loguniform:1", "lr=uniform:2:1", "m=choice:a,b", "x=foo"])
def test_space_parser_rejects_bad_input(text: str) -> None:
    with pytest.raises(UsageError, match="Expected --space"):
        parse_space_entry(text)


@pytest.mark.parametrize("kwargs", [{"interval": 0}, {"quantile_fraction": 0.7}, {"resample_probability": 2},
                                    {"perturbation_factors": ()}, {"mode": "up"}])
def test_pbt_rejects_bad_knobs(kwargs: dict) -> None:
    with pytest.raises(UsageError):
        PBT({"lr": [0.1]}, **kwargs)
