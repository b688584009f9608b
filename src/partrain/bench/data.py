"""Feeding the device: overlapped loading, device-resident compiled epochs, length bucketing.

Three parts, all in one run, each in alternating rounds (`harness.alternate`), one torch
thread for every variant (the same compute for all):

- *slow reader*: a dataset whose batch read waits ``--read-ms`` (5 ms: an h5py slice
  read, simulated by sleeping, not computing) and an MLP whose step takes about as long (its width is
  calibrated on this machine at the start).
  ``plain loop``: ``for x, y in DataLoader(ds, batch_size, shuffle=True)`` (no workers:
  read, then step); ``fit``: `partrain.fit` with its default pipeline (loader threads,
  bounded prefetch). Figure: training samples/s; goal ``data.overlap_speedup`` (fit /
  plain loop) >= 1.8 (the limit is 2.0: the step and the read fully overlapped).
- *data in memory, small model*: the usual loop (``DataLoader(TensorDataset, shuffle=True,
  batch_size=32)``, forward, backward, step), `fit` with its default (in-memory gathers),
  and `fit(data_on_device=True, compile=True)` (inductor on CPU; CUDA graphs on CUDA): one
  compiled call per step (gather, forward, backward, SGD update, sums; `FusedStep`).
  Goal ``data.resident_vs_dataloader`` (compiled resident epoch / usual loop, samples/s) >= 2.
  The compile time (`fit`'s ``compile_seconds``, first round) is printed apart.
- *variable length*: an LSTM classifier over sequences of 1 to ``--max-length`` steps,
  padded per batch; `fit` with random batches vs length-bucketed ones
  (`BucketBatchSampler`). Figures: padding fraction of an epoch's batches and samples/s.
  Goal ``data.padding_vs_random`` (bucketed padding / random padding) <= 0.2.

The epoch times of `fit` variants are its own training seconds (the evaluation after
each epoch is not counted; nor is it in the plain loops, which have none).

``--device cuda`` runs every variant on the GPU, the plain loops as users write them there
(``DataLoader(pin_memory=True)``, each batch ``.to(device, non_blocking=True)``, a
synchronisation before the clock stops), and adds `fit`'s device utilisation (NVML) to the
tables. The default is the CPU for every variant: `fit`'s own default ("auto") would put
only the `fit` variants on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ..data import BucketBatchSampler, PadCollate, Sequences
from ..data.padding import padding_fraction
from ..data.sharding import ShardedBatchSampler
from ..train.fit import fit
from .harness import (
    Report,
    Spread,
    alternate,
    device_option,
    divide,
    paired_ratio,
    pick_size,
    positive_int,
    torch_threads,
)


@dataclass(frozen=True)
class Size:
    rounds: int
    reader_batches: int  # batches per slow-reader epoch
    memory_samples: int  # samples of the in-memory part
    sequences: int  # sequences of the variable-length part
    width: int | None = None  # hidden width of the slow-reader MLP (None: a step as long as the read)
    compile: bool | str = True  # the toy run (a test) compiles with a cheap backend
    device: str = "cpu"  # where every variant trains (--device)


FULL = Size(rounds=5, reader_batches=120, memory_samples=16384, sequences=2048)
QUICK = Size(rounds=2, reader_batches=30, memory_samples=4096, sequences=512)
TOY = Size(rounds=1, reader_batches=4, memory_samples=256, sequences=64, width=64, compile="aot_eager")

READER_BATCH, FEATURES, CLASSES = 64, 256, 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 5; --quick 2)")
    parser.add_argument("--read-ms", type=float, default=5.0, help="simulated I/O per batch read, ms (default 5)")
    parser.add_argument("--max-length", type=positive_int, default=100, help="longest sequence (default 100)")
    parser.add_argument("--device", default="cpu", help="where every variant trains: cpu (default) or cuda")


# --------------------------------------------------------------------------- part 1: slow reader


class SlowReader(Dataset):
    """Samples in memory behind a read that waits ``read_s`` per batch (``__getitems__``), as an
    h5py slice read of one batch does: the wait releases the GIL and uses no core."""

    def __init__(self, n: int, read_s: float, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.read_s = read_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]):
        time.sleep(self.read_s)  # the simulated I/O: not a synchronisation
        index = torch.as_tensor(indices)
        return list(zip(self.x[index], self.y[index]))


def reader_mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, CLASSES))


def _sgd(params):  # noqa: ANN001, ANN202
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def reader_data(n: int, read_s: float) -> tuple[Dataset, Dataset]:
    return SlowReader(n, read_s), SlowReader(READER_BATCH, 0.0, seed=1)


def plain_reader_loop(size: Size, read_s: float) -> float:
    """samples/s of ``for x, y in DataLoader(...)``: read, then step, one after the other."""
    torch.manual_seed(0)
    return _dataloader_epoch(reader_mlp(size.width), SlowReader(size.reader_batches * READER_BATCH, read_s),
                             READER_BATCH, size.device)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _dataloader_epoch(model: nn.Module, ds: Dataset, batch: int, device: str = "cpu") -> float:
    """samples/s of one epoch of the loop users write: ``DataLoader(shuffle=True)``, then step
    (on a GPU: pinned batches copied without blocking, as the PyTorch tutorials do)."""
    model.to(device)
    opt = _sgd(model.parameters())
    on_gpu = device != "cpu"
    start = time.perf_counter()
    for x, y in DataLoader(ds, batch_size=batch, shuffle=True, pin_memory=on_gpu):
        x, y = x.to(device, non_blocking=on_gpu), y.to(device, non_blocking=on_gpu)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _sync(device)
    return len(ds) / (time.perf_counter() - start)


def fit_reader(size: Size, read_s: float) -> float:
    data = functools.partial(reader_data, size.reader_batches * READER_BATCH, read_s)
    result = fit(functools.partial(reader_mlp, size.width), data, _sgd, strategy="single", workers=1,
                 threads=1, epochs=1, batch_size=READER_BATCH, quiet=True, return_state=False, device=size.device)
    return result.final["samples_per_s"]


def step_ms(width: int, device: str = "cpu") -> float:
    """The slow-reader model's step alone, ms (median of 20 after 5 warm-up steps)."""
    model = reader_mlp(width).to(device)
    opt = _sgd(model.parameters())
    x = torch.randn(READER_BATCH, FEATURES, device=device)
    y = torch.randint(0, CLASSES, (READER_BATCH,), device=device)
    times = []
    for _ in range(25):
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t)
    return 1000 * Spread.of(times[5:]).median


def calibrate_width(read_ms: float, widths: tuple[int, ...] = (128, 256, 384, 512, 768, 1024, 1536),
                    device: str = "cpu") -> tuple[int, float]:
    """The MLP width whose step time is nearest the read time on this machine (the issue's
    case: read and step about equal, where overlapping them can at best halve the epoch).
    On a GPU these widths all step in well under the read: the widest is taken."""
    timed = [(abs(step_ms(w, device) - read_ms), w) for w in widths]
    width = min(timed)[1]
    return width, step_ms(width, device)


# --------------------------------------------------------------------------- part 2: data in memory


MEM_FEATURES, MEM_BATCH = 64, 32


def memory_data(n: int) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, MEM_FEATURES, generator=g)
    y = (x[:, :CLASSES] + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(1)
    return TensorDataset(x, y), TensorDataset(x[:MEM_BATCH], y[:MEM_BATCH])


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(MEM_FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def usual_loop(size: Size) -> float:
    """samples/s of the loop most users write for data in memory."""
    torch.manual_seed(0)
    train, _ = memory_data(size.memory_samples)
    return _dataloader_epoch(small_mlp(), train, MEM_BATCH, size.device)


def fit_memory(size: Size, resident: bool) -> tuple[float, float, str, float]:
    """samples/s of a steady epoch, the seconds `fit` spent compiling (0 when it did not), what
    it compiled (``step``: the whole step as one function; ``forward``; ``-``: nothing) and the
    device's utilisation in that epoch (NaN on a CPU)."""
    data = functools.partial(memory_data, size.memory_samples)
    options = dict(data_on_device=True, compile=size.compile) if resident else {}
    result = fit(small_mlp, data, _sgd, strategy="single", workers=1, threads=1, epochs=2, batch_size=MEM_BATCH,
                 quiet=True, return_state=False, device=size.device, **options)
    return (result.history[1]["samples_per_s"], result.final.get("compile_seconds", 0.0),
            result.final.get("compiled", "-"), result.history[1].get("device_utilization", math.nan))


# --------------------------------------------------------------------------- part 3: variable length


SEQ_FEATURES, SEQ_BATCH = 8, 32


class LastStepLstm(nn.Module):
    """An LSTM over the padded batch; the head reads each sequence's last real step."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.lstm = nn.LSTM(SEQ_FEATURES, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        last = out[torch.arange(len(x)), lengths - 1]
        return self.head(last)


def sequence_data(n: int, max_length: int) -> tuple[Sequences, Sequences]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, max_length + 1, (n + SEQ_BATCH,), generator=g)
    xs = [torch.randn(int(k), SEQ_FEATURES, generator=g) for k in lengths]
    ys = torch.tensor([int(x[:, 0].sum() > 0) for x in xs])
    return Sequences(xs[:n], ys[:n]), Sequences(xs[n:], ys[n:])


def fit_sequences(size: Size, max_length: int, bucket: bool) -> float:
    data = functools.partial(sequence_data, size.sequences, max_length)
    result = fit(LastStepLstm, data, _sgd, strategy="single", workers=1, threads=1, epochs=1,
                 batch_size=SEQ_BATCH, quiet=True, return_state=False, collate_fn=PadCollate(), bucket=bucket,
                 device=size.device)
    return result.final["samples_per_s"]


def epoch_padding(size: Size, max_length: int, bucket: bool) -> float:
    """Padding fraction of one epoch's batches as `fit` draws them (seed 0, epoch 0)."""
    lengths = sequence_data(size.sequences, max_length)[0].lengths
    sampler = (BucketBatchSampler(lengths, SEQ_BATCH) if bucket
               else ShardedBatchSampler(len(lengths), SEQ_BATCH))
    return padding_fraction(lengths, list(sampler.iter_tensors()))


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> Report:
    size, smoke = pick_size(args, FULL, QUICK, TOY)
    size = dataclasses.replace(size, device=device_option(args))
    rounds = args.rounds or size.rounds
    read_s = args.read_ms / 1000
    report = Report("data", smoke=smoke)
    results: dict[str, list] = {}
    with torch_threads(1):
        width, step = ((size.width, step_ms(size.width, size.device)) if size.width is not None
                       else calibrate_width(args.read_ms, device=size.device))
        size = dataclasses.replace(size, width=width)
        report.say(f"slow reader: {args.read_ms:g} ms read per batch of {READER_BATCH}, model step "
                   f"{step:.1f} ms (MLP width {width}); {size.reader_batches} batches per epoch; {rounds} rounds")
        report.figure("slow_reader.step_ms", step)
        results.update(alternate({
            "plain loop": functools.partial(plain_reader_loop, size, read_s),
            "fit (input pipeline)": functools.partial(fit_reader, size, read_s),
        }, rounds, on_result=lambda r, n, v: report.progress(f"round {r + 1} {n}: {v:,.0f} samples/s")))
        results.update(alternate({
            "DataLoader loop": functools.partial(usual_loop, size),
            "fit default": functools.partial(fit_memory, size, False),
            "fit resident + compiled": functools.partial(fit_memory, size, True),
        }, rounds, on_result=lambda r, n, v: report.progress(f"round {r + 1} {n}: {v}")))
        results.update(alternate({
            "random batches": functools.partial(fit_sequences, size, args.max_length, False),
            "bucketed batches": functools.partial(fit_sequences, size, args.max_length, True),
        }, rounds, on_result=lambda r, n, v: report.progress(f"round {r + 1} {n}: {v:,.0f} samples/s")))

    plain, piped = results["plain loop"], results["fit (input pipeline)"]
    overlap = paired_ratio(piped, plain)
    report.table(["variant", "samples/s", "vs plain loop"], [
        ["plain loop (DataLoader, no workers)", Spread.of(plain).cell(), "1"],
        ["fit (input pipeline)", Spread.of(piped).cell(), overlap.cell()],
    ], title="slow reader (I/O-bound): median (min-max) over rounds")

    usual = results["DataLoader loop"]
    default = [v for v, _, _, _ in results["fit default"]]
    resident = [v for v, _, _, _ in results["fit resident + compiled"]]
    _, compile_s, compiled, _ = results["fit resident + compiled"][0]
    vs_default = paired_ratio(default, usual)
    vs_resident = paired_ratio(resident, usual)
    report.table(["variant", "samples/s", "vs DataLoader loop"], [
        ["DataLoader(TensorDataset, shuffle=True, batch_size=32)", Spread.of(usual).cell(), "1"],
        ["fit default (in-memory gathers)", Spread.of(default).cell(), vs_default.cell()],
        ["fit data_on_device + compile", Spread.of(resident).cell(), vs_resident.cell()],
    ], title=f"data in memory, small MLP ({size.memory_samples} samples): steady epochs")
    report.say(f"compiled: the {'whole step (one call per batch)' if compiled == 'step' else compiled}; "
               f"compile time (fit's trial compilation, first round): {compile_s:.1f} s")

    pad_random = epoch_padding(size, args.max_length, False)
    pad_bucket = epoch_padding(size, args.max_length, True)
    rand_sps, bucket_sps = results["random batches"], results["bucketed batches"]
    speed = paired_ratio(bucket_sps, rand_sps)
    report.table(["batching", "padding fraction", "samples/s", "vs random"], [
        ["random", f"{pad_random:.3f}", Spread.of(rand_sps).cell(), "1"],
        ["bucketed (BucketBatchSampler)", f"{pad_bucket:.3f}", Spread.of(bucket_sps).cell(), speed.cell()],
    ], title=f"variable length: LSTM over 1..{args.max_length} steps, batches of {SEQ_BATCH}")
    if size.device == "cpu":
        report.note("on the CPU: --device cuda measures the GPU (the CUDA-graph step, device utilisation)")
    else:
        utilisation = {name: Spread.of([u for *_, u in results[name] if not math.isnan(u)])
                       for name in ("fit default", "fit resident + compiled")}
        report.table(["variant", "device utilisation %"], [[name, spread.cell() if spread.values else "unknown"]
                                                           for name, spread in utilisation.items()],
                     title=f"data in memory on {torch.cuda.get_device_name(0)}: NVML's utilisation in the "
                           f"steady epoch (unknown without pynvml)")
        for name, spread in utilisation.items():
            if spread.values:
                report.figure(f"memory.{name.replace(' ', '_').replace('+', 'and')}_device_utilization", spread)

    for name, values in (("slow_reader.plain", plain), ("slow_reader.fit", piped), ("memory.dataloader", usual),
                         ("memory.fit_default", default), ("memory.fit_resident_compiled", resident),
                         ("length.random_samples_per_s", rand_sps), ("length.bucketed_samples_per_s", bucket_sps)):
        report.figure(name, Spread.of(values))
    report.figure("memory.compile_seconds", compile_s)
    report.figure("length.padding_random", pad_random)
    report.figure("length.padding_bucketed", pad_bucket)
    report.goal("data.overlap_speedup", overlap.median, ">=", 1.8, "fit / plain loop, slow reader")
    report.goal("data.resident_vs_dataloader", vs_resident.median, ">=", 2.0,
                "resident compiled epoch / DataLoader loop")
    report.goal("data.padding_vs_random", divide(pad_bucket, pad_random), "<=", 0.2, "bucketed / random padding fraction")
    return report
