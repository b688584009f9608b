"""Are the answers right? A local copy of the model runs each sample (`AnswerChecker`) or each generated
answer (`GreedyChecker`) once; the server's answers are compared with it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import UsageError, error_line


def load_reference_model(spec: str) -> Any:
    """The model to check answers with, in the forms ``partrain serve`` takes.

    ``[name=]MODEL`` where MODEL is a partrain checkpoint, a TorchScript or
    ``torch.export`` (.pt2) file, or ``module:factory`` (called with no
    arguments; it must build the same weights as the server's, e.g. by seeding).
    """
    import torch

    from ...models import build_model
    from ..checkpoints import model_from_checkpoint
    from ..loading import import_callable

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


class GreedyChecker:
    """Checks greedy generations against the model alone, one forward pass per distinct answer.

    Greedy decoding is defined token by token: each new token is the argmax of the
    logits after the tokens before it. So the model run once over the prompt followed
    by the server's answer (teacher forcing, the model's plain forward call) says
    whether every answer token is that argmax; an answer that passes is, token for
    token, what ``GPT.generate(ids, n, temperature=0)`` returns, by induction from the
    prompt, at one forward pass instead of one per token.

    Floating point: the server's batched float32 arithmetic (a KV cache, other rows in
    the batch) may differ from this run in the last bits, and where the two best logits
    are that close the argmax can flip. A token that is not the local argmax but whose
    logit is within ``rtol`` of it (relative to the larger magnitude, and at least
    ``rtol`` absolute) is a *tie*: reported, not counted wrong. The tokens after a tie
    are still checked, each given the server's own tokens before it.
    """

    def __init__(self, model: Any, rtol: float = 1e-4) -> None:
        self.model = model
        self.rtol = rtol
        self._seen: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[str, str]] = {}

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """The model's logits [T, V] after each of ``ids`` (one sequence, no batch)."""
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor([list(ids)], dtype=torch.int64))
        if hasattr(out, "logits"):  # a Hugging Face model's output
            out = out.logits
        elif isinstance(out, (tuple, list)):
            out = out[0]
        return out[0].detach().to(torch.float64).cpu().numpy()

    def compare(self, prompt: Sequence[int], tokens: Sequence[int]) -> tuple[str, str]:
        """``("", "")`` when ``tokens`` are the greedy continuation of ``prompt``; else ``("tie", what)``
        when they differ only at near-ties, or ``("wrong", what)``."""
        key = (tuple(prompt), tuple(tokens))
        if key not in self._seen:
            self._seen[key] = self._compare(key[0], key[1])
        return self._seen[key]

    def _compare(self, prompt: tuple[int, ...], tokens: tuple[int, ...]) -> tuple[str, str]:
        if not tokens:
            return "", ""
        try:
            logits = self.logits(prompt + tokens[:-1])[len(prompt) - 1:]
        except Exception as exc:  # noqa: BLE001 - e.g. ids outside the vocabulary, longer than the context
            return "wrong", f"the local model cannot run the prompt and answer: {error_line(exc)}"
        if logits.shape[0] != len(tokens):
            return "wrong", f"the local model gave {logits.shape[0]} rows of logits for {len(tokens)} tokens"
        vocab = logits.shape[1]
        tie = ""
        for k, token in enumerate(tokens):
            if not 0 <= token < vocab:
                return "wrong", f"token {k} is {token}, outside the model's vocabulary of {vocab}"
            row = logits[k]
            best = int(row.argmax())
            if best == token or row[token] == row[best]:
                continue
            gap = row[best] - row[token]
            what = (f"token {k} of {len(tokens)} is {token}; the model alone chooses {best} "
                    f"(logits {row[token]:.6g} vs {row[best]:.6g})")
            if gap > self.rtol * max(abs(row[best]), abs(row[token]), 1.0):
                return "wrong", what
            tie = tie or what
        return ("tie", tie) if tie else ("", "")
