"""Causal language models as ``partrain serve`` loads them: which module generates, with
what context and tokenizer, and the factory of its `GenerationEngine`.

A causal language model (partrain's built-in GPT, from a checkpoint or a factory, or a
Hugging Face one from a ``save_pretrained`` directory) is served twice: logits on
``infer`` and generation on ``generate`` / ``generate_stream``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ...errors import UsageError, error_line, first_line
from .engine import GenerationEngine
from .text import Tokenizer


class LanguageModel:
    """A causal language model to generate with: the module a runner drives (`runner_for`), its
    context (longest sequence) and tokenizer (None: token ids only); ``logits`` is what ``infer`` serves."""

    def __init__(self, model: nn.Module, context: int, tokenizer: Tokenizer | None,
                 logits: nn.Module | None = None) -> None:
        self.model = model
        self.context = context
        self.tokenizer = tokenizer
        self.logits = logits if logits is not None else CausalLMLogits(model) if is_hf_causal_lm(model) else model


class CausalLMLogits(nn.Module):
    """A Hugging Face causal LM as ``infer`` serves it: token ids [N, T] -> FP32 logits [N, T, V]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits.float()


def gpt_language_model(module: nn.Module, tokenizer: str | None) -> LanguageModel | None:
    """The built-in GPT as a `LanguageModel` (its tokenizer as its checkpoint names it), else None."""
    from ...models.gpt import GPT
    from .text import load_tokenizer

    if not isinstance(module, GPT):
        return None
    return LanguageModel(module, module.block_size, load_tokenizer(tokenizer, module.vocab_size))


def is_hf_causal_lm(module: Any) -> bool:
    """A Hugging Face model with a language-modelling head (what ``AutoModelForCausalLM`` builds)."""
    if not (isinstance(module, nn.Module) and type(module).__module__.startswith("transformers.")):
        return False
    head = getattr(module, "get_output_embeddings", None)
    return callable(head) and head() is not None


def context_of(config: Any, source: str) -> int:
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    raise UsageError(f"Expected the config of {source!r} to give the longest sequence (max_position_embeddings or "
                     f"n_positions). Received: neither")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def hf_causal_lm(directory: str) -> LanguageModel:
    """The Hugging Face causal LM saved in ``directory`` (``save_pretrained``), in eval mode, with its
    tokenizer when one is saved there. Local files only; one line for anything else."""
    from ...extras import require
    from .text import HFTokenizer

    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise UsageError(f"Expected a directory holding a Hugging Face causal language model (config.json and "
                         f"weights, as save_pretrained writes them). Received: {directory!r} without config.json")
    require("hf")
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"Expected a Hugging Face causal language model in {directory!r} (a config of a model "
                         f"with a language-modelling head, and its weights). Received: {first_line(exc)}") from None
    model.eval()
    has_tokenizer = any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES)
    return LanguageModel(model, context_of(model.config, directory), HFTokenizer(directory) if has_tokenizer else None)


def engine_factory(name: str, lm: LanguageModel, options: Mapping[str, Any]) -> Callable[[], GenerationEngine]:
    """The factory of ``lm``'s `GenerationEngine` (one per app); built once here to check ``options``."""
    from .runners import runner_for

    def build() -> GenerationEngine:
        return GenerationEngine(runner_for(lm.model), lm.tokenizer, name=name, **options)

    try:
        build()
    except ValueError as exc:  # a cache budget below one sequence, a bad option
        raise UsageError(f"{first_line(exc)} (model {name!r}: --kv-cache-mb, --max-running, "
                         f"--max-prefill-tokens)") from None
    except (TypeError, NotImplementedError) as exc:  # a model no runner drives
        raise UsageError(f"Expected model {name!r} to be a causal language model partrain can generate with. "
                         f"Received: {error_line(exc)}") from None
    return build
