"""Serving: the dynamic `Batcher` (no I/O) and the Open Inference Protocol v2 HTTP app.

``Batcher`` is the project's one dynamic batcher (HTTP serving, RL central
inference and streaming training all use it). ``create_app`` builds the
Starlette app over `ServedModel` descriptions; ``partrain serve`` runs it.
The HTTP parts import lazily so that the batcher needs only torch.
"""

from __future__ import annotations

from typing import Any

from ..batching import (
    AdaptivePolicy,
    Batcher,
    BatcherClosed,
    BatcherStats,
    FixedPolicy,
    Policy,
    QueueFull,
    collect_batch,
    make_policy,
)
from .protocol import DATATYPES, ProtocolError, ServedModel, TensorSpec

__all__ = [
    "AdaptivePolicy",
    "Batcher",
    "BatcherClosed",
    "BatcherStats",
    "DATATYPES",
    "FixedPolicy",
    "Policy",
    "ProtocolError",
    "QueueFull",
    "ServedModel",
    "TensorSpec",
    "collect_batch",
    "create_app",
    "load_model_spec",
    "make_policy",
]


def __getattr__(name: str) -> Any:
    # Starlette / prometheus-client are the `serve` extra: import them only when asked.
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "load_model_spec":
        from .loading import load_model_spec

        return load_model_spec
    raise AttributeError(f"module 'partrain.serve' has no attribute {name!r}")
