"""Strategies: how one training loop runs on many processes. See `base.Strategy`.

The classes are importable from here (``from partrain.strategies import LocalSGD``);
each module is imported when its class is first asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import StepPlan, Strategy, available, get_strategy, parse_options, register

_CLASSES = {
    "Single": "single",
    "AllReduce": "allreduce",
    "ParameterServer": "parameter_server",
    "Hogwild": "hogwild",
    "LocalSGD": "local_sgd",
    "Pipeline": "pipeline",
    "FullyShard": "fsdp",
    "TensorParallel": "tensor_parallel",
    "MeshParallel": "mesh",
}

__all__ = ["StepPlan", "Strategy", "available", "get_strategy", "parse_options", "register", *_CLASSES]


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return getattr(importlib.import_module(f"{__name__}.{_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
