"""Input pipelines hand over the sampler's batches, in order, each once, whatever loads them.

Every loader (inline, threads, processes, device-resident gathers) is compared with the
sampler itself, the reference: the batches of an epoch must be exactly its index
batches, in its order, under sharding over 2 replicas (every sample once across them), for a
mid-epoch resume too. A loader that fails must stop the epoch with the loader's
traceback. Start with `test_every_loader_hands_over_the_samplers_batches`.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from partrain.data.pipeline import (
    Feeder,
    LoaderError,
    LoaderSettings,
    ThreadBatches,
)
from partrain.data.sharding import ShardedBatchSampler
from partrain.data.sources import HDF5Dataset, NpyArrays
from partrain.errors import UsageError

CPU = torch.device("cpu")
N = 53  # odd: the last global batch splits unevenly


class IndexDataset(Dataset):
    """Sample i is (i as a float tensor, i): a batch says which samples it holds."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i


def _indices(batch) -> list[int]:
    return batch[1].tolist()


def _reference(rank: int, skip: int = 0) -> list[list[int]]:
    sampler = ShardedBatchSampler(N, 4, rank, 2, seed=5)
    sampler.set_epoch(3)
    return list(sampler)[skip:]


@pytest.mark.parametrize("kind", ["inline", "threads", "processes"])
def test_every_loader_hands_over_the_samplers_batches(kind):
    feeder = Feeder(IndexDataset(), CPU, LoaderSettings(kind, workers=2, prefetch=2, timeout=60))
    seen = []
    for rank in (0, 1):
        sampler = ShardedBatchSampler(N, 4, rank, 2, seed=5)
        sampler.set_epoch(3)
        got = [_indices(b) for b in feeder.epoch(sampler)]
        assert got == _reference(rank)
        seen += [i for batch in got for i in batch]
    assert sorted(seen) == list(range(N))  # every sample once across the replicas
    # a mid-epoch resume: the same batches from the fifth on
    sampler = ShardedBatchSampler(N, 4, 1, 2, seed=5)
    sampler.set_epoch(3)
    assert [_indices(b) for b in feeder.epoch(sampler, skip=4)] == _reference(1, skip=4)


def test_device_resident_batches_are_the_samplers_batches():
    ds = TensorDataset(torch.arange(N, dtype=torch.float64).unsqueeze(1), torch.arange(N))
    feeder = Feeder(ds, CPU, LoaderSettings(), on_device=True)
    for rank in (0, 1):
        sampler = ShardedBatchSampler(N, 4, rank, 2, seed=5)
        sampler.set_epoch(3)
        assert [_indices(b) for b in feeder.epoch(sampler, skip=2)] == _reference(rank, skip=2)
    with pytest.raises(UsageError, match="Expected an in-memory TensorDataset"):
        Feeder(IndexDataset(), CPU, LoaderSettings(), on_device=True)


class OutOfOrder(Dataset):
    """Batch 0's read waits until batch 1's read has finished: threads complete out of order."""

    def __init__(self) -> None:
        self.second_done = threading.Event()
        self.active = 0
        self.most_active = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return N

    def __getitems__(self, indices):
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            if indices == self.first:
                assert self.second_done.wait(timeout=30), "batch 1 was never read"
            samples = [(torch.tensor([float(i)]), i) for i in indices]
            if indices == self.second:
                self.second_done.set()
            return samples
        finally:
            with self.lock:
                self.active -= 1

    def __getitem__(self, i):
        return self.__getitems__([i])[0]


def test_threads_keep_the_order_when_reads_finish_out_of_order_and_prefetch_is_bounded():
    ds = OutOfOrder()
    sampler = ShardedBatchSampler(N, 4, 0, 1, seed=1)
    ds.first, ds.second = list(sampler)[:2]
    batches = ThreadBatches(ds, sampler, CPU, None, skip=0, threads=3, depth=3, timeout=60)
    got = [_indices(b) for b in batches]
    assert got == list(sampler)
    assert ds.most_active <= 3  # never more reads in flight than the prefetch depth


class EndsLoudly(ShardedBatchSampler):
    """Records how many batches the loop had taken when the sampler's iteration ended
    (local SGD syncs the replicas at that point: it must come after the last step)."""

    def __iter__(self):
        yield from super().__iter__()
        self.ended_after = self.taken


def test_the_samplers_iteration_ends_only_after_the_last_batch_was_taken():
    sampler = EndsLoudly(N, 4, 0, 1)
    sampler.taken = 0
    for _ in ThreadBatches(IndexDataset(), sampler, CPU, None, skip=0, threads=2, depth=4, timeout=60):
        sampler.taken += 1
    assert sampler.ended_after == len(sampler)


class Broken(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        if i == 7:
            return decode_corrupt_record(i)
        return torch.tensor([float(i)]), i


def decode_corrupt_record(i: int):
    raise ValueError(f"record {i} is corrupt")


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_a_failing_loader_stops_the_epoch_with_its_traceback(kind):
    feeder = Feeder(Broken(), CPU, LoaderSettings(kind, workers=2, timeout=60))
    sampler = ShardedBatchSampler(N, 4, 0, 1, shuffle=False)
    with pytest.raises(LoaderError) as info:
        for _ in feeder.epoch(sampler):
            pass
    text = str(info.value)
    assert "record 7 is corrupt" in text
    assert "decode_corrupt_record" in text  # the loader's own frames, not only the message


def test_memory_mapped_npy_files_read_by_batch(tmp_path):
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    y = np.arange(N, dtype=np.int64) % 5
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    ds = NpyArrays(str(tmp_path / "x.npy"), str(tmp_path / "y.npy"))
    sampler = ShardedBatchSampler(N, 8, 0, 1, seed=2)
    for batch, index in zip(Feeder(ds, CPU, LoaderSettings("threads")).epoch(sampler), sampler):
        assert torch.equal(batch[0], torch.from_numpy(x[index]))
        assert torch.equal(batch[1], torch.from_numpy(y[index]))


def test_hdf5_files_read_by_batch(tmp_path):
    h5py = pytest.importorskip("h5py")
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"], f["y"] = x, np.arange(N)
    ds = HDF5Dataset(str(tmp_path / "d.h5"))
    index = [9, 2, 2, 40]  # unsorted, repeated: HDF5 reads want increasing indices
    assert torch.equal(torch.stack([s[0] for s in ds.__getitems__(index)]), torch.from_numpy(x[index]))
    sampler = ShardedBatchSampler(N, 8, 0, 1, seed=2)
    # a loader process reopens the file (an h5py handle does not survive a fork)
    for batch, index in zip(Feeder(ds, CPU, LoaderSettings("processes", workers=1)).epoch(sampler), sampler):
        assert torch.equal(batch[0], torch.from_numpy(x[index]))


@pytest.mark.parametrize("settings, message", [
    (LoaderSettings("fast"), "Expected loader among"),
    (LoaderSettings("threads", workers=0), "Expected a positive number of loader workers"),
    (LoaderSettings("threads", prefetch=0), "Expected a positive prefetch depth"),
])
def test_bad_loader_settings_are_one_line(settings, message):
    with pytest.raises(UsageError, match=message):
        Feeder(IndexDataset(), CPU, settings)


def test_auto_adds_loader_threads_only_while_the_loop_waits_for_data():
    feeder = Feeder(IndexDataset(), CPU, LoaderSettings("auto"))
    assert (feeder.kind, feeder.workers) == ("threads", 2)
    assert feeder.tune(data_seconds=1.0, busy_seconds=9.0, cores_left=1) is None  # 10%: not input-bound
    assert feeder.tune(data_seconds=6.0, busy_seconds=4.0, cores_left=1) == "loader threads 2->4"
    for _ in range(10):
        feeder.tune(data_seconds=6.0, busy_seconds=4.0, cores_left=1)
    assert feeder.workers == 16  # MAX_THREADS: threads that wait on I/O need no core each
    fixed = Feeder(IndexDataset(), CPU, LoaderSettings("threads", workers=3))
    assert fixed.tune(data_seconds=6.0, busy_seconds=4.0, cores_left=1) is None and fixed.workers == 3
    tensors = Feeder(TensorDataset(torch.zeros(4, 1)), CPU, LoaderSettings("auto"))
    assert tensors.kind == "inline"  # in-memory tensors: a gather, nothing to overlap
