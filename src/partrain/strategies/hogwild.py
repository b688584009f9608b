"""``hogwild``: lock-free training on one host, every worker stepping one shared model.

The parameters, the buffers (BatchNorm statistics) and the optimizer's state
(SGD momentum buffers, Adam moments, ...) live in one shared-memory file that
every worker process maps. Each worker computes gradients on its own shard of
the data and steps the optimizer directly on that memory, without locks
(Recht et al., 2011, "Hogwild!"): updates from different workers may
interleave and overwrite each other now and then, which sparse or small
updates tolerate well. Nothing goes over the network, so ``comm_bytes`` stays 0.

How the memory gets shared: the model is built inside each worker by the
training loop, so sharing goes by name, not by handle. At `setup`, worker 0
draws a token and broadcasts it; at `prepare`, worker 0 creates
``/dev/shm/partrain-hogwild-<token>`` sized for every tensor, copies its values
in; after a barrier every worker maps the file (``torch.from_file(...,
shared=True)``) and points each tensor's ``.data`` at its view. Once all have
mapped it, the file is unlinked: the memory lives as long as the mappings, and
nothing is left behind in /dev/shm even if a worker is killed.

The optimizer's state is created lazily by most optimizers (at the first
``step()``), so `prepare` runs one dry step on zero gradients, restores the
parameters, resets the newly created state to zeros (its initial value:
exact for Adam-style moments and for SGD momentum without dampening) and moves
it into the shared file too. A later ``optimizer.load_state_dict`` (resume)
copies the loaded values into the shared memory instead of replacing it.

Frozen elements (`partrain.nn.freeze`): `prepare` attaches `keep_frozen` to the
optimizer and *pins* it once the memory is shared, so every step restores the
frozen elements (and their optimizer state) to their values at set-up. A
snapshot before each step would not do: another worker's step may be half way
through the same elements when it is taken.

Metrics: ``updates`` (optimizer steps applied by all workers together) and
``updates_w<i>`` (by worker ``i``), read from counters in the same shared file,
so any worker can report them without a collective.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .. import comm
from ..env import DEFAULT_TIMEOUT, DistEnv
from ..errors import UsageError
from ..nn.freeze import keep_frozen
from .base import Strategy, register

_ALIGN = 64  # bytes: keeps every view aligned for any dtype (and on its own cache line)


def shm_dir() -> str:
    """Where the shared file goes: /dev/shm (RAM) when the system has it."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def check_one_host(hosts: list[str]) -> None:
    """Hogwild shares memory: every worker must run on the same machine."""
    if len(set(hosts)) > 1:
        where = ", ".join(f"worker {i} on {h!r}" for i, h in enumerate(hosts))
        raise UsageError(
            f"Expected all hogwild workers on one host (they share memory). Received: {where}; "
            f"use 'allreduce', 'localsgd' or 'ps' across machines"
        )


@register
class Hogwild(Strategy):
    name = "hogwild"
    dynamic_sharding = True  # workers claim batches: a fast one is never held back by a slow one

    def __init__(self, shm_path: str = "") -> None:
        """``shm_path``: directory of the shared file (default /dev/shm)."""
        super().__init__()
        self.shm_path = shm_path
        self.path: str | None = None  # the shared file, until it is unlinked
        self._token = ""
        self._memory: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._state_views: dict[tuple[int, str], torch.Tensor] = {}
        self._counts: torch.Tensor | None = None

    def hostname(self) -> str:
        """This machine's name, as compared across workers at setup."""
        return socket.gethostname()

    def setup(self, env: DistEnv, *, store: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().setup(env, store=store, timeout=timeout)
        check_one_host(comm.all_gather_object(self.hostname(), self.group))
        self._token = self.broadcast_object(uuid.uuid4().hex if self.rank == 0 else None)

    # ----- sharing ----------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        model = model.to(self.device)
        if self.device.type != "cpu":
            raise UsageError(f"Expected the CPU for hogwild (shared host memory). Received: device={self.device}")
        frozen = keep_frozen(optimizer)
        _init_state(optimizer)
        tensors = [p for p in model.parameters()] + [b for b in model.buffers()]
        state_keys = _state_tensors(optimizer)
        tensors += [optimizer.state[p][k] for p, k in state_keys]
        offsets, end = _layout(tensors)
        counts_at = end
        total = counts_at + 8 * self.num_workers

        self.path = os.path.join(self.shm_path or shm_dir(), f"partrain-hogwild-{self._token}")
        if self.rank == 0:
            with open(self.path, "xb") as f:  # "x": never map another job's file
                f.truncate(total)
            self._map(total)
            for t, off in zip(tensors, offsets):
                self._view(off, t).copy_(t.detach())
        self.barrier()  # the file holds worker 0's values: the others may map it
        if self.rank != 0:
            self._map(total)
        with torch.no_grad():
            for t, off in zip(tensors, offsets):
                t.data = self._view(off, t)
        self._views = tensors
        n_model = len(tensors) - len(state_keys)
        self._state_views = {(id(p), k): tensors[n_model + i] for i, (p, k) in enumerate(state_keys)}
        assert self._memory is not None
        self._counts = self._memory[counts_at:total].view(torch.int64)
        # frozen elements are restored to their values now, not to a snapshot taken before each
        # step: another worker's step may be half way through them when that snapshot is taken
        frozen.pin()
        self.barrier()  # everyone has mapped it (and pinned): the name is no longer needed
        if self.rank == 0:
            self._unlink()
        optimizer.register_step_post_hook(self._count_update)
        optimizer.register_load_state_dict_post_hook(self._reshare_state)
        return model, optimizer

    def _map(self, total: int) -> None:
        assert self.path is not None
        self._memory = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)

    def _view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        assert self._memory is not None
        nbytes = like.numel() * like.element_size()
        return self._memory[offset : offset + nbytes].view(like.dtype).view(like.shape)

    def _count_update(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._counts is not None:
            self._counts[self.rank] += 1  # each worker writes only its own counter

    def _reshare_state(self, optimizer: Optimizer) -> None:
        """After ``load_state_dict``: put the loaded state back into shared memory."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for k, v in list(state.items()):
                    shared = self._state_views.get((id(p), k))
                    if shared is None or not torch.is_tensor(v) or v.shape != shared.shape:
                        continue
                    if self.rank == 0:  # every worker loaded the same values; one copy is enough
                        with torch.no_grad():
                            shared.copy_(v)
                    state[k] = shared

    def _unlink(self) -> None:
        if self.path is not None and self.rank == 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.path = None

    # ----- reporting --------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        if self._counts is None:
            return {}
        counts = self._counts.tolist()
        out = {"updates": float(sum(counts))}
        out.update({f"updates_w{i}": float(c) for i, c in enumerate(counts)})
        return out

    def close(self) -> None:
        self._unlink()


def _init_state(optimizer: Optimizer) -> None:
    """Create the optimizer's lazily built state now, at its initial value, params untouched.

    One dry step on zero gradients creates it; the parameters are restored (weight
    decay would move them), state that existed before (eagerly built, e.g. Adagrad's
    sums) gets its old values back and state the step created is zeroed - its value
    before any update (Adam's step count and moments; SGD's momentum buffer, whose
    first update from zero equals its clone-the-gradient start when dampening is 0).
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params or all(optimizer.state.get(p) for p in params):
        return
    saved_params = [p.detach().clone() for p in params]
    saved_grads = [p.grad for p in params]
    before = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in optimizer.state.get(p, {}).items()}
              for p in params}
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, saved, grad in zip(params, saved_params, saved_grads):
            p.copy_(saved)
            p.grad = grad
            state = optimizer.state.get(p, {})
            for k, v in state.items():
                old = before[id(p)].get(k)
                if old is not None:
                    if torch.is_tensor(v):
                        v.copy_(old)
                    else:
                        state[k] = old
                elif torch.is_tensor(v):
                    v.zero_()


def _state_tensors(optimizer: Optimizer) -> list[tuple[torch.Tensor, str]]:
    """(param, key) of every tensor in the optimizer's state, in the same order on every worker."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k in sorted(optimizer.state.get(p, {})):
                if torch.is_tensor(optimizer.state[p][k]):
                    out.append((p, k))
    return out


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the shared file, each aligned to ``_ALIGN``."""
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, at
