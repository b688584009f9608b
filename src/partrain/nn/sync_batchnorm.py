"""SyncBatchNorm that runs on every torch.distributed backend (gloo on CPU, NCCL on CUDA).

``torch.nn.SyncBatchNorm`` refuses CPU tensors, so CPU clusters and CPU CI
cannot keep batch statistics in sync. This module computes the statistics of
the *global* batch - every rank's batch of the process group, concatenated -
with torch.distributed collectives only, so one code path serves both backends.

Vocabulary: a *channel* is dimension 1 of the input; its *values* are all the
entries of that channel over the batch and spatial dimensions; a rank's
*count* is how many values per channel it holds (batch size times spatial
size, possibly 0).

Forward in training mode, per layer call, one collective:

1. each rank computes its count and per-channel shifted sums ``S1 = sum(x - s)``,
   ``S2 = sum((x - s)^2)`` around a shift ``s`` common to all ranks - the running
   mean, zeros without running statistics - from PyTorch's fused one-pass
   statistics kernel (`shifted_stats`);
2. one ``all_reduce`` of the flat float64 tensor ``[count, s, S1, S2]`` (3C+1
   numbers) sums them (with gloo: one all-gather of the rows, summed on each rank, through
   shared memory when every rank is on this host, else gloo's with at most
   `_GATHER_MAX_RANKS` ranks; see `_gathers`); the global ``mean = s + S1/n`` and ``M2 = S2 - S1^2/n``
   follow, and the summed shift row checks that ``s`` really was common;
3. when the batch mean lies far from the shift (more than `_SHIFT_LIMIT` standard
   deviations: the first steps of a layer whose activations sit far from 0),
   ``S2 - S1^2/n`` would cancel digits, so every rank - deciding on the same reduced
   numbers - falls back to the exact path: an ``all_gather`` of each rank's sums
   around its own mean (`local_stats`) combined with Chan's parallel formula
   (`combine_stats`), ``M2 = sum(M2_i) + sum(n_i * (mean_i - mean)^2)``, which never
   subtracts two large numbers: stable when the mean is large against the spread,
   unlike ``E[x^2] - E[x]^2`` (see `naive_variance` for what that would cost).

Backward, one collective: the per-channel sums of ``grad_out`` and
``grad_out * x_hat`` are all-reduced so every input gradient equals that of
BatchNorm on the concatenated batch. Weight and bias gradients stay local sums,
as in ``torch.nn.SyncBatchNorm``: DistributedDataParallel averages them like any
parameter gradient, which makes training under ``allreduce`` equal to a single
process running BatchNorm on the global batch.

Every rank must call forward and backward of every SyncBatchNorm layer the
same number of times (a rank with an empty batch included); collectives use
the process group's timeout, so a rank that does not turn up becomes an error,
never a hang.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase

from .._compat import all_gather_into, batchnorm_takes_bias
from ..errors import UsageError
from ..host_exchange import HostExchange

Group = Any  # torch.distributed.ProcessGroup | None (None = the default group)

# |mean| / std beyond which backward forms (x - mean) before scaling it (see the forward pass)
_FOLD_MEAN_LIMIT = 4.0
# |batch mean - shift| / std beyond which shifted sums give way to Chan's combination
_SHIFT_LIMIT = 4.0
# inputs with fewer values than this take the statistics in plain float64 kernels (`shifted_stats`)
_SMALL_INPUT = 32768
# up to this many gloo ranks, sums over ranks go by one all-gather instead of an all-reduce (`_gathers`)
_GATHER_MAX_RANKS = 8
# gloo ranks that all share this host exchange through shared memory (`HostExchange`)
_HOST_EXCHANGE = True



def _group_size(group: Group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of a process group, on any backend.

    A drop-in replacement for ``torch.nn.BatchNorm1d/2d/3d`` (inputs of 2 to 5
    dimensions, ``(N, C, ...)``) and ``torch.nn.SyncBatchNorm``; same parameters,
    buffers and ``state_dict`` keys, so checkpoints move freely between them.

    Args:
        num_features: C, the number of channels.
        eps: added to the variance for numerical stability.
        momentum: weight of the new batch in the running statistics; ``None``
            for a cumulative moving average (as ``torch.nn.BatchNorm``).
        affine: learnable per-channel weight and bias.
        track_running_stats: keep running mean and variance for eval mode;
            when False, batch statistics are used in eval mode too (local to
            each rank in eval mode, as ``torch.nn.SyncBatchNorm`` does).
        process_group: the ranks whose batches are pooled; ``None`` = the
            default group.
        bias: with ``affine``, a learnable bias too (False: weight only, where torch offers it).

    Synchronisation happens in training mode only, when the group has more
    than one rank. Otherwise (a single process, no initialized process group,
    eval mode) the layer is exactly ``torch.nn.BatchNorm``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group: Group = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                 bias: bool = True) -> None:
        if not isinstance(num_features, int) or num_features < 1:
            raise UsageError(f"Expected a positive number of features. Received: num_features={num_features!r}")
        extra: dict[str, Any] = {}
        if not bias:
            if not batchnorm_takes_bias():
                raise UsageError("Expected bias=True: this torch release has no batch norm without bias. "
                                 "Received: bias=False")
            extra["bias"] = False
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         **extra)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise UsageError(f"Expected a 2D to 5D input (N, C, ...). Received: {input.dim()}D input "
                             f"of shape {tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise UsageError(f"Expected an input with {self.num_features} channels (dimension 1). "
                             f"Received: shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or self.running_mean is None
        if not (self.training and use_batch_stats and _group_size(self.process_group) > 1):
            # one process, or eval: nothing to synchronise; exactly torch.nn.BatchNorm
            return super().forward(input)

        # running-statistics bookkeeping exactly as torch.nn.BatchNorm
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        tracked = self.track_running_stats  # buffers are only updated when tracked
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias,
                                            self.running_mean if tracked else None,
                                            self.running_var if tracked else None,
                                            self.eps, factor, self.process_group)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.process_group is None else ", process_group=...")


# ----- the statistics -----------------------------------------------------------------------

def local_stats(x: torch.Tensor) -> torch.Tensor:
    """This rank's statistics as one flat float64 tensor ``[count, shift (C), S1 (C), S2 (C)]``.

    Shifted sums around the rank's own mean ``m`` (computed in x's precision):
    ``S1 = sum(x - m)`` and ``S2 = sum((x - m)^2)``. ``x - m`` is exact for
    values near the mean, so ``mean = m + S1/n`` and ``M2 = S2 - S1^2/n`` keep
    full precision however large the mean is against the spread (``S1`` is
    a tiny correction, nothing large cancels). Half-precision inputs are
    promoted to float32 first. An empty batch gives zeros.
    """
    c = x.shape[1]
    count = x.numel() // c if c else 0
    out = torch.empty(3 * c + 1, dtype=torch.float64, device=x.device)
    if count == 0:
        return out.zero_()
    out[:1].fill_(count)
    xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    dims = (0, *range(2, x.dim()))
    shift = xs.mean(dims, keepdim=True)
    d = xs - shift
    torch.sum(d, dims, dtype=torch.float64, out=out[1 + c : 1 + 2 * c])
    torch.sum(d.mul_(d), dims, dtype=torch.float64, out=out[1 + 2 * c :])
    out[1 : 1 + c].copy_(shift.view(c))
    return out


def combine_stats(gathered: torch.Tensor) -> tuple[int, np.ndarray, np.ndarray]:
    """Chan's parallel combination of per-rank `local_stats` rows (shape ``(W, 3C+1)``).

    Returns ``(count, mean, M2)`` of the union (float64 arrays of C numbers):
    per rank ``mean_i = shift_i + S1_i/n_i`` and ``M2_i = S2_i - S1_i^2/n_i``, then
    ``mean = sum(n_i mean_i)/n`` and ``M2 = sum(M2_i) + sum(n_i (mean_i - mean)^2)``,
    which never subtracts two large numbers. Ranks with count 0 contribute nothing.
    The arithmetic is a few dozen operations on 3C+1 numbers per rank, done on
    the host in NumPy (one device-to-host copy; each torch call would cost more
    in dispatch than in arithmetic).
    """
    rows = gathered.detach().to("cpu", torch.float64).numpy()
    c = (rows.shape[1] - 1) // 3
    counts = rows[:, 0]
    shift, s1, s2 = rows[:, 1 : 1 + c], rows[:, 1 + c : 1 + 2 * c], rows[:, 1 + 2 * c :]
    per = np.maximum(counts, 1.0)[:, None]
    means = shift + s1 / per
    m2s = np.maximum(s2 - s1 * s1 / per, 0.0)
    total = float(counts.sum())
    mean = counts @ means / max(total, 1.0)
    m2 = m2s.sum(0) + counts @ np.square(means - mean)
    return int(total), mean, m2


def naive_variance(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The textbook one-pass ``E[x^2] - E[x]^2`` in ``x``'s dtype: what NOT to do.

    Kept for tests and docs, to show how far it is off when the mean is large
    against the spread (float32, mean 1e4, std 1: the squares are ~1e8, whose
    spacing is 8, so the variance of ~1 drowns in rounding).
    """
    return (x * x).mean(dims) - x.mean(dims).square()


def _host_exchange(group: Group) -> HostExchange | None:
    """The group's shared-memory exchange when every rank is on this host (gloo groups only), else None.

    Set up on the first call for a group, which every rank makes at the same point (the
    first synchronised forward), as the set-up is a collective.
    """
    if not _HOST_EXCHANGE or dist.get_backend(group) != "gloo":
        return None
    return HostExchange.for_group(group)


def _all_gather_flat(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``t`` (same size everywhere) as rows of a ``(W, len(t))`` tensor, one exchange.

    Through shared memory when every rank is on this host (`HostExchange`), else one collective.
    """
    world = _group_size(group)
    if world == 1:
        return t.unsqueeze(0)
    exchange = _host_exchange(group)
    if exchange is not None:
        rows = exchange.all_gather(t)
        if rows is not None:
            return rows
    out = torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
    all_gather_into(out, t, group)
    return out.view(world, t.numel())


def _gathers(group: Group) -> bool:
    """Sum small per-channel vectors by an all-gather (one exchange) rather than an all-reduce.

    With gloo and a few ranks an all-gather of the 3C+1 numbers is one exchange where
    the ring all-reduce takes two: 650-875 us against 888-1,398 us (medians, 2 ranks on
    a 2-core host, 193 float64 numbers, a pass of work between calls).
    When every rank shares this host the rows go through shared memory (`HostExchange`,
    31-84 us against gloo's 423-454 us in the same test), whatever the number of ranks.
    Every rank then sums the same rows in the same order, so every rank gets the same sums.
    """
    world = _group_size(group)
    if world < 2 or dist.get_backend(group) != "gloo":
        return False
    return world <= _GATHER_MAX_RANKS or _host_exchange(group) is not None


def _all_reduce_sum(t: torch.Tensor, group: Group) -> torch.Tensor:
    world = _group_size(group)
    if world == 1:
        return t
    if _gathers(group):
        return _all_gather_flat(t, group).sum(0)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def dims_of(x: torch.Tensor) -> tuple[int, ...]:
    """The dimensions a channel's values span: all but dimension 1."""
    return (0, *range(2, x.dim()))


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (x.shape[1],) + (1,) * (x.dim() - 2)


def shifted_stats(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """This rank's ``[count, shift (C), S1 (C), S2 (C)]`` around a shift common to all ranks (float64).

    ``S1 = sum(x - shift)`` and ``S2 = sum((x - shift)^2)`` per channel, so that the
    element-wise sum over ranks gives the global ``mean = shift + S1/n`` and
    ``M2 = S2 - S1^2/n`` (one all-reduce). They are formed from the rank's own mean
    ``m`` and variance ``v`` (PyTorch's fused batch-norm statistics kernel, one pass):
    ``S1 = n (m - shift)``, ``S2 = n (v + (m - shift)^2)``. When the shift is large
    against ``scale`` (an expected standard deviation) the input is centred on the shift
    first, so ``m`` is small and its rounding harmless. The shift's own row lets every
    rank check that the shift really was common (`_global_stats`).
    """
    c = x.shape[1]
    count = x.numel() // c if c else 0
    out = torch.zeros(3 * c + 1, dtype=torch.float64, device=x.device)
    out[1 : 1 + c].copy_(shift)
    if count == 0:
        return out
    out[0] = count
    xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    shift_x = shift.to(xs.dtype)
    if x.numel() < _SMALL_INPUT:
        # small: float64 throughout, in kernels too small to start a parallel region (the fused
        # kernel parallelises over channels however few values each holds)
        var, offset = torch.var_mean(xs.double() - shift.view(_channel_shape(x)), dims_of(x), correction=0)
    elif bool((shift.abs() > _FOLD_MEAN_LIMIT * scale).any()):
        mean, var = torch.batch_norm_update_stats(xs - shift_x.view(_channel_shape(x)), None, None, 0.0)
        offset = mean.double()
    else:
        mean, var = torch.batch_norm_update_stats(xs, None, None, 0.0)
        offset = mean.double() - shift
    torch.mul(offset, count, out=out[1 + c : 1 + 2 * c])
    torch.mul(offset.square_().add_(var.double()), count, out=out[1 + 2 * c :])
    return out


def _global_stats(x: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                  eps: float, group: Group) -> tuple[int, np.ndarray, np.ndarray]:
    """``(count, mean, M2)`` of the global batch: one all-reduce, Chan's all-gather as the fallback.

    The shift is the running mean (the same on every rank: every rank updates it from
    the same global statistics, DDP broadcasts buffers, a checkpoint restores the same
    values), zeros without running statistics. ``M2 = S2 - S1^2/n`` subtracts
    ``n (mean - shift)^2`` from ``S2``; when the batch mean lies more than
    ``_SHIFT_LIMIT`` standard deviations from the shift (the first steps of a layer
    whose activations sit far from 0) that would cost digits, and every rank - deciding
    on the same reduced numbers - takes the exact path: an ``all_gather`` of
    `local_stats` combined by `combine_stats`.
    """
    c = x.shape[1]
    if running_mean is not None and running_var is not None:
        shift = running_mean.detach().double()
        scale = running_var.detach().double().add(eps).sqrt_()
    else:
        shift = torch.zeros(c, dtype=torch.float64, device=x.device)
        scale = torch.ones(c, dtype=torch.float64, device=x.device)
    world = _group_size(group)
    own_shift = shift.cpu().numpy()
    mine = shifted_stats(x, shift, scale)
    if _gathers(group):
        rows = _all_gather_flat(mine, group).cpu().numpy()
        common = bool((rows[:, 1 : 1 + c] == own_shift).all())  # every rank's own shift row, exactly
        sums = rows.sum(0)
    else:
        sums = _all_reduce_sum(mine, group).cpu().numpy()
        common = np.array_equal(sums[1 : 1 + c], world * own_shift)
    if not common:
        raise UsageError("Expected the same running_mean on every rank of the group (SyncBatchNorm shifts "
                         "its sums by it). Received: a rank whose running_mean differs")
    n = float(sums[0])
    s1, s2 = sums[1 + c : 1 + 2 * c], sums[1 + 2 * c :]
    offset = s1 / max(n, 1.0)
    m2 = np.maximum(s2 - s1 * offset, 0.0)
    if np.all(np.square(offset) * n <= _SHIFT_LIMIT**2 * (m2 + eps * n)):
        return int(n), own_shift + offset, m2
    return combine_stats(_all_gather_flat(local_stats(x), group))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward and backward of batch normalization over the global batch of ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float, group: Group) -> torch.Tensor:
        n, mean64, m264 = _global_stats(x, running_mean, running_var, eps, group)
        if n < 2:
            # every rank sees the same counts, so every rank raises: no rank is left waiting
            raise UsageError("Expected more than 1 value per channel over the global batch when training. "
                             f"Received: {n} (per-rank input shape {tuple(x.shape)})")
        stat_dtype = weight.dtype if weight is not None else (
            torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype)
        # rows: mean, biased variance (to normalise), unbiased variance (running stats, as nn.BatchNorm)
        stats = torch.from_numpy(np.stack([mean64, m264 / n, m264 / (n - 1)])).to(x.device, stat_dtype)
        mean, var = stats[0], stats[1]
        if running_mean is not None and running_var is not None:
            # identical on every rank: computed from the same gathered numbers
            running_mean.lerp_(stats[0].to(running_mean.dtype), momentum)
            running_var.lerp_(stats[2].to(running_var.dtype), momentum)
        # normalise with the global statistics: PyTorch's own eval-mode kernel does it in one pass
        out = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        invstd = (var + eps).rsqrt_()
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count = n
        ctx.eps = eps
        ctx.group = group
        # the backward pass may fold the mean into a per-channel constant (one pass less over x)
        # unless the mean is large against the spread, where forming (x - mean) first keeps it exact
        ctx.centre_first = bool(np.any(np.abs(mean64) > _FOLD_MEAN_LIMIT * np.sqrt(m264 / n + eps)))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        grad_out = grad_out.contiguous(memory_format=_memory_format(x))
        if x.numel() > 0:
            # per-channel sum(grad_out * x_hat) and sum(grad_out), local, in one fused kernel. The two
            # sums do not depend on the weight, but CUDA's kernel needs one (None: "tensor does not
            # have a device", seen on an H100 with affine=False; the CPU's accepts None)
            kernel_weight = weight if weight is not None else torch.ones(c, dtype=mean.dtype, device=x.device)
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad_out, x, kernel_weight, None, None, mean, invstd, True, ctx.eps, [False, True, True])
        else:
            sum_dy_xhat = torch.zeros(c, dtype=mean.dtype, device=x.device)
            sum_dy = torch.zeros(c, dtype=mean.dtype, device=x.device)

        grad_input = None
        if ctx.needs_input_grad[0]:
            sums = _all_reduce_sum(torch.cat([sum_dy, sum_dy_xhat]), ctx.group).view(2, c)
            # dx = k * (dy - mean(dy) - x_hat * mean(dy * x_hat)), k = weight * invstd,
            # x_hat = (x - mean) * invstd, so dx = k * dy + coef[1] * (x - mean) + coef[0] with
            # coef[0] = -k * mean(dy), coef[1] = -k * invstd * mean(dy * x_hat)
            k = invstd if weight is None else invstd * weight
            coef = sums.mul_(k).mul_(-1.0 / ctx.count)
            coef[1].mul_(invstd)
            shape = _channel_shape(x)
            if ctx.centre_first:
                grad_input = torch.addcmul(coef[0].view(shape), x - mean.view(shape), coef[1].view(shape))
            else:  # coef[1] * (x - mean) + coef[0] = coef[1] * x + (coef[0] - coef[1] * mean)
                grad_input = torch.addcmul(coef[0].addcmul_(coef[1], mean, value=-1).view(shape), x,
                                           coef[1].view(shape))
            grad_input.addcmul_(grad_out, k.view(shape))
            grad_input = grad_input.to(x.dtype)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


# ----- conversion ---------------------------------------------------------------------------

def convert_sync_batchnorm(model: nn.Module, process_group: Group = None) -> nn.Module:
    """Replace every batch-norm layer of ``model`` by `SyncBatchNorm`; returns the converted model.

    Converts ``torch.nn.BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm`` and any
    other ``_BatchNorm`` subclass (a `SyncBatchNorm` is kept, with its group
    replaced when ``process_group`` is given). The new layer takes over the same
    parameter and buffer tensors - weights, running statistics,
    ``num_batches_tracked``, ``requires_grad``, device and dtype stay as they
    were, and an optimizer built before the conversion still holds the right
    parameters - plus eps, momentum, affine, track_running_stats and the
    training flag. A ``torch.nn.SyncBatchNorm``'s own group is kept unless
    ``process_group`` is given. Modules are replaced in place inside their
    parents; when ``model`` itself is a batch-norm layer the new one is returned.
    """
    if isinstance(model, SyncBatchNorm):
        if process_group is not None:
            model.process_group = process_group
        return model
    if isinstance(model, _BatchNorm):
        if isinstance(model, _LazyNormBase) and model.has_uninitialized_params():
            raise UsageError("Expected initialized batch-norm layers to convert. Received: a lazy batch-norm "
                             "layer that has not seen an input yet (run one forward pass first)")
        group = process_group if process_group is not None else getattr(model, "process_group", None)
        extra = {} if not model.affine or model.bias is not None else {"bias": False}
        new = SyncBatchNorm(model.num_features, model.eps, model.momentum, model.affine,
                            model.track_running_stats, group, device="meta", **extra)
        # take over the very tensors (no copy): values, requires_grad, device and dtype are kept
        new._parameters.update(model._parameters)
        new._buffers.update(model._buffers)
        new._non_persistent_buffers_set = set(model._non_persistent_buffers_set)
        new.train(model.training)
        if hasattr(model, "qconfig"):
            new.qconfig = model.qconfig
        return new
    for name, child in model.named_children():
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            setattr(model, name, converted)
    return model
