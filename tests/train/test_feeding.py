"""`fit` trains the same whichever pipeline feeds it; failures and Ctrl-C end it cleanly.

- the loader (inline, threads, processes) changes nothing in the result: each is
  compared with the inline run, float64;
- a device-resident compiled epoch (``data_on_device=True, compile=...``: one compiled call
  per step, the optimizer's update in it) equals the plain eager loop, float64, for SGD with
  momentum and for Adam under a per-step schedule: parameters, optimizer state, the epoch's
  figures (the cheap ``aot_eager`` backend: the check is that compiling and gathering on the
  device change nothing, not inductor's code generation, which the benchmark runs); a step
  it does not cover (clipping) says so in one line and trains as the eager loop; a
  non-finite loss stops it before any checkpoint; a backend that fails falls back to eager
  with one line;
- a loader that raises stops `fit` with the loader's traceback;
- Ctrl-C during training with loader processes leaves none of them behind;
- an LSTM on variable-length sequences (bucketed, padded, packed) under all-reduce with
  2 workers equals one process on the same global batches.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from examples.lstm_variable_length import LstmClassifier, data
from torch.utils.data import Dataset

from partrain.data import LoaderError, PadCollate
from partrain.train.fit import fit
from tests.helpers import assert_states_close, sgd
from tests.train.test_tasks import regression64, regressor64
from tests.waiting import wait_until

ONE = dict(workers=1, batch_size=16, quiet=True, timeout=60, threads=1, epochs=2)


class MapStyle(Dataset):
    """The float64 regression samples behind ``__getitem__`` (not a TensorDataset)."""

    def __init__(self, train: bool = True) -> None:
        self.ds = regression64()[0 if train else 1]

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        if self.fail_at is not None and i == self.fail_at:
            return read_broken_shard(i)
        return self.ds[i]

    fail_at: int | None = None


class FailsAt(MapStyle):
    fail_at = 11


def read_broken_shard(i: int):
    raise OSError(f"shard of sample {i} unreadable")


def map_style():
    return MapStyle(), MapStyle(train=False)


def failing():
    return FailsAt(), MapStyle(train=False)


@pytest.fixture(scope="module")
def inline():
    return fit(regressor64, regression64, sgd, **ONE).model_state


@pytest.mark.parametrize("loader", ["threads", "processes"])
def test_background_loaders_train_exactly_as_the_inline_loop(loader, inline):
    result = fit(regressor64, map_style, sgd, loader=loader, loader_workers=2, prefetch=2, **ONE)
    assert_states_close(result.model_state, inline)
    assert result.final["loader"].startswith(loader)


def adam(params):
    return torch.optim.Adam(params, lr=0.02, weight_decay=1e-3)


def nesterov(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)


def _optimizer_state(run_dir):
    return torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)["optimizer"]["state"]


@pytest.mark.parametrize("opt, options", [
    (sgd, dict(drop_last=True)),  # momentum, weight decay; one batch shape
    (adam, dict(lr_schedule="cosine", warmup_steps=3)),  # a learning rate per step; a short last batch
])
def test_a_device_resident_compiled_epoch_equals_the_eager_loop(opt, options, tmp_path, capfd):
    """One compiled call per step (gather, forward, backward, the optimizer's update, the
    sums) trains as the eager loop: parameters, optimizer state, the epoch's figures."""
    from torch._dynamo.utils import counters

    common = dict(ONE, quiet=False, **options)
    eager = fit(regressor64, regression64, opt, out_dir=str(tmp_path / "eager"), **common)
    graphs = counters["stats"]["unique_graphs"]
    result = fit(regressor64, regression64, opt, data_on_device=True, compile="aot_eager",
                 out_dir=str(tmp_path / "fused"), **common)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled indeed, not eager under another name
    assert "not fused" not in capfd.readouterr().err
    assert_states_close(result.model_state, eager.model_state)
    fused_state, eager_state = _optimizer_state(tmp_path / "fused"), _optimizer_state(tmp_path / "eager")
    assert fused_state.keys() == eager_state.keys()
    for k in eager_state:
        assert_states_close(fused_state[k], eager_state[k])
    for mine, theirs in zip(result.history, eager.history):
        for name in ("train_loss", "train_mse", "train_mae", "test_loss", "lr", "samples", "step"):
            assert mine[name] == pytest.approx(theirs[name], rel=1e-12, abs=0), name
    assert result.final["loader"] == "device" and result.final["compile_seconds"] > 0


def test_a_step_the_fused_path_does_not_cover_says_why_and_trains_as_the_eager_loop(capfd):
    # the "eager" backend: traces the forward, generates no code (the cheapest check of the path)
    eager = fit(regressor64, regression64, sgd, clip_grad=0.5, **dict(ONE, epochs=1))
    result = fit(regressor64, regression64, sgd, data_on_device=True, compile="eager", clip_grad=0.5,
                 **dict(ONE, quiet=False, epochs=1))
    lines = [line for line in capfd.readouterr().err.splitlines() if "not fused" in line]
    assert lines == ["partrain: data_on_device with compile: the step is not fused (clip_grad is set); "
                     "only the forward is compiled"]
    assert_states_close(result.model_state, eager.model_state)


def nan_target():
    train, test = regression64()
    train.tensors[1][40] = 1e300  # finite, but its squared error is not: the loss is the first non-finite value
    return train, test


def test_a_non_finite_loss_stops_a_fused_epoch_before_any_checkpoint(tmp_path):
    from partrain.train.guard import NonFiniteError

    with pytest.raises(NonFiniteError, match=r"Non-finite loss in epoch 1 between optimizer steps 1 and 6 "):
        fit(regressor64, nan_target, sgd, data_on_device=True, compile="aot_eager", drop_last=True,
            out_dir=str(tmp_path / "run"), **ONE)
    assert not os.path.exists(tmp_path / "run" / "checkpoint.pt")


def test_a_compiler_that_fails_falls_back_to_eager_with_one_line(inline, capfd):
    result = fit(regressor64, regression64, sgd, data_on_device=True, compile="no_such_backend",
                 **dict(ONE, quiet=False))
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "torch.compile failed" in line]
    assert len(lines) == 1 and lines[0].endswith("training eagerly")
    assert_states_close(result.model_state, inline)


def test_a_failing_loader_stops_fit_with_its_traceback():
    with pytest.raises(LoaderError) as info:
        fit(regressor64, failing, sgd, loader="threads", **ONE)
    assert "shard of sample 11 unreadable" in str(info.value)
    assert "read_broken_shard" in str(info.value)


SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from torch.utils.data import Dataset
    from partrain.train.fit import fit

    class Slow(Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, i):
            path = os.path.join(sys.argv[1], f"{os.getpid()}.pid")
            if not os.path.exists(path):  # a loader process says it runs
                open(path, "w").close()
            return torch.ones(4), torch.tensor(0.0)

    def model():
        return torch.nn.Linear(4, 1)

    def data():
        return Slow(), Slow()

    def opt(p):
        return torch.optim.SGD(p, lr=0.0)

    if __name__ == "__main__":
        fit(model, data, opt, workers=1, epochs=1000, loader="processes", loader_workers=2,
            batch_size=4, quiet=True, timeout=60)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_leaves_no_loader_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def loaders() -> list[int]:  # the training process reads two samples itself (fit's checks)
            return [pid for pid in (int(p.stem) for p in tmp_path.glob("*.pid")) if pid != proc.pid]

        wait_until(lambda: len(loaders()) >= 2, "two loader processes", timeout=60)
        pids = loaders()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        wait_until(lambda: not any(_alive(pid) for pid in pids), "the loader processes to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def lstm64() -> LstmClassifier:
    torch.manual_seed(0)
    return LstmClassifier(hidden=6).double()


def sequences64():
    return data(96, dtype=torch.float64)


plain_sgd = functools.partial(sgd, lr=0.1, momentum=0.0, weight_decay=0.0)


def test_an_lstm_on_variable_length_sequences_trains_under_allreduce_with_2_workers():
    """Bucketed global batches of 16 split over 2 workers = one process on the same 16."""
    common = dict(quiet=True, timeout=60, threads=1, epochs=2, collate_fn=PadCollate())
    two = fit(lstm64, sequences64, plain_sgd, strategy="allreduce", workers=2, batch_size=8, **common)
    one = fit(lstm64, sequences64, plain_sgd, strategy="single", workers=1, batch_size=16, **common)
    assert_states_close(two.model_state, one.model_state)
    assert two.history[0]["samples"] == 96  # every sample once per epoch
    assert two.history[-1]["train_loss"] < two.history[0]["train_loss"] or two.final["train_accuracy"] > 0.6


def test_the_epoch_line_says_when_the_input_pipeline_is_the_bottleneck():
    from partrain.train.report import summary as _summary

    row = {"epoch": 1, "train_loss": 0.5, "test_loss": 0.4, "samples_per_s": 100.0, "time_data": 3.0,
           "time_compute": 1.0, "time_comm": 0.0, "loader": "threads x2, prefetch 4",
           "loader_tuned": "loader threads 2->4"}
    line = _summary(row, 2)
    assert "[data 75% compute 25% comm 0%]" in line
    assert line.endswith("input-bound (loader threads x2, prefetch 4: loader threads 2->4 for the next epoch)")
    assert "input-bound" not in _summary(dict(row, time_data=0.1), 2)


@pytest.mark.parametrize("argv, line", [
    (["--loader-workers", "0"], "Expected a positive number of loader workers or None. Received: loader_workers=0"),
    (["--prefetch", "0"], "Expected a positive prefetch depth"),
])
def test_bad_feeding_options_are_one_line(argv, line, tmp_path, capsys):
    from partrain.cli import main

    assert main(["train", "--out", str(tmp_path / "run"), "--workers", "1", "--dataset", "synthetic",
                 "--synthetic-samples", "64", *argv]) == 2
    assert line in capsys.readouterr().err


def sampler_batches(epoch: int, rank: int, workers: int, stop_after: int | None = None):
    """A user's generator that yields the batches the inline loop would draw (seed 0)."""
    from partrain.data import ShardedBatchSampler

    train = regression64()[0]
    sampler = ShardedBatchSampler(len(train), 16, rank, workers, seed=0)
    sampler.set_epoch(epoch)
    for k, index in enumerate(sampler.iter_tensors()):
        if stop_after is not None and k == stop_after:
            return
        yield tuple(t[index] for t in train.tensors)


def generated(stop_after: int | None = None):
    from partrain.data import Generated

    return Generated(functools.partial(sampler_batches, stop_after=stop_after), steps=7), regression64()[1]


def test_a_batch_generator_trains_exactly_as_the_inline_loop_and_must_yield_every_step(inline):
    result = fit(regressor64, generated, sgd, **ONE)
    assert_states_close(result.model_state, inline)
    assert result.final["loader"].startswith("generator")
    with pytest.raises(LoaderError, match=r"Expected 7 batches from the generator in epoch 1 on worker 0. "
                                          r"Received: 5"):
        fit(regressor64, functools.partial(generated, stop_after=5), sgd, **ONE)


@pytest.mark.parametrize("options, line", [
    (dict(data_on_device=True), "Expected an in-memory TensorDataset (and no collate_fn) for data_on_device=True. "
                                "Received: MapStyle"),
    (dict(bucket=True), "Expected a training set with per-sample lengths for bucket=True"),
    (dict(loader="fast"), "Expected loader among ['auto', 'inline', 'threads', 'processes']. Received: 'fast'"),
    (dict(compile=3), "Expected compile to be True, False or a torch.compile backend name. Received: 3"),
])
def test_bad_feeding_arguments_to_fit_are_one_line_before_any_worker(options, line, monkeypatch):
    from partrain.errors import UsageError
    from tests.train.test_tasks import no_launch

    monkeypatch.setattr("partrain.train.fit.launch", no_launch)
    with pytest.raises(UsageError) as info:
        fit(regressor64, map_style, sgd, **dict(ONE, **options))
    assert str(info.value).startswith(line)


def test_short_epochs_walk_through_the_data_on_every_feeding_path(tmp_path):
    """``samples_per_epoch``: the inline loop, the device-resident feeder and the fused compiled epoch
    take the same samples; an epoch as long as the training set is the plain epoch; a batch
    generator, which sets its own epoch, is one line before any worker."""
    from partrain.errors import UsageError
    from tests.train.test_tasks import no_launch

    short = dict(ONE, epochs=3, samples_per_epoch=40)  # 97 samples: the third epoch begins the second pass
    inline = fit(regressor64, regression64, sgd, **short)
    assert [row["samples"] for row in inline.history] == [40, 40, 40]
    for options in (dict(data_on_device=True), dict(data_on_device=True, compile="eager")):
        other = fit(regressor64, regression64, sgd, **options, **short)
        assert_states_close(other.model_state, inline.model_state)
        for mine, theirs in zip(other.history, inline.history):
            assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-12, abs=0)
    whole = fit(regressor64, regression64, sgd, **dict(ONE, samples_per_epoch=97))
    plain = fit(regressor64, regression64, sgd, **ONE)
    assert_states_close(whole.model_state, plain.model_state, atol=0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("partrain.train.fit.launch", no_launch)
        with pytest.raises(UsageError, match=r"^Expected samples_per_epoch with a Dataset of samples; a batch "
                                             r"generator sets its own epoch\. Received: samples_per_epoch=40 with "
                                             r"a Generated"):
            fit(regressor64, generated, sgd, **dict(ONE, workers=2, samples_per_epoch=40))
        with pytest.raises(UsageError, match=r"^Expected a positive number of training samples per epoch\. "
                                             r"Received: samples_per_epoch=0$"):
            fit(regressor64, regression64, sgd, **dict(ONE, workers=2, samples_per_epoch=0))


def test_the_fused_step_marks_every_input_it_writes_or_reads_whole_as_fixed_on_cuda(monkeypatch):
    """CUDA graphs take a compiled step that writes its inputs in place only when those inputs are
    marked as living at fixed addresses (else inductor skips the graphs: "mutated inputs"), and copy
    every unmarked input into the graph at each replay. `FusedStep.begin_epoch` must mark the
    parameters, the optimizer's state, the learning rates, the resident training set and the sums;
    here on the CPU with every tensor taken for a CUDA one (the marking is all that runs)."""
    from partrain.train import compiling
    from partrain.train.task import Task

    marked: list[int] = []
    monkeypatch.setattr(torch._dynamo, "mark_static_address",
                        lambda t, guard=True: marked.append(t.data_ptr()) if not guard else pytest.fail("guarded"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    model = regressor64()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = compiling.FusedStep(model, optimizer, Task("mse"), {"backend": "eager"})
    data = (torch.zeros(10, 6, dtype=torch.float64), torch.zeros(10, dtype=torch.float64))
    sums = step.begin_epoch(data, torch.tensor(1.5, dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64))
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    expected = [*model.parameters(), *momentum, *step.lrs, *data, *sums]
    assert set(marked) >= {t.data_ptr() for t in expected}
    assert sums[0].tolist() == [1.5] and sums[1].tolist() == [2.0]  # the epoch's starting sums
    assert step.begin_epoch(data, torch.tensor(0.0, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)) is sums
