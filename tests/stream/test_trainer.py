"""OnlineTrainer: dequeue-all training is plain training on the same batches, and no item is lost.

The reference is a hand-written float64 loop: for each batch the trainer
reports (`StepRecord`, in order), the model's output on the batch's items, then
one optimizer step on the labelled items' weighted mean loss. Each item's
prediction must equal that output *before* the step (the documented version),
and the final weights must equal the reference's. Start with
`test_dequeue_all_equals_a_plain_loop_on_the_same_batches`; the rest pin the
options (replay, schedule, exact resume), the overflow policies and the drain,
with a model gated by an Event so that "the step is running" is a condition,
not a sleep.
"""

from __future__ import annotations

import asyncio
import copy
import csv
import logging
import math
import re
import shutil
import threading

import pytest
import torch
from torch import nn

from partrain.batching import BatcherClosed, Evicted, QueueFull
from partrain.errors import UsageError
from partrain.stream import DuplicateItem, OnlineTrainer, Prediction, TrainerClosed
from partrain.stream.metrics import COLUMNS, LATENCY_BUCKETS, StreamMetrics

from ..waiting import wait_until


def mlp64(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def items(n: int, seed: int = 1, unlabelled_every: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(6, generator=g, dtype=torch.float64)
        y = None if unlabelled_every and i % unlabelled_every == 3 else torch.randn(2, generator=g, dtype=torch.float64)
        out.append({"x": x, "y": y, "weight": 0.5 + (i % 3) / 2, "id": f"item-{i}"})
    return out


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, batch: list[dict]) -> torch.Tensor:
    """The hand-written loop's step: forward all, weighted MSE on the labelled rows, one update."""
    out = model(torch.stack([it["x"] for it in batch]))
    rows = [i for i, it in enumerate(batch) if it["y"] is not None]
    if rows:
        y = torch.stack([batch[i]["y"] for i in rows])
        w = torch.tensor([batch[i]["weight"] for i in rows], dtype=torch.float64)
        per_row = ((out[rows] - y) ** 2).mean(1)
        loss = (w * per_row).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out.detach()


class HoldFirst(nn.Module):
    """``inner``, except that the first forward waits for ``gate``: the queue fills behind it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.gate = threading.Event()

    def forward(self, x):
        assert self.gate.wait(30), "the test never opened the gate"
        return self.inner(x)


def submit_from_threads(trainer: OnlineTrainer, stream: list[dict], threads: int) -> dict[str, object]:
    """Every item submitted, ``threads`` producers at once (item k by producer k % threads); the futures by id."""
    futures: dict[str, object] = {}

    def produce(part: list[dict]) -> None:
        for it in part:
            futures[it["id"]] = trainer.submit(it["x"], it["y"], weight=it["weight"], id=it["id"])

    producers = [threading.Thread(target=produce, args=(stream[k::threads],)) for k in range(threads)]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    return futures


def test_dequeue_all_equals_a_plain_loop_on_the_same_batches():
    model, ref = HoldFirst(mlp64()), mlp64()
    records = []
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "mse",
                            max_batch=16, on_step=records.append)
    stream = items(240)
    futures = submit_from_threads(trainer, stream, 3)
    model.gate.set()  # everything is queued behind the first step: the next ones take 16 at a time
    stats = trainer.close()
    assert stats.accepted == stats.predicted == 240 and stats.unresolved == 0
    assert stats.trained == sum(it["y"] is not None for it in stream)
    assert sum(r.items for r in records) == 240 and all(r.items == 16 for r in records[1:-1])

    by_id = {it["id"]: it for it in stream}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for version, record in enumerate(records):
        batch = [by_id[i] for i in record.ids]
        expected = reference_step(ref, ref_opt, batch)
        assert record.version == version  # one update per batch, all batches labelled or not in order
        for row, item_id in enumerate(record.ids):
            got = futures[item_id].result(0)
            assert isinstance(got, Prediction) and got.version == record.version
            assert torch.equal(got.output, expected[row]), item_id
    for a, b in zip(model.inner.parameters(), ref.parameters()):
        assert torch.equal(a.detach(), b.detach())


def test_an_unlabelled_batch_predicts_without_an_update():
    model = mlp64()
    before = copy.deepcopy(model)
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse")
    x = torch.randn(6, dtype=torch.float64)
    got = trainer.predict(x)
    trainer.close()
    assert got.version == 0 and trainer.version == 0 and trainer.stats.updates == 0
    assert torch.equal(got.output, before(x.unsqueeze(0))[0].detach())


def ordered_trainer(model: nn.Module, path, on_step=None, resume=False) -> OnlineTrainer:
    """Batches of exactly 8 items in submission order (min_batch = max_batch), Adam, replay, schedule."""
    return OnlineTrainer(model, torch.optim.Adam(model.parameters(), lr=0.01), "mse", max_batch=8, min_batch=8,
                         max_wait=60.0, replay=4, replay_capacity=20, seed=3, lr_schedule="warmup:20",
                         checkpoint=str(path), checkpoint_every=3, resume=resume, on_step=on_step)


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    stream = items(48, unlabelled_every=0)
    snapshot = tmp_path / "after-3.pt"

    def keep_third(record):
        if record.version + 1 == 3:  # the checkpoint of update 3 was written before the hook
            shutil.copy(tmp_path / "a.pt", snapshot)

    whole = mlp64()
    a = ordered_trainer(whole, tmp_path / "a.pt", keep_third)
    a.consume(stream)
    a.close()
    assert a.version == 6 and a.stats.replayed == 5 * 4  # the first update has no history yet

    resumed = mlp64(seed=7)  # other initial weights: everything must come from the checkpoint
    b = ordered_trainer(resumed, snapshot, resume=True)
    assert b.version == 3 and b.items_trained == 24
    with pytest.raises(DuplicateItem):
        b.submit(stream[0]["x"], stream[0]["y"], id=stream[0]["id"])  # trained before the checkpoint
    b.consume(stream[24:])
    b.close()
    assert b.version == 6
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_a_resume_with_other_optimizer_settings_trains_with_them_and_says_so(tmp_path, caplog):
    """The checkpoint's Adam state (moments) carries over; this run's lr and betas win where the
    checkpoint's differ (its lr had come back with the optimizer state: a resume with another
    --lr trained on at the old one), the schedule scales the new base lr, and one log line
    names the changes."""
    stream = items(24, unlabelled_every=0)
    a = ordered_trainer(mlp64(), tmp_path / "a.pt")
    a.consume(stream)
    a.close()
    saved = torch.load(tmp_path / "a.pt", weights_only=True)["optimizer"]["state"]
    lrs = []
    model = mlp64()
    with caplog.at_level(logging.INFO, logger="partrain.stream"):
        b = OnlineTrainer(model, torch.optim.Adam(model.parameters(), lr=0.002, betas=(0.8, 0.99)), "mse",
                          max_batch=8, min_batch=8, max_wait=60.0, lr_schedule="warmup:20",
                          checkpoint=str(tmp_path / "a.pt"), resume=True, on_step=lambda r: lrs.append(r.lr))
    assert [r.getMessage() for r in caplog.records] == [
        "resuming with this run's optimizer settings where the checkpoint's differ: betas (0.8, 0.99) (the "
        "checkpoint's (0.9, 0.999)), lr 0.002 (the checkpoint's 0.01)"]
    group = b.optimizer.param_groups[0]
    assert tuple(group["betas"]) == (0.8, 0.99)
    for i, p in enumerate(model.parameters()):
        assert torch.equal(b.optimizer.state[p]["exp_avg"], saved[i]["exp_avg"])
    b.consume([{**it, "id": f"new-{i}"} for i, it in enumerate(items(8, seed=2, unlabelled_every=0))])
    b.close()
    assert lrs == [0.002]  # past the warmup (24 items trained): the schedule's factor is 1


def test_lr_schedule_counts_items_and_replay_mixes_history(tmp_path):
    lrs, replayed = [], []
    model = mlp64()

    def seen(record):
        lrs.append(record.lr)
        replayed.append(record.replayed)

    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse", max_batch=4, min_batch=4,
                            max_wait=60.0, replay=3, lr_schedule="warmup:8", on_step=seen)
    trainer.consume(items(12, unlabelled_every=0))
    trainer.close()
    # warmup:8 by items trained before the update: 0, 4, 8 items -> (n+1)/8 capped at 1
    assert lrs == pytest.approx([0.1 * 1 / 8, 0.1 * 5 / 8, 0.1])
    assert replayed == [0, 3, 3]


def test_replay_draws_at_most_the_history_it_holds_and_trains_like_a_hand_written_loop():
    """Replay 16 from a history of 2, then 4: a draw takes 2, then 4 items (with replacement, from the
    trainer's seeded generator), never 16 copies of the few items seen so far; each update equals a
    hand-written step on the batch plus the drawn items, weights included (float64)."""
    stream = items(6, unlabelled_every=0)
    model, ref = mlp64(), mlp64()
    replayed = []
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse", max_batch=2, min_batch=2,
                            max_wait=60.0, replay=16, seed=5, on_step=lambda record: replayed.append(record.replayed))
    trainer.consume(stream)
    trainer.close()
    assert replayed == [0, 2, 4]

    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g, history = torch.Generator().manual_seed(5), []
    for start in range(0, 6, 2):
        batch = stream[start:start + 2]
        drawn = [history[i] for i in torch.randint(len(history), (min(16, len(history)),), generator=g).tolist()] \
            if history else []
        reference_step(ref, opt, batch + drawn)
        history += batch
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-12)


class Gated(nn.Module):
    """A linear model whose forward waits for ``gate``: the test decides when a step may finish."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1).double()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def forward(self, x):
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return self.lin(x)


def gated_trainer(**options) -> tuple[OnlineTrainer, Gated]:
    model = Gated()
    return OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse", **options), model


def x2(v: float = 1.0) -> torch.Tensor:
    return torch.tensor([v, -v], dtype=torch.float64)


def y1(v: float = 0.0) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float64)


def test_overflow_reject_counts_and_raises():
    trainer, model = gated_trainer(max_queue=3, overflow="reject")
    first = trainer.submit(x2(), y1())
    wait_until(model.entered.is_set, "the first step to start")
    queued = [trainer.submit(x2(i), y1()) for i in range(3)]
    with pytest.raises(QueueFull, match="queue is full"):
        trainer.submit(x2(), y1())
    assert trainer.stats.rejected == 1 and trainer.stats.accepted == 4
    model.gate.set()
    stats = trainer.close()
    assert all(isinstance(f.result(5), Prediction) for f in [first, *queued])
    assert stats.predicted == 4 and stats.trained == 4


def test_overflow_drop_oldest_evicts_the_oldest_waiting_item():
    trainer, model = gated_trainer(max_queue=2, overflow="drop_oldest")
    first = trainer.submit(x2(), y1())
    wait_until(model.entered.is_set, "the first step to start")
    oldest, second, third = (trainer.submit(x2(i), y1()) for i in range(3))
    model.gate.set()  # the batcher takes the three when the step ends: the third evicts the oldest
    with pytest.raises(Evicted):
        oldest.result(30)
    stats = trainer.close()
    assert [f.result(5).version for f in (first, second, third)] == [0, 1, 1]
    assert stats.dropped == 1 and stats.predicted == 3 and stats.accepted == 4 and stats.unresolved == 0


def test_overflow_block_waits_for_room_then_times_out():
    trainer, model = gated_trainer(max_queue=1, overflow="block", block_timeout=0.05)
    trainer.submit(x2(), y1())
    wait_until(model.entered.is_set, "the first step to start")
    trainer.submit(x2(), y1())
    with pytest.raises(QueueFull, match="stayed full"):  # block_timeout is the bound under test
        trainer.submit(x2(), y1())
    trainer.block_timeout = 30.0
    landed = threading.Event()
    blocked = threading.Thread(target=lambda: (trainer.submit(x2(), y1()), landed.set()))
    blocked.start()
    assert not landed.is_set()
    model.gate.set()  # the queued item enters a step: room for the blocked one
    blocked.join(30)
    assert landed.is_set()
    stats = trainer.close()
    assert stats.accepted == stats.predicted == 3 and stats.rejected == 1


def test_a_blocked_producer_gets_room_before_the_steps_forward_pass():
    """A batch's items leave the queue's count before its forward pass (which runs without the
    GIL), not after the step: a producer blocked on the full queue hands its item over while
    that forward runs."""
    landed = threading.Event()
    seen: list[bool] = []

    class SecondWaits(Gated):
        calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:  # the second step's forward: the blocked item must land meanwhile
                seen.append(landed.wait(30))
                return self.lin(x)
            return super().forward(x)

    model = SecondWaits()
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse", max_queue=1,
                            overflow="block", block_timeout=30.0)
    first = trainer.submit(x2(), y1())
    wait_until(model.entered.is_set, "the first step to start")
    second = trainer.submit(x2(2.0), y1())  # the queue is full now
    blocked = threading.Thread(target=lambda: (trainer.submit(x2(3.0), y1()), landed.set()))
    blocked.start()
    model.gate.set()  # the first step ends; the second takes the queued item and runs its forward
    assert second.result(60).version == 1
    blocked.join(30)
    stats = trainer.close()
    assert seen == [True] and first.result(5).version == 0
    assert stats.accepted == stats.predicted == 3


def test_close_drains_every_accepted_item_or_reports_it():
    trainer, model = gated_trainer()
    running = trainer.submit(x2(), y1())
    wait_until(model.entered.is_set, "the first step to start")
    waiting = [trainer.submit(x2(i), y1()) for i in range(5)]
    closer = threading.Thread(target=trainer.close)
    closer.start()
    wait_until(lambda: trainer._closed, "close() to stop accepting")
    with pytest.raises(TrainerClosed):
        trainer.submit(x2(), y1())
    model.gate.set()
    closer.join(30)
    assert running.result(0).version == 0 and all(f.result(0).version == 1 for f in waiting)
    assert trainer.stats.trained == 6 and trainer.stats.unresolved == 0

    trainer, model = gated_trainer()
    trainer.submit(x2(), y1())
    wait_until(model.entered.is_set, "the first step to start")
    waiting = [trainer.submit(x2(i), y1()) for i in range(3)]
    closer = threading.Thread(target=trainer.close, kwargs={"drain": False})
    closer.start()
    wait_until(lambda: not trainer._batcher.running, "the batcher to stop accepting")
    model.gate.set()  # the running step ends; the waiting items are answered, never run
    closer.join(30)
    for f in waiting:
        with pytest.raises(BatcherClosed):
            f.result(0)
    assert trainer.stats.abandoned == 3 and trainer.stats.trained == 1 and trainer.stats.unresolved == 0


def test_a_failing_step_answers_its_items_with_the_error_and_the_loop_goes_on():
    model = mlp64()
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse")
    bad = trainer.submit(torch.zeros(5, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))  # 5 features: its own batch (shape group)
    with pytest.raises(RuntimeError):
        bad.result(10)
    good = trainer.predict(torch.zeros(6, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    stats = trainer.close()
    assert good.version == 0 and stats.failed == 1 and stats.trained == 1


class _GatedBackward(torch.autograd.Function):
    """Identity whose backward waits for ``gate`` (or raises ``error``): "the update is running"."""

    @staticmethod
    def forward(ctx, x, gate, error):
        ctx.gate, ctx.error = gate, error
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        assert ctx.gate.wait(30), "the test never opened the gate"
        if ctx.error is not None:
            raise ctx.error
        return grad, None, None


class GateBackward(nn.Module):
    def __init__(self, inner: nn.Module, error: Exception | None = None) -> None:
        super().__init__()
        self.inner, self.gate, self.error = inner, threading.Event(), error

    def forward(self, x):
        return _GatedBackward.apply(self.inner(x), self.gate, self.error)


def test_predictions_are_answered_before_the_update_runs():
    reference = mlp64()
    model = GateBackward(mlp64())
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse")
    x, y = torch.randn(6, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    try:
        prediction = trainer.submit(x, y).result(30)  # the backward pass waits for the gate meanwhile
        assert prediction.version == 0 and trainer.version == 0 and trainer.stats.trained == 0
        assert torch.equal(prediction.output, reference(x[None])[0].detach())
    finally:
        model.gate.set()
    stats = trainer.close()
    assert stats.trained == 1 and stats.updates == 1 and trainer.version == 1


def test_an_update_that_fails_after_the_answers_is_counted_and_logged(caplog):
    model = GateBackward(mlp64(), error=RuntimeError("backward broke"))
    model.gate.set()
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse")
    with caplog.at_level("ERROR", logger="partrain.stream"):
        first = trainer.predict(torch.zeros(6, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
        second = trainer.predict(torch.ones(6, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
        stats = trainer.close()
    assert first.version == 0 and second.version == 0  # answered both times; no update went through
    assert stats.predicted == 2 and stats.failed == 0 and stats.trained == 0 and stats.failed_updates == 2
    lines = [r.getMessage() for r in caplog.records if "backward broke" in r.getMessage()]
    assert len(lines) == 2 and "predicted, not trained on" in lines[0]


@pytest.mark.parametrize("loss", ["mse", "l1", "huber", "bce_logits"])
def test_a_label_of_another_shape_than_the_output_fails_the_update_in_one_line(loss, caplog):
    # torch would broadcast a label of [1] against an output of [2] (with a warning) into a loss of
    # another meaning: the update fails instead, says why, and nothing is trained on
    model = mlp64()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss)
    with caplog.at_level("ERROR", logger="partrain.stream"):
        prediction = trainer.predict(torch.zeros(6, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
        stats = trainer.close()
    assert prediction.version == 0 and stats.trained == 0 and stats.failed_updates == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    lines = [r.getMessage() for r in caplog.records if "Expected a model output" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(
        "Expected a model output shaped like the target (1, 1). Received: output (1, 2)")


def test_scalar_labels_train_a_one_output_model_as_fit_takes_them():
    # an output of [rows, 1] against scalar labels: the rows' own losses (fit's rule), not a
    # broadcast [rows, rows] matrix; one step of SGD on (out - y)^2 by hand, in float64
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1).double()
    reference = copy.deepcopy(model)
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse")
    x = torch.randn(6, dtype=torch.float64)
    trainer.predict(x, 2.5)
    stats = trainer.close()
    assert stats.trained == 1 and stats.failed_updates == 0
    out = reference(x[None])[0, 0]
    grad_w, grad_b = 2 * (out - 2.5) * x, 2 * (out - 2.5)
    assert torch.allclose(model.weight[0], reference.weight[0] - 0.1 * grad_w.detach())
    assert torch.allclose(model.bias[0], reference.bias[0] - 0.1 * grad_b.detach())


def test_a_non_finite_loss_skips_the_update():
    model = mlp64()
    before = copy.deepcopy(model.state_dict())
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse")
    trainer.predict(torch.zeros(6, dtype=torch.float64), torch.tensor([float("nan"), 0.0], dtype=torch.float64))
    stats = trainer.close()
    assert stats.skipped_updates == 1 and stats.updates == 0 and trainer.version == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_eval_predictions_come_from_eval_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 2)).double()
    reference = copy.deepcopy(model).eval()
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse", eval_predictions=True)
    x = torch.randn(6, dtype=torch.float64)
    got = trainer.predict(x, torch.zeros(2, dtype=torch.float64))
    trainer.close()
    assert torch.equal(got.output, reference(x.unsqueeze(0))[0].detach())


@pytest.mark.parametrize("pad", [False, True], ids=["one row per item", "padded"])
def test_predictions_are_delivered_on_the_prediction_device_as_copies(pad):
    """``prediction_device`` moves a batch's predictions off the model's device (the meta device
    stands in for the CPU here: a CPU build has no second real one); ``None`` and the model's own
    device leave them where the model is, its outputs before the update."""
    model = SumOverTime() if pad else mlp64()
    ref = copy.deepcopy(model)
    xs = ([torch.randn(n, 3, dtype=torch.float64) for n in (2, 5, 3)] if pad
          else [torch.randn(6, dtype=torch.float64) for _ in range(3)])
    for device, expected in (("meta", "meta"), (None, "cpu"), ("cpu", "cpu")):
        trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5), "mse", pad=pad,
                                max_batch=8, min_batch=3, max_wait=60.0, prediction_device=device)
        # labelled (padded items have labels of one shape only: not these): the update after the
        # answers changes the weights, not the answers
        futures = [trainer.submit(x, None if pad else torch.zeros(2, dtype=torch.float64)) for x in xs]
        trainer.close()
        for x, f in zip(xs, futures):
            got = f.result(0).output
            assert got.device.type == expected
            want = ref(x.unsqueeze(0))[0].detach()
            assert got.shape == want.shape
            if expected == "cpu":  # a batch of 3 against one row: float64 rounding apart
                torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        ref = copy.deepcopy(model)


class SumOverTime(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1).double()

    def forward(self, x):  # [batch, time, 3] -> [batch, time, 1]: a padded time step adds its own row
        return self.lin(x)


def test_padding_batches_items_of_different_lengths_and_cuts_each_answer_back():
    model = SumOverTime()
    ref = copy.deepcopy(model)
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse", pad=True,
                            max_batch=8, min_batch=3, max_wait=60.0)
    xs = [torch.randn(n, 3, dtype=torch.float64) for n in (2, 5, 3)]
    futures = [trainer.submit(x) for x in xs]
    trainer.close()
    for x, f in zip(xs, futures):
        assert torch.equal(f.result(0).output, ref(x.unsqueeze(0))[0].detach())


def test_async_producers_and_iterators():
    model = mlp64()
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "mse", max_queue=4)
    stream = items(30, unlabelled_every=0)

    async def main() -> tuple[Prediction, int]:
        first = await trainer.asubmit(stream[0]["x"], stream[0]["y"], id="async-0")

        async def agen():
            for it in stream[1:]:
                yield it

        return first, await trainer.aconsume(agen())

    first, accepted = asyncio.run(main())
    assert first.version == 0 and accepted == 29
    assert trainer.consume([(stream[0]["x"], stream[0]["y"])]) == 1  # a plain (x, y) iterator
    stats = trainer.close()
    assert stats.accepted == stats.predicted == 31 and stats.trained == 31


def test_metrics_rows_go_to_csv_and_prometheus(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("prometheus_client")
    model = mlp64()
    path = tmp_path / "metrics.csv"
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "mse", metrics_csv=str(path),
                            metrics_interval=3600)
    url = trainer.serve_metrics()
    trainer.consume(items(20))
    wait_until(lambda: trainer.stats.unresolved == 0, "every item answered")
    text = httpx.get(url, timeout=10, trust_env=False).text
    assert 'partrain_stream_items_total{outcome="accepted"} 20.0' in text
    assert "partrain_stream_prediction_latency_seconds_count 20.0" in text
    assert "partrain_stream_batch_size_bucket" in text and "partrain_stream_queue_depth" in text
    steps = re.search(r'partrain_stream_steps_total\{kind="all"\} (\S+)', text)
    assert steps and float(steps.group(1)) == trainer.stats.steps
    trainer.close()
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == COLUMNS and len(rows) == 1  # the closing row (the interval never passed)
    assert int(rows[0]["accepted"]) == 20 and int(rows[0]["items_trained"]) == 16
    assert float(rows[0]["latency_p99_ms"]) >= float(rows[0]["latency_p50_ms"]) > 0


def test_latency_histogram_counts_each_value_in_its_bucket():
    """Prometheus buckets are "at most le": a value on a bound counts in that bound's bucket."""
    assert LATENCY_BUCKETS[:4] == (0.001, 0.002, 0.005, 0.01) and LATENCY_BUCKETS[-1] == 10.0
    metrics = StreamMetrics()
    metrics.record_latencies([0.0015, 0.0005, 0.001, 0.002, 30.0, 0.0011, 10.0])  # in no order
    metrics.record_latencies([])
    metrics.record_latencies([0.004])
    expected = [0] * (len(LATENCY_BUCKETS) + 1)
    expected[0] = 2  # 0.0005, 0.001
    expected[1] = 3  # 0.0011, 0.0015, 0.002
    expected[2] = 1  # 0.004
    expected[len(LATENCY_BUCKETS) - 1] = 1  # 10.0
    expected[-1] = 1  # 30.0: past the last bound (+Inf)
    assert metrics.latency_counts == expected
    assert metrics.latency_sum == pytest.approx(40.0101)
    # the row's quantiles by the nearest-rank rule: sorted, 0.0005 0.001 0.0011 [0.0015] 0.002 0.004 10 [30]
    row = metrics.row({}, queue_depth=0)
    assert row["latency_p50_ms"] == pytest.approx(1.5) and row["latency_p99_ms"] == pytest.approx(30000.0)
    assert math.isnan(metrics.row({}, queue_depth=0)["latency_p50_ms"])  # an interval without answers


@pytest.mark.parametrize("call, message", [
    (lambda t: t.submit([1.0, 2.0]), "Expected an item's x as a Tensor or a tuple of Tensors"),
    (lambda t: t.submit(torch.zeros(6), weight=-1), "Expected an item weight >= 0. Received: weight=-1"),
    (lambda t: t.submit(torch.zeros(6), id=1.5), "Expected an item id as a str or int. Received: float"),
    (lambda t: (t.submit(torch.zeros(6), torch.zeros(2)), t.submit(torch.zeros(6), torch.zeros(3))),
     r"Expected a label of shape \[2\] and dtype torch.float32 like the first one. Received: shape \[3\]"),
    (lambda t: (t.submit(torch.zeros(6), torch.zeros(2)), t.submit(torch.zeros(6), torch.zeros(2).double())),
     r"Expected a label of shape \[2\] and dtype torch.float32 like the first one. Received: shape \[2\], "
     r"dtype torch.float64"),
    (lambda t: (t.submit(torch.zeros(6), torch.zeros(1)), t.submit(torch.zeros(6), 2.5)),
     r"Expected a label of shape \[1\] and dtype torch.float32 like the first one. Received: shape \[\], "),
    (lambda t: (t.submit(torch.zeros(6), id="a"), t.submit(torch.zeros(6), id="a")),
     "Item id 'a' was accepted already"),
])
def test_bad_items_are_refused_in_one_line(call, message):
    model = nn.Linear(6, 2)
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse")
    try:
        with pytest.raises((UsageError, DuplicateItem), match=message):
            call(trainer)
    finally:
        trainer.close()


def test_a_gpu_index_past_the_last_gpu_is_one_line(monkeypatch):
    """prediction_device='cuda:2' on a machine with 2 GPUs (torch's count, faked on a CPU build)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    model = nn.Linear(6, 2)
    with pytest.raises(UsageError, match=r"^Expected a visible CUDA device for prediction_device='cuda:2'\. "
                                         r"Received: 2 visible \(cuda:0 to cuda:1\)$"):
        OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse", prediction_device="cuda:2")


@pytest.mark.parametrize("options, message", [
    ({"max_batch": 0}, "Expected max_batch >= 1 (an integer). Received: max_batch=0"),
    ({"overflow": "spill"}, "Expected an overflow policy among ['block', 'drop_oldest', 'reject']"),
    ({"min_batch": 4}, "Expected max_wait > 0 seconds with min_batch > 1"),
    ({"lr_schedule": "cosine"}, "Expected an lr schedule among"),
    ({"resume": True}, "Expected a checkpoint path to resume from"),
    ({"loss_fn": "hinge"}, "Expected a loss among"),
    ({"prediction_device": "gpu0"}, "Expected prediction_device to be a device such as 'cpu' or 'cuda:0', or None. "
                                    "Received: 'gpu0'"),
    *([] if torch.cuda.is_available() else [
        ({"prediction_device": "cuda"}, "Expected a CUDA device for prediction_device='cuda'. Received: none visible"),
    ]),
])
def test_bad_options_are_refused_in_one_line(options, message):
    model = nn.Linear(6, 2)
    loss = options.pop("loss_fn", "mse")
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, **options)


def test_on_a_gpu_a_step_that_leaves_nothing_waiting_waits_for_its_update(monkeypatch):
    """`_settle`: with the model on a GPU (faked: the stream's synchronize is counted), a step after
    which no item waits waits for the device's update; one with items waiting does not (the next
    step's copy waits for it); on the CPU nothing is waited for. tests/gpu checks it on a device."""
    model = mlp64()
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse")
    waits = []

    class Stream:
        def synchronize(self):
            waits.append(trainer._waiting)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    try:
        trainer._settle()
        assert waits == []  # the CPU: the update is done when the step's Python is
        trainer.device = torch.device("cuda", 0)
        trainer._settle()
        assert waits == [0]
        with trainer._lock:
            trainer._waiting += 3
        trainer._settle()
        assert waits == [0]
    finally:
        with trainer._lock:
            trainer._waiting = 0
        trainer.device = torch.device("cpu")
        trainer.close()


def test_answers_pushed_to_a_callback_equal_the_futures_and_a_failing_callback_stops_nothing(caplog):
    # two trainers on the same items: one answers futures, the other pushes to on_answer
    items = [(torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(i)),
              torch.zeros(2, dtype=torch.float64)) for i in range(40)]
    waited = OnlineTrainer(mlp64(), torch.optim.SGD(mlp64().parameters(), lr=0.05), "mse", max_batch=8)
    futures = [waited.submit(x, y) for x, y in items]
    waited.close()
    pushed = OnlineTrainer(mlp64(), torch.optim.SGD(mlp64().parameters(), lr=0.05), "mse", max_batch=8)
    got: dict[int, tuple] = {}

    def answer(i):
        def on_answer(prediction, error):
            if i == 3:
                raise RuntimeError("a callback of the user's that fails")
            got[i] = (prediction, error)
        return on_answer

    with caplog.at_level(logging.ERROR, logger="partrain.batching"):
        slots = [pushed.submit(x, y, on_answer=answer(i)) for i, (x, y) in enumerate(items)]
        stats = pushed.close()
    assert stats.predicted == 40 and all(slot.done() for slot in slots)
    assert sorted(got) == [i for i in range(40) if i != 3] and all(e is None for _, e in got.values())
    assert "an answer's callback failed" in caplog.text
    # the same predictions as the futures' (the batches may differ: the first item's, from the initial
    # weights; float64 to 1e-12, not ==: another batch size may sum in another order)
    assert got[0][0].version == 0 == futures[0].result().version
    torch.testing.assert_close(got[0][0].output, futures[0].result().output, rtol=0, atol=1e-12)
    with pytest.raises(TrainerClosed):
        pushed.submit(*items[0], on_answer=answer(0))
