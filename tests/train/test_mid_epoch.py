"""Checkpoints within an epoch: a run that fails mid-epoch and resumes equals an uninterrupted one, bit for bit.

Both runs are the same 2 processes with one intra-op thread each, float64, with dropout
(the random state matters) and gradient accumulation (checkpoints fall at the end of a
window). The fault is injected in the model's forward at a chosen micro-batch.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from partrain.checkpoint import load_checkpoint
from partrain.errors import UsageError, WorkerError
from partrain.train.fit import fit
from tests.helpers import assert_states_close, sgd
from tests.train.test_tasks import COMMON, no_launch, regression64, regressor64

FAIL_AT = "PARTRAIN_TEST_FAIL_AT"


class FailsOnCall(nn.Module):
    """A float64 regressor with dropout that raises at its Nth training forward when $PARTRAIN_TEST_FAIL_AT=N."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Dropout(0.2), nn.Linear(12, 1)).double()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == int(os.environ.get(FAIL_AT, "0")):
                raise RuntimeError("injected fault")
        return self.net(x)


# 97 samples, 2 workers x 8: 7 micro-batches per epoch, accumulate 2: 4 optimizer steps per epoch
RUN = dict(COMMON, batch_size=8, accumulate=2, epochs=2, checkpoint_every=1)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run (with the same mid-epoch checkpoints) both cases compare with."""
    return fit(FailsOnCall, regression64, sgd, out_dir=str(tmp_path_factory.mktemp("full")), **RUN)


def test_a_run_resumed_from_the_middle_of_an_epoch_equals_an_uninterrupted_one(tmp_path, monkeypatch, full):
    """The fault in epoch 2: the resumed run needs the sampler's position, the random states
    and the history of epoch 1 from the checkpoint."""
    part = str(tmp_path / "part")
    monkeypatch.setenv(FAIL_AT, str(7 + 5))  # micro-batch index 4 of epoch 2: after the step of window (2, 3)
    with pytest.raises(WorkerError, match="injected fault"):
        fit(FailsOnCall, regression64, sgd, out_dir=part, **RUN)
    ckpt = load_checkpoint(os.path.join(part, "checkpoint.pt"))
    assert ckpt["within_epoch"]["batch"] == 4 and ckpt["epoch"] == 1
    assert ckpt["within_epoch"]["rng"].shape[0] == 2  # one random state per worker
    monkeypatch.delenv(FAIL_AT)
    with monkeypatch.context() as m:  # refused in the calling process, before any worker starts
        m.setattr("partrain.train.fit.launch", no_launch)
        with pytest.raises(UsageError, match=r"^Expected 2 workers to resume a mid-epoch checkpoint \(its random "
                                             r"states are per worker\)\. Received: 1$"):
            fit(FailsOnCall, regression64, sgd, out_dir=part, resume="auto", **{**RUN, "workers": 1})
    resumed = fit(FailsOnCall, regression64, sgd, out_dir=part, resume="auto", **RUN)
    assert_states_close(resumed.model_state, full.model_state, atol=0)
    for got, want in zip(resumed.history, full.history, strict=True):
        for key in ("epoch", "step", "samples", "train_loss", "train_mse", "train_mae", "test_loss", "test_mse"):
            assert got[key] == want[key], (key, got[key], want[key])


def test_asynchronous_strategies_refuse_mid_epoch_checkpoints_before_spawning(monkeypatch):
    monkeypatch.setattr("partrain.train.fit.launch", no_launch)
    with pytest.raises(UsageError, match=r"Received: strategy 'hogwild', which checkpoints at epoch ends only"):
        fit(FailsOnCall, regression64, sgd, strategy="hogwild", **RUN)


def test_a_run_stopped_by_max_steps_inside_an_epoch_resumes_where_it_stopped(tmp_path, full):
    """max_steps = 6 stops in the middle of epoch 2 (4 optimizer steps per epoch): its checkpoint
    continues that epoch, and a resume without the limit equals the uninterrupted run."""
    part = str(tmp_path / "part")
    stopped = fit(FailsOnCall, regression64, sgd, out_dir=part, max_steps=6, **RUN)
    assert stopped.stopped == "max_steps" and stopped.history[-1]["step"] == 6
    ckpt = load_checkpoint(os.path.join(part, "checkpoint.pt"))
    assert ckpt["epoch"] == 1 and ckpt["within_epoch"]["batch"] == 4  # windows (0, 1), (2, 3) of epoch 2 done
    resumed = fit(FailsOnCall, regression64, sgd, out_dir=part, resume="auto", **RUN)
    assert_states_close(resumed.model_state, full.model_state, atol=0)
    assert [row["step"] for row in resumed.history] == [row["step"] for row in full.history]
    assert resumed.history[-1]["train_loss"] == full.history[-1]["train_loss"]


def test_a_mid_epoch_checkpoint_resumed_with_another_batch_size_goes_on_after_the_same_samples(tmp_path):
    """Stopped inside epoch 2 after 4 micro-batches of 8 per worker (accumulate 2), resumed
    with batches of 16 (accumulate 1): the same optimizer steps on the same global batches,
    so it equals the uninterrupted run (float64; sums split differently: 1e-10). Before, the
    resume skipped 4 batches of the new size: 128 samples of an epoch of 97. A size that
    does not divide the 32 samples per worker done is one line."""
    run = dict(RUN, batch_size=8, accumulate=2)
    full = fit(regressor64, regression64, sgd, out_dir=str(tmp_path / "full"), return_state=True, **run)
    part = str(tmp_path / "part")
    fit(regressor64, regression64, sgd, out_dir=part, max_steps=6, **run)
    assert load_checkpoint(os.path.join(part, "checkpoint.pt"))["within_epoch"]["batch"] == 4
    with pytest.raises(UsageError, match=r"^Expected batch_size 8 \(the mid-epoch checkpoint's\) or one that divides "
                                         r"the 32 samples per worker it had trained on, to resume within its epoch\. "
                                         r"Received: 12$"):
        fit(regressor64, regression64, sgd, out_dir=part, resume="auto", **{**run, "batch_size": 12, "accumulate": 1})
    resumed = fit(regressor64, regression64, sgd, out_dir=part, resume="auto", return_state=True,
                  **{**run, "batch_size": 16, "accumulate": 1})
    assert [row["samples"] for row in resumed.history] == [row["samples"] for row in full.history] == [97, 97]
    assert [row["step"] for row in resumed.history] == [4, 8]
    assert_states_close(resumed.model_state, full.model_state, atol=1e-10)


def test_the_worker_count_check_before_launch_counts_a_pipelines_replicas(tmp_path, monkeypatch):
    """The check before any process starts asks the strategy how many data-parallel workers a job
    has: a pipeline of 2 stages over 2 processes is 1 (one replica), so it may resume a mid-epoch
    checkpoint of one worker; over 4 processes it is 2, one line."""
    part = str(tmp_path / "part")
    run = dict(batch_size=8, quiet=True, timeout=60, threads=1, epochs=2)
    fit(regressor64, regression64, sgd, out_dir=part, max_steps=16, checkpoint_every=1, strategy="single",
        workers=1, **run)
    assert len(load_checkpoint(os.path.join(part, "checkpoint.pt"))["within_epoch"]["rng"]) == 1
    monkeypatch.setattr("partrain.train.fit.launch", no_launch)
    with pytest.raises(AssertionError, match="a process was started"):  # accepted: on to the launch
        fit(regressor64, regression64, sgd, out_dir=part, resume="auto", strategy="pipeline", workers=2, **run)
    with pytest.raises(UsageError, match=r"^Expected 1 workers to resume a mid-epoch checkpoint \(its random "
                                         r"states are per worker\)\. Received: 2$"):
        fit(regressor64, regression64, sgd, out_dir=part, resume="auto", strategy="pipeline", workers=4, **run)
