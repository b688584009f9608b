"""What travels between actors and the learner: weights and segments as safetensors, no pickle.

Both are one safetensors blob (a JSON header, then raw little-endian tensors; a
reader never runs code from it). Its string metadata carries the rest:

- weights: the model's ``state_dict`` and ``{"version": "12"}``;
- a segment: the tensors of `partrain.rl.algorithms.Batch` and ``{"version": V,
  "episode_returns": "[...]", "actor": NAME}``, ``V`` the oldest weights version
  that acted in it.

`decode_segment` checks a segment against the learner's observation and action
spaces and raises `ProtocolError` (HTTP 400) with one "Expected ... Received: ..."
line, so that a bad actor gets a clear answer and the learner goes on.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..serve.protocol import ProtocolError

CONTENT_TYPE = "application/vnd.safetensors"  # not registered; says what the body is
VERSION_HEADER = "X-Partrain-Version"

# name -> (dtype, rows of time: T or T + 1)
SEGMENT_FIELDS: dict[str, tuple[torch.dtype, int]] = {
    "obs": (torch.float32, 1),
    "actions": (torch.int64, 0),
    "logp": (torch.float32, 0),
    "rewards": (torch.float32, 0),
    "dones": (torch.float32, 0),
    "versions": (torch.int64, 0),
}


#: dtypes numpy has: tensors of these travel through safetensors' numpy reader and writer (same
#: format, about 5x less time than its torch ones on a segment's or a small model's few tensors)
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


def _save(tensors: Mapping[str, Tensor], metadata: dict[str, str]) -> bytes:
    from safetensors import numpy as st_numpy
    from safetensors import torch as st_torch

    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    if all(t.dtype in _NUMPY_DTYPES for t in cpu.values()):
        return st_numpy.save({k: t.numpy() for k, t in cpu.items()}, metadata=metadata)
    return st_torch.save(cpu, metadata=metadata)  # bfloat16 and other dtypes numpy lacks


def _load(data: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors and string metadata of a safetensors blob; `ProtocolError` 400 when it is not one."""
    from safetensors import numpy as st_numpy
    from safetensors import torch as st_torch

    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        metadata = header.get("__metadata__") or {}
        try:
            tensors = {k: torch.from_numpy(v) for k, v in st_numpy.load(data).items()}
        except KeyError:  # a dtype numpy lacks (BF16, FP8): torch's reader
            tensors = st_torch.load(data)
    except Exception as exc:  # noqa: BLE001 - any malformed body is one 400 line
        raise ProtocolError(f"Expected a safetensors body. Received: {len(data)} bytes that are not one "
                            f"({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(metadata, dict):
        raise ProtocolError(f"Expected safetensors metadata as an object. Received: {str(metadata)[:80]}")
    return tensors, metadata


def encode_weights(state_dict: Mapping[str, Tensor], version: int) -> bytes:
    return _save(state_dict, {"version": str(version)})


def decode_weights(data: bytes) -> tuple[dict[str, Tensor], int]:
    tensors, metadata = _load(data)
    return tensors, _int_field(metadata, "version")


def _int_field(metadata: Mapping[str, str], name: str) -> int:
    try:
        return int(metadata[name])
    except (KeyError, ValueError):
        raise ProtocolError(f"Expected an integer {name!r} in the safetensors metadata. "
                            f"Received: {metadata.get(name)!r}") from None


@dataclass
class Segment:
    """One decoded segment: its tensors, the oldest version that acted in it, finished episodes."""

    tensors: dict[str, Tensor]
    version: int
    episode_returns: list[float]
    actor: str

    @property
    def frames(self) -> int:
        return int(self.tensors["actions"].numel())


def encode_segment(tensors: Mapping[str, Tensor], episode_returns: list[float], actor: str = "") -> bytes:
    version = int(tensors["versions"].min())
    return _save(tensors, {"version": str(version), "episode_returns": json.dumps(episode_returns),
                           "actor": actor})


def decode_segment(data: bytes, obs_shape: tuple[int, ...], num_actions: int) -> Segment:
    """A segment from an actor, checked field by field; `ProtocolError` 400 on the first problem."""
    tensors, metadata = _load(data)
    missing = sorted(set(SEGMENT_FIELDS) - set(tensors))
    if missing:
        raise ProtocolError(f"Expected segment tensors {sorted(SEGMENT_FIELDS)}. Received: {sorted(tensors)} "
                            f"(missing {missing})")
    steps, envs = _time_shape(tensors["actions"])
    for name, (dtype, extra) in SEGMENT_FIELDS.items():
        t = tensors[name]
        want = (steps + extra, envs, *(obs_shape if name == "obs" else ()))
        if t.dtype != dtype:
            raise ProtocolError(f"Expected {name!r} of dtype {dtype}. Received: {t.dtype}")
        if tuple(t.shape) != want:
            raise ProtocolError(f"Expected {name!r} of shape {list(want)}. Received: {list(t.shape)}")
        # the checks run on numpy views (the dtypes are checked): a few small arrays cost numpy
        # ~1 us per call and torch ~5-10 us, and a learner decodes every segment
        if t.is_floating_point() and not np.isfinite(t.numpy()).all():
            raise ProtocolError(f"Expected finite values in {name!r}. Received: NaN or infinity")
    actions = tensors["actions"].numpy()
    low, high = int(actions.min()), int(actions.max())
    if low < 0 or high >= num_actions:
        raise ProtocolError(f"Expected actions in 0..{num_actions - 1}. Received: values {low}..{high}")
    version = _int_field(metadata, "version")
    oldest = int(tensors["versions"].numpy().min())
    if oldest != version:
        raise ProtocolError(f"Expected metadata version = min(versions). Received: {version} and {oldest}")
    try:
        returns = [float(r) for r in json.loads(metadata.get("episode_returns", "[]"))]
    except (ValueError, TypeError):
        raise ProtocolError(f"Expected episode_returns as a JSON list of numbers. Received: "
                            f"{metadata.get('episode_returns', '')[:80]!r}") from None
    if not all(math.isfinite(r) for r in returns):
        raise ProtocolError("Expected finite episode returns. Received: NaN or infinity")
    return Segment(tensors, version, returns, str(metadata.get("actor", "")))


def _time_shape(actions: Tensor) -> tuple[int, int]:
    if actions.dim() != 2 or actions.shape[0] < 1 or actions.shape[1] < 1:
        raise ProtocolError(f"Expected 'actions' of shape [T, E] with T, E >= 1. Received: {list(actions.shape)}")
    return int(actions.shape[0]), int(actions.shape[1])


def stack_segments(segments: list[Segment]) -> dict[str, Any]:
    """Segments of the same length side by side along the environment dim (dim 1)."""
    return {name: torch.cat([s.tensors[name] for s in segments], dim=1) for name in SEGMENT_FIELDS}
