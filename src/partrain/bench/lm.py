"""LM: the built-in GPT on the bundled text under fit, against a hand-written loop; 1->2 workers; checkpointing's memory.

The workload is a language model a user would train on a laptop's CPU: the built-in
GPT (6 layers of width 384, 6 heads, 256-token context, byte vocabulary: about 10.8M
parameters) on the bundled corpus (`partrain.data.text`, non-overlapping 256-byte
blocks), AdamW at lr 1e-3, 4 blocks per worker and step (about a second of work on one
core). Four variants run it in alternating rounds (every variant once per round, the
turn order rotating), each for a few short epochs (``samples_per_epoch``):

  plain loop      a hand-written loop in this process: model(x), F.cross_entropy over
                  logits.view(-1, V), backward, step, on fit's sample order
  fit single      partrain.fit with strategy "single", 1 worker: it runs in this process
                  with the threads this process has, so the plain loop gets the same
  1 worker        fit "allreduce" with 1 worker of 1 thread
  2 workers       fit "allreduce" with 2 workers of 1 thread each (batch 4 each: the
                  global batch doubles, as in ``bench core``)

A variant's figure in a round is its steady-state tokens/s: the epochs after the first
(start-up, the first steps' warm-up and, for 2 workers, process start excluded), as
``bench core`` takes samples/s. Tables show the median over rounds with the min-max
spread; ratios are taken round by round.

Goals:

- lm.fit_vs_plain >= 0.98: fit single / plain loop, tokens/s.
- lm.scaling >= 1.6: 2 workers / 1 worker, tokens/s, both fit "allreduce" with one
  thread per worker: the definition of ``core.scaling`` (its baseline is fit with 1
  worker of 1 thread, not the plain loop nor one process on every core).
- lm.activation_memory <= 0.6: the peak memory of one training step (forward, loss,
  backward, AdamW step; its optimizer state already made by a step before) above what
  was allocated before it, with activation checkpointing over without, full-size model,
  one worker's batch. Checkpointing is `partrain.nn.checkpointing.checkpoint_blocks(model,
  True)`, what ``fit(activation_checkpointing=True)`` applies. On CUDA (``--device cuda``)
  the peak is ``torch.cuda.max_memory_allocated``; on the CPU, which keeps no such count,
  it is the running sum of the CPU allocator's allocations and frees during the step, as
  the PyTorch profiler records them (``profile_memory=True``): the same figure, every
  allocation counted (activations, gradients, temporaries, the recomputation), not only
  what the forward pass saves for backward.
- lm.loss_vs_plain <= 0.01: after the same steps on the same samples in the same order
  (same seed, fit's order: each epoch the next positions of seeded permutations laid end
  to end, a step the next consecutive slice), |loss of fit single's model - loss of the
  plain loop's| / the plain loop's, both on the same held-out blocks; taken every round.

The memory figure is measured on ``--device`` (cpu by default); the rates run on the
CPU, as ``bench core``'s.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from ..data.datasets import DataSpec, load_dataset
from ..env import available_cores
from ..models.gpt import gpt
from ..nn.checkpointing import checkpoint_blocks
from ..tables import format_number
from ..train.fit import fit
from .core import MARGIN, rate_table, resolution, steady_rate
from .harness import (
    Report,
    Spread,
    alternate,
    device_option,
    divide,
    paired_ratio,
    pick_size,
    positive_int,
)

VOCAB = 256  # the bundled corpus as UTF-8 bytes


@dataclass(frozen=True)
class Shape:
    """The GPT's size."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int  # tokens per sample (the context)


@dataclass(frozen=True)
class Workload:
    """One training configuration every variant runs."""

    shape: Shape
    batch: int  # blocks per worker and step
    steps: int  # optimizer steps per epoch
    epochs: int  # the first is left out of the rates
    held_out: int  # test blocks the loss goal is measured on


@dataclass(frozen=True)
class Size:
    work: Workload
    rounds: int


FULL = Size(Workload(Shape(6, 6, 384, 256), batch=4, steps=3, epochs=5, held_out=16), rounds=3)
QUICK = Size(Workload(Shape(2, 4, 64, 64), batch=8, steps=4, epochs=3, held_out=8), rounds=2)
TOY = Size(Workload(Shape(2, 2, 32, 32), batch=4, steps=2, epochs=2, held_out=4), rounds=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=positive_int, default=None, help="blocks per worker and step (default 4)")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help="epochs per run, the first left out of the rates (default 5, quick 3)")
    p.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 3, quick 2)")
    p.add_argument("--device", default="cpu",
                   help="where the activation-memory step runs: cpu (default) or cuda; the rates run on the CPU")


def _size(args: argparse.Namespace) -> tuple[Size, bool]:
    size, smoke = pick_size(args, FULL, QUICK, TOY)
    work = replace(size.work, **({"batch": args.batch_size} if args.batch_size else {}),
                   **({"epochs": args.epochs} if args.epochs else {}))
    return Size(work, args.rounds or size.rounds), smoke


# ----- the workload ----------------------------------------------------------------
def _model(shape: Shape) -> torch.nn.Module:
    return gpt(vocab_size=VOCAB, n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd,
               block_size=shape.block_size)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@functools.lru_cache(maxsize=2)
def _text(block_size: int) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """The bundled corpus in ``block_size``-byte blocks, targets pre-shifted: (train, test)."""
    return load_dataset(DataSpec(name="text", block_size=block_size))


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss a user writes: cross-entropy over every token of the batch, averaged."""
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


def sample_order(num_samples: int, samples_per_epoch: int, epochs: int, seed: int = 0) -> torch.Tensor:
    """The samples fit's epochs of ``samples_per_epoch`` take, in order, for ``epochs`` epochs:
    seeded permutations of every index laid end to end (`partrain.data.sharding`), written out
    here so the plain loop sees fit's order without its sampler."""
    passes = -(-epochs * samples_per_epoch // num_samples)
    return torch.cat([torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + p))
                      for p in range(passes)])


@dataclass(frozen=True)
class Run:
    """One variant's run: steady tokens/s, and the held-out loss of the model it left (NaN: not taken)."""

    tokens_per_s: float
    held_out_loss: float = math.nan


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, work: Workload) -> float:
    """``token_loss`` of ``model`` on the first ``work.held_out`` test blocks."""
    _, test = _text(work.shape.block_size)
    x, y = (t[: work.held_out] for t in test.tensors)
    model.eval()
    return token_loss(model(x), y).item()


# ----- the hand-written baseline -------------------------------------------------------
def plain_loop(work: Workload) -> Run:
    """The loop a user writes, in this process: fit's seed and sample order, forward, loss, backward, step."""
    train, _ = _text(work.shape.block_size)
    x_all, y_all = train.tensors
    per_epoch = work.batch * work.steps
    order = sample_order(len(x_all), per_epoch, work.epochs)
    torch.manual_seed(0)  # fit seeds the same way before it builds the model
    model = _model(work.shape)
    opt = _optimizer(model.parameters())
    model.train()
    epochs = []
    for epoch in range(work.epochs):
        start_time, tokens = time.perf_counter(), 0
        for start in range(epoch * per_epoch, (epoch + 1) * per_epoch, work.batch):
            idx = order[start : start + work.batch]
            x, y = x_all.index_select(0, idx), y_all.index_select(0, idx)
            loss = token_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += y.numel()
        epochs.append((tokens, time.perf_counter() - start_time))
    return Run(steady_rate(epochs), held_out_loss(model, work))


# ----- partrain.fit ------------------------------------------------------------------
def fit_run(work: Workload, strategy: str, workers: int, threads: int | None = None, loss: bool = False) -> Run:
    """Steady tokens/s of ``partrain.fit`` on ``work`` (and with ``loss``, its model's held-out loss)."""
    train, _ = _text(work.shape.block_size)
    result = fit(functools.partial(_model, work.shape), (train, None), _optimizer, strategy=strategy,
                 workers=workers, epochs=work.epochs, batch_size=work.batch,
                 samples_per_epoch=work.batch * work.steps * workers, quiet=True, checkpoint=False,
                 return_state=loss, threads=threads, timeout=600, device="cpu")
    assert result is not None  # fit returns worker 0's result when it launched the workers
    rate = steady_rate([(r["tokens"], r["seconds"]) for r in result.history])
    if not loss:
        return Run(rate)
    model = _model(work.shape)
    model.load_state_dict(result.model_state)
    return Run(rate, held_out_loss(model, work))


# ----- activation memory ---------------------------------------------------------------
def peak_bytes(fn: Callable[[], Any], device: str = "cpu") -> int:
    """The most bytes allocated at once on ``device`` while ``fn()`` runs, above what was allocated
    before it (memory ``fn`` frees that was allocated before it is not subtracted).

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the running sum of the allocations and frees
    the PyTorch profiler records (``profile_memory=True``), in the order they happened.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name == "CPU"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


def step_peak_bytes(work: Workload, checkpointed: bool, device: str = "cpu") -> int:
    """`peak_bytes` of one training step of ``work``'s model on one worker's batch (its optimizer
    state made by a step before), with or without activation checkpointing."""
    train, _ = _text(work.shape.block_size)
    x, y = (t[: work.batch].to(device) for t in train.tensors)
    torch.manual_seed(0)
    model = _model(work.shape).to(device)
    checkpoint_blocks(model, checkpointed)
    opt = _optimizer(model.parameters())

    def step() -> None:
        token_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's state, and the first call's one-off allocations
    return peak_bytes(step, device)


def run(args: argparse.Namespace) -> Report:
    size, smoke = _size(args)
    work, device = size.work, device_option(args)
    shape = work.shape
    threads, cores = torch.get_num_threads(), available_cores()
    train, _ = _text(shape.block_size)
    parameters = sum(p.numel() for p in _model(shape).parameters())
    report = Report("lm", smoke=smoke)
    report.say(f"partrain bench lm: GPT {shape.n_layer} layers x {shape.n_embd} ({shape.n_head} heads, "
               f"{parameters / 1e6:.1f}M parameters), block {shape.block_size}, vocabulary {VOCAB} (bytes); the "
               f"bundled corpus ({len(train):,} blocks); AdamW lr 1e-3, batch {work.batch}/worker, {work.epochs} "
               f"epochs of {work.steps} steps (the first left out of the rates), {size.rounds} alternating rounds; "
               f"plain loop and fit single on {threads} thread{'s' * (threads != 1)}, {cores} cores, "
               f"torch {torch.__version__}")
    report.figure("parameters", parameters)

    plain, single = "plain PyTorch loop, 1 process", "fit single"
    one_worker, two_workers = "fit allreduce, 1 worker x 1 thread", "fit allreduce, 2 workers x 1 thread"
    variants = {
        plain: functools.partial(plain_loop, work),
        single: functools.partial(fit_run, work, "single", 1, None, True),
        one_worker: functools.partial(fit_run, work, "allreduce", 1, 1),
        two_workers: functools.partial(fit_run, work, "allreduce", 2, 1),
    }
    runs = alternate(variants, size.rounds, on_result=lambda r, name, v: report.progress(
        f"round {r + 1}: {name}: {v.tokens_per_s:,.0f} tokens/s"))
    rates = {label: [v.tokens_per_s for v in runs[label]] for label in variants}
    fit_vs_plain = paired_ratio(rates[single], rates[plain])
    scaling = paired_ratio(rates[two_workers], rates[one_worker])
    ratio_of = {single: (fit_vs_plain, "this / plain loop"), two_workers: (scaling, "this / 1 worker")}
    rate_table(report, rates, ratio_of, "tokens/s")
    report.figure("ratio_fit_single_vs_plain", fit_vs_plain)
    report.figure("ratio_2_workers_vs_1_worker", scaling)

    plain_loss = [r.held_out_loss for r in runs[plain]]
    fit_loss = [r.held_out_loss for r in runs[single]]
    loss_gap = Spread.of([abs(divide(f - p, p)) for f, p in zip(fit_loss, plain_loss)])
    steps, tokens = work.epochs * work.steps, work.epochs * work.steps * work.batch * shape.block_size
    report.table([f"held-out loss after {steps} steps ({tokens:,} tokens), {work.held_out} test blocks",
                  "median (min-max)"],
                 [[plain, Spread.of(plain_loss).cell()], [single, Spread.of(fit_loss).cell()],
                  ["|fit - plain| / plain", loss_gap.cell()]])
    report.figure("held_out_loss_plain", Spread.of(plain_loss))
    report.figure("held_out_loss_fit_single", Spread.of(fit_loss))
    report.figure("loss_gap_fit_vs_plain", loss_gap)

    report.progress(f"activation memory: one training step on {device}, without and with checkpointing")
    without = step_peak_bytes(work, False, device)
    with_checkpointing = step_peak_bytes(work, True, device)
    memory_ratio = divide(with_checkpointing, without)
    report.table([f"one training step on {device}, batch {work.batch}", "peak MiB above before the step"],
                 [["without activation checkpointing", format_number(without / 2**20)],
                  ["with activation checkpointing (every block)", format_number(with_checkpointing / 2**20)],
                  ["with / without", format_number(memory_ratio)]])
    report.figure("step_peak_bytes_without_checkpointing", without)
    report.figure("step_peak_bytes_with_checkpointing", with_checkpointing)
    report.figure("ratio_activation_memory", memory_ratio)

    report.goal("lm.fit_vs_plain", fit_vs_plain, ">=", 0.98, "fit single / plain loop, tokens/s")
    report.goal("lm.scaling", scaling, ">=", 1.6, "2 workers / 1 worker (fit allreduce, 1 thread each), tokens/s")
    report.goal("lm.activation_memory", memory_ratio, "<=", 0.6,
                f"one step's peak memory on {device}: checkpointing / none")
    report.goal("lm.loss_vs_plain", loss_gap, "<=", 0.01,
                f"held-out loss after {steps} steps: |fit - plain| / plain")
    line = resolution(plain, Spread.of(rates[plain]), MARGIN, "lm.fit_vs_plain", "tokens/s")
    if line:
        report.note(line)
    return report

