"""Everything ``partrain population`` checks in the parent, before any process starts.

A population spread over processes that meets bad input inside a worker fails
late (after the spawn, seconds of imports) and, worse, on one process while
its peers wait in a collective: what reaches the user may be a peer's echo of
the broken connection rather than the cause. So every input the parent can
check is checked here, once, in the caller's process: the data (loaded once
and handed to the workers as tensors), the model against a sample of it, the
search space against the optimizer, the training length, PBT's knobs and, on
``--resume``, every process's checkpoint against the command line.

`prepare` returns a `Prepared`: the tensors and the few numbers the workers need.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ..data.datasets import DataSpec, load_dataset
from ..errors import UsageError
from ..models import MODELS, build_model, model_kwargs_for
from .functional_optim import make_optimizer
from .pbt import PBT
from .population import EXTRA_HPARAMS, FORMAT, Population
from .space import Spec, choice, loguniform, parse_space_entry, randint, uniform

DEFAULT_STEPS = 300
VAL_FRACTION = 0.2
#: config keys a resumed run must repeat (they define the members and their data), with
#: their values in checkpoints written before the key existed
SAME_ON_RESUME = {"members": None, "workers": 1, "optimizer": None, "nesterov": False, "model": None,
                  "seed": None, "dataset": "digits", "test_fraction": 0.2, "synthetic_samples": 4096,
                  "synthetic_shape": [1, 8, 8], "synthetic_classes": 10}
OPTION = {"members": "--members", "workers": "--workers", "optimizer": "--optimizer", "nesterov": "--nesterov",
          "model": "--model", "seed": "--seed", "dataset": "--dataset", "test_fraction": "--test-fraction",
          "synthetic_samples": "--synthetic-samples", "synthetic_shape": "--synthetic-shape",
          "synthetic_classes": "--synthetic-classes"}


@dataclass
class Prepared:
    """What the workers need, checked: data splits as tensors, model options, lengths."""

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    shape: list[int]
    classes: int
    model_kwargs: dict[str, Any]
    steps: int
    eval_interval: int


def prepare(cfg: dict[str, Any]) -> Prepared:
    """Check everything the parent can (one `UsageError` line each); load the data once."""
    check_out(cfg["out"], cfg["resume"], cfg.get("overwrite", False))
    train, val, test = load_splits(cfg)
    shape, classes = list(train.tensors[0].shape[1:]), class_count(train, val, test)
    name = cfg["model"]
    kwargs = model_kwargs_for(name, tuple(shape), classes) if name in MODELS else {}
    # torch's warnings about this model (e.g. a zero-size layer) would come before the line that
    # says why it cannot take the data: hold them back, and show them only if it can
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model(name, **kwargs)
        check_model_output(model, train, classes, name, cfg["dataset"])
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    space = dict(parse_space_entry(e) for e in cfg["space_args"])
    check_space(space, cfg["optimizer"], cfg["nesterov"], model, len(train))
    if cfg["batch_size"] > len(train):
        raise UsageError(f"Expected --batch-size <= {len(train)} (the training samples after holding out "
                         f"validation). Received: --batch-size {cfg['batch_size']}")
    steps = total_steps(cfg, len(train))
    eval_interval = cfg["eval_interval"] or (cfg["pbt_interval"] or max(1, steps // 10))
    if cfg["pbt_interval"]:
        if cfg["pbt_interval"] % eval_interval:
            raise UsageError(f"Expected --pbt-interval to be a multiple of --eval-interval. Received: "
                             f"--pbt-interval {cfg['pbt_interval']}, --eval-interval {eval_interval}")
        PBT(space, interval=cfg["pbt_interval"], quantile_fraction=cfg["quantile_fraction"],
            perturbation_factors=cfg["perturbation_factors"], resample_probability=cfg["resample_probability"])
    if cfg["resume"]:
        check_resume(cfg, model, space, steps)
    return Prepared(train, val, test, shape, classes, kwargs, steps, eval_interval)


#: files a population run writes: their presence means ``--out`` holds a run
RUN_FILES = ("population.pt", "leaderboard.csv", "history.csv", "best.pt", "curves.png")


def check_out(out: str, resume: bool = False, overwrite: bool = False) -> None:
    """``--out`` must be (or become) a writable directory holding no other run (unless resumed
    or overwritten)."""
    from ..train.prepare import check_run_dir

    check_run_dir(out, resume=resume, overwrite=overwrite, label="--out", run_files=RUN_FILES)


# ------------------------------------------------------------------------------------ data

def load_splits(cfg: dict[str, Any]) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """(train, validation, test) as tensors: the dataset's test split, and its train split
    split again (`VAL_FRACTION` held out for PBT's scores and the ranking)."""
    spec = DataSpec(name=cfg["dataset"], samples=cfg["synthetic_samples"], shape=tuple(cfg["synthetic_shape"]),
                    classes=cfg["synthetic_classes"], test_fraction=cfg["test_fraction"], seed=cfg["seed"])
    train_ds, test_ds = load_dataset(spec)
    where = f"dataset {cfg['dataset']!r}"
    train = as_tensors(train_ds, f"{where} (train split)")
    test = as_tensors(test_ds, f"{where} (test split)")
    if len(train) < 2 or len(test) < 1:
        raise UsageError(f"Expected at least 2 training samples and 1 test sample in {where}. Received: "
                         f"{len(train)} and {len(test)}")
    if train.tensors[0].shape[1:] != test.tensors[0].shape[1:]:
        raise UsageError(f"Expected train and test samples of one shape in {where}. Received: "
                         f"{tuple(train.tensors[0].shape[1:])} and {tuple(test.tensors[0].shape[1:])}")
    train, val = split_validation(train, VAL_FRACTION, cfg["seed"])
    return train, val, test


def as_tensors(ds: Dataset, where: str) -> TensorDataset:
    """A dataset of ``(input, class label)`` samples as one float32 input tensor and int64 labels.

    A population indexes its members' batches out of tensors in memory, so any other
    ``Dataset`` is read once, sample by sample.
    """
    if isinstance(ds, TensorDataset) and len(ds.tensors) >= 2:
        x, y = ds.tensors[0], ds.tensors[1]
    else:
        try:
            n = len(ds)  # type: ignore[arg-type]
            samples = [ds[i] for i in range(n)]
        except Exception as exc:
            raise UsageError(f"Expected a dataset with len() and indexing in {where}. Received: "
                             f"{type(ds).__name__} ({type(exc).__name__}: {exc})") from None
        if not samples or not all(isinstance(s, (tuple, list)) and len(s) == 2 for s in samples):
            kind = type(samples[0]).__name__ if samples else "no samples"
            raise UsageError(f"Expected (input, class label) samples in {where}. Received: {kind}")
        try:
            x = torch.stack([torch.as_tensor(s[0]) for s in samples])
            y = torch.stack([torch.as_tensor(s[1]) for s in samples])
        except Exception as exc:
            raise UsageError(f"Expected samples of one shape in {where}. Received: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or len(x) != len(y):
        raise UsageError(f"Expected inputs shaped (N, ...) and one label per input in {where}. Received: "
                         f"inputs {tuple(getattr(x, 'shape', ()))}, labels {tuple(y.shape)}")
    if not (x.is_floating_point() or x.dtype in _INTEGER_DTYPES or x.dtype == torch.bool):
        raise UsageError(f"Expected real-valued inputs in {where}. Received dtype {x.dtype}")
    return TensorDataset(x.to(torch.float32), class_labels(y, where))


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def class_labels(y: torch.Tensor, where: str) -> torch.Tensor:
    """Integer class labels (int64), or one line saying why these targets are not labels."""
    if y.is_floating_point() or y.is_complex():
        raise UsageError(f"Expected integer class labels: partrain population trains classifiers "
                         f"(cross-entropy) and does not support regression targets. Received: {y.dtype} "
                         f"targets in {where}")
    if y.dtype not in _INTEGER_DTYPES and y.dtype != torch.bool:
        raise UsageError(f"Expected integer class labels in {where}. Received dtype {y.dtype}")
    if y.dim() != 1:
        raise UsageError(f"Expected one class label per sample (labels shaped (N,)) in {where}. Received: "
                         f"labels shaped {tuple(y.shape)}")
    y = y.to(torch.int64)
    if len(y) and int(y.min()) < 0:
        raise UsageError(f"Expected class labels >= 0 in {where}. Received: {int(y.min())}")
    return y


def class_count(*splits: TensorDataset) -> int:
    """Number of classes: the largest label of any split, plus one."""
    return max(int(s.tensors[1].max()) for s in splits if len(s)) + 1


def split_validation(train: TensorDataset, fraction: float, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Hold out ``fraction`` of the training set for PBT's scores (the test set stays unseen)."""
    x, y = train.tensors[:2]
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + 17))
    n_val = max(1, int(round(len(x) * fraction)))
    return TensorDataset(x[perm[n_val:]], y[perm[n_val:]]), TensorDataset(x[perm[:n_val]], y[perm[:n_val]])


# ----------------------------------------------------------------------------------- model

def check_model_output(model: nn.Module, train: TensorDataset, classes: int, name: str, dataset: str) -> None:
    """The model takes two training samples and returns class scores for every label."""
    from ..train.prepare import check_model_takes

    check_model_takes(model, train, f"model {name!r}", f"dataset {dataset!r}")
    model.eval()
    with torch.no_grad():
        out = model(train.tensors[0][:2])
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[1] < classes:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UsageError(f"Expected model {name!r} to return class scores shaped (batch, {classes}) for the "
                         f"{classes} classes of dataset {dataset!r}. Received: {got}")


# ----------------------------------------------------------------------------- search space

def check_space(space: dict[str, Spec], optimizer: str, nesterov: bool, model: nn.Module, n_train: int) -> None:
    """Every ``--space`` name is a hyperparameter of this optimizer; every value it can take is valid."""
    allowed = {**make_optimizer(optimizer, nesterov).defaults, **EXTRA_HPARAMS}
    for name, spec in space.items():
        if name not in allowed:
            raise UsageError(f"Expected --space names among {sorted(allowed)} for --optimizer {optimizer}. "
                             f"Received: {name!r}")
        values = _extremes(spec)
        try:
            Population._check_values(name, torch.tensor(values, dtype=torch.float64))
        except UsageError:
            raise UsageError(f"Expected --space {name} within the values {name} can take ({_RANGES.get(name)}). "
                             f"Received: {_describe(spec)}") from None
        if name == "batch_size" and max(values) > n_train:
            raise UsageError(f"Expected --space batch_size at most {n_train} (the training samples). "
                             f"Received: {_describe(spec)}")
    if "dropout" in space and not any(type(m) is nn.Dropout for m in model.modules()):
        raise UsageError("Expected a model with nn.Dropout layers for --space dropout. Received: a model "
                         "without any")


_RANGES = {"lr": ">= 0", "momentum": ">= 0", "weight_decay": ">= 0", "eps": ">= 0", "beta1": "in [0, 1)",
           "beta2": "in [0, 1)", "dropout": "in [0, 1)", "batch_size": ">= 1"}


def _extremes(spec: Spec) -> list[float]:
    if isinstance(spec, choice):
        return [float(v) for v in spec.values]
    if isinstance(spec, (uniform, loguniform, randint)):
        return [float(spec.low), float(spec.high)]
    return []


def _describe(spec: Spec) -> str:
    from .space import describe

    return describe(spec)


# ------------------------------------------------------------------------------ length

def total_steps(cfg: dict[str, Any], n_train: int) -> int:
    """Steps per member: ``--steps``, or ``--epochs`` at ``--batch-size``, or `DEFAULT_STEPS`."""
    if cfg["steps"] is not None:
        return int(cfg["steps"])
    if cfg["epochs"] is not None:
        return max(1, math.ceil(cfg["epochs"] * n_train / cfg["batch_size"]))
    return DEFAULT_STEPS


# ------------------------------------------------------------------------------ resume

def checkpoint_path(out: str, rank: int) -> str:
    """Process ``rank``'s population checkpoint in ``out``."""
    return os.path.join(out, "population.pt" if rank == 0 else f"population.rank{rank}.pt")


def check_resume(cfg: dict[str, Any], model: nn.Module, space: dict[str, Spec], steps: int) -> None:
    """Every process's checkpoint exists, matches the command line and stopped at the same step."""
    first = checkpoint_path(cfg["out"], 0)
    if not os.path.exists(first):
        raise UsageError(f"Expected a population checkpoint to resume from. Received: {first!r} (no such file)")
    saved = [_read(first)]
    saved_cfg = saved[0].get("config") or {}
    for key, default in SAME_ON_RESUME.items():
        if key.startswith("synthetic_") and cfg["dataset"] != "synthetic":
            continue
        want = saved_cfg.get(key, default)
        if want is not None and _plain(want) != _plain(cfg[key]):
            raise UsageError(f"Expected {OPTION[key]} {_show(want)} as in the saved population ({first}). "
                             f"Received: {OPTION[key]} {_show(cfg[key])}")
    for rank in range(1, cfg["workers"]):
        path = checkpoint_path(cfg["out"], rank)
        if not os.path.exists(path):
            raise UsageError(f"Expected process {rank}'s population checkpoint next to {first!r}. Received: "
                             f"{path!r} (no such file)")
        saved.append(_read(path))
    done = [int(s["population"]["steps"]) for s in saved]
    if len(set(done)) != 1:
        where = ", ".join(f"{os.path.basename(checkpoint_path(cfg['out'], r))} at step {d}"
                          for r, d in enumerate(done))
        raise UsageError(f"Expected every process's population checkpoint at the same step. Received: {where} "
                         f"(a run stopped while saving); resume is not possible from these files")
    if steps <= done[0]:
        raise UsageError(f"Expected --steps (or --epochs) beyond the {done[0]} steps the saved population has "
                         f"trained, for --resume to train further. Received: {steps} steps")
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    got = {n: tuple(t.shape[1:]) for n, t in saved[0]["population"]["params"].items()}
    if params != got:
        raise UsageError(f"Expected the model of the saved population ({first}). Received: --model "
                         f"{cfg['model']!r} with other parameters")
    names = set(saved[0]["population"]["hparams"])
    if not set(space) <= names:
        raise UsageError(f"Expected --space names among the saved population's hyperparameters "
                         f"{sorted(names)}. Received: {sorted(set(space) - names)}")


def _read(path: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise UsageError(f"Expected a readable population checkpoint. Received: {path!r} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not isinstance(state, dict) or not isinstance(state.get("population"), dict) \
            or state["population"].get("format") != FORMAT:
        raise UsageError(f"Expected a population checkpoint (format {FORMAT!r}). Received: {path!r}")
    return state


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)
