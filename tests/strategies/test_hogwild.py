"""hogwild: every worker steps one model held in shared memory.

What must hold: a write by one worker (parameters and optimizer state) is seen
by the other, with no copy in between; the shared file leaves no trace in
/dev/shm; training under `fit` converges and resumes; the optimizer state built
ahead of time gives exactly the first step a fresh optimizer would; workers on
different hosts are refused with one clear line. Start with
`test_workers_share_one_memory`.
"""

import functools
import os

import pytest
import torch

from partrain import launch
from partrain.errors import UsageError, WorkerError
from partrain.strategies.hogwild import Hogwild, _init_state, check_one_host, shm_dir
from partrain.train.fit import fit
from tests.helpers import sgd, small_mlp


def _share_worker(strategy):
    torch.manual_seed(strategy.rank)  # different initial values: worker 0's must win
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = strategy.prepare(model, opt)
    p = next(model.parameters())
    initial = p.detach().clone()
    strategy.barrier()
    # worker 0 writes a parameter and a momentum buffer; worker 1 reads them after a barrier
    if strategy.rank == 0:
        with torch.no_grad():
            p.fill_(7.0)
            opt.state[p]["momentum_buffer"].fill_(3.0)
    strategy.barrier()
    seen = (bool(p.eq(7.0).all()), bool(opt.state[p]["momentum_buffer"].eq(3.0).all()))
    strategy.barrier()
    # worker 1 steps the optimizer; worker 0 sees the update
    if strategy.rank == 1:
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    strategy.barrier()
    left = [f for f in os.listdir(shm_dir()) if strategy._token in f]
    return {"initial": initial, "seen": seen, "after": p.detach().clone(),
            "buf": opt.state[p]["momentum_buffer"].detach().clone(), "metrics": strategy.metrics(),
            "left": left, "comm_bytes": strategy.comm_bytes}


def test_workers_share_one_memory():
    a, b = launch(_share_worker, workers=2, strategy="hogwild", timeout=60)
    torch.testing.assert_close(a["initial"], b["initial"], rtol=0, atol=0)  # worker 0's init everywhere
    assert b["seen"] == (True, True)
    assert not torch.equal(a["after"], torch.full_like(a["after"], 7.0))  # worker 1's step landed...
    torch.testing.assert_close(a["after"], b["after"], rtol=0, atol=0)  # ...in the memory worker 0 reads
    torch.testing.assert_close(a["buf"], b["buf"], rtol=0, atol=0)
    assert a["metrics"] == b["metrics"] == {"updates": 1.0, "updates_w0": 0.0, "updates_w1": 1.0}
    assert a["left"] == [] and a["comm_bytes"] == 0


class _TwoHosts(Hogwild):
    """Pretends every worker runs on its own machine."""

    def hostname(self):
        return f"node{self.env.rank}"


def _noop(strategy):
    return strategy.rank


def test_workers_on_different_hosts_are_refused():
    with pytest.raises(UsageError, match="Expected all hogwild workers on one host"):
        check_one_host(["a", "b"])
    check_one_host(["a", "a"])
    with pytest.raises(WorkerError, match="Expected all hogwild workers on one host.*node1"):
        launch(_noop, workers=2, strategy=_TwoHosts(), timeout=60)


@pytest.mark.parametrize("make", [
    functools.partial(torch.optim.Adam, lr=0.01, weight_decay=0.1),
    functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.1),
    functools.partial(torch.optim.Adagrad, lr=0.1, initial_accumulator_value=0.5),
])
def test_state_built_ahead_gives_the_same_first_steps(make):
    torch.manual_seed(0)
    ref_model = small_mlp()
    model = small_mlp()
    model.load_state_dict(ref_model.state_dict())
    ref_opt, opt = make(ref_model.parameters()), make(model.parameters())
    _init_state(opt)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)  # the dry step moved nothing
    x = torch.randn(16, 64)
    for _ in range(2):
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_fit_converges_and_resumes(tmp_path):
    run = functools.partial(fit, small_mlp, "digits", functools.partial(sgd, lr=0.05), strategy="hogwild",
                            workers=2, batch_size=16, quiet=True, timeout=60, out_dir=str(tmp_path))
    first = run(epochs=1)
    row = first.final
    assert row["comm_bytes"] == 0
    # both workers' steps, counted in shared memory, read by worker 0; the workers claim
    # the epoch's 90 batches of 16 (1438 samples) between them, each as fast as it can
    units = -(-1438 // 16)
    assert row["hogwild_updates"] == row["hogwild_updates_w0"] + row["hogwild_updates_w1"] == units
    assert row["hogwild_updates_w0"] == row["step"]
    resumed = run(epochs=3, resume="auto")
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3]
    assert resumed.final["hogwild_updates"] == 2 * units  # counters start again with the resumed job
    # unsynchronised updates make the figure vary with the interleaving: 0.96-0.97 on a quiet machine,
    # 0.883 once in CI under two pytest workers' load; one process reaches 0.95 (chance: 0.1)
    assert resumed.test_accuracy >= 0.85
    assert resumed.history[-1]["train_loss"] < 0.5 * first.history[0]["train_loss"]
