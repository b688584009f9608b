"""Built-in models, and resolution of a model spec ("cnn", "gpt", "pkg.mod:factory").

A model spec is what `partrain train --model` takes and what a checkpoint records
so that `partrain serve` and `--resume` can rebuild the module without unpickling
code: ``{"name": str, "kwargs": dict}``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from ..errors import UsageError, error_line
from .gpt import GPT as GPT  # re-exported: partrain.models.GPT
from .gpt import gpt


def cnn(in_channels: int = 1, num_classes: int = 10, image_size: int = 8, width: int = 32) -> nn.Module:
    """A small CNN for 8x8 to 32x32 images (the default for the digits data)."""
    pooled = image_size // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * pooled * pooled, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def bn_cnn(in_channels: int = 1, num_classes: int = 10, image_size: int = 8, width: int = 32) -> nn.Module:
    """The small CNN with BatchNorm after each convolution (for SyncBatchNorm)."""
    pooled = image_size // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * pooled * pooled, num_classes),
    )


def mlp(in_features: int = 64, num_classes: int = 10, hidden: int = 256, depth: int = 2,
        dropout: float = 0.0) -> nn.Module:
    """A multi-layer perceptron; flattens its input first."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def lenet5(in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> nn.Module:
    """LeNet-5 (about 61k parameters at 28x28 input), with ReLU and max pooling."""
    s = ((image_size + 4 - 4) // 2 - 4) // 2  # conv5 pad 2, pool, conv5, pool
    if s < 1:
        raise UsageError(f"Expected images of at least 12x12 for model 'lenet5' (its second 5x5 convolution and "
                         f"pooling need them). Received: {image_size}x{image_size} (model 'cnn' takes 8x8)")
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * s * s, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn": cnn,
    "bn-cnn": bn_cnn,
    "mlp": mlp,
    "lenet5": lenet5,
    "gpt": gpt,
}


def importable_from(directory: str, *, first: bool = False) -> None:
    """Put ``directory`` on ``sys.path`` (at the front with ``first``, else the end) unless there.

    At the end, a recorded directory can add a user's modules but never shadow an
    installed package; the current directory goes first, as ``python -m`` and
    uvicorn put it.
    """
    directory = os.path.abspath(directory)
    if directory in {os.path.abspath(p or os.curdir) for p in sys.path}:
        return
    if first:
        sys.path.insert(0, directory)
    else:
        sys.path.append(directory)
    importlib.invalidate_caches()


def resolve_callable(spec: str, what: str, path: str | None = None) -> Callable[..., Any]:
    """The function ``"package.module:function"`` names.

    The ``partrain`` console script does not put the current directory on ``sys.path``
    (``python -m partrain`` does): it is added here, so that ``mymodel:build`` finds
    ``./mymodel.py`` either way. ``path`` (a checkpoint's ``model_spec["path"]``, the
    directory of the script that trained it) is searched last. Raises `UsageError`, one
    line, when the module is missing or fails to import.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"Expected a {what} as 'module:function'. Received: {spec!r}")
    importable_from(os.getcwd(), first=True)
    if path:
        importable_from(path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name != exc.name and not module_name.startswith(exc.name + "."):
            raise UsageError(f"Expected module {module_name!r} of {what} {spec!r} to import. "
                             f"Received: {type(exc).__name__}: {exc}") from exc  # one of its imports
        where = "the current directory, installed packages" + (f" or {path!r}" if path else "")
        raise UsageError(f"Expected module {module_name!r} of {what} {spec!r} in {where}. "
                         f"Received: no module named {exc.name or module_name!r}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: one line
        raise UsageError(f"Expected module {module_name!r} of {what} {spec!r} to import. "
                         f"Received: {error_line(exc)}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"Expected {spec!r} to name a callable {what}. Received: {type(fn).__name__}")
    return fn


def build_named_model(name: str, kwargs: dict[str, Any], sync_bn: bool = False) -> nn.Module:
    """``build_model(name, **kwargs)``, with SyncBatchNorm when asked: the model factory the
    commands send to their workers (here, not beside the command, so a worker imports no CLI)."""
    model = build_model(name, **kwargs)
    if sync_bn:
        from ..nn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model)
    return model


def build_model(name: str, *, _path: str | None = None, **kwargs: Any) -> nn.Module:
    """Build a model from a built-in name or ``module:function`` (found in ``_path`` too)."""
    if name in MODELS:
        factory = MODELS[name]
    elif ":" in name:
        factory = resolve_callable(name, "model factory", _path)
    else:
        raise UsageError(
            f"Expected a model among {sorted(MODELS)} or 'module:function'. Received: {name!r}"
        )
    try:
        model = factory(**kwargs)
    except TypeError as exc:
        raise UsageError(f"Model {name!r} does not accept options {kwargs}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"Expected model {name!r} to return a torch.nn.Module. Received: {type(model).__name__}")
    return model


def model_kwargs_for(name: str, sample_shape: tuple[int, ...], num_classes: int) -> dict[str, Any]:
    """Shape options a built-in model needs for samples of ``sample_shape``."""
    if name == "mlp":
        n = 1
        for d in sample_shape:
            n *= d
        return {"in_features": n, "num_classes": num_classes}
    if name in ("cnn", "bn-cnn", "lenet5"):
        if len(sample_shape) != 3 or sample_shape[1] != sample_shape[2]:
            raise UsageError(
                f"Model {name!r} expects square images shaped (channels, size, size). "
                f"Received samples of shape {tuple(sample_shape)}"
            )
        return {"in_channels": sample_shape[0], "num_classes": num_classes, "image_size": sample_shape[1]}
    if name == "gpt":  # samples are token ids (block,); num_classes is the vocabulary size
        if len(sample_shape) != 1:
            raise UsageError(f"Model 'gpt' expects samples of token ids shaped (block_size,). "
                             f"Received samples of shape {tuple(sample_shape)}")
        return {"vocab_size": num_classes, "block_size": sample_shape[0]}
    return {}
