"""Ray Train: `fit` and a `launch` loop run unchanged inside ``TorchTrainer`` (2 CPU workers).

Ray Train starts the workers, sets torchrun's variables and makes the gloo group itself
before the train function runs; partrain must use that group (no second init, no second
store host) and worker 0's `RunResult` must reach the driver through `partrain.ray.report`.
The reference is a hand-written float64 loop in this process on the global batch
(`tests.helpers.train_by_hand`), same model, data and seed: the parameters must agree to
`F64_ATOL`.

One local Ray instance and one TorchTrainer run for the module (Ray's start-up costs
far more than the training). Where to start reading: `train_in_ray`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import partrain
from partrain._process import run_in_process
from partrain.env import DistEnv, external_job
from partrain.errors import UsageError
from partrain.strategies.base import get_strategy

from .helpers import (
    assert_history_matches,
    assert_states_close,
    digits64,
    small_mlp64,
    train_by_hand,
)

ray = pytest.importorskip("ray")
ray_train = pytest.importorskip("ray.train")
ray_torch = pytest.importorskip("ray.train.torch")
partrain_ray = pytest.importorskip("partrain.ray")

REPO = Path(__file__).resolve().parent.parent
FIT = dict(strategy="allreduce", epochs=1, batch_size=32, seed=3, threads=1, quiet=True)
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def sum_ranks(strategy):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item(), strategy.rank, strategy.num_workers


def train_in_ray(config: dict) -> None:
    """The train function, unchanged from a script's: a `launch` loop, a `fit`, then `report`.

    Both in one Ray run: Ray Train's start-up costs far more than either.
    """
    (total, rank, workers), = partrain.launch(sum_ranks, workers=5)  # under Ray: ignored, Ray decides
    launched = {"launch_total": total, "launch_rank": rank, "launch_workers": workers,
                "threads": torch.get_num_threads()}
    result = partrain.fit(small_mlp64, digits64, SGD, **FIT)
    partrain_ray.report(result, extra={**launched, "group_kept": dist.is_initialized()})


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A 2-CPU Ray for the module; its workers import partrain and these tests from this checkout."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_AUTH_MODE")}
    paths = [str(REPO / "src"), str(REPO)] + ([saved["PYTHONPATH"]] if saved["PYTHONPATH"] else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)  # Ray's workers inherit the driver's environment
    os.environ["RAY_AUTH_MODE"] = "disabled"  # else Ray writes a token under ~/.ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_trainer(fn, tmp_path: Path):
    trainer = ray_torch.TorchTrainer(
        fn, scaling_config=ray_train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray_train.RunConfig(storage_path=str(tmp_path), name="run"))
    return trainer.fit()


@pytest.fixture(scope="module")
def ray_run(local_ray, tmp_path_factory):
    """One TorchTrainer run of `train_in_ray` on 2 CPU workers, shared by the tests below."""
    trainer = ray_torch.TorchTrainer(
        train_in_ray, scaling_config=ray_train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray_train.RunConfig(storage_path=str(tmp_path_factory.mktemp("ray")), name="run"))
    return trainer.fit()


def test_fit_inside_ray_train_equals_a_hand_written_loop(ray_run):
    want_state, want_history = train_by_hand(small_mlp64, digits64, SGD, batch=2 * FIT["batch_size"], epochs=1,
                                              seed=FIT["seed"])
    assert ray_run.metrics["group_kept"]  # partrain left Ray's group alone
    run = partrain_ray.load_result(ray_run, small_mlp64)
    assert_history_matches(run.history, want_history)
    assert ray_run.metrics["train_loss"] == run.history[-1]["train_loss"]
    assert_states_close(run.model_state, want_state)
    assert isinstance(run.model(), torch.nn.Module)


def test_a_launch_loop_inside_ray_train_uses_rays_group(ray_run):
    # (0 + 1) + (1 + 1) over Ray's two workers, on rank 0, in the group Ray made
    got = ray_run.metrics
    assert (got["launch_total"], got["launch_rank"], got["launch_workers"]) == (3.0, 0, 2)
    assert got["threads"] == 1  # Ray gives each worker its CPUs (2 / 2 workers) as OMP_NUM_THREADS


# ----- without Ray's workers: the joining rules and the bad-input lines ---------------------

@pytest.fixture
def one_process_group(tmp_path) -> Iterator[None]:
    """A default group made before partrain runs, as Ray Train makes it (here: 1 process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_an_existing_group_without_master_addr_is_joined_not_respawned(one_process_group):
    """Ray's ``TorchConfig(init_method="tcp")`` sets RANK/WORLD_SIZE and the group, no MASTER_ADDR."""
    job = external_job({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert job is not None and job.joinable and job.master_addr is None


def test_an_existing_group_of_another_shape_is_one_line(one_process_group):
    env = DistEnv(0, 2, 0, 2)
    with pytest.raises(UsageError, match=r"^Expected the existing process group to be rank 0 of 2 "
                                         r"\(RANK, WORLD_SIZE\)\. Received: rank 0 of 1$"):
        run_in_process(sum_ranks, (), {}, get_strategy("allreduce"), env, 5.0, None, store=None)
    assert dist.is_initialized()  # the caller's group stays


def test_report_refuses_what_is_not_a_run_result():
    with pytest.raises(UsageError, match=r"^Expected the RunResult of partrain.fit \(or None\)\. Received: dict$"):
        partrain_ray.report({"train_loss": 1.0})


def test_load_result_refuses_a_result_without_checkpoint():
    class NoCheckpoint:
        checkpoint = None
        metrics = {"train_loss": 1.0}

    with pytest.raises(UsageError, match=r"^Expected a Ray Train result with the checkpoint of "
                                         r"partrain.ray.report\. Received: NoCheckpoint without a checkpoint$"):
        partrain_ray.load_result(NoCheckpoint())
