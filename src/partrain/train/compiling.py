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
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn

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
