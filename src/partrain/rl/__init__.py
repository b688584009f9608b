"""Actor-learner reinforcement learning: a live model shared with processes started by anyone.

A `Learner` holds the model, trains on trajectory segments that actors send, and
publishes every update as a new *version*. Actors, in any process, `connect` to its
URL and either keep a local copy of the policy (pulling weights only when the
version changed) or ask the learner for actions (central inference over the Open
Inference Protocol, batched by `partrain.serve.Batcher`). Weights and segments travel
as safetensors; nothing is pickled. See docs/rl.md.
"""

from __future__ import annotations

from typing import Any

from .algorithms import PPO, ActorCritic, Algorithm, Batch, VTrace, vtrace
from .learner import ExperienceFull, Learner, LearnerStats, StaleWeights, TrainingDone

__all__ = [
    "ActorCritic",
    "Actor",
    "Algorithm",
    "Batch",
    "ExperienceFull",
    "Learner",
    "LearnerDone",
    "LearnerServer",
    "LearnerStats",
    "PPO",
    "StaleWeights",
    "TrainingDone",
    "VTrace",
    "connect",
    "run_actor",
    "train_single",
    "vtrace",
]


def __getattr__(name: str) -> Any:
    # imported only when asked: the learner's server (starlette, uvicorn) is the `serve` extra, and an
    # actor's client (the standard library's http.client) needs safetensors, the `rl` extra
    if name in ("Actor", "LearnerDone", "connect", "run_actor"):
        from . import client

        return getattr(client, name)
    if name == "LearnerServer":
        from .app import LearnerServer

        return LearnerServer
    if name == "train_single":
        from .single import train_single

        return train_single
    raise AttributeError(f"module 'partrain.rl' has no attribute {name!r}")
