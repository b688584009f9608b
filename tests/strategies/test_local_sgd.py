"""localsgd and DiLoCo: periodic parameter averaging, with an optional outer optimizer.

The references: with ``period=1`` and plain SGD, averaging the workers'
one-step updates *is* synchronous data parallel training, so the result must
equal one process on the global batch, written by hand (`train_by_hand`, the
reference `allreduce` is held to as well); DiLoCo with ``outer_lr=1,
outer_momentum=0`` must equal plain local SGD; the outer Nesterov step is
checked against a hand computation; bytes are counted by hand from the number
of syncs; resume must be exact. Start with `test_period_one_equals_a_hand_written_loop`.

Precision: runs that compute the same thing in another order (averaging
updates instead of gradients, ``global - 1 * (global - average)`` instead of the
average) run in float64 and agree to `F64_ATOL` = 1e-10 (rounding differences
near 1e-14 after these tens of steps, see `tests.helpers`). A resumed run
repeats every operation of the uninterrupted one (same processes, one thread
each), so it must agree bit for bit.
"""

import functools
import math

import pytest
import torch

from partrain.env import DistEnv
from partrain.errors import UsageError
from partrain.strategies import get_strategy, parse_options
from partrain.strategies.local_sgd import LocalSGD
from partrain.train.fit import fit
from tests.helpers import (
    DIGITS64_TRAIN,
    assert_history_matches,
    assert_states_close,
    digits64,
    sgd,
    sgd_plain,
    small_mlp64,
    train_by_hand,
)

N_PARAMS = sum(p.numel() for p in small_mlp64().parameters())


def run(strategy, workers=2, batch=24, epochs=1, optimizer=sgd_plain, **kw):
    return fit(small_mlp64, digits64, optimizer, strategy=strategy, workers=workers, batch_size=batch,
               epochs=epochs, quiet=True, return_state=True, timeout=60, **kw)


def test_period_one_equals_a_hand_written_loop():
    # batch 24 x 2 workers: the last global batch of the epoch is partial and split unevenly
    # (1437 = 29 * 48 + 45, 23 + 22), where each worker's update must weigh its share
    state, history = train_by_hand(small_mlp64, digits64, sgd_plain, batch=48, epochs=1)
    par = run(LocalSGD(period=1))
    assert par.final["step"] == math.ceil(DIGITS64_TRAIN / 48)
    assert_history_matches(par.history, history)
    assert_states_close(par.model_state, state)


def test_diloco_with_unit_outer_lr_is_local_sgd_and_bytes_are_counted():
    period, batch = 4, 32
    plain = run(LocalSGD(period=period), batch=batch, epochs=2, optimizer=sgd)
    diloco = run(LocalSGD(period=period, outer="nesterov", outer_lr=1.0, outer_momentum=0.0),
                 batch=batch, epochs=2, optimizer=sgd)
    assert_states_close(diloco.model_state, plain.model_state)
    # by hand: 23 steps an epoch -> syncs at steps 4, 8, ..., 20 and one at the epoch's end
    steps = math.ceil(DIGITS64_TRAIN / (2 * batch))
    syncs = steps // period + (1 if steps % period else 0)
    for row in plain.history:
        # each of the 2 workers all-reduces every parameter (float64: 8 bytes) once per sync
        assert row["comm_bytes"] == 2 * syncs * N_PARAMS * 8
    assert plain.final["localsgd_syncs"] == 2 * syncs
    assert plain.final["localsgd_local_steps"] == 0  # evaluation saw the averaged model
    assert plain.final["localsgd_bytes_per_sync"] == N_PARAMS * 8


def test_checkpoint_resume_is_exact(tmp_path):
    strategy = functools.partial(LocalSGD, period=5, outer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    # threads=1 in every run: the same processes doing the same operations on the same numbers
    # give the same bits, so anything the checkpoint fails to restore shows
    whole = run(strategy(), epochs=2, optimizer=sgd, threads=1)
    first = run(strategy(), epochs=1, optimizer=sgd, out_dir=str(tmp_path), threads=1)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["strategy"]["worker_optimizer_states"].shape[0] == 2  # each worker's momentum kept
    assert first.final["step"] == whole.history[0]["step"]
    resumed = run(strategy(), epochs=2, optimizer=sgd, out_dir=str(tmp_path), resume="auto", threads=1)
    assert_states_close(resumed.model_state, whole.model_state, atol=0)
    assert resumed.train_loss == whole.train_loss


def test_outer_nesterov_step_by_hand():
    """One worker, so the average is the local model: check DiLoCo's update formula."""
    strategy = LocalSGD(period=2, outer="nesterov", outer_lr=0.5, outer_momentum=0.9)
    strategy.setup(DistEnv())
    w = torch.nn.Parameter(torch.tensor([1.0]))
    model = torch.nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=0.1)
    model, opt = strategy.prepare(model, opt)
    glob, mom = 1.0, 0.0
    local = glob
    for step in range(1, 7):
        w.grad = torch.tensor([1.0])  # each local step moves w by -0.1
        opt.step()
        local -= 0.1
        if step % 2 == 0:
            delta = glob - local
            mom = 0.9 * mom + delta
            glob -= 0.5 * (delta + 0.9 * mom)
            local = glob
        assert w.item() == pytest.approx(local, abs=1e-6), step
    assert strategy.syncs == 3 and strategy.comm_bytes == 0  # nothing to send with one worker


def test_options_are_checked_and_parsed():
    assert parse_options("localsgd", ["period=4", "outer=nesterov", "outer_lr=1"]) == {
        "period": 4, "outer": "nesterov", "outer_lr": 1.0}
    s = get_strategy("localsgd", period=4, outer="nesterov")
    assert (s.period, s.outer, s.outer_lr, s.outer_momentum) == (4, "nesterov", 0.8, 0.3)
    for bad, match in (({"period": 0}, "positive integer period"), ({"outer": "adam"}, "outer among"),
                       ({"outer_lr": 0.0}, "positive outer_lr"), ({"outer_momentum": 1.0}, "outer_momentum")):
        with pytest.raises(UsageError, match=match):
            get_strategy("localsgd", **bad)
