"""Where a population's numbers live, and the two engines that train them.

Vocabulary used in this package:

- **member**: one model of the population, named by its *global id* ``0..size-1``.
- **row**: a member's slot in this process's storage (equal to its global id
  unless members are spread over processes).
- **flat buffer**: ``(rows, D)`` tensor holding every member's trainable
  parameters, concatenated in ``named_parameters()`` order (see `Layout`).

`MemberStore` owns the flat parameter buffer, the optimizer state buffers (same
shape, plus step counts) and the stacked module buffers (BatchNorm statistics,
per-member dropout rates). Both engines read and write the *same* storage:

- `VmapEngine` runs every member at once - ``functional_call`` under ``vmap``
  over views of the flat buffer, one backward for all, then a batched
  functional optimizer (`functional_optim`).
- `LoopEngine` keeps one ordinary ``nn.Module`` and one ``torch.optim``
  optimizer per member whose parameters and state *are* row views of the same
  buffers, and steps them one after the other.

So switching engine (the automatic choice) and copying a member (PBT exploit)
are tensor copies, never a conversion or a file round trip.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from .functional_optim import FunctionalOptimizer


class MemberDropout(nn.Module):
    """Dropout whose rate is a buffer, so every member of a population can have its own.

    ``nn.Dropout`` keeps ``p`` as a Python float shared by all copies; here ``p``
    is a tensor stacked per member like any other buffer. (Random masks differ
    between members: the vectorized engine runs ``vmap(randomness="different")``.)
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.register_buffer("p", torch.tensor(float(p)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = 1.0 - self.p
        mask = (torch.rand_like(x) < keep).to(x.dtype)
        return x * mask / keep.clamp_min(1e-6)


def use_member_dropout(model: nn.Module) -> list[str]:
    """Replace every ``nn.Dropout`` in ``model`` by `MemberDropout`; return the rate buffers' names."""
    names = []
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                setattr(module, child_name, MemberDropout(child.p))
                names.append(f"{path}.{child_name}.p" if path else f"{child_name}.p")
    return names


@dataclass(frozen=True)
class Layout:
    """Where each named parameter sits in a row of the flat buffer."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]

    @classmethod
    def of(cls, model: nn.Module) -> Layout:
        names, shapes, offsets, numels = [], [], [], []
        offset = 0
        for name, p in model.named_parameters():
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(offset)
            numels.append(p.numel())
            offset += p.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), tuple(numels))

    @property
    def size(self) -> int:
        return sum(self.numels)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views of a flat ``(rows, D)`` buffer, shaped ``(rows, *shape)``."""
        rows = flat.shape[0]
        return {n: flat[:, o : o + k].view(rows, *s)
                for n, s, o, k in zip(self.names, self.shapes, self.offsets, self.numels)}

    def row_views(self, flat: torch.Tensor, row: int) -> list[torch.Tensor]:
        """Views of one row, one per parameter, in order."""
        return [flat[row, o : o + k].view(s) for s, o, k in zip(self.shapes, self.offsets, self.numels)]


class MemberStore:
    """Parameters, optimizer state and buffers of this process's members, stacked by row."""

    def __init__(self, models: list[nn.Module], optimizer: FunctionalOptimizer,
                 device: torch.device) -> None:
        self.layout = Layout.of(models[0])
        rows = len(models)
        with torch.no_grad():
            self.flat = torch.stack([
                torch.cat([p.detach().reshape(-1) for p in m.parameters()]) if self.layout.size
                else torch.zeros(0) for m in models
            ]).to(device)
        self.flat.requires_grad_(True)
        self.opt = optimizer.init_state(self.flat.detach())
        # one step count per (member, parameter): torch.optim counts per parameter
        self.opt["step"] = torch.zeros(rows, max(1, len(self.layout.names)), device=device)
        self.buffers = {name: torch.stack([dict(m.named_buffers())[name].detach() for m in models]).to(device)
                        for name, _ in models[0].named_buffers()}

    @property
    def rows(self) -> int:
        return self.flat.shape[0]

    def member_tensors(self, row: int) -> list[torch.Tensor]:
        """Every tensor of one member (parameters, optimizer state, buffers), as row views."""
        out = [self.flat.detach()[row]]
        out += [self.opt[k][row] for k in sorted(self.opt)]
        out += [self.buffers[k][row] for k in sorted(self.buffers)]
        return out

    @torch.no_grad()
    def copy_row(self, src: int, dst: int) -> None:
        """Member ``dst`` becomes an exact copy of member ``src`` (weights, optimizer state, buffers)."""
        for s, d in zip(self.member_tensors(src), self.member_tensors(dst)):
            d.copy_(s)


def member_losses(out: torch.Tensor, y: torch.Tensor, sizes: torch.Tensor | None) -> torch.Tensor:
    """Mean cross-entropy per member of ``out`` (rows, B, C) against ``y`` (rows, B).

    With ``sizes``, member ``i`` uses only its first ``sizes[i]`` samples (the
    rest is padding, so members can have different batch sizes in one tensor).
    """
    rows, batch, classes = out.shape
    per_sample = F.cross_entropy(out.reshape(rows * batch, classes), y.reshape(-1),
                                 reduction="none").view(rows, batch)
    if sizes is None:
        return per_sample.mean(dim=1)
    mask = torch.arange(batch, device=out.device).unsqueeze(0) < sizes.unsqueeze(1)
    return (per_sample * mask).sum(dim=1) / sizes.to(per_sample.dtype)


class Engine:
    """How a population's members take a step and are evaluated (storage lives in `MemberStore`)."""

    name = "engine"

    def __init__(self, store: MemberStore, template: nn.Module, optimizer: FunctionalOptimizer) -> None:
        self.store = store
        self.optimizer = optimizer
        self.template = template

    def step(self, x: torch.Tensor, y: torch.Tensor, sizes: torch.Tensor | None,
             hp_rows: dict[str, torch.Tensor], hp_version: int) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class VmapEngine(Engine):
    """Every member at once: ``functional_call`` under ``vmap``, one backward, batched optimizer."""

    name = "vmap"

    def __init__(self, store: MemberStore, template: nn.Module, optimizer: FunctionalOptimizer) -> None:
        super().__init__(store, template, optimizer)
        self.base = copy.deepcopy(template).to("meta")

        def forward(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                    x: torch.Tensor) -> torch.Tensor:
            return functional_call(self.base, (params, buffers), (x,))

        self._forward = forward
        self._train = vmap(forward, in_dims=(0, 0, 0), randomness="different")
        self._eval = vmap(forward, in_dims=(0, 0, None), randomness="different")

    def step(self, x: torch.Tensor, y: torch.Tensor, sizes: torch.Tensor | None,
             hp_rows: dict[str, torch.Tensor], hp_version: int) -> torch.Tensor:
        store = self.store
        self.base.train()
        params = store.layout.views(store.flat)
        out = self._train(params, store.buffers, x)
        losses = member_losses(out, y, sizes)
        # members share no parameter, so the gradient of the sum is each member's own gradient
        (grad,) = torch.autograd.grad(losses.sum(), store.flat)
        with torch.no_grad():
            self.optimizer.step(store.flat, grad, _member_state(store.opt), hp_rows)
            store.opt["step"].add_(1)
        return losses.detach()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        store = self.store
        self.base.eval()
        params = store.layout.views(store.flat.detach())
        loss = torch.zeros(store.rows, device=store.flat.device, dtype=torch.float64)
        correct = torch.zeros_like(loss)
        for start in range(0, len(x), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            out = self._eval(params, store.buffers, xb)  # (rows, b, classes)
            rows, b, c = out.shape
            loss += F.cross_entropy(out.reshape(rows * b, c), yb.repeat(rows), reduction="none").view(rows, b).sum(1)
            correct += (out.argmax(-1) == yb).sum(1)
        return loss / len(x), correct / len(x)


def _member_state(opt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The functional optimizer's view of the state: ``step`` is one count per member."""
    state = {k: v for k, v in opt.items() if k != "step"}
    state["step"] = opt["step"][:, 0].clone()
    return state


class LoopEngine(Engine):
    """One ``nn.Module`` + ``torch.optim`` optimizer per member, stepped in turn.

    Their parameters and optimizer state are row views of the shared store, so
    ``torch.optim`` updates the very buffers the vectorized engine uses.
    """

    name = "loop"

    def __init__(self, store: MemberStore, template: nn.Module, optimizer: FunctionalOptimizer,
                 hp_of_row: list[dict[str, float]]) -> None:
        super().__init__(store, template, optimizer)
        self.modules: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        layout = store.layout
        flat = store.flat.detach()
        for row in range(store.rows):
            module = copy.deepcopy(template).to_empty(device=flat.device)
            params = []
            for name, view in zip(layout.names, layout.row_views(flat, row)):
                owner, leaf = _owner(module, name)
                # aliases the store's row (no copy); `.data` gives it its own version counter, so
                # one member's in-place update does not look like a change to another's graph
                param = nn.Parameter(view.data)
                owner._parameters[leaf] = param
                params.append(param)
            for name, stacked in store.buffers.items():
                owner, leaf = _owner(module, name)
                owner._buffers[leaf] = stacked[row]
            opt = optimizer.torch_optimizer(params, hp_of_row[row])
            state_views = {k: layout.row_views(store.opt[k], row) for k in optimizer.state_keys}
            for j, param in enumerate(params):
                state = {k: views[j] for k, views in state_views.items()}
                if optimizer.torch_counts_steps:
                    state["step"] = store.opt["step"][row, j]
                opt.state[param] = state
            self.modules.append(module)
            self.optimizers.append(opt)
        self._hp_version = -1

    def step(self, x: torch.Tensor, y: torch.Tensor, sizes: torch.Tensor | None,
             hp_rows: dict[str, torch.Tensor], hp_version: int) -> torch.Tensor:
        if hp_version != self._hp_version:
            for row, opt in enumerate(self.optimizers):
                self.optimizer.set_torch_group(opt, {k: float(v[row]) for k, v in hp_rows.items()})
            self._hp_version = hp_version
        losses = torch.empty(self.store.rows, dtype=self.store.flat.dtype, device=x.device)  # as vmap returns
        for row, (module, opt) in enumerate(zip(self.modules, self.optimizers)):
            module.train()
            n = int(sizes[row]) if sizes is not None else x.shape[1]
            loss = F.cross_entropy(module(x[row, :n]), y[row, :n])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[row] = loss.detach()
        if not self.optimizer.torch_counts_steps:
            self.store.opt["step"].add_(1)  # torch.optim.SGD keeps no count; keep ours in step
        return losses

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.store.rows
        loss = torch.zeros(rows, dtype=torch.float64, device=x.device)
        correct = torch.zeros_like(loss)
        for row, module in enumerate(self.modules):
            module.eval()
            for start in range(0, len(x), batch_size):
                out = module(x[start : start + batch_size])
                yb = y[start : start + batch_size]
                loss[row] += F.cross_entropy(out, yb, reduction="sum")
                correct[row] += (out.argmax(-1) == yb).sum()
        return loss / len(x), correct / len(x)


def _owner(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    path, _, leaf = dotted.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf
