"""``fit(..., compile=True)``: the model's forward and backward compiled with ``torch.compile``.

The module's ``forward`` is replaced, on this instance, by its compiled version, so the
module stays itself: its ``state_dict`` keeps its keys (checkpoints, ``partrain serve``) and
a strategy's wrapper (DDP) calls it as before. (``nn.Module.compile`` would be the obvious
call, but torch 2.13 skips the frame it compiles, ``Module._call_impl`` in torch's own
files, and runs the module eagerly without a word.) On CUDA the
default mode is ``reduce-overhead`` (CUDA graphs: one launch replays a whole step's
kernels); on CPU inductor's default. ``compile="aot_eager"`` (or any backend name) picks a
backend; ``"eager"`` traces without generating code (a check that the model traces).

Compilation happens at the first call, deep inside the first training step, where a
failure would leave a strategy's collectives half done. So a trial compiles a copy of
the model on one batch first (forward and backward, under a forked random state, the
real model untouched); when that fails the run trains eagerly and says why in one line.
The trial's compiled code is reused by the real model (same class, same shapes).

With the training set resident on the device (``data_on_device=True``) the whole step is
compiled as one function instead, where it can be (`FusedStep`: gather, forward, gradient,
the optimizer's update, the epoch's sums); `fused_blocker` and `optimizer_blocker` say why
not, and then the forward alone is compiled as above.
"""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import torch
from torch import nn

from .._compat import mark_static_address, optimizer_step_dtype
from ..errors import UsageError, first_line

BACKENDS_HINT = ("inductor", "aot_eager", "eager", "cudagraphs")


def compile_settings(value: bool | str, device: torch.device) -> dict[str, Any] | None:
    """``torch.compile`` keywords for ``fit``'s ``compile`` option (None: do not compile)."""
    if value is False or value is None:
        return None
    if value is True or value == "inductor":
        mode = "reduce-overhead" if device.type == "cuda" else None
        return {"backend": "inductor", "mode": mode}
    if isinstance(value, str) and value.strip():
        return {"backend": value}
    raise UsageError(f"Expected compile to be True, False or a torch.compile backend name (e.g. "
                     f"{', '.join(BACKENDS_HINT)}). Received: {value!r}")


def compile_model(model: nn.Module, settings: dict[str, Any], trial: Any, task: Any,
                  quiet: bool = False) -> bool:
    """Compile ``model`` in place when a trial on ``trial`` (a batch on the model's device)
    compiles; else leave it eager and print one line why. True when compiled."""
    try:
        probe = copy.deepcopy(model)
        compile_forward(probe, settings)
        with torch.random.fork_rng(devices=[trial_device(trial)] if trial_device(trial) >= 0 else []):
            inputs, target = task.split(trial)
            out = task.forward(probe, inputs)
            task.loss(out, target).sum().backward()
        del probe
    except Exception as exc:  # any compiler error: train eagerly, say why once
        if not quiet:
            print(f"partrain: torch.compile failed ({type(exc).__name__}: {first_line(exc)[:200]}); "
                  "training eagerly", file=sys.stderr, flush=True)
        return False
    compile_forward(model, settings)
    return True


def compile_forward(module: nn.Module, settings: dict[str, Any]) -> None:
    """``module.forward`` compiled, for this instance only (hooks and wrappers still apply)."""
    module.forward = torch.compile(module.forward, **settings)  # type: ignore[method-assign]


def trial_device(batch: Any) -> int:
    """The CUDA device index a batch is on (-1 on CPU), for forking its random state."""
    from .._tree import map_tensors

    found: list[int] = []
    map_tensors(batch, lambda t: found.append(t.device.index if t.is_cuda else -1))
    return found[0] if found else -1


# --------------------------------------------------------------------------- the fused step

#: optimizers whose update `FusedStep` writes itself, with the settings it follows
FUSED_OPTIMIZERS = ("SGD", "Adam", "AdamW")


def fused_blocker(strategy: Any, model: nn.Module, cfg: Any) -> str | None:
    """Why the device-resident epoch cannot run as one compiled step per batch (None: it can).

    What the fused step leaves out runs on the host between steps in the usual loop:
    gradient exchange between workers, accumulation windows, clipping, skipping steps,
    buffers the forward updates (BatchNorm's running statistics), bf16 autocast.
    """
    if not strategy.fuses_steps or strategy.num_workers != 1:
        return (f"strategy {strategy.name!r} with {strategy.num_workers} workers (one worker of a strategy "
                "whose step stays in one process: single, allreduce)")
    if cfg.accumulate != 1:
        return f"accumulate={cfg.accumulate}"
    if cfg.activation_checkpointing:
        return "activation_checkpointing"
    if cfg.clip_grad is not None:
        return "clip_grad is set"
    if cfg.on_nan == "skip":
        return "on_nan='skip'"
    if cfg.precision != "fp32":
        return f"precision={cfg.precision!r}"
    if any(p.dim() == 0 for p in model.parameters()):
        return "a 0-dim parameter (torch 2.13 loses a compiled function's writes to 0-dim inputs)"
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        return f"the model has buffers ({buffers[0]}, ...), which its forward may update"
    return None


def optimizer_blocker(optimizer: Any, model: nn.Module) -> str | None:
    """Why `FusedStep` cannot write ``optimizer``'s update itself (None: it can)."""
    from ..nn.freeze import _frozen_params

    kind = type(optimizer).__name__
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"] or kind not in FUSED_OPTIMIZERS:
        return f"optimizer {kind} (fused: torch.optim {', '.join(FUSED_OPTIMIZERS)})"
    if _frozen_params(optimizer):
        return "frozen parameter slices"
    own = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for key in ("maximize", "differentiable", "amsgrad", "capturable"):
            if group.get(key):
                return f"{kind} with {key}=True"
        if group.get("dampening"):
            return f"SGD with dampening={group['dampening']}"
        if isinstance(group.get("lr"), torch.Tensor):
            return "a tensor learning rate"
        if any(id(p) not in own or not p.requires_grad for p in group["params"]):
            return "the optimizer holds tensors that are not trainable parameters of the model"
    return None


class _Forward(nn.Module):
    """The task's forward of the model as one module, so ``functional_call`` can swap its parameters."""

    def __init__(self, model: nn.Module, task: Any) -> None:
        super().__init__()
        self.model = model
        self.task = task

    def forward(self, inputs: Any) -> Any:
        return self.task.forward(self.model, inputs)


class FusedStep:
    """One training step as one compiled function: the batch gathered by index from the
    resident tensors, forward, per-sample loss, gradient (``torch.func.grad``), the
    optimizer's update (written here, in place, on the parameters and on the optimizer's own
    state tensors, so checkpoints and resume see them as after ``optimizer.step()``), and
    the epoch's loss and metric sums, kept on the device.

    The update follows ``torch.optim``'s single-tensor code step for step: SGD (momentum,
    weight decay, nesterov), Adam and AdamW (weight decay, not amsgrad). Learning rates are
    0-dim tensors filled before each step, so a schedule causes no recompilation.
    """

    def __init__(self, model: nn.Module, optimizer: Any, task: Any, settings: dict[str, Any]) -> None:
        self.model, self.optimizer, self.task = model, optimizer, task
        self.kind = type(optimizer).__name__
        self.adamw = self.kind == "AdamW" or any(g.get("decoupled_weight_decay") for g in optimizer.param_groups)
        names = {id(p): name for name, p in model.named_parameters()}
        self.groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        device = next(model.parameters()).device
        self.lrs = [torch.zeros((), dtype=torch.float64, device=device) for _ in optimizer.param_groups]
        self.wrapper = _Forward(model, task)
        # a code object of its own: dynamo keeps compiled code per code object, and every run
        # of fit (a new model, optimizer and task) would add entries to one shared cache, up
        # to its limit of recompilations
        code = FusedStep._step.__code__
        fn = types.FunctionType(code.replace(co_name=code.co_name), FusedStep._step.__globals__, "fused_step")
        self.compiled = torch.compile(types.MethodType(fn, self), fullgraph=True, dynamic=False, **settings)
        self._sums: list[torch.Tensor] | None = None

    # ----- what the compiled function reads and writes
    def params(self) -> list[list[torch.Tensor]]:
        return [[p.detach() for p in g["params"]] for g in self.optimizer.param_groups]

    def state(self) -> list[list[list[torch.Tensor]]]:
        """The optimizer's state tensors per group and parameter, created as ``step()`` would
        (zeros: SGD's first momentum step ``0 * momentum + grad`` is the gradient exactly)."""
        out = []
        for group in self.optimizer.param_groups:
            rows = []
            for p in group["params"]:
                st = self.optimizer.state[p]
                if self.kind == "SGD":
                    if group["momentum"]:
                        if st.get("momentum_buffer") is None:
                            st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        rows.append([st["momentum_buffer"]])
                    else:
                        rows.append([])
                else:
                    if not st:
                        st["step"] = torch.tensor(0.0, dtype=optimizer_step_dtype())
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    # 0-dim inputs a compiled function writes to keep their old value in torch 2.13:
                    # the step count goes in as a 1-element view
                    rows.append([st["step"].view(1), st["exp_avg"], st["exp_avg_sq"]])
            out.append(rows)
        return out

    def set_lrs(self) -> None:
        """Before a step: the groups' learning rates into their tensors; their other settings
        (constants of the compiled code: a change recompiles) as they are now."""
        for t, group in zip(self.lrs, self.optimizer.param_groups):
            t.fill_(group["lr"])
        self.hyper = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                      for group in self.optimizer.param_groups]

    def begin_epoch(self, tensors: tuple[torch.Tensor, ...], loss_sum: torch.Tensor,
                    metric_sums: torch.Tensor) -> list[torch.Tensor]:
        """Take the parameters and the optimizer's state as they are now (after a resume's
        ``load_state_dict``, which replaces the state tensors), for the epoch's steps. Returns
        the epoch's sums, starting from ``loss_sum`` and ``metric_sums``: buffers the step keeps
        from epoch to epoch (`sum_buffers`), which the steps add to."""
        self.set_lrs()
        self.args = (self.params(), self.state(), self.lrs)
        _static_inputs([self.args, tensors])
        sums = self.sum_buffers(loss_sum.device, metric_sums.numel())
        sums[0].copy_(loss_sum.reshape(1))
        sums[1].copy_(metric_sums)
        return sums

    def sum_buffers(self, device: torch.device, n_metrics: int) -> list[torch.Tensor]:
        """The loss sum (1 element: see `state`) and the metric sums the compiled step adds to,
        made once: with CUDA graphs an input the step writes must keep its address from call to
        call (a new one each epoch would record the graphs again each epoch)."""
        if self._sums is None or self._sums[1].numel() != n_metrics or self._sums[0].device != device:
            self._sums = [torch.zeros(1, dtype=torch.float64, device=device),
                          torch.zeros(n_metrics, dtype=torch.float64, device=device)]
            _static_inputs(self._sums)
        return self._sums

    def __call__(self, tensors: tuple[torch.Tensor, ...], index: torch.Tensor, sums: list[torch.Tensor]) -> None:
        """One step on the batch ``index``; adds its loss and metric sums to ``sums`` (`begin_epoch`'s)."""
        self.compiled(*self.args, tensors, index, sums)

    def trial(self, tensors: tuple[torch.Tensor, ...], sizes: list[int], n_metrics: int) -> None:
        """Compile for each batch size on copies (parameters, optimizer state; the sums' buffers,
        which `begin_epoch` sets before the first real step): a failure leaves the model and
        optimizer untouched, and the real steps reuse the code."""
        self.set_lrs()
        fresh = [p for g in self.optimizer.param_groups for p in g["params"] if not self.optimizer.state.get(p)]
        params = [[p.clone() for p in g] for g in self.params()]
        state = [[[s.clone() for s in row] for row in g] for g in self.state()]
        for p in fresh:  # the state made for the copies goes: the first real step makes its own
            self.optimizer.state.pop(p, None)
        sums = self.sum_buffers(tensors[0].device, n_metrics)
        _static_inputs([params, state, self.lrs, tensors])
        for size in sizes:
            index = torch.arange(size, device=tensors[0].device)
            self.compiled(params, state, self.lrs, tensors, index, sums)

    # ----- the compiled function
    def _loss(self, flat: dict[str, torch.Tensor], inputs: Any, target: Any) -> Any:
        out = torch.func.functional_call(self.wrapper, flat, (inputs,))
        per_sample = self.task.loss(out, target)
        # as the eager loop: the sum times 1 / (global batch), one worker
        return per_sample.sum() * (1.0 / per_sample.shape[0]), (out, per_sample)

    def _step(self, params: list[list[torch.Tensor]], state: list[list[list[torch.Tensor]]],
              lrs: list[torch.Tensor], tensors: tuple[torch.Tensor, ...], index: torch.Tensor,
              sums: list[torch.Tensor]) -> None:
        batch = tuple(t.index_select(0, index) for t in tensors)
        inputs, target = self.task.split(batch)
        flat = {f"model.{name}": p for names, ps in zip(self.groups, params) for name, p in zip(names, ps)}
        grads, (out, per_sample) = torch.func.grad(self._loss, has_aux=True)(flat, inputs, target)
        with torch.no_grad():
            sums[0].add_(per_sample.sum())
            if self.task.metric_names:
                sums[1].add_(self.task.metric_values(out, target))
            for group, names, ps, states, lr in zip(self.hyper, self.groups, params, state, lrs):
                for name, p, st in zip(names, ps, states):
                    g = grads[f"model.{name}"]
                    if self.kind == "SGD":
                        _sgd(p, g, st, lr, group)
                    else:
                        _adam(p, g, st, lr, group, self.adamw)


def _static_inputs(tensors: Any) -> None:
    """Mark the compiled step's inputs (nested lists and tuples of them) that keep their address (parameters, optimizer state,
    learning rates, the resident training set, the sums) as such, on CUDA.

    Under CUDA graphs (``reduce-overhead``) inductor copies every other input into the graph's
    own memory at each replay (the whole training set, each step), and it skips the graphs
    altogether when the function writes an input in place that is not marked ("skipping
    cudagraphs due to mutated inputs"): this step writes the parameters, the optimizer's state
    and the sums. Unguarded: a tensor at a new address (the trial's copies, a resume's new
    state) records the graphs again instead of compiling again. The CPU has no graphs: nothing
    to mark. (Adam's step count lives on the CPU, as ``torch.optim`` keeps it: its graphs are
    skipped still, and its steps run compiled without them.)"""
    from .._tree import map_tensors

    map_tensors(tensors, lambda t: mark_static_address(t) if t.is_cuda else None)


def _sgd(p: torch.Tensor, g: torch.Tensor, st: list[torch.Tensor], lr: torch.Tensor, group: dict) -> None:
    """``torch.optim.SGD``'s single-tensor update (dampening 0, not maximize)."""
    if group["weight_decay"]:
        g = g.add(p, alpha=group["weight_decay"])
    if group["momentum"]:
        buf = st[0]
        buf.mul_(group["momentum"]).add_(g)
        g = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
    p.sub_(lr.to(p.dtype) * g)


def _adam(p: torch.Tensor, g: torch.Tensor, st: list[torch.Tensor], lr: torch.Tensor, group: dict,
          decoupled: bool) -> None:
    """``torch.optim.Adam`` / ``AdamW``'s single-tensor update (not amsgrad, not maximize)."""
    step, exp_avg, exp_avg_sq = st
    beta1, beta2 = group["betas"]
    step.add_(1)
    if group["weight_decay"]:
        if decoupled:
            p.mul_(1 - lr * group["weight_decay"])
        else:
            g = g.add(p, alpha=group["weight_decay"])
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    t = step.to(torch.float64).reshape(())
    bias_correction1 = 1 - beta1 ** t
    bias_correction2 = 1 - beta2 ** t
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt().to(p.dtype)).add_(group["eps"])
    p.sub_(step_size.to(p.dtype) * exp_avg / denom)
