"""What `fit` checks and decides in the calling process, before any worker starts.

Every input error the caller's process can see is one line here, not a failure in a
worker: the data and the model (run together on two samples, labels against the
model's classes), the loss and metrics, the output directory (a file, an existing run),
the checkpoint to resume and whether it leaves anything to train. It also records what
makes a run servable and repeatable: the model spec (when ``model_fn`` is an importable
``module:function``) and ``config.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from .._tree import map_tensors
from ..batch import describe, split_batch
from ..data.bucketing import lengths_of
from ..data.datasets import DataSpec, load_dataset, preprocessing
from ..data.generated import Generated
from ..data.pipeline import collate
from ..errors import UsageError, first_line
from ..files import RUN_FILES, numbered_dir
from ..nn.partial import on_meta
from .config import FitConfig
from .task import OwnLossOnMeta, Task

DataArg = DataSpec | str | Callable[[], Any] | tuple[Dataset, Dataset]


def resolve_data(data: DataArg, test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset | None]:
    """``(train, test)`` from a name, a `DataSpec`, a ``(train, test)`` pair of datasets, an
    ``(x, y)`` pair of arrays or tensors (Keras' and scikit-learn's way), or a function
    returning a pair or one dataset (one dataset or ``(x, y)`` is split ``test_fraction``
    for evaluation)."""
    if isinstance(data, (DataSpec, str)):
        return load_dataset(data)
    if isinstance(data, tuple) and len(data) == 2 and _is_array(data[0]) and _is_array(data[1]):
        return _split_one(arrays_dataset(*data), test_fraction, seed)
    if isinstance(data, tuple) and len(data) == 2:
        if not all(d is None or isinstance(d, Dataset) for d in data):
            raise UsageError("Expected data as (train, test) datasets or (x, y) arrays. Received: a pair of "
                             f"{type(data[0]).__name__} and {type(data[1]).__name__}")
        return data
    if isinstance(data, Dataset):
        return _split_one(data, test_fraction, seed)
    if callable(data):
        out = data()
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Dataset):
            return out
        if isinstance(out, Dataset):
            return _split_one(out, test_fraction, seed)
        raise UsageError(f"Expected the data function to return a Dataset or a (train, test) pair. "
                         f"Received: {describe(out)}")
    raise UsageError("Expected data as a dataset name, DataSpec, a Dataset, (train, test) or a function. "
                     f"Received: {type(data).__name__}")


def _is_array(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) or type(obj).__module__ == "numpy" and hasattr(obj, "shape")


def arrays_dataset(x: Any, y: Any) -> TensorDataset:
    """``(x, y)`` arrays or tensors as a dataset: float32 inputs (float64 stays float64; 1-D
    ``x`` is one feature per sample); integer targets are class labels (int64), floating ones
    values to predict."""
    try:
        xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    except (TypeError, ValueError, RuntimeError) as exc:  # object or string arrays
        raise UsageError(f"Expected numeric arrays or tensors x and y. Received: {first_line(exc)}") from None
    if xt.dim() < 1 or yt.dim() < 1 or len(xt) != len(yt):
        raise UsageError(f"Expected x shaped (N, ...) and y shaped (N, ...). Received: x {tuple(xt.shape)}, "
                         f"y {tuple(yt.shape)}")
    if xt.dtype == torch.bool or xt.is_complex():
        raise UsageError(f"Expected numeric inputs x. Received dtype {xt.dtype}")
    dtype = torch.float64 if xt.dtype == torch.float64 else torch.float32  # float64 stays (exact tests)
    xt = (xt.unsqueeze(1) if xt.dim() == 1 else xt).to(dtype)
    yt = yt.to(dtype) if yt.is_floating_point() else yt.long()
    return TensorDataset(xt, yt)


def _split_one(ds: Dataset, test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    from ..data.datasets import split_dataset

    return split_dataset(ds, test_fraction, seed)


def first_batch(ds: Dataset, collate_fn: Callable[[list], Any] | None = None, n: int = 2) -> Any:
    """A small batch of the first samples, as the loop would batch them."""
    if isinstance(ds, Generated):  # whole batches: the generator's first one
        return ds.first()
    count = min(n, len(ds))  # type: ignore[arg-type]
    if count == 0:
        raise UsageError("Expected a training set with at least one sample. Received: an empty dataset")
    if isinstance(ds, TensorDataset) and collate_fn is None:
        return tuple(t[:count] for t in ds.tensors)
    return collate([ds[i] for i in range(count)], collate_fn)


def check_finite(ds: Dataset | None, which: str, data_name: str = "dataset") -> None:
    """One line when an in-memory dataset holds NaN or infinite values: a run on them trains or
    evaluates on nothing meaningful (fit checks the training set under ``on_nan="stop"`` and the
    test set unless ``on_nan="off"``)."""
    if not isinstance(ds, TensorDataset):  # samples read on demand: the NaN policy watches the loss
        return
    for i, t in enumerate(ds.tensors):
        if not t.is_floating_point() or t.numel() == 0:
            continue
        bad = ~torch.isfinite(t.reshape(len(t), -1)).all(dim=1)
        if not bool(bad.any()):
            continue
        part = ("targets" if i == len(ds.tensors) - 1 else "inputs") if len(ds.tensors) == 2 else f"tensor {i}"
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        remedy = ("on_nan='skip' / --on-nan skip skips the steps they reach" if which == "training" else
                  "on_nan='off' / --on-nan off evaluates on them anyway")
        values = " and ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "infinite")) if n)
        raise UsageError(f"Expected finite values in the {which} set's {part}. Received: {data_name} with "
                         f"{values} value{'s' * (nan + inf != 1)} in {int(bad.sum())} of {len(t)} samples (the "
                         f"first at sample {int(bad.nonzero()[0])}; {remedy})")


def check_sizes(train_ds: Dataset, test_ds: Dataset | None, workers: int | None, data_name: str = "dataset") -> None:
    """One line when every worker cannot get a training sample, or a test set was given empty
    (its figures would be NaN in every epoch line). ``workers``: data-parallel workers, when known."""
    n = len(train_ds)  # type: ignore[arg-type]
    if workers is not None and n < workers:
        raise UsageError(f"Expected at least one training sample per worker ({workers}). Received: {data_name} "
                         f"with {n} training sample{'s' * (n != 1)} (fewer workers, or more data)")
    if test_ds is not None and len(test_ds) == 0:  # type: ignore[arg-type]
        raise UsageError(f"Expected a test set of at least one sample (or none). Received: {data_name} with an "
                         "empty test set (a larger test fraction or dataset, or test set None)")


def warn_one_step_epochs(train_ds: Dataset, samples_per_epoch: int | None, batch: int, workers: int) -> None:
    """One line on stderr when an epoch holds less than one global batch: every epoch is then one
    optimizer step on fewer samples than the batch size asks for (training still means something:
    full-batch descent, so the run goes on)."""
    n = samples_per_epoch or len(train_ds)  # type: ignore[arg-type]
    global_batch = batch * workers
    if n < global_batch:
        print(f"partrain: an epoch holds {n:,} training samples, less than one global batch ({batch:,} per worker x "
              f"{workers} = {global_batch:,}): every epoch is one step on {n:,} samples (a smaller batch size gives "
              "more steps)", file=sys.stderr, flush=True)


def all_targets(ds: Dataset, task: Task) -> torch.Tensor | None:
    """Every target of an in-memory dataset (for the label range check), else None."""
    if isinstance(ds, TensorDataset) and task.collate_fn is None and len(ds.tensors) >= 2:
        return ds.tensors[-1]
    return None


def check_model_takes(model: nn.Module, ds: Dataset, model_name: str = "model", data_name: str = "dataset",
                      task: Task | None = None) -> Task:
    """One clear line when the model, the data and the loss do not fit together.

    Runs the model on two samples, computes the loss and metrics, and checks class labels
    against the model's outputs. Returns the task, resolved (``"auto"`` made concrete).

    A model on the meta device (`on_meta`: what the caller builds for a strategy whose processes
    each hold a part) runs on the samples' shapes: shapes, dtypes, the loss and the label range
    are checked, no value computed. A model whose forward needs values (``.item()``, an operator
    without a meta kernel) is then left to the workers' first step; one that returns a loss of its
    own raises `OwnLossOnMeta` (adopting it reads values: the caller builds the model for real).
    """
    task = task or Task()
    batch = first_batch(ds, task.collate_fn)
    task.resolve(batch)
    was_training = model.training
    meta = on_meta(model)
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            task.check(model, map_tensors(batch, lambda t: t.to("meta")) if meta else batch, all_targets(ds, task))
    except (UsageError, OwnLossOnMeta):
        raise
    except Exception as exc:
        if meta and "meta" in str(exc).lower():
            return task  # values needed: the workers' first step is the check
        inputs, _ = split_batch(batch, task.target_key)
        raise UsageError(f"Expected samples that {model_name} can take. Received: {data_name} with inputs "
                         f"{describe(inputs)} ({first_line(exc)[:300]})") from None
    finally:
        model.train(was_training)
    return task


# ----- the run directory -----------------------------------------------------------------
def check_run_dir(out: str, *, resume: bool, overwrite: bool, label: str = "out_dir",
                  run_files: tuple[str, ...] = RUN_FILES) -> None:
    """``out`` is (or becomes) a writable directory holding no other run, unless resumed or
    overwritten (then the run's files go). One line naming ``label`` when not."""
    if not str(out).strip():
        raise UsageError(f"Expected {label} to name a directory. Received: an empty string")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"Expected {label} to be a directory. Received: {out!r}, which is a file")
    existing = [f for f in run_files if os.path.exists(os.path.join(out, f))]
    if existing and not resume and not overwrite:
        raise UsageError(f"Expected a new output directory (or resume / overwrite). Received: {out!r}, which "
                         f"holds a run ({', '.join(existing)})")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"Expected {label} to be a directory that can be created. Received: {out!r} "
                         f"({exc.strerror or exc})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"Expected a writable {label}. Received: {out!r} (not writable)")
    if existing and overwrite and not resume:
        for name in existing:  # a sharded checkpoint is a directory
            path = os.path.join(out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        shutil.rmtree(os.path.join(out, "tensorboard"), ignore_errors=True)


def check_resume(cfg: FitConfig, ckpt: dict[str, Any], path: str, auto: bool) -> bool:
    """True when the checkpoint leaves something to train; one line (or a note, for
    ``resume="auto"``, which is idempotent by choice) when it does not."""
    epoch, step = int(ckpt.get("epoch", 0)), int(ckpt.get("step", 0))
    done_epochs = epoch >= cfg.epochs
    done_steps = cfg.max_steps is not None and step >= cfg.max_steps
    if not (done_epochs or done_steps):
        return True
    why = (f"epoch {epoch} of epochs={cfg.epochs}" if done_epochs
           else f"step {step} of max_steps={cfg.max_steps}")
    if auto:
        if not cfg.quiet:
            print(f"partrain: {path} is already at {why}: nothing to train", flush=True)
        return False
    more = f"epochs above {epoch}" if done_epochs else f"max_steps above {step}"
    raise UsageError(f"Expected {more} to train on from {path!r}. Received: a checkpoint at {why}, "
                     "which leaves nothing to train")


# ----- what makes a run servable and repeatable ------------------------------------------
def infer_model_spec(model_fn: Callable[[], nn.Module], train_ds: Dataset, task: Task, data: Any,
                     collate_fn: Any = None) -> dict[str, Any] | None:
    """``{"name": "module:function", "kwargs", "path", "input_shape", ...}`` when ``model_fn``
    is a module-level function (or a ``functools.partial`` of one with JSON-able keywords),
    else None: `partrain serve` can then rebuild the model from the checkpoint alone."""
    fn, kwargs = model_fn, {}
    if isinstance(model_fn, functools.partial):
        if model_fn.args:
            return None
        fn, kwargs = model_fn.func, dict(model_fn.keywords)
    qualname, module_name = getattr(fn, "__qualname__", ""), getattr(fn, "__module__", None)
    if not module_name or not qualname or "." in qualname or "<" in qualname:
        return None
    try:
        json.dumps(kwargs)
    except TypeError:
        return None
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = os.path.dirname(os.path.abspath(file))
    if module_name == "__main__":
        module_name = os.path.splitext(os.path.basename(file))[0]
        if not module_name.isidentifier():
            return None
    else:
        for _ in range(module_name.count(".") + (os.path.basename(file) == "__init__.py")):
            path = os.path.dirname(path)
    spec: dict[str, Any] = {"name": f"{module_name}:{qualname}", "kwargs": kwargs, "path": path,
                            "task": task.kind}
    spec.update(data_spec_fields(train_ds, task, data, collate_fn))
    return spec


def _several_inputs(inputs: Any, ragged: bool) -> list[dict[str, Any]] | None:
    """A model's several inputs as a spec records them (``partrain serve`` rebuilds its inputs from
    it): each one's name (a dict batch's key: the model takes them by keyword; None for a tuple,
    taken in order), one sample's shape and dtype. In a dataset of sequences (``lengths``) the
    first dim of an input with one is the time: any size (-1)."""
    if isinstance(inputs, Mapping):
        items = list(inputs.items())
    elif isinstance(inputs, (tuple, list)):
        items = [(None, t) for t in inputs]
    else:
        return None
    if not items or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for _, t in items):
        return None
    return [{"name": name, "shape": [-1 if ragged and d == 0 else n for d, n in enumerate(t.shape[1:])],
             "dtype": str(t.dtype).removeprefix("torch.")} for name, t in items]


def data_spec_fields(train_ds: Dataset, task: Task, data: Any, collate_fn: Any = None) -> dict[str, Any]:
    """What a model spec says about the inputs: their shape, and preprocessing to apply to raw ones."""
    out: dict[str, Any] = {}
    inputs, _ = split_batch(first_batch(train_ds, collate_fn), task.target_key)
    if isinstance(inputs, Mapping) and len(inputs) == 1:  # the model takes it as its one argument
        inputs = next(iter(inputs.values()))
    if isinstance(inputs, torch.Tensor):
        out["input_shape"] = list(inputs.shape[1:])
    elif several := _several_inputs(inputs, ragged=lengths_of(train_ds) is not None):
        out["inputs"] = several
    pre = preprocessing(data)
    if pre is not None:
        out["preprocess"] = pre
    return out


def describe_callable(fn: Any) -> Any:
    """A JSON-able account of a factory (``functools.partial`` keywords included)."""
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        return {"function": describe_callable(fn.func), "args": [repr(a) for a in fn.args],
                "keywords": json.loads(json.dumps(fn.keywords, default=repr))}
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def describe_data(data: Any) -> Any:
    """The data as config.json records it: a spec's fields, a name, or what each part of a pair is."""
    if isinstance(data, DataSpec):
        return {f.name: (list(v) if isinstance(v := getattr(data, f.name), tuple) else v)
                for f in dataclasses.fields(data)}
    if isinstance(data, str):
        return data
    if isinstance(data, tuple):
        return [None if d is None else f"{type(d).__name__} of {len(d)} samples" for d in data]
    return describe_callable(data)


def write_config(path: str, settings: dict[str, Any]) -> None:
    """``config.json``, atomically."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(settings, f, indent=2, default=repr)
    os.replace(tmp, path)


__all__ = ["RUN_FILES", "check_model_takes", "check_resume", "check_run_dir", "collate",
           "first_batch", "infer_model_spec", "numbered_dir", "resolve_data", "write_config"]
