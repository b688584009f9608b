"""ParallelStyles torch does not have, for `partrain.strategies.tensor_parallel`.

- `first_input_style`: lay a module's first input out anew (sequence parallel: gather the
  positions before an attention or an MLP, split them before the first block);
- `conv1d_style`: split Hugging Face's Conv1D (GPT-2), which torch's Colwise/RowwiseParallel
  do not take.

Each is a `torch.distributed.tensor.parallel.ParallelStyle` for ``parallelize_module``, its class
built on first use: importing torch's tensor-parallel package would cost every other strategy's start.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from .._compat import dtensor_module
from ..errors import UsageError


def first_input_style(src: Any, dst: Any, *, local: bool) -> Any:
    """A ParallelStyle that lays a module's first input (its first positional argument, or
    ``hidden_states=``) out anew: ``src`` -> ``dst`` (the sequence gathered for an attention or an MLP,
    or split for the first block, whose sequence must then divide by tp)."""
    return _first_input_class()(src, dst, local)


@functools.cache
def _first_input_class() -> type:
    # built on first use: importing torch's tensor-parallel package costs every other strategy's start
    from torch.distributed.tensor.parallel import ParallelStyle

    DTensor, Shard = dtensor_module().DTensor, dtensor_module().Shard

    class FirstInput(ParallelStyle):
        def __init__(self, src: Any, dst: Any, local: bool) -> None:
            self.src, self.dst, self.local = src, dst, local

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def lay_out(x: Any) -> Any:
                if not isinstance(x, torch.Tensor):
                    return x
                if isinstance(self.dst, Shard) and not isinstance(x, DTensor):
                    tp = device_mesh.size()
                    if x.dim() <= self.dst.dim or x.shape[self.dst.dim] % tp:
                        raise UsageError(f"Expected sequences whose length divides by tp={tp} for sequence_parallel "
                                         f"(each process normalises its share of the positions). Received: an input "
                                         f"shaped {tuple(x.shape)}")
                d = x if isinstance(x, DTensor) else DTensor.from_local(x, device_mesh, [self.src], run_check=False)
                d = d.redistribute(device_mesh, [self.dst])
                return d.to_local() if self.local else d

            def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                if args:
                    return (lay_out(args[0]), *args[1:]), kwargs
                if "hidden_states" in kwargs:
                    return args, {**kwargs, "hidden_states": lay_out(kwargs["hidden_states"])}
                return args, kwargs

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return FirstInput


def conv1d_style(style: str, *, gather: bool) -> Any:
    """A ParallelStyle for Hugging Face's Conv1D (GPT-2's layers: a Linear with its weight stored
    ``[in, out]``), which torch's Colwise/RowwiseParallel do not take: ``colwise`` splits the
    weight's dim 1 and the bias, ``rowwise`` the weight's dim 0 (the bias stays whole and the
    partial outputs are summed). The module's own forward runs on the DTensors."""
    return _conv1d_class()(style != "rowwise", gather)


@functools.cache
def _conv1d_class() -> type:
    from torch.distributed.tensor.parallel import ParallelStyle

    dt = dtensor_module()
    DTensor, Replicate, Shard = dt.DTensor, dt.Replicate, dt.Shard

    class Conv1DSplit(ParallelStyle):
        def __init__(self, colwise: bool, gather: bool) -> None:
            self.colwise, self.gather = colwise, gather

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            colwise = self.colwise

            def partition(name: str, mod: nn.Module, mesh: Any) -> None:
                for pname, p in list(mod.named_parameters(recurse=False)):
                    weight = pname == "weight"
                    placement = Shard(1 if weight else 0) if colwise else (Shard(0) if weight else Replicate())
                    mod.register_parameter(pname, nn.Parameter(dt.distribute_tensor(p, mesh, [placement]),
                                                               requires_grad=p.requires_grad))

            def inputs(mod: nn.Module, args: tuple, mesh: Any) -> tuple:
                x = args[0]
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, mesh, [Replicate() if colwise else Shard(-1)], run_check=False)
                elif colwise:
                    x = x.redistribute(mesh, [Replicate()])
                return (x, *args[1:])

            def outputs(mod: nn.Module, out: Any, mesh: Any) -> Any:
                if colwise and not self.gather:
                    return out.to_local()  # this process's output features, for the next rowwise layer
                return out.redistribute(mesh, [Replicate()]).to_local()

            return dt.distribute_module(module, device_mesh, partition, inputs, outputs)

    return Conv1DSplit
