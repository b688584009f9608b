"""allreduce = a single process on the concatenated global batch.

The core promise of synchronous data parallel training: after k steps the
parameters of 2 workers with per-worker batch b equal those of one process
with batch 2b (and with gradient accumulation, of one process with the whole
accumulation window as its batch) - including the uneven last batch of an
epoch, which `fit` normalises by the global sample count.
"""

import functools

import pytest
import torch

from partrain.train.loop import fit
from tests.helpers import assert_states_close, sgd, small_cnn, small_mlp


def run(strategy, workers, batch, *, accumulate=1, model=small_cnn, optimizer=sgd, **kw):
    return fit(model, "digits", optimizer, strategy=strategy, workers=workers, batch_size=batch,
               accumulate=accumulate, quiet=True, return_state=True, timeout=60, **kw)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_allreduce_equals_single_process_on_global_batch(accumulate):
    # 1438 training samples; 20 steps of 96 cross the end of epoch 1, whose last global
    # batch is partial (1438 = 14 * 96 + 94): the uneven split is part of the check
    steps = 20 if accumulate == 1 else 10
    ref = run("single", 1, 2 * 48 // accumulate * accumulate, epochs=2, max_steps=steps)
    par = run("allreduce", 2, 48 // accumulate, accumulate=accumulate, epochs=2, max_steps=steps)
    assert ref.final["step"] == par.final["step"] == steps
    assert_states_close(par.model_state, ref.model_state, atol=1e-5)
    assert par.train_loss == pytest.approx(ref.train_loss, abs=1e-5)


def test_accumulation_lr_scaling_breakdown_and_bytes():
    """One run checks the bookkeeping: steps, scaled lr, timing split, bytes all-reduced."""
    opt = functools.partial(torch.optim.SGD, lr=0.01)
    par = run("allreduce", 2, 16, accumulate=3, model=small_mlp, optimizer=opt, scale_lr=True, max_steps=5)
    row = par.final
    assert row["step"] == 5
    assert row["lr"] == pytest.approx(0.01 * 2 * 3)
    assert row["time_compute"] > 0 and row["time_data"] >= 0 and row["time_comm"] >= 0
    n_params = sum(p.numel() for p in small_mlp().parameters())
    # only the last of 3 micro-batches communicates: one all-reduce of every gradient per step
    assert row["comm_bytes"] == 2 * 5 * n_params * 4
    ref = run("single", 1, 96, model=small_mlp, optimizer=functools.partial(torch.optim.SGD, lr=0.06), max_steps=5)
    assert_states_close(par.model_state, ref.model_state)
