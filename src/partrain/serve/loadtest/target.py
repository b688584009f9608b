"""What the server says about the model under test: `ModelInfo` from ``GET /v2/models/{name}``."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from ...errors import UsageError
from ..protocol import DATATYPES, TensorSpec


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /v2/models/{name}`` says about a model (shapes: -1 = any size).

    ``parameters`` is the metadata's own ``parameters`` object as sent (partrain's server
    puts input limits there, and for a generative model its ``generate`` settings).
    """

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...] = ()
    parameters: dict[str, Any] = field(default_factory=dict, compare=False)


def _tensor_specs(items: Any, where: str) -> tuple[TensorSpec, ...]:
    try:
        return tuple(TensorSpec.from_json(t) for t in items)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{exc} (in the model's {where})") from None


def parse_metadata(body: Any, model: str) -> ModelInfo:
    """Read the model metadata object of the Open Inference Protocol."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or not body["inputs"]:
        raise UsageError(f"Expected model metadata with a list of inputs for model {model!r}. "
                         f"Received: {str(body)[:200]}")
    inputs = _tensor_specs(body["inputs"], "inputs")
    outputs = _tensor_specs(body.get("outputs") or [], "outputs")
    for t in inputs:
        if t.datatype not in DATATYPES:
            raise UsageError(f"Expected input datatypes among {sorted(DATATYPES)}. "
                             f"Received: {t.datatype!r} for input {t.name!r}")
    parameters = body.get("parameters")
    return ModelInfo(str(body.get("name", model)), inputs, outputs,
                     dict(parameters) if isinstance(parameters, dict) else {})


async def fetch_model_info(client: Any, base: str, model: str, timeout: float) -> ModelInfo:
    """``GET {base}/v2/models/{model}`` with an httpx client; unreachable server or unknown model -> `UsageError`."""
    import httpx

    url = f"{base}/v2/models/{model}"
    try:
        response = await asyncio.wait_for(client.get(url), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise UsageError(f"Expected a server answering at {base} within {timeout:g} s. Received: no answer") from None
    except httpx.HTTPError as exc:
        raise UsageError(f"Expected a reachable server at {base}. Received: {type(exc).__name__}: {exc}") from None
    if response.status_code == 404:
        raise UsageError(f"Expected a model named {model!r} on the server at {base}. "
                         f"Received: HTTP 404 {_error_text(response.content)}")
    if response.status_code != 200:
        raise UsageError(f"Expected model metadata from {url}. "
                         f"Received: HTTP {response.status_code} {_error_text(response.content)}")
    try:
        body = response.json()
    except ValueError:
        raise UsageError(f"Expected JSON model metadata from {url}. Received: {response.text[:200]!r}") from None
    return parse_metadata(body, model)


async def query_model_info(base: str, model: str, timeout: float, headers: dict[str, str]) -> ModelInfo:
    """`fetch_model_info` with its own short-lived client (the load itself never uses httpx)."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout, headers=headers, trust_env=False) as client:
        return await fetch_model_info(client, base, model, timeout)


def _error_text(content: bytes) -> str:
    try:
        return str(json.loads(content).get("error", ""))[:200]
    except (ValueError, AttributeError):
        return content[:200].decode("utf-8", "replace")
