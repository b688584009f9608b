"""`fit` beyond classification tensors: regression, dict batches, tuple outputs, the per-sample
loss contract, non-finite values, clipping, schedules, early stopping, mixed precision.

References are hand-written float64 PyTorch loops on the global batch (the same sample
order, `tests.helpers.epoch_order`); equal runs through different batch structures
are compared bit for bit.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from partrain.checkpoint import load_checkpoint, load_model
from partrain.errors import UsageError, WorkerError
from partrain.train.fit import fit
from partrain.train.task import Task
from tests.helpers import F64_ATOL, assert_states_close, epoch_order, sgd, torch_threads

COMMON = dict(workers=2, batch_size=16, quiet=True, timeout=60, threads=1)
W = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -1.0], dtype=torch.float64)


def regression64() -> tuple[TensorDataset, TensorDataset]:
    """Float64 regression data; 97 training samples (odd: the last global batch splits unevenly)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(130, 6, generator=g, dtype=torch.float64)
    y = x @ W + 0.5 + 0.1 * torch.randn(130, generator=g, dtype=torch.float64)
    return TensorDataset(x[:97], y[:97]), TensorDataset(x[97:], y[97:])


def regressor64() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1)).double()


class DictData(Dataset):
    """The samples of a TensorDataset as dicts ``{"x": ..., "y": ...}``."""

    def __init__(self, ds: TensorDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.ds[i]
        return {"x": x, "y": y}


def dict_regression64() -> tuple[Dataset, Dataset]:
    train, test = regression64()
    return DictData(train), DictData(test)


class TwoHeads(nn.Module):
    """A model returning a tuple: the prediction and an auxiliary output."""

    def __init__(self) -> None:
        super().__init__()
        self.net = regressor64()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out, out.detach().abs()

    def state_dict(self, *args, **kwargs):  # same keys as regressor64, to compare the runs
        return self.net.state_dict(*args, **kwargs)


def first_head_mse(output, target):
    return (output[0].squeeze(1) - target) ** 2


def mean_mse(output, target):
    return F.mse_loss(output.squeeze(1), target)  # reduction="mean": one number per batch


def train_regression_by_hand(epochs: int, batch: int, clip: float | None = None,
                             lr_at=None) -> dict[str, torch.Tensor]:
    """One process on the global batch, plain PyTorch, ``mse_loss(reduction="mean")``."""
    with torch_threads(1):
        train, _ = regression64()
        x_all, y_all = train.tensors
        torch.manual_seed(0)
        model = regressor64()
        opt = sgd(model.parameters())
        step = 0
        for epoch in range(epochs):
            order = epoch_order(len(x_all), epoch)
            for start in range(0, len(order), batch):
                index = order[start:start + batch]
                if lr_at is not None:
                    for group in opt.param_groups:
                        group["lr"] = lr_at(step)
                loss = F.mse_loss(model(x_all[index]).squeeze(1), y_all[index])
                opt.zero_grad()
                loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                step += 1
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_regression_equals_a_hand_written_loop():
    """Float targets pick the mse loss and regression metrics; 2 workers = one process on the global batch."""
    result = fit(regressor64, regression64, sgd, strategy="allreduce", epochs=2, **COMMON)
    assert_states_close(result.model_state, train_regression_by_hand(2, 32))
    row = result.final
    assert "test_accuracy" not in row and "train_accuracy" not in row
    assert math.isclose(row["train_loss"], row["train_mse"], rel_tol=1e-12)
    model = result.model()
    _, test = regression64()
    x, y = test.tensors
    with torch.no_grad():
        err = model(x).squeeze(1) - y
    assert math.isclose(row["test_mse"], err.pow(2).mean().item(), rel_tol=0, abs_tol=F64_ATOL)
    assert math.isclose(row["test_mae"], err.abs().mean().item(), rel_tol=0, abs_tol=F64_ATOL)
    assert math.isnan(result.test_accuracy)


def test_dict_batches_and_tuple_outputs_train_like_tensors():
    """The same samples as dicts, and a model with a tuple output and its own loss: the same run, bit for bit."""
    plain = fit(regressor64, regression64, sgd, epochs=1, **COMMON)
    as_dicts = fit(regressor64, dict_regression64, sgd, epochs=1, **COMMON)
    assert_states_close(as_dicts.model_state, plain.model_state, atol=0)
    tuple_out = fit(TwoHeads, regression64, sgd, epochs=1, loss_fn=first_head_mse, metrics=["mse", "mae"],
                    **COMMON)
    assert_states_close(tuple_out.model_state, plain.model_state, atol=0)
    assert tuple_out.final["test_mse"] == plain.final["test_mse"]


def flat_regressor64() -> nn.Module:
    return nn.Sequential(regressor64(), nn.Flatten(0))  # outputs (N,), the target's shape


def test_a_mean_reduced_torch_loss_is_used_per_sample_exactly():
    named = fit(flat_regressor64, regression64, sgd, epochs=1, loss_fn="mse", **COMMON)
    module = fit(flat_regressor64, regression64, sgd, epochs=1, loss_fn=nn.MSELoss(), **COMMON)  # reduction="mean"
    assert_states_close(module.model_state, named.model_state, atol=0)


@pytest.mark.parametrize("loss_fn,expected", [
    (mean_mse, "Received: a single number for 2 samples - a mean-reduced loss"),
    (nn.MSELoss(reduction="sum"), "Received: MSELoss(reduction='sum')"),
    (nn.CrossEntropyLoss(weight=torch.ones(1)), "Received: CrossEntropyLoss(weight=..., reduction='mean')"),
    ("hinge", "Expected a loss among"),
])
def test_a_whole_batch_loss_is_refused_before_spawning(loss_fn, expected, monkeypatch):
    monkeypatch.setattr("partrain.train.fit.launch", no_launch)
    with pytest.raises(UsageError) as e:
        fit(regressor64, regression64, sgd, epochs=1, loss_fn=loss_fn, **COMMON)
    assert expected in str(e.value) and len(str(e.value).splitlines()) == 1


def no_launch(*args, **kwargs):
    raise AssertionError("a process was started for input the calling process could check")


def nan_data() -> tuple[TensorDataset, TensorDataset]:
    train, test = regression64()
    x, y = train.tensors
    x = x.clone()
    x[50, 2] = math.nan
    return TensorDataset(x, y), test


class ReadOnDemand(Dataset):
    """Samples a run cannot look at before its first step (a file read per sample, say)."""

    def __init__(self, ds: TensorDataset):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def nan_data_on_demand() -> tuple[Dataset, TensorDataset]:
    train, test = nan_data()
    return ReadOnDemand(train), test


def test_nan_in_an_in_memory_training_set_is_one_line_before_the_first_step(tmp_path):
    with pytest.raises(UsageError, match=r"training set's inputs\. Received: dataset with 1 NaN value in 1 of 97 "
                       r"samples \(the first at sample 50; on_nan='skip'"):
        fit(regressor64, nan_data, sgd, epochs=2, out_dir=str(tmp_path), **COMMON)
    assert not os.path.exists(tmp_path / "checkpoint.pt")


def test_nan_in_the_data_stops_the_run_before_a_checkpoint(tmp_path):
    with pytest.raises(WorkerError) as e:  # samples read on demand: the step's guard finds it
        fit(regressor64, nan_data_on_demand, sgd, epochs=2, out_dir=str(tmp_path), **COMMON)
    message = str(e.value)
    assert "NonFiniteError" in message and "epoch 1" in message
    assert "holds" in message and "NaN/Inf" in message
    assert not os.path.exists(tmp_path / "checkpoint.pt")


def test_a_nan_learning_rate_is_named_at_the_step_the_parameters_break(tmp_path):
    nan_sgd = functools.partial(torch.optim.SGD, lr=math.nan)
    with pytest.raises(WorkerError, match=r"optimizer step 2: parameter 0\.weight holds 72 NaN/Inf of 72 \(lr nan\)"):
        fit(regressor64, regression64, nan_sgd, epochs=1, **COMMON)


def test_skip_drops_the_steps_with_nan_and_counts_them():
    result = fit(regressor64, nan_data, sgd, epochs=2, on_nan="skip", **COMMON)
    # the NaN sample's step, once per epoch, on both workers (all-reduce spreads the NaN): summed
    assert [r["skipped_steps"] for r in result.history] == [2, 2]
    assert all(torch.isfinite(v).all() for v in result.model_state.values())
    assert result.final["step"] == 2 * math.ceil(97 / 32)


def test_clip_grad_and_cosine_schedule_equal_a_hand_written_loop():
    steps = 2 * math.ceil(97 / 32)

    def lr_at(step: int) -> float:
        warm = min(1.0, (step + 1) / 3)
        return 0.05 * warm * 0.5 * (1 + math.cos(math.pi * step / steps))

    result = fit(regressor64, regression64, sgd, epochs=2, clip_grad=0.5, lr_schedule="cosine", warmup_steps=3,
                 **COMMON)
    assert_states_close(result.model_state, train_regression_by_hand(2, 32, clip=0.5, lr_at=lr_at))
    assert math.isclose(result.final["lr"], lr_at(steps - 1), rel_tol=1e-12)


def test_early_stop_ends_the_run_and_best_pt_holds_the_best_epoch(tmp_path):
    """monitor='epoch' never improves after the first epoch: patience 1 stops after epoch 2."""
    result = fit(regressor64, regression64, sgd, epochs=5, early_stop=1, monitor="epoch",
                 out_dir=str(tmp_path), **COMMON)
    assert [r["epoch"] for r in result.history] == [1, 2] and result.stopped == "early_stop"
    assert load_checkpoint(str(tmp_path / "best.pt"))["epoch"] == 1
    assert load_checkpoint(str(tmp_path / "checkpoint.pt"))["epoch"] == 2


def test_bf16_autocast_trains_digits():
    from tests.helpers import small_cnn

    result = fit(small_cnn, "digits", sgd, epochs=2, precision="bf16", **COMMON)
    assert result.test_accuracy > 0.8 and math.isfinite(result.final["test_loss"])


def test_tensorboard_receives_every_figure(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fit(regressor64, regression64, sgd, epochs=2, out_dir=str(tmp_path), tensorboard=True, **COMMON)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/train", "loss/test", "mse/test", "mae/train", "time/compute"} <= tags
    assert [e.step for e in acc.Scalars("loss/test")] == [1, 2]


class Ragged(Dataset):
    """Sequences of different lengths with a float target: their sum."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.arange(1 + i % 5, dtype=torch.float32)
        return x, x.sum()


def ragged_data():
    return Ragged()


def pad_collate(samples):
    xs, ys = zip(*samples)
    return nn.utils.rnn.pad_sequence(list(xs), batch_first=True, padding_value=0.0), torch.stack(ys)


class SumModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x.sum(1)


def test_variable_length_samples_need_a_collate_fn_and_train_with_one():
    with pytest.raises(UsageError, match=r"Expected samples of equal shape to stack into a batch, or "
                                         r"fit\(\.\.\., collate_fn=\.\.\.\)"):
        fit(SumModel, ragged_data, sgd, epochs=1, **COMMON)
    plain = functools.partial(sgd, lr=0.01, momentum=0.0, weight_decay=0.0)
    result = fit(SumModel, ragged_data, plain, epochs=5, collate_fn=pad_collate, **COMMON)
    assert abs(result.model_state["scale"].item() - 1.0) < 0.05  # the model learns: prediction = sum


def test_labels_beyond_the_model_outputs_are_refused_before_spawning(monkeypatch):
    monkeypatch.setattr("partrain.train.fit.launch", no_launch)

    def data():
        return TensorDataset(torch.randn(20, 6), torch.arange(20) % 5)

    from tests.data_fixtures import tiny_model  # 2 outputs

    with pytest.raises(UsageError, match=r"Expected class labels in \[0, 1\] for a model with 2 outputs\. "
                                         r"Received labels from 0 to 4"):
        fit(tiny_model, data(), sgd, epochs=1, **COMMON)


def test_resume_with_nothing_to_train_says_so(tmp_path, capsys):
    out = str(tmp_path / "run")
    fit(regressor64, regression64, sgd, epochs=1, out_dir=out, **COMMON)
    with pytest.raises(UsageError, match=r"Expected epochs above 1 to train on from .*checkpoint\.pt'\. "
                                         r"Received: a checkpoint at epoch 1 of epochs=1"):
        fit(regressor64, regression64, sgd, epochs=1, out_dir=out, resume=os.path.join(out, "checkpoint.pt"),
            **COMMON)
    again = fit(regressor64, regression64, sgd, epochs=1, out_dir=out, resume="auto", **{**COMMON, "quiet": False})
    assert "is already at epoch 1 of epochs=1: nothing to train" in capsys.readouterr().out
    assert len(again.history) == 1


def test_an_existing_run_is_never_overwritten_silently(tmp_path):
    out = str(tmp_path / "run")
    fit(regressor64, regression64, sgd, epochs=1, out_dir=out, **COMMON)
    with pytest.raises(UsageError, match=r"Expected a new output directory \(or resume / overwrite\)\. Received: "
                                         r".*which holds a run \(checkpoint\.pt, best\.pt, metrics\.csv"):
        fit(regressor64, regression64, sgd, epochs=2, out_dir=out, **COMMON)
    result = fit(regressor64, regression64, sgd, epochs=2, out_dir=out, overwrite=True, **COMMON)
    assert len(open(os.path.join(out, "metrics.jsonl")).read().splitlines()) == 2 == len(result.history)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="which is a file"):
        fit(regressor64, regression64, sgd, epochs=1, out_dir=str(tmp_path / "file"), **COMMON)


def test_a_python_trained_model_records_its_spec_and_rebuilds(tmp_path):
    from tests.data_fixtures import tiny_regression, tiny_regressor

    result = fit(tiny_regressor, tiny_regression, sgd, epochs=1, out_dir=str(tmp_path), **COMMON)
    spec = load_checkpoint(str(tmp_path / "checkpoint.pt"))["model_spec"]
    assert spec["name"] == "tests.data_fixtures:tiny_regressor" and spec["task"] == "regression"
    assert spec["input_shape"] == [6] and os.path.isdir(spec["path"])
    model, _ = load_model(str(tmp_path / "checkpoint.pt"))
    x = torch.randn(4, 6)
    assert torch.equal(model(x), result.model()(x))
    from partrain.serve.checkpoints import (
        model_from_checkpoint,  # what `partrain serve CHECKPOINT` runs
    )

    served, _ = model_from_checkpoint(str(tmp_path / "checkpoint.pt"))
    with torch.no_grad():
        assert torch.equal(served(x), result.model()(x))
    cfg = __import__("json").load(open(tmp_path / "config.json"))
    assert cfg["optimizer"] == "tests.helpers:sgd" and cfg["task"]["loss"] == "mse"
    assert cfg["launch"]["workers"] == 2 and cfg["data"] == "tests.data_fixtures:tiny_regression"


def test_regression_from_npz_and_module_function_on_the_command_line(tmp_path, capsys):
    from partrain.cli import main
    from tests.data_fixtures import tiny_regression

    x, y = tiny_regression().tensors
    np.savez(tmp_path / "reg.npz", x=x.numpy(), y=y.numpy())
    for dataset in (str(tmp_path / "reg.npz"), "tests.data_fixtures:tiny_regression"):
        out = tmp_path / dataset.replace("/", "_")
        code = main(["train", "--quiet", "--workers", "2", "--epochs", "3", "--model", "mlp", "--lr", "0.01",
                     "--dataset", dataset, "--out", str(out)])
        assert code == 0
        line = capsys.readouterr().out
        assert "test mse: " in line and "accuracy" not in line
        rows = [__import__("json").loads(r) for r in open(out / "metrics.jsonl")]
        assert rows[-1]["test_mse"] < 0.5 * float(y.var())  # it learns
        assert load_checkpoint(str(out / "checkpoint.pt"))["model_spec"]["task"] == "regression"


@pytest.mark.parametrize("strategy", ["single", "ps", "hogwild", "localsgd"])
def test_regression_trains_under_every_strategy(strategy):
    from tests.data_fixtures import tiny_regression, tiny_regressor

    workers = 1 if strategy == "single" else 2
    result = fit(tiny_regressor, tiny_regression, functools.partial(sgd, lr=0.01), strategy=strategy, epochs=6,
                 **{**COMMON, "workers": workers})
    y = tiny_regression().tensors[1]
    # asynchronous strategies are not deterministic: the best epoch shows that it learns
    assert min(r["test_mse"] for r in result.history) < 0.5 * float(y.var()), result.history
    assert "test_accuracy" not in result.final


def test_a_task_object_carries_target_key_and_metrics():
    class Keyed(Dataset):
        def __init__(self):
            self.ds = regression64()[0]

        def __len__(self):
            return len(self.ds)

        def __getitem__(self, i):
            x, y = self.ds[i]
            return {"features": x, "price": y}

    task = Task("mse", metrics={"mae": None}, target_key="price")
    batch = {"features": torch.zeros(2, 6, dtype=torch.float64), "price": torch.zeros(2, dtype=torch.float64)}
    task.resolve(batch)
    assert task.metric_names == ["mae"]
    with pytest.raises(UsageError, match=r"Expected dict batches with a target under 'y'"):
        Task(target_key="y").resolve({"features": torch.zeros(2)})


def test_resuming_with_weights_of_another_shape_names_the_tensors(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    fit(regressor64, regression64, sgd, epochs=1, out_dir=out, **COMMON)
    monkeypatch.setattr("partrain.train.fit.launch", no_launch)
    with pytest.raises(UsageError) as e:
        fit(wider, regression64, sgd, epochs=2, out_dir=out, resume="auto", **COMMON)
    assert str(e.value).endswith("Received: 3 mismatched tensors (0.weight: checkpoint (12, 6) vs model (20, 6); "
                                 "0.bias: checkpoint (12,) vs model (20,); 2.weight: checkpoint (1, 12) vs model "
                                 "(1, 20))")


def wider() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 1)).double()


def test_a_lambda_loss_is_named_in_one_line(monkeypatch):
    monkeypatch.setattr("partrain.train.fit.launch", no_launch)
    with pytest.raises(UsageError, match=r"^Expected loss_fn to be picklable \(a module-level function"):
        fit(regressor64, regression64, sgd, epochs=1, loss_fn=lambda out, y: (out.squeeze(1) - y) ** 2, **COMMON)


def test_resume_auto_starts_again_where_a_run_stopped_before_its_first_checkpoint(tmp_path):
    """A restart (torchrun, a scheduler) before the first checkpoint: config.json is there, nothing to resume."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    result = fit(regressor64, regression64, sgd, epochs=1, out_dir=str(out), resume="auto", **COMMON)
    assert len(result.history) == 1 and (out / "checkpoint.pt").exists()
