"""Cutting a model that is not an ``nn.Sequential``: torch's tracer (``torch.distributed.pipelining.pipeline``).

The tracer (torch.export) records the forward pass on an example micro-batch and cuts the
graph where the named submodules begin; each stage is a module holding the original
parameters under their original names. Where no names are given, the candidates are the
top-level children (the items of a top-level ``ModuleList``/``ModuleDict``) in the order
the forward pass calls them, each called once, balanced by parameter count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import UsageError, error_line
from ..nn.split import balance


def call_order(model: nn.Module, args: Sequence[Any]) -> list[tuple[str, nn.Module]]:
    """The candidate cut points of ``model``, in the order its forward pass calls them once each."""
    candidates: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            candidates += [(f"{name}.{n}", c) for n, c in child.named_children()]
        else:
            candidates.append((name, child))
    calls: dict[str, int] = {}
    order: list[str] = []
    handles = []
    for name, module in candidates:
        def hook(_module: nn.Module, _args: Any, name: str = name) -> None:
            if name not in calls:
                order.append(name)
            calls[name] = calls.get(name, 0) + 1
        handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args)
    finally:
        for handle in handles:
            handle.remove()
    modules = dict(candidates)
    return [(name, modules[name]) for name in order if calls[name] == 1]


def split_points(model: nn.Module, args: Sequence[Any], chunks: int, split: str) -> list[str]:
    """The submodule names where stages 2, 3, ... begin (``split`` names, or balanced by parameters)."""
    if split == "params":
        order = call_order(model, args)
        costs = [float(sum(p.numel() for p in m.parameters())) for _, m in order]
        has_params = [c > 0 for c in costs]
        if chunks > len(order):
            raise UsageError(f"Expected at least {chunks} submodules called once each to cut into {chunks} stages. "
                             f"Received: {type(model).__name__} calling {[n for n, _ in order]}")
        return [order[i][0] for i in balance(costs, chunks, has_params)]
    if split == "time":
        raise UsageError(f"Expected split='params' or submodule names for a model that is not an nn.Sequential. "
                         f"Received: split='time' for {type(model).__name__}")
    points = [p.strip() for p in split.split(",") if p.strip()]
    if len(points) != chunks - 1:
        raise UsageError(f"Expected {chunks - 1} split point{'s' * (chunks != 2)} (submodule names where a stage "
                         f"begins) for {chunks} stages. Received: {points}")
    for point in points:
        try:
            model.get_submodule(point)
        except AttributeError:
            raise UsageError(f"Expected split points among {type(model).__name__}'s submodules. "
                             f"Received: {point!r}") from None
    return points


def culprit(model: nn.Module, args: Sequence[Any]) -> str:
    """Which part of ``model`` torch.export cannot trace: the first top-level submodule (in call
    order, on the inputs it received) that fails alone, else the model's own forward."""
    inputs: dict[str, tuple[Any, ...]] = {}
    handles = []
    for name, module in model.named_children():
        def grab(_module: nn.Module, module_args: tuple[Any, ...], name: str = name) -> None:
            inputs.setdefault(name, module_args)
        handles.append(module.register_forward_pre_hook(grab))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args)
    except Exception:
        pass  # the part that ran recorded its inputs
    finally:
        for handle in handles:
            handle.remove()
    for name, module_args in inputs.items():
        try:
            torch.export.export(model.get_submodule(name), tuple(module_args), strict=False)
        except Exception:
            return f"submodule {name!r} ({type(model.get_submodule(name)).__name__})"
    return f"{type(model).__name__}.forward itself"


def trace_stages(model: nn.Module, args: Sequence[Any], points: Sequence[str], chunks: int,
                 why_not_blocks: str = "") -> list[nn.Module]:
    """The stage modules of ``model`` cut where ``points`` begin (one line when tracing fails,
    saying too why it was not cut between blocks: ``why_not_blocks``)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        pipe = pipeline(model, mb_args=tuple(args), split_spec={p: SplitPoint.BEGINNING for p in points})
    except Exception as exc:
        where = culprit(model, args)
        blocks = f" (not cut between blocks: {why_not_blocks})" if why_not_blocks else ""
        raise UsageError(f"Expected a model torch.export can trace, or an nn.Sequential (cut between its children "
                         f"without tracing) or a model running an nn.ModuleList of blocks (cut between them); else "
                         f"strategy 'allreduce' (the whole model on each process). Received: {type(model).__name__}{blocks}, whose tracing "
                         f"failed in {where}: {error_line(exc)}") from None
    if pipe.num_stages != chunks:
        raise UsageError(f"Expected split points that cut {type(model).__name__} into {chunks} stages. Received: "
                         f"{list(points)}, which make {pipe.num_stages} (a point inside a loop or called twice?)")
    stages = [pipe.get_stage_module(s) for s in range(chunks)]
    retie(model, stages)
    for s, stage in enumerate(stages):
        if not any(p.requires_grad for p in stage.parameters()):
            where = f"beginning at {points[s - 1]!r}" if s else "the first"
            raise UsageError(f"Expected every pipeline stage to hold parameters. Received: stage {s} ({where}) "
                             "has none; move its split point")
    return stages


def retie(model: nn.Module, stages: Sequence[nn.Module]) -> None:
    """Point every stage back at ``model``'s own Parameters, under each name the model gives them.

    torch's tracer gives a weight that several stages use (an embedding tied to the output
    layer) a copy in each, which then train apart; on its own Parameter again, each process
    trains it with the gradient summed over the stages that use it (`Runtime.sum_shared_grads`)
    and its optimizer steps the model's own Parameter (the copy is not in it).
    """
    own = dict(model.named_parameters(remove_duplicate=False))
    for stage in stages:
        for name, p in list(stage.named_parameters(remove_duplicate=False)):
            want = own.get(name)
            if want is not None and p is not want:
                parent, _, leaf = name.rpartition(".")
                setattr(stage.get_submodule(parent) if parent else stage, leaf, want)
