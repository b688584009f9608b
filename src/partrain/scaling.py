"""How each strategy's step time grows with the number of workers: a communication model.

Per optimizer step, a worker computes for ``compute_s`` seconds and the strategy moves
bytes over links of ``bandwidth`` bytes/s with a per-message latency ``latency_s``.
``model_bytes`` (S) is what one worker's gradient (or parameters) weighs: partrain's
``comm_bytes`` per step and worker measures it.

- all-reduce, ring: ``2 (n-1)/n * S/B + 2 (n-1) * latency``; with a tree for the latency
  term (what NCCL switches to at scale): ``2 (n-1)/n * S/B + 2 log2(n) * latency``.
- parameter server with ``k`` shards: every worker pushes S and pulls S per step, and each
  shard's link carries ``2 n S / k`` per round of steps: ``2 n S / (k B) + 2 * latency``
  when all workers step together (the synchronous bound; asynchronous workers see the same
  link saturate at that rate).
- local SGD / DiLoCo with period H: one all-reduce every H steps, ``ring / H`` per step.
- pipeline with p stages and m micro-batches: the bubble, ``(p-1)/(m+p-1)`` of the step idle.
- fsdp (ZeRO-3): the parameters all-gathered for the forward and again for the backward, the
  gradients reduce-scattered: three collectives of ``(n-1)/n * S`` each, ``1.5x`` the bytes of
  an all-reduce, in ``3 (n-1)`` messages per unit (ring); ZeRO-2 (no gather for the backward)
  moves what an all-reduce does.
- tp over t processes, L transformer blocks: each block all-reduces its activations
  (``A = tokens x width x bytes`` per micro-batch) after attention and after the MLP, forward
  and backward: ``4 L`` all-reduces of A per step, ``4 L * 2 (t-1)/t * A`` bytes, whatever the
  model's size.

Efficiency is ``compute / (compute + exposed communication)``: the exposed share is the
whole communication time here (no overlap with backward), a lower bound on efficiency;
``overlap=True`` hides up to the backward pass (two thirds of compute) behind it.
These are the formulas `docs/scaling.md` prints with measured constants, and what a
strategy advisor (``partrain compare``) fits to its measurements.

What `Constants` adds for a measured job (``partrain compare``): DDP's all-reduce is not one
message but one per gradient bucket (``k`` messages, each paying the latency), and on a host
whose cores the workers' compute fills, the reductions' CPU (gloo sums and copies the
buckets on the same cores) cannot overlap the compute: ``c`` seconds per step, measured; and
DDP's own bookkeeping (autograd hooks, the buckets, averaging them) adds ``o`` seconds to every
step of two workers or more, measured on one worker without communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import UsageError

GBIT = 1e9 / 8  # bytes/s in one Gbit/s


@dataclass(frozen=True)
class Link:
    """A network: bandwidth in bytes/s and the latency of one message in seconds."""

    bandwidth: float
    latency_s: float = 20e-6

    @classmethod
    def gbit(cls, gbit_per_s: float, latency_s: float = 20e-6) -> Link:
        return cls(gbit_per_s * GBIT, latency_s)


def parameter_bytes(model: Any) -> int:
    """``S`` for a ``torch.nn.Module``: what one copy of its trainable parameters weighs, the
    gradient every synchronous step exchanges."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _check(n: int, model_bytes: float, compute_s: float) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"Expected a positive number of workers. Received: {n!r}")
    if not (model_bytes >= 0 and compute_s > 0):
        raise UsageError(f"Expected model_bytes >= 0 and compute_s > 0. Received: {model_bytes}, {compute_s}")


def allreduce_seconds(n: int, model_bytes: float, link: Link, tree: bool = False) -> float:
    """Seconds of one all-reduce of ``model_bytes`` over ``n`` workers (ring, or tree latency)."""
    if n == 1:
        return 0.0
    transfer = 2 * (n - 1) / n * model_bytes / link.bandwidth
    hops = 2 * math.log2(n) if tree else 2 * (n - 1)
    return transfer + hops * link.latency_s


def ps_seconds(n: int, model_bytes: float, link: Link, shards: int) -> float:
    """Seconds per step at the busiest parameter-server shard (push and pull of every worker)."""
    if shards < 1:
        raise UsageError(f"Expected at least one server shard. Received: {shards}")
    return 2 * n * model_bytes / (shards * link.bandwidth) + 2 * link.latency_s


def local_sgd_seconds(n: int, model_bytes: float, link: Link, period: int, tree: bool = False) -> float:
    """Communication per step of local SGD: one all-reduce every ``period`` steps."""
    if period < 1:
        raise UsageError(f"Expected a period of at least 1 step. Received: {period}")
    return allreduce_seconds(n, model_bytes, link, tree) / period


def allreduce_bytes(n: int, model_bytes: float) -> float:
    """Bytes one worker sends in a ring all-reduce of ``model_bytes`` over ``n`` workers."""
    return 2 * (n - 1) / n * model_bytes


def fsdp_bytes(n: int, model_bytes: float, reshard_after_forward: bool = True) -> float:
    """Bytes one worker sends in a step of fsdp over ``n`` workers: all-gathers for the forward (and
    for the backward under ZeRO-3) and a reduce-scatter, ``(n-1)/n * S`` each (ring)."""
    return (3 if reshard_after_forward else 2) * (n - 1) / n * model_bytes


def fsdp_seconds(n: int, model_bytes: float, link: Link, units: int = 1,
                 reshard_after_forward: bool = True) -> float:
    """Seconds of one step's collectives of fsdp: `fsdp_bytes` over the link, and per sharding unit
    each collective's ``n - 1`` ring hops."""
    if units < 1:
        raise UsageError(f"Expected at least one sharding unit. Received: {units}")
    if n == 1:
        return 0.0
    collectives = 3 if reshard_after_forward else 2
    return fsdp_bytes(n, model_bytes, reshard_after_forward) / link.bandwidth + \
        collectives * units * (n - 1) * link.latency_s


def tp_bytes(t: int, activation_bytes: float, layers: int) -> float:
    """Bytes one process sends in a step of tensor parallelism over ``t`` processes: ``4 layers``
    ring all-reduces of one micro-batch's activations (attention and MLP, forward and backward)."""
    return 4 * layers * allreduce_bytes(t, activation_bytes)


def tp_seconds(t: int, activation_bytes: float, layers: int, link: Link) -> float:
    """Seconds of one step's all-reduces of tensor parallelism (ring: ``2 (t-1)`` hops each)."""
    if layers < 1:
        raise UsageError(f"Expected at least one layer. Received: {layers}")
    return 4 * layers * allreduce_seconds(t, activation_bytes, link)


def pipeline_bubble(stages: int, microbatches: int) -> float:
    """The idle share of a GPipe/1F1B step: ``(p-1)/(m+p-1)``."""
    if stages < 1 or microbatches < 1:
        raise UsageError(f"Expected stages and micro-batches >= 1. Received: {stages}, {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def efficiency(compute_s: float, comm_s: float, overlap: bool = False) -> float:
    """``compute / (compute + exposed comm)``; with ``overlap`` the backward (2/3 of compute) hides comm."""
    exposed = max(0.0, comm_s - (2 / 3) * compute_s) if overlap else comm_s
    return compute_s / (compute_s + exposed)


def predict(strategy: str, n: int, model_bytes: float, compute_s: float, link: Link, *, shards: int | None = None,
            period: int = 8, tree: bool = False, overlap: bool = False) -> float:
    """Predicted efficiency of ``strategy`` (allreduce, ps, localsgd, fsdp: ZeRO-3 in one unit) at ``n``
    workers."""
    _check(n, model_bytes, compute_s)
    if strategy == "allreduce":
        comm = allreduce_seconds(n, model_bytes, link, tree)
    elif strategy == "fsdp":
        comm = fsdp_seconds(n, model_bytes, link)
    elif strategy == "ps":
        comm = ps_seconds(n, model_bytes, link, shards or max(1, n // 8))
    elif strategy == "localsgd":
        comm = local_sgd_seconds(n, model_bytes, link, period, tree)
    else:
        raise UsageError(f"Expected a strategy among ['allreduce', 'ps', 'localsgd', 'fsdp']. Received: {strategy!r}")
    return efficiency(compute_s, comm, overlap)


# ----- throughput from measured constants (what ``partrain compare`` prints) ------------------

#: how each strategy's step time at n workers is written, with t1 the one-worker step time
FORMULAS = {
    "allreduce": "t(n) = h t1 + o + c + 2(n-1)/n * S/B + 2(n-1) k a   (k all-reduces a step: DDP's gradient buckets)",
    "ps": "t(n) = h t1 + 2 n S/(k B) + 2 a,  k = max(1, n // 8) server shards",
    "localsgd": "t(n) = h t1 + (c + 2(n-1)/n * S/B + 2(n-1) a) / H   (one flat all-reduce every H steps)",
    "pipeline": "t(n) = h t1/n * (m + n - 1)/m  (n stages, m micro-batches, one batch in flight)",
}
#: what h is (1 where it was not measured)
HOST_FACTOR = ("h = one worker's step when a host runs its workers at once, over its step alone "
               "(shared cores, memory bandwidth and caches; measured here)")
#: what c is (0 where it was not measured)
CONTENTION = ("c = what a synchronous step costs beyond its parts when the reductions share the cores with the "
              "compute (their CPU, the wait for the slowest worker, evicted caches): every worker's step followed "
              "by the all-reduces of the real bucket layout, at once, minus (the steps at once + the all-reduces "
              "alone); measured here")
#: what o is (0 where it was not measured)
DDP_OVERHEAD = ("o = DDP's own work in a step (its autograd hooks, the gradient buckets, averaging them): one "
                "worker's step wrapped in DDP without communication, minus its plain step; measured here")
#: how the predictions beyond this machine treat h, o and c
BEYOND = ("beyond this machine: one worker per host (h = 1), o as here, c = 0 (the reductions run beside the compute: a GPU's "
          "collectives, or a core left to gloo; on CPU hosts whose compute takes every core add c), "
          "a = 20 us per message, B the link")
THROUGHPUT = "X(n) = n b / t(n) (pipeline: b / t(n));  efficiency E(n) = X(n) / (n X(1))"


@dataclass(frozen=True)
class Constants:
    """What a one-worker window measures: the step time ``t1`` (data and compute) at ``batch``
    samples per worker, and the bytes ``S`` one worker's gradient weighs; ``host_factor`` is
    ``h``, how much longer that step takes when a host runs its workers at once (1: not
    measured, or cores to spare); ``messages`` is ``k``, the all-reduces of one allreduce
    step (DDP's gradient buckets); ``contention_s`` is ``c``, the seconds a synchronous step
    loses when the reductions run on the cores the compute uses (0: not measured, or a core
    to spare); ``overhead_s`` is ``o``, the seconds DDP's own bookkeeping adds to an
    allreduce step besides communicating (0: not measured)."""

    step_s: float
    batch: int
    model_bytes: float
    host_factor: float = 1.0
    messages: int = 1
    contention_s: float = 0.0
    overhead_s: float = 0.0


def step_seconds(strategy: str, n: int, c: Constants, link: Link, *, period: int = 8,
                 microbatches: int = 4, shards: int | None = None) -> float:
    """``t(n)`` of `FORMULAS` for one of its strategies."""
    _check(n, c.model_bytes, c.step_s)
    if not (c.host_factor > 0 and math.isfinite(c.host_factor)):
        raise UsageError(f"Expected a host factor h > 0. Received: {c.host_factor!r}")
    if isinstance(c.messages, bool) or not isinstance(c.messages, int) or c.messages < 1:
        raise UsageError(f"Expected k >= 1 messages per step. Received: {c.messages!r}")
    if not (c.contention_s >= 0 and math.isfinite(c.contention_s)):
        raise UsageError(f"Expected a contention c >= 0 seconds. Received: {c.contention_s!r}")
    if not (c.overhead_s >= 0 and math.isfinite(c.overhead_s)):
        raise UsageError(f"Expected DDP's overhead o >= 0 seconds. Received: {c.overhead_s!r}")
    t1 = c.step_s * c.host_factor
    contention = c.contention_s if n > 1 else 0.0
    if strategy == "allreduce":
        # k messages: the transfer is the same bytes, the latency is paid per message; one worker
        # runs without DDP (partrain's allreduce skips it), so o only from two on
        overhead = c.overhead_s if n > 1 else 0.0
        return t1 + overhead + contention + allreduce_seconds(n, c.model_bytes, Link(link.bandwidth,
                                                                          link.latency_s * c.messages))
    if strategy == "ps":
        return t1 + ps_seconds(n, c.model_bytes, link, shards or max(1, n // 8))
    if strategy == "localsgd":
        ring = local_sgd_seconds(n, c.model_bytes, link, period)  # checks the period
        return t1 + ring + contention / period
    if strategy == "pipeline":
        return t1 / n / (1 - pipeline_bubble(n, microbatches))
    raise UsageError(f"Expected a strategy among {sorted(FORMULAS)}. Received: {strategy!r}")


def samples_per_s(strategy: str, n: int, c: Constants, link: Link, **options: int) -> float:
    """``X(n)``: predicted samples per second of ``strategy`` on ``n`` workers (or pipeline stages)."""
    t = step_seconds(strategy, n, c, link, **options)
    return (c.batch if strategy == "pipeline" else n * c.batch) / t


def scaling_efficiency(strategy: str, n: int, c: Constants, link: Link, **options: int) -> float:
    """``E(n) = X(n) / (n X(1))``: 1.0 is perfect scaling."""
    return samples_per_s(strategy, n, c, link, **options) / (n * c.batch / c.step_s)
