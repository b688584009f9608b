"""The population training loop: per-member data order, evaluation, PBT rounds, checkpoints.

`MemberLoader` gives every member its own shuffled order of the same dataset
(its seed depends on the member's global id, so the order does not depend on
how members are spread over processes) and its own batch size. `train_population`
is the loop the CLI runs; it is usable from Python too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import TensorDataset

from ..errors import UsageError
from .pbt import PBT
from .population import Population


class MemberLoader:
    """Batches for a population: member ``i`` walks its own permutation of the dataset.

    Each call returns ``(x, y, sizes)``: ``x`` shaped ``(members, B, ...)`` with
    ``B`` the largest batch size, ``sizes`` the members' own batch sizes (rows
    are padded beyond them). An epoch of a member ends when fewer than its batch
    size samples remain (drop-last); the next uses a fresh permutation.
    """

    def __init__(self, dataset: TensorDataset, members: Sequence[int], seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        self.x, self.y = (t.to(device) for t in dataset.tensors[:2])
        self.n = len(self.x)
        self.members = list(members)
        self.seed = seed
        self.epoch = [0] * len(self.members)
        self.cursor = [0] * len(self.members)
        self._perm = [self._permutation(i) for i in range(len(self.members))]

    def _permutation(self, row: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7_919 + self.members[row] * 104_729 + self.epoch[row])
        return torch.randperm(self.n, generator=g)

    def next(self, batch_sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if any(b > self.n for b in batch_sizes):
            raise UsageError(f"Expected batch sizes <= {self.n} (the training set). Received: {max(batch_sizes)}")
        width = max(batch_sizes)
        index = torch.zeros(len(self.members), width, dtype=torch.long)
        for row, b in enumerate(batch_sizes):
            if self.cursor[row] + b > self.n:
                self.epoch[row] += 1
                self.cursor[row] = 0
                self._perm[row] = self._permutation(row)
            index[row, :b] = self._perm[row][self.cursor[row] : self.cursor[row] + b]
            self.cursor[row] += b
        index = index.to(self.x.device)
        return self.x[index], self.y[index], torch.tensor(list(batch_sizes))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": list(self.epoch), "cursor": list(self.cursor), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = list(state["epoch"]), list(state["cursor"])
        self._perm = [self._permutation(i) for i in range(len(self.members))]


def train_population(population: Population, train: TensorDataset, val: TensorDataset, *, steps: int,
                     batch_size: int = 32, pbt: PBT | None = None, eval_interval: int | None = None,
                     eval_batch_size: int = 1024, seed: int = 0, loader: MemberLoader | None = None,
                     history: list[dict[str, Any]] | None = None,
                     on_eval: Callable[[int, list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Train every member for ``steps`` steps in total (counting from ``population.steps``).

    Every ``eval_interval`` steps (default: the PBT interval, or ``steps // 10``)
    members are evaluated on ``val``; then, when ``pbt`` is due, its round runs on
    the validation scores. Returns ``history``: one record per member per
    evaluation (step, member, train loss, val loss and accuracy, hyperparameters),
    identical in every process. ``on_eval(step, records)`` is called after each
    evaluation (e.g. to checkpoint).
    """
    if steps < 0:
        raise UsageError(f"Expected a non-negative number of steps. Received: steps={steps}")
    if batch_size < 1:
        raise UsageError(f"Expected a positive batch size. Received: batch_size={batch_size}")
    if eval_interval is None:
        eval_interval = pbt.interval if pbt is not None else max(1, steps // 10)
    if pbt is not None and pbt.interval % eval_interval:
        raise UsageError(f"Expected the PBT interval ({pbt.interval}) to be a multiple of the evaluation "
                         f"interval ({eval_interval}). Received otherwise")
    loader = loader or MemberLoader(train, population.members, seed, population.device)
    history = history if history is not None else []
    vx, vy = val.tensors[0].to(population.device), val.tensors[1].to(population.device)
    if pbt is not None and population.steps < steps:
        _pending_round(population, pbt, history)
    running = torch.zeros(len(population.members), dtype=torch.float64)
    since = 0
    t0 = time.perf_counter()
    samples = 0
    while population.steps < steps:
        sizes = population.batch_sizes(batch_size)
        x, y, size_t = loader.next(sizes)
        losses = population.step(x, y, size_t)
        running += losses.detach().to("cpu", torch.float64)
        since += 1
        samples += sum(sizes)
        step = population.steps
        if step % eval_interval == 0 or step == steps:
            ev = population.evaluate(vx, vy, eval_batch_size)
            train_loss = population.gather(running / max(since, 1))
            val_loss, val_acc = population.gather(ev["loss"]), population.gather(ev["accuracy"])
            elapsed = time.perf_counter() - t0
            records = [{"step": step, "member": m, "train_loss": float(train_loss[m]),
                        "val_loss": float(val_loss[m]), "val_accuracy": float(val_acc[m]),
                        "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
                        "engine": population.engine, **population.member_hparams(m)}
                       for m in range(population.size)]
            history.extend(records)
            running.zero_()
            since = 0
            if pbt is not None and pbt.due(step) and step < steps:  # none after the last step
                scores = val_acc if pbt.metric == "accuracy" else val_loss
                pbt.update(population, scores, step)
            if on_eval is not None:
                on_eval(step, records)
    return history


def _pending_round(population: Population, pbt: PBT, history: list[dict[str, Any]]) -> None:
    """Run the PBT round a previous run skipped because it ended on that step (resume = straight run)."""
    step = population.steps
    if not pbt.due(step) or pbt.last_round == step:
        return
    records = {r["member"]: r for r in history if r["step"] == step}
    if len(records) != population.size:
        return
    key = "val_accuracy" if pbt.metric == "accuracy" else "val_loss"
    scores = torch.tensor([records[m][key] for m in range(population.size)], dtype=torch.float64)
    pbt.update(population, scores, step)
