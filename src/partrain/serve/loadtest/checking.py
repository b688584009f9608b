"""Are the answers right? A local copy of the model runs each sample once; answers are compared with it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import UsageError


def load_reference_model(spec: str) -> Any:
    """The model to check answers with, in the forms ``partrain serve`` takes.

    ``[name=]MODEL`` where MODEL is a partrain checkpoint, a TorchScript or
    ``torch.export`` (.pt2) file, or ``module:factory`` (called with no
    arguments; it must build the same weights as the server's, e.g. by seeding).
    """
    import torch

    from ...models import build_model
    from ..loading import import_callable, model_from_checkpoint

    name, sep, rest = spec.partition("=")
    if sep and name.isidentifier() and not os.path.exists(spec):
        spec = rest
    if os.path.exists(spec):
        if spec.endswith(".pt2"):
            return torch.export.load(spec).module()
        try:
            model, _ = model_from_checkpoint(spec)  # with its preprocessing, as the server has it
            return model
        except UsageError as first:
            try:
                return torch.jit.load(spec, map_location="cpu").eval()
            except Exception:
                raise first from None
    if ":" in spec:
        import_callable(spec, "model factory")  # finds modules in the current directory
        return build_model(spec).eval()
    raise UsageError(f"Expected a model file or 'module:factory' to check answers with. Received: {spec!r}")


class AnswerChecker:
    """Runs each sample through a local model once and compares the server's answers with it."""

    def __init__(self, model: Any, samples: Sequence[Mapping[str, np.ndarray]], atol: float = 1e-4,
                 rtol: float = 1e-4):
        import torch

        self.atol, self.rtol = atol, rtol
        self.expected: list[list[np.ndarray]] = []
        with torch.inference_mode():
            for sample in samples:
                try:
                    out = model(*(torch.from_numpy(np.array(a)) for a in sample.values()))
                except Exception as exc:
                    shapes = {k: list(a.shape) for k, a in sample.items()}
                    raise UsageError(f"Expected the --check model to accept the inputs sent {shapes}. "
                                     f"Received: {type(exc).__name__}: {exc}") from None
                if isinstance(out, dict):
                    out = list(out.values())
                elif not isinstance(out, (list, tuple)):
                    out = [out]
                self.expected.append([o.detach().cpu().numpy() for o in out])

    def compare(self, sample: int, outputs: dict[str, np.ndarray]) -> str:
        """'' when ``outputs`` are right for ``sample``, else what is wrong."""
        expected = self.expected[sample]
        got = list(outputs.values())
        if len(got) != len(expected):
            return f"{len(got)} outputs instead of {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            if e.shape != g.shape:
                return f"output {i} has shape {list(g.shape)} instead of {list(e.shape)}"
            if not np.allclose(g.astype(np.float64), e.astype(np.float64), atol=self.atol, rtol=self.rtol):
                diff = float(np.max(np.abs(g.astype(np.float64) - e.astype(np.float64))))
                return f"output {i} differs by up to {diff:.3g}"
        return ""
