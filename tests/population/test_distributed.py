"""Members spread over two processes give the same population as one process.

Both processes run the same PBT decisions; a member copied across processes
travels by a torch.distributed broadcast. `test_member_tensors_from_any_process`
guards the cause of a multi-process ``partrain population`` failing at its end:
fetching the best member to process 0 when process 0 already owns it must not
enter a broadcast on one process only. Reference: the same population,
loader seeds and PBT seed in this (single) process.

Precision: float64 members and data, parameters to `F64_ATOL` = 1e-10. Two
members per process run the vectorized kernels on other shapes than four in
one process (and on another thread count), so sums may round differently; in
float64 that stays near 1e-14 over these 6 steps (see `tests.helpers`), far
from flipping a PBT decision or an accuracy, which are compared exactly.
"""

from __future__ import annotations

import torch

import partrain
from partrain.data.datasets import synthetic
from partrain.models import cnn
from partrain.population import PBT, Population, choice, loguniform, train_population
from partrain.population.run import split_validation
from tests.helpers import F64_ATOL, to_float64

SIZE, STEPS = 4, 6


def small_cnn():
    return cnn(width=4).double()


def scenario(distributed: bool) -> dict:
    train, _ = synthetic(samples=256, shape=(1, 8, 8), classes=10, seed=0)
    train, val = split_validation(to_float64(train), 0.25, 0)
    hp = {"lr": [0.2, 0.05, 0.01, 0.001], "momentum": [0.9, 0.5, 0.0, 0.9]}
    pop = Population(small_cnn, SIZE, "sgd", hp, engine="vmap", seed=3, distributed=distributed)
    pbt = PBT({"lr": loguniform(1e-4, 1.0), "momentum": choice((0.0, 0.5, 0.9))}, interval=2,
              quantile_fraction=0.25, seed=7)
    history = train_population(pop, train, val, steps=STEPS, batch_size=16, pbt=pbt, seed=1)
    # an explicit copy from a member of process 0 to one of process 1
    pop.copy_member(0, SIZE - 1)
    return {"members": list(pop.members), "params": {k: v.clone() for k, v in pop.state_dict()["params"].items()},
            "lineage": pbt.lineage, "hparams": pop.hparams, "history": history, "pop": pop}


def worker(strategy) -> dict:
    out = scenario(distributed=True)
    pop = out.pop("pop")
    # every member to every destination, called alike on both processes (as run.py does for the best)
    out["copies"] = {(m, to): pop.member_tensors(m, to_rank=to) for m in range(SIZE) for to in (None, 0, 1)}
    out["models"] = {m: pop.member_model(m).state_dict() for m in range(SIZE)}
    return out


def test_two_processes_equal_one() -> None:
    ref = scenario(distributed=False)
    ref.pop("pop")
    parts = partrain.launch(worker, workers=2, timeout=60.0, threads=1)  # threads: speed only (see conftest)
    assert [p["members"] for p in parts] == [[0, 1], [2, 3]]
    assert [(r["src"], r["dst"]) for r in parts[0]["lineage"]] == [(r["src"], r["dst"]) for r in ref["lineage"]]
    assert parts[0]["lineage"] and parts[1]["lineage"] == parts[0]["lineage"]
    assert parts[0]["hparams"] == ref["hparams"]
    for k, v in ref["params"].items():
        got = torch.cat([parts[0]["params"][k], parts[1]["params"][k]])
        assert torch.allclose(got, v, atol=F64_ATOL, rtol=0), k
    # the cross-process copy is exact
    for k in ref["params"]:
        assert torch.equal(parts[1]["params"][k][-1], parts[0]["params"][k][0])
    assert [r["val_accuracy"] for r in parts[0]["history"]] == [r["val_accuracy"] for r in ref["history"]]


def test_member_tensors_from_any_process() -> None:
    parts = partrain.launch(worker, workers=2, timeout=60.0, threads=1)
    owner = {m: 0 if m < SIZE // 2 else 1 for m in range(SIZE)}
    for m in range(SIZE):
        mine = parts[owner[m]]["copies"][(m, owner[m])]  # the owner's own copy: no communication
        assert mine and parts[1 - owner[m]]["copies"][(m, owner[m])] == []
        for rank in (0, 1):
            for to in (None, 0, 1):
                got = parts[rank]["copies"][(m, to)]
                if to not in (None, rank):
                    assert got == [], (m, to, rank)
                    continue
                assert len(got) == len(mine) and all(torch.equal(a, b) for a, b in zip(got, mine)), (m, to, rank)
        # a standalone model of any member (a broadcast from its owner) is the same on both processes
        a, b = parts[0]["models"][m], parts[1]["models"][m]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
