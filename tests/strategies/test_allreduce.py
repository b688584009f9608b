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


def run(strategy, workers, batch, *, accumulate=1, epochs=1, model=small_cnn, data="digits", **kw):
    return fit(model, data, sgd, strategy=strategy, workers=workers, batch_size=batch, accumulate=accumulate,
               epochs=epochs, quiet=True, return_state=True, timeout=60, **kw)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_allreduce_equals_single_process_on_global_batch(accumulate):
    # 1797 * 0.8 = 1438 training samples: the last global batch of an epoch is partial
    ref = run("single", 1, 2 * 24 * accumulate, epochs=2)
    par = run("allreduce", 2, 24, accumulate=accumulate, epochs=2)
    assert ref.history[-1]["step"] == par.history[-1]["step"]
    assert_states_close(par.model_state, ref.model_state, atol=1e-5)
    assert par.train_loss == pytest.approx(ref.train_loss, abs=1e-5)
    assert par.test_accuracy == pytest.approx(ref.test_accuracy)


def test_max_steps_stops_exactly():
    res = run("allreduce", 2, 16, model=small_mlp, max_steps=5)
    assert res.history[-1]["step"] == 5
    state = res.model_state
    ref = run("single", 1, 32, model=small_mlp, max_steps=5)
    assert_states_close(state, ref.model_state)


def test_step_time_breakdown_and_comm_bytes_are_reported():
    res = run("allreduce", 2, 64, model=small_mlp)
    row = res.final
    assert row["time_compute"] > 0 and row["time_data"] >= 0 and row["time_comm"] >= 0
    n_params = sum(p.numel() for p in small_mlp().parameters())
    steps = row["step"]
    # every step all-reduces every gradient once, on each of the 2 workers
    assert row["comm_bytes"] == 2 * steps * n_params * 4


def test_linear_lr_scaling_rule():
    res = fit(small_mlp, "digits", functools.partial(torch.optim.SGD, lr=0.01), strategy="allreduce", workers=2,
              batch_size=16, accumulate=3, scale_lr=True, epochs=1, quiet=True, max_steps=1, timeout=60)
    assert res.final["lr"] == pytest.approx(0.01 * 2 * 3)
