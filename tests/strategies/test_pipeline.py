"""pipeline: a model cut over 2 processes trains exactly like one process on the global batch.

The promise: micro-batches through stages compute the gradient of the whole batch,
so after k steps the parameters equal one process's - for every schedule offered,
with batches that do not divide into micro-batches (padded by the strategy, whose
padding must contribute nothing), under `fit` (figures per epoch included), in the
hybrid 2 x 2 layout (2 pipeline replicas all-reducing per stage), and across a
checkpoint written by a pipeline, resumed by ``single`` and resumed again by a pipeline;
for a model that is not an ``nn.Sequential`` too (cut by torch's tracer). Besides: the
whole model's gradient norm for clipping, a stage killed mid-step, the command line, and
bad input as one line.

References are plain PyTorch written here or in `tests.helpers` (`train_by_hand`):
one process, ``F.cross_entropy(reduction="mean")``, no partrain sampler or strategy.
Start with `test_every_schedule_equals_one_process`.

Precision: float64, compared to `F64_ATOL` (micro-batches add the same numbers in
another order: rounding near 1e-15 here, see `tests.helpers`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partrain.checkpoint import load_checkpoint, load_model
from partrain.cli import main
from partrain.env import DistEnv
from partrain.errors import UsageError, WorkerError
from partrain.launch import launch
from partrain.models import mlp
from partrain.nn.split import balance, stage_ranks
from partrain.strategies import get_strategy, parse_options
from partrain.strategies._pipeline_trace import culprit
from partrain.strategies.pipeline import SCHEDULES, Pipeline
from partrain.train.fit import fit
from tests.helpers import (
    KillOnRank,
    assert_history_matches,
    assert_states_close,
    digits64,
    sgd,
    train_by_hand,
)

EPOCHS, GLOBAL_BATCH = 2, 96  # digits64: 1437 = 14 * 96 + 93, the last batch does not divide by 4 or 8


def mlp64() -> nn.Module:
    """8 children, 4 of them with parameters: enough for 2 stages x 2 virtual stages."""
    return mlp(in_features=64, hidden=16, depth=3).double()


def per_sample_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """40, 38 (not a multiple of 4 micro-batches: padded to 40), 3 (fewer samples than micro-batches)."""
    x, y = digits64()[0].tensors
    bounds = [0, 40, 78, 81]
    return [(x[a:b], y[a:b]) for a, b in zip(bounds, bounds[1:])]


def _by_hand_steps() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = mlp64()
    optimizer = sgd(model.parameters())
    for x, y in _batches():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def _trained(strategy: Pipeline, name: str, model_fn: Any) -> tuple[Pipeline, Any]:
    """A Pipeline for ``name`` ("schedule" or "schedule/split") on the job's group, and
    ``model_fn()``'s pipelined model after the test batches, stepped by hand."""
    schedule, _, split = name.partition("/")
    pipe = Pipeline(schedule=schedule, microbatches=4, split=split or "params")
    pipe.setup(strategy.env, timeout=30)
    torch.manual_seed(0)
    model = pipe.build_model(model_fn)  # this process's stages alone (a cut by time: the whole model)
    model, optimizer = pipe.prepare(model, sgd(model.parameters()))
    for x, y in _batches():
        out, losses = pipe.train_step(model, optimizer, x, y, per_sample_ce, loss_scale=1 / len(y))
        assert out.shape == (len(y), 10) and losses.shape == (len(y),)  # on both stages, padding left out
    return pipe, model


def every_schedule(strategy: Pipeline, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Each schedule in turn on the job's 2 processes (one Pipeline each on the same process group:
    a pool job per schedule would cost a process group per schedule), stepping by hand.
    ``"1f1b/time"`` is 1f1b cut by measured time (rank 0 times the children on the first batch)."""
    states = {}
    for name in names:
        pipe, model = _trained(strategy, name, mlp64)
        states[name] = pipe.model_state_dict(model)
    return states


def test_every_schedule_equals_one_process():
    """Every schedule (and a cut by measured time), 3 steps whose batches of 38 and 3 need
    padding to 4 micro-batches."""
    names = [*SCHEDULES, "1f1b/time"]
    first, second = launch(every_schedule, names, workers=2, strategy=Pipeline(), threads=1, timeout=60)
    want = _by_hand_steps()
    for name in names:
        assert_states_close(first[name], want)  # the first stage gathers the whole model
        assert set(second[name]) < set(want)  # the others hold their part only


class ResidualMLP(nn.Module):
    """Not an nn.Sequential (residual blocks in a ModuleList): cut by torch's tracer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x.flatten(1)))
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.head(h)


def residual64() -> nn.Module:
    return ResidualMLP().double()


def traced(strategy: Pipeline, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """`every_schedule` for the residual model; also checks evaluation (``model(x)``) on every stage."""
    x_eval = digits64()[1].tensors[0][:5]
    states = {}
    for name in names:
        pipe, model = _trained(strategy, name, residual64)
        with torch.no_grad():
            states[name] = {"state": pipe.model_state_dict(model), "eval": model(x_eval)}
    return states


def test_a_model_that_is_not_sequential_is_traced_and_equals_one_process():
    names = ["1f1b/blocks.1", "interleaved1f1b"]
    first, second = launch(traced, names, workers=2, strategy=Pipeline(), threads=1, timeout=60)
    torch.manual_seed(0)
    model = residual64()
    optimizer = sgd(model.parameters())
    for x, y in _batches():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        want = model(digits64()[1].tensors[0][:5])
    for name in names:
        assert_states_close(first[name]["state"], model.state_dict())
        for got in (first, second):  # the output on every stage
            torch.testing.assert_close(got[name]["eval"], want, atol=1e-12, rtol=0)


def clip_job(strategy: Pipeline) -> dict[str, torch.Tensor]:
    """Every stage sets known gradients and clips with the whole model's norm."""
    torch.manual_seed(0)
    model = mlp64()
    model, _ = strategy.prepare(model, sgd(model.parameters()))
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, float(name[0]))  # layer index: 1, 3, 5, 7
    norm = strategy.clip_grad_norm_(model.parameters(), 1.0)
    return {"norm": norm, **{n: p.grad for n, p in model.named_parameters()}}


def test_clip_grad_norm_uses_the_whole_models_norm():
    first, second = launch(clip_job, workers=2, strategy=Pipeline(), threads=1, timeout=60)
    torch.manual_seed(0)
    model = mlp64()
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, float(name[0]))
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for got in (first, second):
        torch.testing.assert_close(got.pop("norm"), want.to(torch.float64), atol=1e-12, rtol=0)
    grads = {**first, **second}
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-12, rtol=0)


@functools.cache
def by_hand(epochs: int = EPOCHS, scheduler: bool = False):
    return train_by_hand(mlp64, digits64, sgd, batch=GLOBAL_BATCH, epochs=epochs,
                         scheduler_fn=_halving if scheduler else None)


def _halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def run(workers: int, batch: int, **kw):
    options = {k: kw.pop(k) for k in ("stages", "microbatches", "schedule", "split") if k in kw}
    return fit(mlp64, digits64, sgd, strategy=get_strategy("pipeline", **options), workers=workers,
               batch_size=batch, quiet=True, return_state=True, timeout=60, threads=1, **kw)


def test_fit_equals_a_hand_written_loop_figures_included():
    """`fit` unchanged: the loop's step, evaluation (`model(x)` on every stage) and epoch figures;
    with gradient accumulation (2 x 48 = the hand loop's 96; the last window 48 + 45)."""
    state, history = by_hand()
    result = run(2, GLOBAL_BATCH // 2, epochs=EPOCHS, accumulate=2, microbatches=8, schedule="gpipe")
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)
    row = result.final
    assert row["strategy"] == "pipeline" and row["workers"] == 1  # one replica: the data is not split
    assert row["pipeline_compute_seconds"] > 0 and row["pipeline_bubble_seconds"] >= 0


def test_fit_clips_by_the_whole_models_norm():
    """``clip_grad`` under `fit`: every stage scales by the norm of the whole model's gradient
    (a stage's own norm would clip the stages differently), as one process clips."""
    want = fit(mlp64, digits64, sgd, strategy="single", workers=1, batch_size=GLOBAL_BATCH, quiet=True,
               return_state=True, timeout=60, threads=1, epochs=1, clip_grad=0.05)
    got = run(2, GLOBAL_BATCH, epochs=1, clip_grad=0.05, microbatches=4, schedule="1f1b")
    assert_states_close(got.model_state, want.model_state)
    assert_history_matches(got.history, want.history)


def test_hybrid_two_replicas_of_two_stages_equal_one_process():
    """4 processes: replicas {0, 1} and {2, 3} each take half of every global batch of 96 and
    all-reduce gradients per stage; the last batch (93) splits 47 + 46, padded differently."""
    state, history = by_hand(1)
    result = run(4, GLOBAL_BATCH // 2, epochs=1, stages=2, microbatches=4, split="3")
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)
    n_params = sum(v.numel() for v in state.values())
    # stage 0 of each replica all-reduces its own gradients (layer 1: 64 * 16 + 16 float64) every step
    assert result.final["comm_bytes"] == 2 * 15 * (64 * 16 + 16) * 8 and n_params > 64 * 16 + 16
    assert result.final["workers"] == 2  # the replicas: data-parallel workers


def test_checkpoints_cross_strategies_pipeline_single_pipeline(tmp_path):
    """Epoch 1 under a pipeline, 2 under ``single`` from its checkpoint, 3 under a pipeline from
    that one: equal to 3 epochs in one process, with momentum (optimizer state) and an LR schedule.
    The pipeline's checkpoint is an ordinary one: `partrain serve`'s loader rebuilds the model."""
    state, history = by_hand(3, scheduler=True)
    first = run(2, GLOBAL_BATCH, epochs=1, schedule="1f1b", out_dir=str(tmp_path / "a"), scheduler_fn=_halving)
    ckpt = load_checkpoint(first.checkpoint)
    assert len(ckpt["optimizer"]["state"]) == len(state)  # every parameter's momentum, gathered
    model, _ = load_model(first.checkpoint)
    assert_states_close(model.state_dict(), first.model_state)
    second = fit(mlp64, digits64, sgd, strategy="single", workers=1, batch_size=GLOBAL_BATCH, epochs=2,
                 quiet=True, return_state=True, threads=1, out_dir=str(tmp_path / "b"), resume=first.checkpoint,
                 scheduler_fn=_halving)
    third = run(2, GLOBAL_BATCH, epochs=3, schedule="interleaved1f1b", out_dir=str(tmp_path / "c"),
                resume=second.checkpoint, scheduler_fn=_halving)
    assert_history_matches(third.history, history)
    assert_states_close(third.model_state, state)


def _mortal_mlp() -> nn.Module:
    layers = list(mlp64())
    return nn.Sequential(*layers[:5], KillOnRank(1), *layers[5:])


@pytest.mark.timeout(60)
@pytest.mark.fresh_processes
def test_a_stage_killed_mid_step_fails_the_job_naming_it():
    with pytest.raises(WorkerError) as info:
        fit(_mortal_mlp, digits64, sgd, strategy="pipeline", workers=2, batch_size=GLOBAL_BATCH, epochs=1,
            quiet=True, timeout=20, threads=1)
    assert info.value.rank == 1  # rank 1 = stage 1 (rank % stages), named so
    assert str(info.value).startswith("stage 1 (rank 1) failed: died with SIGKILL"), str(info.value)


# ----- the split and bad input, in this process -------------------------------------------------
def test_balance_minimises_the_largest_stage_and_skips_parameterless_stages():
    assert balance([4, 1, 1, 4], 2) == [2]
    assert balance([1, 1, 1, 1, 1, 1], 3) == [2, 4]
    # Flatten (no parameters) never forms a stage alone, even where it would balance better
    assert balance([0, 10, 0, 10, 0, 10], 3, [False, True, False, True, False, True]) == [2, 4]
    assert stage_ranks(4, 2, "loop") == [0, 1, 0, 1] and stage_ranks(4, 2, "v") == [0, 1, 1, 0]


def _prepared(**options):
    pipe = Pipeline(**options)
    pipe.setup(DistEnv(rank=0, world_size=2))
    model = mlp64()
    return pipe, *pipe.prepare(model, torch.optim.Adam(model.parameters()))


def test_prepare_keeps_this_stage_under_the_models_own_names():
    pipe, model, optimizer = _prepared(split="5")
    assert [n for n, _ in model.named_children()] == ["0", "1", "2", "3", "4"]
    assert [len(g["params"]) for g in optimizer.param_groups] == [4]  # 1.weight/bias, 3.weight/bias
    assert optimizer.local_state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]
    pipe, model, optimizer = _prepared(schedule="zbvzerobubble")  # rank 0 holds stages 0 and 3
    assert pipe.runtime is not None and pipe.runtime.owned == [0, 3]


def test_the_stage_optimizer_numbers_parameters_as_one_process_does():
    """Two groups (weights, biases) of Adam after a step in one process: the stage on rank 1 keeps
    exactly its parameters' state under the whole model's numbers, and gives them back so."""
    torch.manual_seed(0)
    whole = mlp64()
    groups = lambda m: [{"params": [p for n, p in m.named_parameters() if n.endswith("weight")]},  # noqa: E731
                        {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "lr": 0.5}]
    adam = torch.optim.Adam(groups(whole), lr=0.1)
    whole(torch.ones(3, 64, dtype=torch.float64)).sum().backward()
    adam.step()
    full = adam.state_dict()  # weights 1, 3, 5, 7 are 0-3; biases 4-7
    pipe = Pipeline(split="5")
    pipe.setup(DistEnv(rank=1, world_size=2))  # stage 1: layers 5 and 7
    torch.manual_seed(0)
    model = mlp64()
    model, optimizer = pipe.prepare(model, torch.optim.Adam(groups(model), lr=0.1))
    optimizer.load_state_dict(full)
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.5]
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    local = optimizer.local_state_dict()
    assert [g["params"] for g in local["param_groups"]] == [[2, 3], [6, 7]]
    for i in (2, 3, 6, 7):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(local["state"][i][key], full["state"][i][key])
    with pytest.raises(UsageError, match=r"Expected an optimizer state with 2 groups of \[4, 4\] parameters"):
        optimizer.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})


@pytest.mark.parametrize("options, line", [
    ({"stages": 1}, "Expected stages to be an integer of at least 2 (one stage is data parallel: strategy "
                    "'allreduce'). Received: stages=1"),
    ({"schedule": "zigzag"}, "Expected a schedule among"),
    ({"schedule": "zbvzerobubble", "virtual_stages": 3}, "Expected virtual_stages=2 for schedule 'zbvzerobubble'"),
    ({"schedule": "gpipe", "virtual_stages": 2}, "Expected virtual_stages=1 for schedule 'gpipe'"),
    ({"microbatches": 0}, "Expected microbatches to be a positive integer"),
])
def test_bad_options_are_one_line(options, line):
    with pytest.raises(UsageError, match=re.escape(line)):
        get_strategy("pipeline", **options)


class _Branchy(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) if x.sum() > 0 else self.a(x)


def test_bad_models_and_splits_are_one_line():
    with pytest.raises(UsageError, match=r"Expected a number of workers divisible by stages=2 \(.*\). Received: 3 worker"):
        Pipeline().setup(DistEnv(rank=0, world_size=3))
    pipe = Pipeline()
    pipe.setup(DistEnv(rank=0, world_size=2))
    branchy = _Branchy()
    model, _ = pipe.prepare(branchy, torch.optim.SGD(branchy.parameters(), lr=0.1))
    with pytest.raises(UsageError, match="Expected a model torch.export can trace, or an nn.Sequential .*"
                                         "Received: _Branchy, whose tracing failed in _Branchy.forward itself: "), torch.no_grad():
        model(torch.ones(8, 4))  # traced at the first batch, before any message
    # inside a larger model the line names the submodule that does not trace
    wrapped = nn.Module()
    wrapped.first, wrapped.inner = nn.Linear(4, 4), branchy
    wrapped.forward = lambda x: wrapped.inner(wrapped.first(x))
    assert culprit(wrapped, (torch.ones(2, 4),)) == "submodule 'inner' (_Branchy)"
    with pytest.raises(UsageError, match="Expected split='params' or submodule names for a model that is not an "
                                         "nn.Sequential. Received: split='time' for _Branchy"):
        pipe = Pipeline(split="time")
        pipe.setup(DistEnv(rank=0, world_size=2))
        pipe.prepare(branchy, torch.optim.SGD(branchy.parameters(), lr=0.1))
    with pytest.raises(UsageError, match=r"Expected split points among the model's children \['0', '1'"):
        _prepared(split="fc9")
    with pytest.raises(UsageError, match="Expected every pipeline stage to hold parameters. Received: stage 0 "
                                         r"\(children 0\) has none"):
        _prepared(split="1")
    with pytest.raises(UsageError, match="Expected at least 6 top-level children with parameters"):
        _prepared(schedule="interleaved1f1b", virtual_stages=3)


def test_partrain_train_runs_a_pipeline(tmp_path, capsys):
    """The issue's command line, unchanged (the default CNN on digits, a few steps)."""
    code = main(["train", "--quiet", "--strategy", "pipeline", "-o", "stages=2", "-o", "microbatches=8",
                 "--workers", "2", "--epochs", "1", "--max-steps", "4", "--out", str(tmp_path)])
    assert code == 0 and "test accuracy" in capsys.readouterr().out
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[-1]["strategy"] == "pipeline" and rows[-1]["step"] == 4
    assert load_checkpoint(str(tmp_path / "checkpoint.pt"))["config"]["strategy"] == "pipeline"
    assert main(["train", "--strategy", "pipeline", "-o", "stages=3", "--workers", "2", "--out",
                 str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "Expected a number of workers divisible by stages=3 (one process per stage, times the data-parallel "
        "replicas). Received: 2 worker(s)")


def test_cli_options_reach_the_constructor():
    assert parse_options("pipeline", ["stages=2", "microbatches=8", "schedule=GPipe", "split=1,5"]) == {
        "stages": 2, "microbatches": 8, "schedule": "GPipe", "split": "1,5"}


def test_errors_name_the_stage_and_replica():
    strategy = get_strategy("pipeline", stages=2)
    assert [strategy.describe_rank(r, 2) for r in range(2)] == ["stage 0 (rank 0)", "stage 1 (rank 1)"]
    assert strategy.describe_rank(3, 4) == "stage 1 of replica 1 (rank 3)"
