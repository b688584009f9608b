"""SyncBatchNorm = torch.nn.BatchNorm on the concatenated global batch.

Where to start reading: `test_two_ranks_equal_batchnorm_on_global_batch`. It
launches 2 gloo workers once, runs every case there (2D to 5D inputs, uneven and
empty per-rank batches, affine or not, momentum=None, no running stats, eval,
a large mean, DDP training with gradient accumulation) and checks the results
in the parent against nn.BatchNorm*d run on the concatenated batch. The other
tests need no second process: the single-process path, the statistics
combination (Chan) and its precision, gradcheck, conversion.

Precision: the two-rank cases and the DDP training run in float64 and agree
with BatchNorm to `F64_ATOL` = 1e-10. Statistics combined from two ranks add
in another order than one BatchNorm kernel over the whole batch, and CPUs and
thread counts change that order again; in float64 the difference stays near
1e-14 over these few steps (see `tests.helpers`). The large-mean case is the
exception on purpose: it is about float32, and is held to BatchNorm's own
float32 error instead of a fixed tolerance.
"""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import partrain
from partrain.errors import UsageError
from partrain.nn import SyncBatchNorm, convert_sync_batchnorm
from partrain.nn.sync_batchnorm import (
    _global_stats,
    _SyncBatchNormFunction,
    combine_stats,
    local_stats,
    naive_variance,
    shifted_stats,
)
from tests.helpers import F64_ATOL

BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def reduce_dims(x):
    return (0, *range(2, x.dim()))


# ----- one process -----------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [2, 3, 4, 5])
@pytest.mark.parametrize("kwargs", [{}, {"affine": False}, {"momentum": None}, {"track_running_stats": False}])
def test_single_process_is_exactly_batchnorm(dims, kwargs):
    torch.manual_seed(dims)
    shape = (6, 3, 4, 3, 2)[:dims]
    ref = BN[dims](3, **kwargs)
    sync = convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(sync, SyncBatchNorm)
    for step in range(2):
        x = torch.randn(shape) * 2 + step
        xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, ys = ref(xr), sync(xs)
        yr.square().sum().backward()
        ys.square().sum().backward()
        assert torch.equal(yr, ys) and torch.equal(xr.grad, xs.grad)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), sync.state_dict().values()))
    ref.eval(), sync.eval()
    x = torch.randn(shape)
    assert torch.equal(ref(x), sync(x))


@pytest.mark.parametrize("shape", [(4, 3), (3, 3, 2), (2, 3, 2, 2), (2, 3, 1, 2, 2)])
def test_sync_function_gradients_pass_gradcheck(shape):
    """The autograd Function itself (world of one) against finite differences, float64."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def affine(x, w, b):
        return _SyncBatchNormFunction.apply(x, w, b, None, None, 1e-5, 0.1, None)

    def plain(x):
        return _SyncBatchNormFunction.apply(x, None, None, None, None, 1e-5, 0.1, None)

    assert torch.autograd.gradcheck(affine, (x, w, b))
    assert torch.autograd.gradcheck(plain, (x,))
    # and it equals F.batch_norm's training mode
    ref = F.batch_norm(x, None, None, w, b, True, 0.1, 1e-5)
    torch.testing.assert_close(affine(x, w, b), ref)


def test_chan_combination_equals_statistics_of_the_union():
    torch.manual_seed(0)
    x = torch.randn(23, 4, 3, dtype=torch.float64) * 3 + 7
    parts = torch.split(x, [5, 0, 1, 17])  # an empty and a one-sample part
    count, mean, m2 = combine_stats(torch.stack([local_stats(p) for p in parts]))
    assert count == 23 * 3
    torch.testing.assert_close(torch.from_numpy(mean), x.mean((0, 2)), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.from_numpy(m2 / count), x.var((0, 2), unbiased=False), rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_part", [1, 1000])  # small parts (plain float64 kernels), large (fused kernel)
@pytest.mark.parametrize("shift", [0.0, 7.5, 40.0])  # near the mean (direct), far (centred first)
def test_shifted_sums_of_parts_add_up_to_the_union(shift, per_part):
    """The one-all-reduce path: element-wise sums of per-rank shifted sums give mean and M2."""
    torch.manual_seed(0)
    x = torch.randn(23, 4, 3 * per_part, dtype=torch.float64) * 3 + 7
    s = torch.full((4,), shift, dtype=torch.float64)
    rows = [shifted_stats(p, s, torch.ones(4, dtype=torch.float64)) for p in torch.split(x, [5, 0, 1, 17])]
    total = torch.stack(rows).sum(0)
    n, s1, s2 = total[0].item(), total[5:9], total[9:]
    assert n == 23 * 3 * per_part and torch.equal(total[1:5], 4 * s)  # the shift row: every part's shift
    torch.testing.assert_close(s + s1 / n, x.mean((0, 2)), rtol=0, atol=1e-12)
    torch.testing.assert_close((s2 - s1 * s1 / n) / n, x.var((0, 2), unbiased=False), rtol=0, atol=1e-10)


def test_global_stats_fall_back_to_chan_when_the_shift_is_far(monkeypatch):
    """Shift (running mean) within a few std of the batch mean: shifted sums; far: Chan's path."""
    import partrain.nn.sync_batchnorm as sbn
    calls = []
    monkeypatch.setattr(sbn, "local_stats", lambda x: calls.append(1) or local_stats(x))
    x = large_mean_batch().double()
    exact_mean, exact_var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    for running_mean, chan in ((torch.zeros(4), True), (exact_mean.float() + 0.5, False)):
        calls.clear()
        n, mean, m2 = _global_stats(x, running_mean.double(), torch.ones(4, dtype=torch.float64), 1e-5, None)
        assert bool(calls) == chan
        torch.testing.assert_close(torch.from_numpy(mean), exact_mean, rtol=0, atol=1e-9)
        torch.testing.assert_close(torch.from_numpy(m2) / n, exact_var, rtol=0, atol=1e-9)


def large_mean_batch(n=64, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 1e4 + torch.randn(n, c, 5, 5, generator=g)


def test_large_mean_statistics_are_as_accurate_as_batchnorm_and_naive_is_not():
    """Mean 1e4, std 1, float32: the combined variance is as accurate as BatchNorm's own.

    The textbook E[x^2]-E[x]^2 in float32 loses everything: the squares (~1e8)
    are spaced 8 apart, the variance is ~1.
    """
    x = large_mean_batch()
    exact = x.double().var((0, 2, 3), unbiased=False)
    _, var_bn = torch.batch_norm_update_stats(x, None, None, 0.0)
    bn_err = (var_bn.double() - exact).abs().max().item()
    _, _, m2 = combine_stats(torch.stack([local_stats(p) for p in torch.split(x, [30, 0, 34])]))
    ours_err = (torch.from_numpy(m2) / x[:, 0].numel() - exact).abs().max().item()
    naive_err = (naive_variance(x, (0, 2, 3)).double() - exact).abs().max().item()
    assert ours_err <= 2 * bn_err + 1e-6
    assert naive_err > 1000 * max(bn_err, 1e-6)
    assert naive_err > 0.1  # of a variance of about 1


def test_convert_keeps_parameters_buffers_and_options():
    torch.manual_seed(0)
    bn2 = nn.BatchNorm2d(4, eps=1e-3, momentum=0.3).double()
    bn2.weight.requires_grad_(False)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), bn2, nn.Sequential(nn.BatchNorm1d(3, momentum=None)),
                          nn.BatchNorm3d(2, affine=False), nn.BatchNorm1d(5, track_running_stats=False),
                          nn.SyncBatchNorm(6))
    bn2.train()(torch.randn(8, 4, 3, 3, dtype=torch.float64))
    model[2][0].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight = bn2.weight
    params = list(model.parameters())

    out = convert_sync_batchnorm(model)
    assert out is model
    kinds = [type(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert kinds == [SyncBatchNorm] * 5
    s = model[1]
    assert s.weight is weight and not s.weight.requires_grad and s.weight.dtype == torch.float64
    assert (s.eps, s.momentum, s.num_batches_tracked.item()) == (1e-3, 0.3, 1)
    assert model[2][0].momentum is None and not model[2][0].training and model[1].training
    assert model[3].weight is None and model[4].running_mean is None
    assert list(model.parameters()) == params  # an optimizer built before still holds them
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    root = convert_sync_batchnorm(nn.BatchNorm1d(3))
    assert isinstance(root, SyncBatchNorm)
    no_bias = convert_sync_batchnorm(nn.BatchNorm2d(3, bias=False))
    assert no_bias.bias is None and no_bias.weight is not None


def test_bad_input_is_one_clear_error():
    m = SyncBatchNorm(3)
    with pytest.raises(UsageError, match="2D to 5D"):
        m(torch.randn(2, 3, 1, 1, 1, 1))
    with pytest.raises(UsageError, match="3 channels"):
        m(torch.randn(4, 5))
    with pytest.raises(UsageError, match="positive number of features"):
        SyncBatchNorm(0)


# ----- two ranks -------------------------------------------------------------------------------

def make_cases():
    """float64 cases (see the module docstring), and the large-mean one in float32."""
    g = torch.Generator().manual_seed(1)
    f64 = {"generator": g, "dtype": torch.float64}

    def case(shape, sizes, steps=2, **kwargs):
        c = shape[0]
        n = sum(sizes)
        xs = [torch.randn(n, *shape, **f64) * 3 + 2 for _ in range(steps)]
        rs = [torch.randn(n, *shape, **f64) for _ in range(steps)]
        affine = kwargs.get("affine", True)
        w = torch.rand(c, **f64) + 0.5 if affine else None
        b = torch.randn(c, **f64) if affine else None
        return {"xs": xs, "rs": rs, "sizes": sizes, "kwargs": kwargs, "weight": w, "bias": b}

    cases = [
        case((3,), [3, 5]),                                    # 2D
        case((3,), [1, 3]),                                    # 2D, one sample on rank 0
        case((3, 4), [4, 4]),                                  # 3D
        case((3, 4, 4), [5, 0]),                               # 4D, rank 1 empty
        case((3, 1, 1), [1, 2]),                               # 4D, 1 value per channel on rank 0
        case((2, 3, 2, 2), [2, 3]),                            # 5D
        case((3, 2, 2), [3, 4], affine=False),
        case((3, 2, 2), [4, 2], steps=3, momentum=None),
        case((3, 2, 2), [3, 3], track_running_stats=False),
        case((3, 2, 2), [0, 4], eps=1e-3, momentum=0.5),       # rank 0 empty
    ]
    big = large_mean_batch(n=32)
    cases.append({"xs": [big], "rs": [torch.randn(big.shape, generator=g)], "sizes": [12, 20], "kwargs": {},
                  "weight": None, "bias": None, "large": True})
    return cases


def train_case(m, case, lo=None, hi=None):
    """Train ``m`` on the case's steps (rows lo:hi of each batch); gradients and stats per step."""
    if case["weight"] is not None:
        with torch.no_grad():
            m.weight.copy_(case["weight"])
            m.bias.copy_(case["bias"])
    out = {"y": [], "dx": [], "dw": [], "db": [], "stats": []}
    for x, r in zip(case["xs"], case["rs"]):
        x = x[lo:hi].clone().requires_grad_()
        y = m(x)
        (y * r[lo:hi]).sum().backward()
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
        if m.weight is not None:
            out["dw"].append(m.weight.grad.clone())
            out["db"].append(m.bias.grad.clone())
            m.zero_grad()
        out["stats"].append({k: v.clone() for k, v in m.state_dict().items() if k.startswith(("running", "num"))})
    m.eval()
    return out


def run_sync_case(case, rank):
    sizes = case["sizes"]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    m = SyncBatchNorm(case["xs"][0].shape[1], **case["kwargs"], dtype=case["xs"][0].dtype)
    out = train_case(m, case, lo, hi)
    out["eval"] = m(case["xs"][-1][lo:hi])
    return out


def ddp_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).double()


def ddp_data():
    g = torch.Generator().manual_seed(4)
    # 3 steps, 2 micro-batches per step, 2 ranks, 3 samples each
    return (torch.randn(3, 2, 2, 3, 2, 4, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (3, 2, 2, 3), generator=g))


def run_ddp(strategy, accumulate):
    """allreduce (DDP) training of a converted model, with or without gradient accumulation."""
    model = convert_sync_batchnorm(ddp_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = strategy.prepare(model, opt)
    xs, ys = ddp_data()
    for step in range(xs.shape[0]):
        for micro in range(accumulate):
            x, y = xs[step, micro, strategy.rank], ys[step, micro, strategy.rank]
            ctx = strategy.no_sync(model) if micro < accumulate - 1 else torch.enable_grad()
            with ctx:
                (F.cross_entropy(model(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return strategy.unwrap(model).state_dict()


def reference_ddp(accumulate):
    model = ddp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = ddp_data()
    for step in range(xs.shape[0]):
        for micro in range(accumulate):
            x, y = xs[step, micro].flatten(0, 1), ys[step, micro].flatten(0, 1)
            (F.cross_entropy(model(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def too_few_values(rank):
    """A global batch of 0 or 1 value per channel: every rank raises the same error, none hangs."""
    errors = []
    for sizes in ([0, 0], [1, 0]):
        try:
            SyncBatchNorm(3)(torch.randn(sizes[rank], 3))
        except UsageError as exc:
            errors.append(str(exc))
    return errors


def shift_mismatch(rank):
    """Ranks whose running means differ: the shifted sums would be wrong, so every rank raises."""
    m = SyncBatchNorm(3)
    with torch.no_grad():
        m.running_mean.fill_(float(rank))
    try:
        m(torch.randn(4, 3))
    except UsageError as exc:
        return str(exc)
    return None


def two_rank_worker(strategy, cases):
    import partrain.nn.sync_batchnorm as sbn
    out = {
        "cases": [run_sync_case(case, strategy.rank) for case in cases],
        "ddp": run_ddp(strategy, 1),
        "ddp_accumulate": run_ddp(strategy, 2),
        "too_few": too_few_values(strategy.rank),
        "mismatch": shift_mismatch(strategy.rank),
    }
    out["host_exchange"] = sbn._host_exchange(None) is not None
    # the same through gloo's all-gather (ranks on several hosts), then through all-reduces
    # (more than _GATHER_MAX_RANKS gloo ranks over several hosts, or NCCL)
    exchange, gather_max = sbn._HOST_EXCHANGE, sbn._GATHER_MAX_RANKS
    sbn._HOST_EXCHANGE = False
    try:
        out["gloo_cases"] = [run_sync_case(case, strategy.rank) for case in cases[:3]]
        sbn._GATHER_MAX_RANKS = 1
        out["reduce_cases"] = [run_sync_case(case, strategy.rank) for case in cases[:3]]
        out["reduce_mismatch"] = shift_mismatch(strategy.rank)
    finally:
        sbn._HOST_EXCHANGE, sbn._GATHER_MAX_RANKS = exchange, gather_max
    return out


def reference_case(case):
    x0 = case["xs"][0]
    m = BN[x0.dim()](x0.shape[1], **case["kwargs"]).to(x0.dtype)
    out = train_case(m, case)
    # eval mode is local to each rank (without running stats, each rank's own batch statistics)
    out["eval"] = [m(part) for part in torch.split(case["xs"][-1], case["sizes"])]
    return out


def close(a, b, what, atol=F64_ATOL):
    assert a.dtype == b.dtype and a.dtype in (torch.float64, torch.int64), what  # the tolerance is float64's
    torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


def check_case(case, ranks, what):
    """Two ranks' outputs, gradients, statistics and evaluation against BatchNorm on the global batch."""
    ref = reference_case(case)
    for step in range(len(case["xs"])):
        close(torch.cat([r["y"][step] for r in ranks]), ref["y"][step], f"{what} output step {step}")
        close(torch.cat([r["dx"][step] for r in ranks]), ref["dx"][step], f"{what} input grad step {step}")
        if ref["dw"]:
            # local sums: their sum over ranks is the global gradient (DDP averages them)
            close(ranks[0]["dw"][step] + ranks[1]["dw"][step], ref["dw"][step], f"{what} weight grad")
            close(ranks[0]["db"][step] + ranks[1]["db"][step], ref["db"][step], f"{what} bias grad")
        for key, value in ref["stats"][step].items():
            assert torch.equal(ranks[0]["stats"][step][key], ranks[1]["stats"][step][key]), f"{what} {key}"
            close(ranks[0]["stats"][step][key], value, f"{what} {key} step {step}")
    for rank in range(2):
        close(ranks[rank]["eval"], ref["eval"][rank], f"{what} eval rank {rank}")


@pytest.fixture(scope="module")
def two_ranks():
    cases = make_cases()
    results = partrain.launch(two_rank_worker, cases, workers=2, timeout=60)
    return cases, results


def test_two_ranks_equal_batchnorm_on_global_batch(two_ranks):
    cases, results = two_ranks
    for i, case in enumerate(cases):
        if case.get("large"):
            continue
        what = f"case {i} {tuple(case['xs'][0].shape[1:])} sizes={case['sizes']} {case['kwargs']}"
        check_case(case, [r["cases"][i] for r in results], what)
    assert results[0]["cases"][3]["y"][0].shape[0] == 5 and results[1]["cases"][3]["y"][0].shape[0] == 0


def test_two_ranks_large_mean_as_accurate_as_batchnorm(two_ranks):
    """Mean 1e4, std 1, float32: no less accurate than nn.BatchNorm2d against float64."""
    cases, results = two_ranks
    i = next(i for i, c in enumerate(cases) if c.get("large"))
    case, ranks = cases[i], [r["cases"][i] for r in results]
    x, r = case["xs"][0], case["rs"][0]
    exact, bn32 = reference_case({**case, "xs": [x.double()], "rs": [r.double()]}), reference_case(case)
    for key in ("y", "dx"):
        ours = torch.cat([rk[key][0] for rk in ranks]).double()
        bn_err = (bn32[key][0].double() - exact[key][0]).abs().max().item()
        our_err = (ours - exact[key][0]).abs().max().item()
        assert our_err <= 2 * bn_err + 1e-6, (key, our_err, bn_err)
    exact_var = exact["stats"][0]["running_var"]
    bn_err = (bn32["stats"][0]["running_var"].double() - exact_var).abs().max().item()
    our_err = (ranks[0]["stats"][0]["running_var"].double() - exact_var).abs().max().item()
    assert our_err <= 2 * bn_err + 1e-6
    # what an all-reduce of sum and sum of squares would give: off by orders of magnitude
    naive = naive_variance(x, (0, 2, 3)).double() * x[:, 0].numel() / (x[:, 0].numel() - 1)
    naive_running = 0.9 + 0.1 * naive
    assert (naive_running - exact_var).abs().max().item() > 100 * max(bn_err, 1e-7)


@pytest.mark.parametrize("key", ["ddp", "ddp_accumulate"])
def test_ddp_training_equals_single_process_on_global_batch(two_ranks, key):
    """Under allreduce (DDP), with and without no_sync accumulation: = BatchNorm on the global batch."""
    _, results = two_ranks
    ref = reference_ddp(2 if key == "ddp_accumulate" else 1)
    a, b = results[0][key], results[1][key]
    assert a.keys() == ref.keys()
    for k in ref:
        assert torch.equal(a[k], b[k]), k
        close(a[k], ref[k], f"{key} {k}")


def test_two_ranks_too_few_values_is_an_error_on_every_rank(two_ranks):
    _, results = two_ranks
    for r in results:
        assert len(r["too_few"]) == 2
        assert "more than 1 value per channel" in r["too_few"][0] and "Received: 0" in r["too_few"][0]
        assert "Received: 1" in r["too_few"][1]


@pytest.mark.parametrize("path", ["gloo_cases", "reduce_cases"])
def test_two_ranks_through_gloo_equal_batchnorm_on_global_batch(two_ranks, path):
    """gloo's all-gather (ranks on several hosts) and the all-reduce path (more gloo ranks than an
    all-gather pays for, or NCCL) against the reference; the other tests ran through shared memory."""
    cases, results = two_ranks
    if sys.platform.startswith("linux"):
        assert all(r["host_exchange"] for r in results)
    for i, case in enumerate(cases[:3]):
        ref = reference_case(case)
        lo = 0
        for rank, size in enumerate(case["sizes"]):
            got = results[rank][path][i]
            for step in range(len(case["xs"])):
                close(got["y"][step], ref["y"][step][lo:lo + size], f"case {i} rank {rank} y")
                close(got["dx"][step], ref["dx"][step][lo:lo + size], f"case {i} rank {rank} dx")
            lo += size


def test_ranks_with_different_running_means_get_one_error_on_every_rank(two_ranks):
    _, results = two_ranks
    for key in ("mismatch", "reduce_mismatch"):
        for r in results:
            assert r[key] is not None and "same running_mean on every rank" in r[key], (key, r[key])
