"""Ray Train: `fit` and `launch` loops inside ``ray.train.torch.TorchTrainer``, results to the driver.

Nothing to change in the training code. Ray Train starts the workers, sets torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
makes the process group before the train function runs; `partrain.launch` (and so `fit`)
sees the variables, spawns nothing, uses that group as it is and joins the store Ray's
rank 0 hosts at MASTER_ADDR:MASTER_PORT as a client, under a prefix of its own.

What is partrain's here is the way back: `fit` returns worker 0's `RunResult` in one Ray
worker (``None`` in the others), and Ray hands the driver only what the workers pass to
``ray.train.report``. `report` does that on every worker::

    def train_fn(config):
        result = partrain.fit(model_fn, data, optimizer_fn, strategy="allreduce", epochs=3)
        partrain.ray.report(result)             # on every worker: Ray's report is collective

    ray_result = TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=2)).fit()
    ray_result.metrics["test_accuracy"]         # the final row of the history
    run = partrain.ray.load_result(ray_result, model_fn)   # the RunResult, with its parameters

Ray 2.x keeps ``Result.metrics`` only for reports that come with a checkpoint, so the
worker holding the result reports a small Ray checkpoint: ``model.pt`` (the final
parameters, loaded with ``weights_only=True``) and ``history.json``. This module imports
``ray`` (``pip install 'partrain[ray]'``); ``import partrain`` does not.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

from .comm import all_gather_object, broadcast_object
from .errors import UsageError
from .train.result import RunResult

__all__ = ["MODEL_FILE", "HISTORY_FILE", "report", "load_result"]

#: the final parameters in the Ray checkpoint `report` writes
MODEL_FILE = "model.pt"
#: the per-epoch history (a JSON list of rows) in the same checkpoint
HISTORY_FILE = "history.json"


def report(result: RunResult | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hand worker 0's `RunResult` to the Ray driver; call it on every worker, after `fit`.

    Every worker reports the same metrics (Ray keeps world rank 0's; with a parameter
    server worker 0 of `fit` is not always Ray's rank 0): the last row of the history,
    plus ``checkpoint`` (the path of partrain's own checkpoint, when ``out_dir`` was
    given) and ``stopped``, plus ``extra``. The worker holding the result also reports a
    Ray checkpoint with the final parameters and the history (see `load_result`).
    Returns the metrics reported.
    """
    import ray.train

    if result is not None and not isinstance(result, RunResult):
        raise UsageError(f"Expected the RunResult of partrain.fit (or None). Received: {type(result).__name__}")
    holders = _gather_holders(result is not None)
    if sum(holders) != 1:
        raise UsageError(f"Expected the RunResult of fit on exactly one Ray worker. Received: it on "
                         f"{sum(holders)} of {len(holders)}")
    src = holders.index(True)
    mine = _summary(result) if result is not None else None
    metrics = _broadcast(mine, src)
    metrics.update(extra or {})
    if result is None:
        ray.train.report(metrics)
        return metrics
    with tempfile.TemporaryDirectory(prefix="partrain-ray-") as tmp:
        if result.model_state is not None:
            torch.save({k: v.detach().cpu() for k, v in result.model_state.items()}, os.path.join(tmp, MODEL_FILE))
        with open(os.path.join(tmp, HISTORY_FILE), "w") as f:
            json.dump(result.history, f)
        # report copies the directory to the run's storage before it returns
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    return metrics


def load_result(ray_result: Any, model_fn: Any = None) -> RunResult:
    """On the driver: the `RunResult` that `report` sent, from ``TorchTrainer.fit()``'s result.

    ``model_fn``: the model factory, so that ``run.model()`` rebuilds the trained module.
    """
    checkpoint = getattr(ray_result, "checkpoint", None)
    if checkpoint is None:
        raise UsageError("Expected a Ray Train result with the checkpoint of partrain.ray.report. "
                         f"Received: {type(ray_result).__name__} without a checkpoint")
    metrics = dict(getattr(ray_result, "metrics", None) or {})
    with checkpoint.as_directory() as path:
        history_path = os.path.join(path, HISTORY_FILE)
        if not os.path.exists(history_path):
            raise UsageError(f"Expected {HISTORY_FILE} in the checkpoint of partrain.ray.report. "
                             f"Received: a checkpoint holding {sorted(os.listdir(path))}")
        with open(history_path) as f:
            history = json.load(f)
        model_path = os.path.join(path, MODEL_FILE)
        state = torch.load(model_path, weights_only=True) if os.path.exists(model_path) else None
    return RunResult(history=history, out_dir=None, checkpoint=metrics.get("checkpoint"), model_state=state,
                     model_fn=model_fn, stopped=metrics.get("stopped"))


def _summary(result: RunResult) -> dict[str, Any]:
    metrics = dict(result.final)
    metrics["checkpoint"] = result.checkpoint
    metrics["stopped"] = result.stopped
    return metrics


def _gather_holders(have: bool) -> list[bool]:
    """Which Ray worker holds the result, seen from every worker (one small all-gather)."""
    return [bool(flag) for flag in all_gather_object(have)]


def _broadcast(metrics: dict[str, Any] | None, src: int) -> dict[str, Any]:
    """The holder's metrics on every worker, sent as JSON (floats, ints, strings, None)."""
    payload = broadcast_object(json.dumps(metrics) if metrics is not None else None, src=src)
    return json.loads(payload)
