"""``localsgd``: workers step on their own and average parameters every ``period`` steps.

Between synchronisations each worker runs plain local training on its shard
of the data; every ``period`` optimizer steps (H in the literature) the
workers average their parameters and floating-point buffers (BatchNorm
statistics) with one flat all-reduce. That divides the bytes on the network
by H compared with all-reducing gradients every step, and lets workers on a
slow link spend most of their time computing (Lin et al., 2018, "Don't use
large mini-batches, use local SGD").

``outer="nesterov"`` gives DiLoCo (Douillard et al., 2023): the workers keep
the *global* parameters of the last synchronisation; at a sync the
pseudo-gradient ``global - average`` is fed to an outer SGD with Nesterov
momentum (``outer_lr``, ``outer_momentum``) that updates the global
parameters, which every worker then adopts. Every worker computes the same
outer step from the same all-reduced average, so no broadcast is needed.
``outer_lr=1, outer_momentum=0`` is plain local SGD. The defaults,
``outer_lr=0.8, outer_momentum=0.3``, suit runs with tens of syncs (issue 17:
H=64 on ``partrain bench async``'s full task reached 0.94x allreduce's final
test loss with 64x fewer bytes, where the paper's 0.7 / 0.9 - meant for
thousands of outer steps - ended at 2.5x); the paper's values want long runs.

Where syncs happen, without changing the user's loop: a step post-hook on the
user's own optimizer counts steps and syncs every ``period``-th (the
optimizer stays the same object, so LR schedulers and ``state_dict`` work).
Besides, the replicas are synced (whatever the step count) at the end of every
pass over the batches `shard` gave (the loop asks for the next batch only after
stepping on the last one: the epoch's last step is followed by a sync), when a
new pass begins (a pass cut short by ``max_steps``) and when `model_state_dict`
is asked for a checkpoint; so evaluation, checkpoints and the final model
always see the averaged parameters, and an epoch's figures include its final
sync. These points are therefore collective: every worker reaches them, as in
`fit`; a hand-written loop may also call `sync` itself. (A ``DataLoader`` with
worker processes reads its batch sampler ahead: the end-of-pass sync then comes
a few steps early and the next one catches up.)

Frozen elements (`partrain.nn.freeze`) stay exact: `prepare` attaches
`keep_frozen` to the optimizer, and a sync holds them (and DiLoCo's outer
momentum there) through the averaging and the outer step.

``period=1`` with plain SGD is exactly synchronous data parallel training:
the average of the workers' one-step updates is the update of the averaged
gradient.

Measured: ``comm_bytes`` counts the bytes each worker puts into the averaging
all-reduces (the one-off broadcast of the initial parameters is not counted,
as for ``allreduce``); ``comm_seconds`` the time spent in them (all of it
exposed: the loop waits). Metrics: ``syncs``, ``local_steps`` (since the last
sync) and ``bytes_per_sync``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .. import comm
from ..data.sharding import ShardedBatchSampler
from ..errors import UsageError
from ..nn.freeze import hold_frozen, keep_frozen
from .base import Strategy, register

OUTERS = ("none", "nesterov")


@register
class LocalSGD(Strategy):
    name = "localsgd"

    def __init__(self, period: int = 8, outer: str = "none", outer_lr: float = 0.8,
                 outer_momentum: float = 0.3) -> None:
        super().__init__()
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise UsageError(f"Expected a positive integer period (steps between syncs). Received: period={period!r}")
        if outer not in OUTERS:
            raise UsageError(f"Expected outer among {list(OUTERS)}. Received: outer={outer!r}")
        if not outer_lr > 0:
            raise UsageError(f"Expected a positive outer_lr. Received: outer_lr={outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise UsageError(f"Expected 0 <= outer_momentum < 1. Received: outer_momentum={outer_momentum!r}")
        self.period = period
        self.outer = outer
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.steps = 0  # optimizer steps in total
        self.local_steps = 0  # since the last sync
        self.syncs = 0
        self._params: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
        self._global: list[torch.Tensor] = []
        self._momentum: list[torch.Tensor] = []
        self._optimizer: Optimizer | None = None

    # ----- the training loop's side -------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        model = model.to(self.device)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]
        # start from one model: worker 0's (a loop seeding every worker alike changes nothing)
        comm.broadcast_tensors([p.data for p in model.parameters()] + list(model.buffers()),
                               src=self.worker_ranks[0], group=self.group)
        if self.outer == "nesterov":
            self._global = [p.detach().clone() for p in self._params]
            self._momentum = [torch.zeros_like(p) for p in self._params]
        self._optimizer = optimizer
        keep_frozen(optimizer)  # attached first: its post-hook restores frozen elements before a sync
        optimizer.register_step_post_hook(self._after_step)
        return model, optimizer

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        self.local_steps += 1
        if self.local_steps >= self.period:
            self.sync()

    def sync(self) -> None:
        """Average the replicas now (collective; a no-op right after a sync)."""
        if self.local_steps == 0 or not self._params:
            return
        tensors = self._params + self._buffers
        flat = comm.flatten([t.detach() for t in tensors])
        if self.num_workers > 1:
            start = time.perf_counter()
            comm.all_reduce_sum(flat, self.group)
            self.comm_seconds += time.perf_counter() - start
            self.comm_bytes += flat.numel() * flat.element_size()
            flat.div_(self.num_workers)
        # frozen elements are equal on every worker, but (x + x + x) / 3 need not be x, and the
        # outer step must not move them either: they (and the outer momentum there) are held
        outer = (self._global, self._momentum) if self.outer == "nesterov" else ()
        with torch.no_grad(), hold_frozen(self._params, *outer):
            if self.outer == "nesterov":
                self._outer_step(flat)
            else:
                comm.unflatten_into(flat, tensors)
        self.local_steps = 0
        self.syncs += 1

    def _outer_step(self, flat: torch.Tensor) -> None:
        """DiLoCo: SGD with Nesterov momentum on the pseudo-gradient ``global - average``."""
        n = sum(p.numel() for p in self._params)
        average = flat[:n]
        offset = 0
        lr, mu = self.outer_lr, self.outer_momentum
        for p, g, m in zip(self._params, self._global, self._momentum):
            k = p.numel()
            delta = g - average[offset : offset + k].view_as(g)
            m.mul_(mu).add_(delta)
            g.sub_(delta.add(m, alpha=mu), alpha=lr)
            p.copy_(g)
            offset += k
        comm.unflatten_into(flat[n:], self._buffers)

    def shard(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
              drop_last: bool = False, dataset_size: int | None = None) -> ShardedBatchSampler:
        """This worker's batches; the replicas are synced when a pass over them ends.

        A new pass over data begins (next epoch, or evaluation): sync first, in case
        the last pass was cut short (``max_steps``).
        """
        self.sync()
        return _SyncAtEnd(num_samples, batch_size, max(self.rank, 0), self.num_workers, shuffle=shuffle,
                          seed=seed, drop_last=drop_last, dataset_size=dataset_size, on_end=self.sync)

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        self.sync()
        return super().model_state_dict(model)

    def metrics(self) -> dict[str, float]:
        n = sum(t.numel() * t.element_size() for t in self._params + self._buffers)
        return {"syncs": float(self.syncs), "local_steps": float(self.local_steps),
                "bytes_per_sync": float(n if self.num_workers > 1 else 0)}

    # ----- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step counts, the outer optimizer, and every worker's own inner optimizer state.

        Collective (every worker calls it; worker 0's copy is written). The inner
        optimizers' states differ between workers (each saw its own gradients); the
        checkpoint's ``optimizer`` entry holds worker 0's only, so the workers' states
        are gathered here and `load_state_dict` gives each its own back: resume is exact.
        """
        state: dict[str, Any] = {"steps": self.steps, "local_steps": self.local_steps, "syncs": self.syncs,
                                 "num_workers": self.num_workers}
        if self.outer == "nesterov":
            state["global"] = comm.flatten(self._global).clone()
            state["momentum"] = comm.flatten(self._momentum).clone()
        inner = _optimizer_tensors(self._optimizer)
        if self.num_workers > 1:
            mine = comm.flatten(inner).double()
            sizes = comm.all_gather_object(mine.numel(), self.group)
            if len(set(sizes)) == 1 and sizes[0] > 0:  # same layout everywhere (else: worker 0's only)
                rows = [torch.empty_like(mine) for _ in range(self.num_workers)]
                torch.distributed.all_gather(rows, mine, group=self.group)
                state["worker_optimizer_states"] = torch.stack(rows)
        return state

    def unused_state(self, state: dict[str, Any]) -> str | None:
        if "global" in state and self.outer != "nesterov":
            return "the outer Nesterov momentum of a DiLoCo checkpoint (outer=nesterov; this run: outer=none)"
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        self.local_steps = int(state.get("local_steps", 0))
        self.syncs = int(state.get("syncs", 0))
        if self.outer == "nesterov" and "global" in state:
            _unflatten_checked(state["global"], self._global, "global")
            _unflatten_checked(state["momentum"], self._momentum, "momentum")
        rows = state.get("worker_optimizer_states")
        inner = _optimizer_tensors(self._optimizer)
        if rows is not None and inner and int(state.get("num_workers", 0)) == self.num_workers:
            _unflatten_checked(rows[self.rank], inner, "worker_optimizer_states")


class _SyncAtEnd(ShardedBatchSampler):
    """A sharded batch sampler that syncs the replicas when a pass over it is complete.

    The loop asks for the next batch only after it stepped on the last one, so
    the end of the iteration falls right after the epoch's last optimizer step:
    the epoch's figures (bytes, loss) include its final sync.
    """

    def __init__(self, *args: Any, on_end: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_end = on_end

    def __iter__(self):  # noqa: ANN204
        yield from super().__iter__()
        self._on_end()

    def iter_tensors(self):  # noqa: ANN201
        yield from super().iter_tensors()
        self._on_end()


def _optimizer_tensors(optimizer: Optimizer | None) -> list[torch.Tensor]:
    """The tensors of an optimizer's state, in the same order on every worker."""
    if optimizer is None:
        return []
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out += [state[k] for k in sorted(state) if torch.is_tensor(state[k])]
    return out


def _unflatten_checked(flat: torch.Tensor, tensors: list[torch.Tensor], what: str) -> None:
    n = sum(t.numel() for t in tensors)
    if flat.numel() != n:
        raise UsageError(f"Expected a localsgd checkpoint with {n} values in {what!r}. Received: {flat.numel()}")
    with torch.no_grad():
        comm.unflatten_into(flat, tensors)
