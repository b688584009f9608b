"""Datasets by name: the bundled digits, synthetic data, ``.npz`` and ``.csv`` files, text, ``module:function``.

Every loader returns ``(train, test)`` as ``TensorDataset``s of float32 inputs and
targets: int64 class labels, or float32 values for regression (an ``.npz`` whose ``y``
is floating point, a ``module:function`` returning float targets). Text (`load_text`) is
the exception: int64 token ids in, int64 next tokens out. The training loop indexes them
without a DataLoader.

Preprocessing that a loader applies (the digits' scaling) is described by
`preprocessing`, which training records in the model spec so that a served model
takes the raw inputs.
"""

from __future__ import annotations

import importlib.util
import os
import zipfile
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from ..errors import UsageError
from .text import load_text


@dataclass(frozen=True)
class DataSpec:
    """How to build the data: a name plus the options synthetic data takes."""

    name: str = "digits"
    samples: int = 4096
    shape: tuple[int, ...] = (1, 8, 8)
    classes: int = 10
    test_fraction: float = 0.2
    seed: int = 0
    #: a ``.csv`` file's target column, by name (None: the last column)
    target: str | None = None
    #: text: tokens per sample (the model's context)
    block_size: int = 256
    #: text: a Hugging Face tokenizer in the local cache, by name (None: UTF-8 bytes)
    tokenizer: str | None = None

    def load(self) -> tuple[Dataset, Dataset]:
        """The ``(train, test)`` pair, loaded at the first call and kept by this object.

        The caller that checks the data before a run and the worker that runs in its
        process share one load; a pickled copy (a worker process) carries only the
        description and loads again there.
        """
        loaded = self.__dict__.get("_loaded")
        if loaded is None:
            loaded = _load(self)
            object.__setattr__(self, "_loaded", loaded)
        return loaded

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "_loaded"}


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    n_test = max(1, int(round(len(x) * test_fraction))) if test_fraction > 0 else 0
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, real data, offline).

    Inputs are shaped (N, 1, 8, 8), scaled to [0, 1] then standardized.
    """
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - 0.3) / 0.4
    y = torch.tensor(target, dtype=torch.int64)
    return _split(x, y, test_fraction, seed)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' images (N, 8, 8) and labels, read from scikit-learn's own data file.

    Importing ``sklearn.datasets`` (and scipy with it) costs about 2 s of CPU per
    process, and every worker of a run on digits loads them; the file is a CSV of 64
    pixel columns and a label column. Where it is not found (another scikit-learn
    layout), scikit-learn's loader reads it.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as _sk_digits

    bunch = _sk_digits()
    return bunch.images, bunch.target


def synthetic(samples: int = 4096, shape: tuple[int, ...] = (1, 8, 8), classes: int = 10,
              test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A learnable synthetic classification task: Gaussian clusters, one per class."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise UsageError(f"Expected a positive number of synthetic samples. Received: {samples!r}")
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 2:
        raise UsageError(f"Expected at least 2 synthetic classes. Received: {classes!r}")
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, *shape, generator=g)
    y = torch.randint(0, classes, (samples,), generator=g)
    x = centers[y] + 1.5 * torch.randn(samples, *shape, generator=g)
    return _split(x, y, test_fraction, seed)


def load_npz(path: str, test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """An ``.npz`` file with arrays ``x`` (N, ...) and ``y`` (N, ...): integer class labels or float targets."""
    if not os.path.exists(path):
        raise UsageError(f"Expected an existing .npz file with arrays 'x' and 'y'. Received: {path!r} (no such file)")
    if not zipfile.is_zipfile(path):
        raise UsageError(f"Expected {path!r} to be an .npz archive (numpy.savez). Received: a file that is not one")
    try:
        with np.load(path, allow_pickle=False) as f:
            keys = set(f.files)
            if not {"x", "y"} <= keys:
                raise UsageError(f"Expected {path!r} to hold arrays 'x' and 'y'. Received arrays: {sorted(keys)}")
            xa, ya = f["x"], f["y"]
    except UsageError:
        raise
    except Exception as exc:  # zipfile.BadZipFile, ValueError for pickled arrays, ...
        raise UsageError(f"Expected {path!r} to be a readable .npz file. Received: {type(exc).__name__}: {exc}") from None
    if xa.ndim < 2 or ya.ndim < 1 or len(xa) != len(ya):
        raise UsageError(
            f"Expected x shaped (N, ...) and y shaped (N, ...) in {path!r}. Received: x {xa.shape}, y {ya.shape}"
        )
    if not (np.issubdtype(ya.dtype, np.integer) or np.issubdtype(ya.dtype, np.floating)):
        raise UsageError(f"Expected integer class labels or float targets in y of {path!r}. Received dtype {ya.dtype}")
    if not np.issubdtype(xa.dtype, np.number):
        raise UsageError(f"Expected numeric inputs in x of {path!r}. Received dtype {xa.dtype}")
    x = torch.from_numpy(np.ascontiguousarray(xa)).float()
    y = torch.from_numpy(np.ascontiguousarray(ya.astype(np.int64 if np.issubdtype(ya.dtype, np.integer) else np.float32)))
    return _split(x, y, test_fraction, seed)


def load_csv(path: str, target: str | None = None, test_fraction: float = 0.2,
             seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A ``.csv`` file with a header: numeric feature columns and one target column (``target``
    by name; default the last). The target is class labels when its values are integers or
    words (words are numbered in sorted order), else float values to predict (regression).
    Empty cells and cells that are not numbers in a feature column are one line naming the
    row and column."""
    import csv

    if not os.path.exists(path):
        raise UsageError(f"Expected an existing .csv file with a header row. Received: {path!r} (no such file)")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [row for row in csv.reader(f) if any(cell.strip() for cell in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise UsageError(f"Expected {path!r} to be a readable UTF-8 .csv file. Received: {type(exc).__name__}: "
                         f"{exc}") from None
    if len(rows) < 2 or len(rows[0]) < 2:
        raise UsageError(f"Expected {path!r} to hold a header row, at least two columns and at least one row of "
                         f"data. Received: {len(rows)} row(s) of {len(rows[0]) if rows else 0} column(s)")
    header = [h.strip() for h in rows[0]]
    column = len(header) - 1 if target is None else header.index(target) if target in header else None
    if column is None:
        raise UsageError(f"Expected a target column among {header} in {path!r}. Received: target={target!r}")
    features, labels = [], []
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise UsageError(f"Expected {len(header)} cells in every row of {path!r} (the header's). Received: "
                             f"{len(row)} in line {line}")
        values = []
        for i, cell in enumerate(row):
            if i == column:
                continue
            try:
                values.append(float(cell))
            except ValueError:
                raise UsageError(f"Expected numeric features in {path!r}. Received: {cell!r} in line {line}, "
                                 f"column {header[i]!r}") from None
        features.append(values)
        labels.append(row[column].strip())
    x = torch.tensor(features, dtype=torch.float32)
    return _split(x, _csv_target(labels, path, header[column]), test_fraction, seed)


def _csv_target(cells: list[str], path: str, name: str) -> torch.Tensor:
    """Class labels (integers as they are, words numbered in sorted order) or float values."""
    if any(c == "" for c in cells):
        raise UsageError(f"Expected a value in every row of the target column {name!r} of {path!r}. Received: "
                         f"{cells.count('')} empty cell(s)")
    try:
        values = [float(c) for c in cells]
    except ValueError:
        names = sorted(set(cells))
        index = {n: i for i, n in enumerate(names)}
        return torch.tensor([index[c] for c in cells], dtype=torch.int64)
    if all(v.is_integer() and v >= 0 for v in values) and all("." not in c and "e" not in c.lower() for c in cells):
        return torch.tensor([int(v) for v in values], dtype=torch.int64)
    return torch.tensor(values, dtype=torch.float32)


def load_dataset(spec: DataSpec | str) -> tuple[Dataset, Dataset]:
    """Resolve a dataset spec: ``digits``, ``synthetic``, ``path.npz``, ``path.csv``, ``text`` (the
    bundled corpus), ``text:PATH`` (a text file or directory) or ``module:function``
    (a `DataSpec` loads once and keeps the pair: `DataSpec.load`)."""
    return (DataSpec(name=spec) if isinstance(spec, str) else spec).load()


def _load(spec: DataSpec) -> tuple[Dataset, Dataset]:
    name = spec.name
    if spec.target is not None and not name.endswith(".csv"):  # else silently ignored
        raise UsageError(f"Expected a target column by name with a .csv dataset. Received: target={spec.target!r} "
                         f"with dataset {name!r}")
    is_text = name == "text" or name.startswith("text:")
    if spec.tokenizer is not None and not is_text:
        raise UsageError(f"Expected a tokenizer with a text dataset ('text' or 'text:PATH'). Received: "
                         f"tokenizer={spec.tokenizer!r} with dataset {name!r}")
    if is_text:  # before the suffix and module:function checks: text:notes.csv is text
        path = name[len("text:"):] if name != "text" else None
        if path == "":
            raise UsageError("Expected a file or directory after 'text:'. Received: 'text:'")
        return load_text(path, block_size=spec.block_size, tokenizer=spec.tokenizer,
                         test_fraction=spec.test_fraction, seed=spec.seed)
    if name == "digits":
        return load_digits(spec.test_fraction, spec.seed)
    if name == "synthetic":
        return synthetic(spec.samples, spec.shape, spec.classes, spec.test_fraction, spec.seed)
    if name.endswith(".npz"):
        return load_npz(name, spec.test_fraction, spec.seed)
    if name.endswith(".csv"):
        return load_csv(name, spec.target, spec.test_fraction, spec.seed)
    if ":" in name:
        from ..models import resolve_callable

        out = resolve_callable(name, "dataset function")()
        if isinstance(out, tuple) and len(out) == 2:
            return out
        if isinstance(out, Dataset):
            return split_dataset(out, spec.test_fraction, spec.seed)
        raise UsageError(
            f"Expected {name!r} to return a Dataset or a (train, test) pair. Received: {type(out).__name__}"
        )
    raise UsageError(
        f"Expected a dataset among 'digits', 'synthetic', a path ending in .npz or .csv, 'text', 'text:PATH' "
        f"(a text file or directory), or 'module:function'. "
        f"Received: {name!r}"
    )


def split_dataset(ds: Dataset, test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """A held-out share of one dataset for evaluation (the same split for a given seed)."""
    if isinstance(ds, TensorDataset) and len(ds.tensors) == 2:
        return _split(*ds.tensors, test_fraction=test_fraction, seed=seed)
    from torch.utils.data import random_split

    n = len(ds)  # type: ignore[arg-type]
    n_test = int(round(n * test_fraction))
    train, test = random_split(ds, [n - n_test, n_test], generator=torch.Generator().manual_seed(seed))
    return train, test


def sample_shape(ds: Dataset) -> tuple[int, ...]:
    """Shape of one input sample."""
    return tuple(ds[0][0].shape)


def is_regression(ds: Dataset) -> bool:
    """True when the targets are floating point (values to predict, not class labels)."""
    target = ds.tensors[-1] if isinstance(ds, TensorDataset) else torch.as_tensor(ds[0][-1])
    return target.is_floating_point()


def num_classes(ds: Dataset) -> int:
    """Outputs a model needs: the vocabulary size of a dataset that declares one (``vocab_size``:
    text, where the largest id seen is not the vocabulary), classes (max label + 1), or the
    size of one float target."""
    base = ds
    while isinstance(base, Subset):
        base = base.dataset
    vocab_size = getattr(base, "vocab_size", None)
    if vocab_size is not None:
        return int(vocab_size)
    if is_regression(ds):
        target = ds.tensors[-1][0] if isinstance(ds, TensorDataset) else torch.as_tensor(ds[0][-1])
        return max(1, int(target.numel()))
    if isinstance(ds, TensorDataset):
        return int(ds.tensors[-1].max().item()) + 1
    return int(max(int(ds[i][-1]) for i in range(len(ds)))) + 1  # type: ignore[arg-type]


#: what a built-in dataset's loader does to raw inputs: ``x * scale + offset``
_PREPROCESS = {
    "digits": {"scale": 1 / 6.4, "offset": -0.75,
               "raw": "8x8 pixel values 0..16 (scikit-learn digits), scaled as (x/16 - 0.3)/0.4"},
}


def preprocessing(data: object) -> dict | None:
    """The preprocessing a built-in dataset applies to raw inputs, or None."""
    name = data.name if isinstance(data, DataSpec) else data if isinstance(data, str) else None
    entry = _PREPROCESS.get(name) if name else None
    return dict(entry) if entry else None
