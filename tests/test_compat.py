"""partrain's version-dependent and private torch calls (`partrain._compat`, `partrain.comm`'s timeouts).

Why it exists: each probe answers a question about the installed torch; when torch moves, the
probe's fallback takes over silently. These tests check each answer against what this torch
actually does (not against the probe's own reading), and each fallback by taking the probed
name away.
"""

from __future__ import annotations

import datetime
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from partrain import _compat, comm
from partrain.errors import UsageError


@pytest.fixture
def fresh_probes():
    """The cached probes asked again, before the test and after it (after its monkeypatching)."""
    for probe in (_compat.ddp_accepts, _compat.batchnorm_takes_bias, _compat.engine_backward):
        probe.cache_clear()
    yield
    for probe in (_compat.ddp_accepts, _compat.batchnorm_takes_bias, _compat.engine_backward):
        probe.cache_clear()


def test_ddp_accepts_exactly_the_keywords_the_probe_says(tmp_path):
    """For both names of the buffer switch, constructing DDP with it works iff the probe says so;
    the keyword partrain passes is one DDP takes."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for name in ("forward_sync_buffers", "broadcast_buffers"):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated in 2.13
                    nn.parallel.DistributedDataParallel(nn.Linear(2, 2), **{name: False})
                accepted = True
            except TypeError:
                accepted = False
            assert _compat.ddp_accepts(name) == accepted, name
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2), **_compat.ddp_buffer_sync(False))
        assert isinstance(ddp, nn.parallel.DistributedDataParallel)
    finally:
        dist.destroy_process_group()


def test_ddp_keywords_fall_back_to_the_long_standing_name_without_a_signature(monkeypatch, fresh_probes):
    def no_signature(obj):
        raise ValueError(f"no signature found for {obj!r}")

    monkeypatch.setattr(_compat, "inspect", types.SimpleNamespace(signature=no_signature))
    assert _compat.ddp_accepts("broadcast_buffers") and not _compat.ddp_accepts("forward_sync_buffers")
    assert _compat.ddp_buffer_sync(True) == {"broadcast_buffers": True}


def test_batchnorm_bias_option_matches_what_batchnorm_accepts():
    if _compat.batchnorm_takes_bias():
        assert nn.BatchNorm1d(3, bias=False).bias is None
    else:
        with pytest.raises(TypeError):
            nn.BatchNorm1d(3, bias=False)


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_the_step_dtype_is_the_one_adam_itself_uses(default):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.Adam([p], foreach=False)
        p.grad = torch.ones(2)
        opt.step()
        assert opt.state[p]["step"].dtype == _compat.optimizer_step_dtype()
    finally:
        torch.set_default_dtype(previous)


def test_without_a_bias_option_sync_batchnorm_refuses_bias_false(monkeypatch, fresh_probes):
    """The probe reads batch norm's signature: one without ``bias`` (older torch) is a release
    where ``SyncBatchNorm(bias=False)`` is one clear line, not torch's TypeError."""
    from torch.nn.modules.batchnorm import _BatchNorm

    from partrain.nn import SyncBatchNorm

    def old_init(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None):  # torch < 2.13's signature
        raise AssertionError("not called")

    monkeypatch.setattr(_BatchNorm, "__init__", old_init)
    assert not _compat.batchnorm_takes_bias()
    with pytest.raises(UsageError, match="bias=False"):
        SyncBatchNorm(3, bias=False)


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_the_step_dtype_falls_back_without_torchs_private_function(monkeypatch, default):
    import torch.optim.optimizer as optimizer_module

    monkeypatch.delattr(optimizer_module, "_get_scalar_dtype")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        assert _compat.optimizer_step_dtype() == default
    finally:
        torch.set_default_dtype(previous)


def test_mark_static_address_does_nothing_where_torch_lacks_it(monkeypatch):
    import torch._dynamo

    seen = []
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t, guard=True: seen.append(guard))
    _compat.mark_static_address(torch.zeros(1))
    assert seen == [False]
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t: seen.append("no guard keyword"))
    _compat.mark_static_address(torch.zeros(1))
    assert seen == [False, "no guard keyword"]
    monkeypatch.delattr(torch._dynamo, "mark_static_address")
    _compat.mark_static_address(torch.zeros(1))  # no error


def test_a_group_partrain_made_reports_the_timeout_it_was_made_with(tmp_path):
    comm.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=37.0)
    try:
        sub = comm.new_group([0], timeout=11.0)
        assert comm.group_timeout() == 37.0 and comm.group_timeout(sub) == 11.0
    finally:
        dist.destroy_process_group()
        comm.forget_groups()


def test_a_group_made_elsewhere_reports_torchs_own_timeout_or_the_default(tmp_path, monkeypatch):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=23))
    try:
        read = _compat.process_group_timeout(dist.group.WORLD)
        assert read in (23.0, None)  # None: this torch keeps it where the probe cannot read it
        assert comm.group_timeout() == (read if read is not None else dist.default_pg_timeout.total_seconds())
        monkeypatch.delattr(dist.ProcessGroup, "_get_backend")  # the private name the probe reads
        assert _compat.process_group_timeout(dist.group.WORLD) is None
        assert comm.group_timeout() == dist.default_pg_timeout.total_seconds()
    finally:
        dist.destroy_process_group()


def test_all_gather_into_puts_rows_in_rank_order(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        out = torch.empty(3)
        _compat.all_gather_into(out, torch.tensor([1.0, 2.0, 3.0]))
        assert out.tolist() == [1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()


def _grads_after(backward) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    for _ in range(2):  # gradients accumulate, as over micro-batches
        per_sample = nn.functional.cross_entropy(model(x), y, reduction="none")
        backward(per_sample, torch.full_like(per_sample, 0.25))
    return [p.grad for p in model.parameters()]


def test_backward_with_equals_tensor_backward_and_falls_back_without_the_engine_call(monkeypatch, fresh_probes):
    """Straight into the engine (this torch) or through ``Tensor.backward`` (no usable private
    call): the gradients ``Tensor.backward`` gives, accumulated alike."""
    reference = _grads_after(lambda out, grad: out.backward(grad))
    assert _compat.engine_backward() is not None  # this torch has the call the fast path uses
    for got, want in zip(_grads_after(_compat.backward_with), reference):
        assert torch.equal(got, want)
    import torch.autograd.graph as graph

    monkeypatch.setattr(graph, "_engine_run_backward", lambda *a, **k: (_ for _ in ()).throw(TypeError("moved")))
    _compat.engine_backward.cache_clear()
    assert _compat.engine_backward() is None
    for got, want in zip(_grads_after(_compat.backward_with), reference):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="does not require grad"):
        _compat.backward_with(torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
