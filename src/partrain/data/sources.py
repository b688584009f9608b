"""Datasets that read from files as batches are asked for: ``.npy`` memory maps, HDF5.

Both read a whole batch at once through ``__getitems__`` (what ``DataLoader`` and
partrain's loaders call with a batch's indices): one sorted fancy-index read of the rows
instead of one read per sample, which is what makes a file on disk worth prefetching
rather than slow. Files are opened lazily in the process that reads them, so the
datasets cross to loader processes and worker processes as a path.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import UsageError


def _sorted_read(read: Any, indices: list[int]) -> np.ndarray:
    """Rows ``indices`` of an array-like that reads increasing indices best (HDF5 requires it)."""
    order = np.argsort(indices, kind="stable")
    rows = np.asarray(indices)[order]
    unique, inverse = np.unique(rows, return_inverse=True)
    block = read(unique)
    out = np.empty_like(block[inverse])
    out[order] = block[inverse]
    return out


def _sample_tensor(a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.float() if t.is_floating_point() and t.dtype != torch.float64 else t


class NpyArrays(Dataset):
    """Samples ``(x[i], y[i])`` of two ``.npy`` files, memory-mapped (the data stays on disk)."""

    def __init__(self, x_path: str, y_path: str) -> None:
        for p in (x_path, y_path):
            if not os.path.exists(p):
                raise UsageError(f"Expected an existing .npy file. Received: {p!r} (no such file)")
        self.x_path, self.y_path = x_path, y_path
        x, y = self._arrays()
        if len(x) != len(y):
            raise UsageError(f"Expected as many rows in {x_path!r} as in {y_path!r}. Received: {len(x)} and {len(y)}")
        self._n = len(x)
        self._open: tuple[np.ndarray, np.ndarray] | None = None

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return (np.load(self.x_path, mmap_mode="r", allow_pickle=False),
                np.load(self.y_path, mmap_mode="r", allow_pickle=False))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": None}  # a map is reopened where it is read

    def __len__(self) -> int:
        return self._n

    def _maps(self) -> tuple[np.ndarray, np.ndarray]:
        if self._open is None:
            self._open = self._arrays()
        return self._open

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._maps()
        return _sample_tensor(x[i]), torch.as_tensor(np.asarray(y[i]))

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self._maps()
        xs, ys = _sorted_read(lambda r: x[r], indices), _sorted_read(lambda r: y[r], indices)
        return [(_sample_tensor(a), torch.as_tensor(b)) for a, b in zip(xs, ys)]


class HDF5Dataset(Dataset):
    """Samples ``(f[x][i], f[y][i])`` of an HDF5 file (``pip install 'partrain[h5py]'``).

    The file is opened on first read in each process (an h5py handle does not survive a
    fork or a pickle); a batch is one sorted read per dataset.
    """

    def __init__(self, path: str, x: str = "x", y: str = "y") -> None:
        try:
            import h5py
        except ImportError as exc:
            raise UsageError("Expected the h5py package for HDF5 data (pip install 'partrain[h5py]'). "
                             f"Received: {exc}") from None
        if not os.path.exists(path):
            raise UsageError(f"Expected an existing HDF5 file. Received: {path!r} (no such file)")
        self.path, self.x, self.y = path, x, y
        with h5py.File(path, "r") as f:
            missing = [k for k in (x, y) if k not in f]
            if missing:
                raise UsageError(f"Expected datasets {x!r} and {y!r} in {path!r}. Received: {sorted(f.keys())}")
            if len(f[x]) != len(f[y]):
                raise UsageError(f"Expected as many rows in {x!r} as in {y!r}. Received: {len(f[x])} and {len(f[y])}")
            self._n = len(f[x])
        self._file: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_pid": -1}

    def __len__(self) -> int:
        return self._n

    def _handle(self) -> Any:
        if self._file is None or self._pid != os.getpid():
            import h5py

            self._file, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._file

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        f = self._handle()
        xs = _sorted_read(lambda r: f[self.x][r], indices)
        ys = _sorted_read(lambda r: f[self.y][r], indices)
        return [(_sample_tensor(a), torch.as_tensor(b)) for a, b in zip(xs, ys)]


__all__ = ["HDF5Dataset", "NpyArrays"]
