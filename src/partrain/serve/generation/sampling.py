"""What a generate request asks for (`SamplingParams`) and how the next token is chosen.

Vocabulary: ``B`` is the running sequences of one decode step, ``V`` the vocabulary.

Choosing is batched over the step's rows, but every random draw comes from the
row's own ``torch.Generator`` (seeded by the request's ``seed``), one uniform number
per token: a seeded request gets the same tokens whatever else shares its steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

DEFAULT_MAX_TOKENS = 16  # as OpenAI's and vLLM's completions: a request that names no length
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1


class RequestError(ValueError):
    """A generate request the server refuses (400): one line saying what was expected."""


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt.

    ``max_tokens``: new tokens at most (None: `DEFAULT_MAX_TOKENS`, fewer where the
    context ends first). ``temperature`` 0 is greedy (the most likely token, no draw);
    otherwise logits are divided by it and ``top_k`` (0: off) and ``top_p`` (1: off,
    the smallest set of most likely tokens whose probability reaches ``top_p``) cut the
    distribution before the draw. ``seed`` makes the draws reproducible. Generation
    ends at ``max_tokens``, at the context's end, at a ``stop`` string (left out of the
    answer) or at one of ``stop_token_ids`` (the tokenizer's end-of-text, unless
    ``ignore_eos``).
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")

    def __post_init__(self) -> None:
        _int_at_least("max_tokens", self.max_tokens, 1, none_ok=True)
        _number_in("temperature", self.temperature, 0.0, math.inf, "a number >= 0 (0: greedy)")
        _number_in("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1]", open_low=True)
        _int_at_least("top_k", self.top_k, 0)
        if self.seed is not None:
            _int_at_least("seed", self.seed, 0)
            if self.seed > MAX_SEED:
                raise RequestError(f"Expected a seed in [0, 2**63). Received: seed={self.seed}")
        if not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"Expected stop as a non-empty string or a list of at most {MAX_STOP_STRINGS} of them. "
                               f"Received: stop={list(self.stop)!r}")
        for t in self.stop_token_ids:
            _int_at_least("stop_token_ids", t, 0)
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"Expected ignore_eos as true or false. Received: ignore_eos={self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SamplingParams:
        """The parameters of a JSON request (unknown keys are refused: a typo must not pass)."""
        unknown = sorted(set(obj) - set(cls.KEYS))
        if unknown:
            raise RequestError(f"Expected generation parameters among {', '.join(cls.KEYS)}. Received: "
                               f"{', '.join(map(repr, unknown))}")
        kwargs = {k: v for k, v in obj.items() if v is not None}  # null: the default
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = (kwargs["stop"],)
        for key in ("stop", "stop_token_ids"):
            if key in kwargs:
                kwargs[key] = _sequence(key, kwargs[key])
        return cls(**kwargs)


def _sequence(name: str, value: Any) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise RequestError(f"Expected {name} as a list. Received: {name}={value!r}")
    return tuple(value)


def _int_at_least(name: str, value: Any, low: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"Expected {name} as an integer >= {low}. Received: {name}={value!r}")


def _number_in(name: str, value: Any, low: float, high: float, what: str, open_low: bool = False) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > low if open_low else value >= low) and value <= high)
    if not ok:
        raise RequestError(f"Expected {name} as {what}. Received: {name}={value!r}")


def make_generator(seed: int | None, fallback: torch.Generator) -> torch.Generator:
    """The request's own generator: seeded by ``seed``, else by a draw from ``fallback``."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, MAX_SEED, (), generator=fallback)))
    return g


def choose_tokens(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> list[int]:
    """The next token of each row of ``logits`` [B, V] as its row's ``params`` ask.

    Greedy rows take the argmax. Sampling rows draw one uniform number each from their
    own generator and pick by the cumulative probabilities (inverse transform): the
    arithmetic is per row, so a row's choice does not depend on the others.
    """
    chosen = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return chosen
    x = logits[rows].to(torch.float64)
    x = x / torch.tensor([params[i].temperature for i in rows], dtype=torch.float64)[:, None]
    order = None
    if any(params[i].top_k or params[i].top_p < 1.0 for i in rows):
        # sorted, most likely first: top-k keeps a prefix of k, top-p the shortest prefix reaching p
        x, order = x.sort(dim=-1, descending=True)
        probs = torch.softmax(x, dim=-1)
        rank = torch.arange(x.shape[-1])
        keep = torch.ones_like(probs, dtype=torch.bool)
        for r, i in enumerate(rows):
            p = params[i]
            if p.top_k:
                keep[r] &= rank < p.top_k
            if p.top_p < 1.0:
                before = probs[r].cumsum(0) - probs[r]  # probability of the tokens ranked above
                keep[r] &= before < p.top_p
        probs = probs * keep
    else:
        probs = torch.softmax(x, dim=-1)
    cumulative = probs.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=generators[i]) for i in rows])
    target = (u * cumulative[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cumulative, target, right=True).squeeze(1).clamp(max=x.shape[-1] - 1)
    if order is not None:
        picked = order.gather(1, picked[:, None]).squeeze(1)
    for i, token in zip(rows, picked.tolist()):
        chosen[i] = token
    return chosen
