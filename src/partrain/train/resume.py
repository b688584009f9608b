"""Resuming a run from a checkpoint: the optimizer, strategy and scheduler state, and where it stopped.

The caller checks what it can once, before any worker starts (`check_within_epoch`,
`same_samples_per_epoch`); each worker then loads the state into its own optimizer and
strategy (`restore`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from ..errors import UsageError
from ..optim import keep_run_settings
from ..strategies.base import Strategy, strategy_class
from .epoch import Position


def restore(strategy: Strategy, trainer: Any, ckpt: dict[str, Any] | None, quiet: bool = False,
            batch_size: int | None = None,
            load_shards: Callable[[Optimizer | None], None] | None = None) -> Position:
    """Optimizer, strategy and scheduler state of a checkpoint, and where it stopped.

    ``trainer`` holds the worker's ``optimizer``, ``optimizer_class``, ``scheduler``,
    ``schedule`` and ``lengths`` (a `Trainer` after `Trainer.build`).

    A checkpoint another strategy wrote gives the model, the optimizer state (from where
    that strategy kept it: a ps checkpoint's servers) and the position; that strategy's
    own state is left. One written with another optimizer class gives the model and the
    position; the optimizer starts afresh. This run's optimizer settings (lr, momentum,
    weight decay, ...) win where they differ from the checkpoint's, except an lr that a
    schedule sets. Each of these says so in one line. A mid-epoch checkpoint resumed with
    another ``batch_size`` goes on after the same samples (or refuses in one line when its
    batches cannot be counted in the new size).

    ``load_shards(optimizer)``: a sharded checkpoint's tensors are read into this process's
    shards of the model and of ``optimizer`` (None: the model only) instead of ``ckpt``'s
    ``model`` and ``optimizer`` entries (`partrain.train.checkpointer.Checkpointer.shard_loader`).
    """
    if ckpt is None:
        return Position()
    optimizer = trainer.optimizer
    say = strategy.is_main and not quiet
    written_by = (ckpt.get("config") or {}).get("strategy")
    foreign = written_by is not None and written_by != strategy.name
    written_with = ckpt.get("optimizer_class")
    new_optimizer = written_with is not None and written_with != trainer.optimizer_class
    asked = [dict(group) for group in optimizer.param_groups]  # this run's settings, before loading
    optimizer_state = None if new_optimizer else ckpt.get("optimizer")
    if load_shards is not None:
        load_shards(None if new_optimizer else optimizer)
    loaded = load_shards is not None and not new_optimizer
    writer = strategy_class(written_by) if foreign else None
    if writer is not None and optimizer_state is not None and ckpt.get("strategy") is not None:
        numels = [p.numel() for group in optimizer.param_groups for p in group["params"]]
        kept = writer.optimizer_state_in(ckpt["strategy"], numels)  # e.g. on a parameter server's servers
        if kept is not None:
            optimizer_state = {**optimizer_state, "state": kept}
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    if foreign or new_optimizer:
        # what the other strategy kept of its own (local SGD's counters and outer momentum or
        # the workers' optimizer states, a pipeline's stage layout, ps versions) has no meaning here
        strategy.adopt_optimizer_state(optimizer_state)
    elif ckpt.get("strategy"):
        strategy.load_state_dict(ckpt["strategy"])
        unused = strategy.unused_state(ckpt["strategy"])
        if unused and say:
            print(f"partrain: resuming with {strategy.name}: {unused} is left unused", flush=True)
    if new_optimizer and say:
        print(f"partrain: resuming a checkpoint of {written_with} with {trainer.optimizer_class}: the model and the "
              "position carry over; the optimizer starts afresh", flush=True)
    elif foreign and ckpt.get("strategy") and say:
        print(f"partrain: resuming a {written_by} checkpoint with {strategy.name}: the model, the optimizer "
              f"state and the position carry over; {written_by}'s own state does not", flush=True)
    if optimizer_state is not None or loaded:
        # an lr that a schedule sets stays the schedule's (a torch scheduler's state; partrain's
        # own schedule already starts from this run's base lr)
        scheduled_lr = (trainer.scheduler is not None or trainer.schedule.kind != "constant"
                        or trainer.schedule.warmup_steps > 0)
        changed = keep_run_settings(optimizer, asked, skip={"lr"} if scheduled_lr else ())
        if changed and say:
            print("partrain: resuming with this run's optimizer settings where the checkpoint's differ: "
                  + ", ".join(changed), flush=True)
    if trainer.scheduler is not None and ckpt.get("scheduler") is not None:
        trainer.scheduler.load_state_dict(ckpt["scheduler"])
    position = Position(ckpt["epoch"], ckpt["step"], list(ckpt.get("metrics") or []))
    within = ckpt.get("within_epoch")
    if within:  # a mid-epoch checkpoint: every worker's random state and sums, row by worker rank
        rng, sums = within["rng"], within["sums"]
        same_workers(within, strategy.num_workers)
        position.batch = resume_batch(int(within["batch"]), ckpt, batch_size, bucketed=trainer.lengths is not None)
        position.rng = rng[strategy.rank].to(torch.uint8).clone()  # set_rng_state reads a whole storage
        position.sums = sums[strategy.rank]
    return position


def same_workers(within: dict[str, Any], workers: int) -> None:
    """A mid-epoch checkpoint resumes with its worker count: it holds one random state per worker."""
    if len(within["rng"]) != workers:
        raise UsageError(f"Expected {len(within['rng'])} workers to resume a mid-epoch checkpoint (its random states "
                         f"are per worker). Received: {workers}")


def same_samples_per_epoch(ckpt: dict[str, Any], n: int | None) -> None:
    """A run resumes with its checkpoint's ``samples_per_epoch``: epoch ``e`` starts at sample ``e N``
    of the passes over the training set, so another ``N`` would go on from another place."""
    old = (ckpt.get("config") or {}).get("samples_per_epoch")
    if old != n:
        raise UsageError(f"Expected samples_per_epoch={old} (the checkpoint's: another epoch length would go on "
                         f"from another place in the training set) to resume. Received: samples_per_epoch={n}")


def resume_batch(batch: int, ckpt: dict[str, Any], batch_size: int | None, bucketed: bool) -> int:
    """Where a mid-epoch checkpoint goes on, in this run's batches: after the same samples.

    Every batch before a mid-epoch checkpoint was a whole global batch, slices of one
    epoch order that does not depend on the batch size: ``batch`` batches of the old size
    are ``batch * old / new`` of the new one when that divides. Otherwise (or batches
    bucketed by length, which are made for one batch size) one line: before, the run
    skipped ``batch`` batches of the new size and trained on some samples twice or never.
    """
    old = (ckpt.get("config") or {}).get("batch_size")
    if batch_size is None or not isinstance(old, int) or old == batch_size:
        return batch
    done = batch * old
    if not bucketed and done % batch_size == 0:
        return done // batch_size
    if bucketed:
        raise UsageError(f"Expected batch_size {old} (the mid-epoch checkpoint's: batches bucketed by length are "
                         f"made for one size) to resume within its epoch. Received: {batch_size}")
    raise UsageError(f"Expected batch_size {old} (the mid-epoch checkpoint's) or one that divides the {done} "
                     f"samples per worker it had trained on, to resume within its epoch. Received: {batch_size}")
