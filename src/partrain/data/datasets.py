"""Datasets by name: the bundled digits, synthetic data, ``.npz`` files, ``module:function``.

Every loader returns ``(train, test)`` as ``TensorDataset``s of float32 inputs and
targets: int64 class labels, or float32 values for regression (an ``.npz`` whose ``y``
is floating point, a ``module:function`` returning float targets). The training loop
indexes them without a DataLoader.

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
from torch.utils.data import Dataset, TensorDataset

from ..errors import UsageError


@dataclass(frozen=True)
class DataSpec:
    """How to build the data: a name plus the options synthetic data takes."""

    name: str = "digits"
    samples: int = 4096
    shape: tuple[int, ...] = (1, 8, 8)
    classes: int = 10
    test_fraction: float = 0.2
    seed: int = 0

    def load(self) -> tuple[Dataset, Dataset]:
        return load_dataset(self)


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


def load_dataset(spec: DataSpec | str) -> tuple[Dataset, Dataset]:
    """Resolve a dataset spec: ``digits``, ``synthetic``, ``path.npz`` or ``module:function``."""
    if isinstance(spec, str):
        spec = DataSpec(name=spec)
    name = spec.name
    if name == "digits":
        return load_digits(spec.test_fraction, spec.seed)
    if name == "synthetic":
        return synthetic(spec.samples, spec.shape, spec.classes, spec.test_fraction, spec.seed)
    if name.endswith(".npz"):
        return load_npz(name, spec.test_fraction, spec.seed)
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
        f"Expected a dataset among 'digits', 'synthetic', a path ending in .npz, or 'module:function'. Received: {name!r}"
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
    """Outputs a model needs: classes (max label + 1), or the size of one float target."""
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
