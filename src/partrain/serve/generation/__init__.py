"""Generative serving: continuous batching of decode steps over a KV cache.

`GenerationEngine` runs one decode step at a time over every running sequence of a
causal language model (`Runner`: the built-in GPT's, or a Hugging Face model's);
`SamplingParams` is what a request asks for. ``partrain serve`` puts it behind the
Open Inference Protocol's generate extension (``/generate``, ``/generate_stream``).
"""

from __future__ import annotations

from .engine import Completion, EngineStats, Event, GenerationEngine, Handle
from .runners import GPTRunner, Runner, runner_for
from .sampling import RequestError, SamplingParams, choose_tokens
from .text import ByteTokenizer, HFTokenizer, TextStream, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "Completion",
    "EngineStats",
    "Event",
    "GPTRunner",
    "GenerationEngine",
    "HFTokenizer",
    "Handle",
    "RequestError",
    "Runner",
    "SamplingParams",
    "TextStream",
    "Tokenizer",
    "choose_tokens",
    "load_tokenizer",
    "runner_for",
]
