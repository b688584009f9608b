"""Activation checkpointing of a model's repeated blocks: memory for compute.

A transformer keeps every block's activations from the forward pass until the backward
pass needs them; for long sequences they outgrow the parameters. Checkpointing a block
keeps only its input and recomputes the rest during the backward pass (about one more
forward pass of compute). `fit(..., activation_checkpointing=True)` does it for every
block of the model's repeated-block lists (a ``ModuleList`` or ``Sequential`` of two or
more modules of one class with parameters: a GPT's ``blocks``, Hugging Face's
``transformer.h`` / ``model.layers``, through the model's own ``gradient_checkpointing_enable``
there); a class name, or a list of them, picks the modules instead. The numbers do not change (the recomputation is the same arithmetic), parameter
names do not change (checkpoints and resume are unaffected).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .._compat import checkpoint_activations
from ..errors import UsageError

Spec = bool | str | Sequence[str]


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module in the model's lists of repeated blocks."""
    found: list[tuple[str, nn.Module]] = []
    for name, holder in model.named_modules():
        if not isinstance(holder, (nn.ModuleList, nn.Sequential)) or len(holder) < 2:
            continue
        kinds = {type(m) for m in holder}
        if len(kinds) == 1 and any(True for _ in holder[0].parameters()) and not isinstance(holder[0], nn.Linear):
            if any(name.startswith(f"{outer}.") for outer, _ in found):
                continue  # inside a block already taken: the outer one recomputes it
            found += [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(holder)]
    return found


def blocks_to_checkpoint(model: nn.Module, spec: Spec) -> list[tuple[str, nn.Module]]:
    """The modules ``spec`` names (True: the repeated blocks); one line when there are none."""
    if spec is True:
        blocks = repeated_blocks(model)
        what = "repeated blocks (a ModuleList or Sequential of two or more modules of one class)"
    else:
        names = {spec} if isinstance(spec, str) else set(spec)
        blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in names]
        what = f"modules of class {', '.join(sorted(names))}"
    if not blocks:
        raise UsageError(f"Expected {what} in {type(model).__name__} for activation_checkpointing. Received: none; "
                         "pass a block's class name (activation_checkpointing='Block')")
    return blocks


def checkpoint_blocks(model: nn.Module, spec: Spec) -> list[str]:
    """Checkpoint the activations of the blocks ``spec`` names in place; returns their names."""
    if spec is False or spec is None:
        return []
    blocks = blocks_to_checkpoint(model, spec)
    if spec is True and getattr(model, "supports_gradient_checkpointing", False):
        # a Hugging Face model checkpoints its own layers (it turns its key-value cache off
        # for the recomputation, which a hook from outside would see appended twice)
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5's name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return [name for name, _ in blocks]
    for _, module in blocks:
        checkpoint_activations(module)
    return [name for name, _ in blocks]
