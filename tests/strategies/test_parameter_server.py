"""``ps``: the sharded parameter server, checked against references that do not use it.

Start with `test_sync_equals_a_hand_written_loop`: in sync mode (staleness 0)
the servers average one gradient per worker and step the optimizer once, which
must equal one process training on the concatenated global batch, written by
hand (`tests.helpers.train_by_hand`) - with momentum, an LR scheduler, a last
batch split unevenly between the workers, and across a checkpoint and resume
of the servers' state. The other tests each launch one small job:

- bounded staleness: the fast worker runs up to ``s`` steps ahead of the slow
  one and no further (checked from the workers' own clocks and timestamps, not
  only from what the server says it enforced). The slow worker is slow by
  waiting, before each push, until the server has taken the fast worker's
  gradient that puts it ``s + 1`` ahead: no sleep, so the test holds at any load;
- backup workers: exactly the gradient that arrives late for its version is
  dropped, and the parameters equal a sequential replay of the applied ones;
- async: a worker killed with SIGKILL mid-epoch does not stop `fit`, which
  still reaches 0.9 test accuracy on digits;
- colocated servers (``colocate=True``, a server thread in each worker process):
  the same sync test and checkpoint resume, the staleness bound, and overlap
  through the in-process pipe alone (one worker); the pipe itself against
  gloo's point-to-point rules, without processes.

Precision: the comparisons of parameters run in float64 and hold to
`F64_ATOL` = 1e-10 (a sum split over processes rounds differently from one
process; in float64 that stays near 1e-14 after these tens of steps, see
`tests.helpers`).
"""

import datetime
import functools
import json
import math
import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partrain.errors import UsageError, WorkerError
from partrain.launch import launch
from partrain.models import cnn
from partrain.strategies import get_strategy, parse_options
from partrain.strategies._ps_wire import LocalPipe, frame, plan_shards, split_frame
from partrain.strategies.parameter_server import ParameterServer, ps_optimizer_states
from partrain.train.fit import fit
from tests.helpers import (
    assert_history_matches,
    assert_states_close,
    digits64,
    small_cnn64,
    small_mlp64,
    train_by_hand,
)
from tests.waiting import wait_until

sgd_momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def halve_every_epoch(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


@functools.cache
def by_hand(epochs, max_steps=None):
    """One process, plain PyTorch, on the global batch of 64 (shared by the tests below)."""
    return train_by_hand(small_cnn64, digits64, sgd_momentum, batch=64, epochs=epochs, max_steps=max_steps,
                         scheduler_fn=halve_every_epoch)


def run_fit(strategy, workers, batch, **kw):
    kw.setdefault("quiet", True)
    return fit(small_cnn64, digits64, sgd_momentum, strategy=strategy, workers=workers, batch_size=batch,
               scheduler_fn=halve_every_epoch, return_state=True, timeout=60, **kw)


# ----- no processes ------------------------------------------------------------------------------
def test_shards_are_balanced_by_size_and_deterministic():
    assert plan_shards([100, 60, 50, 10], 2) == [[0, 3], [1, 2]]
    assert plan_shards([5, 5, 5], 1) == [[0, 1, 2]]
    assert plan_shards([7], 3) == [[0], [], []]  # more servers than tensors: some own nothing
    numels = [p.numel() for p in cnn().parameters()]
    loads = [sum(numels[i] for i in shard) for shard in plan_shards(numels, 2)]
    assert sorted(sum(plan_shards(numels, 2), [])) == list(range(len(numels)))
    assert max(loads) - min(loads) <= max(numels)


def test_options_modes_and_roles():
    opts = parse_options("ps", ["servers=2", "staleness=inf", "staleness_lr=true"])
    assert opts == {"servers": 2, "staleness": math.inf, "staleness_lr": True}
    ps = get_strategy("ps", **opts)
    assert ps.survives_worker_loss and ps.extra_processes(3) == 2
    assert ps.roles(5) == ["server", "server", "worker", "worker", "worker"]
    assert not get_strategy("ps").survives_worker_loss  # sync: a lost worker is an error
    assert get_strategy("ps", staleness=2).survives_worker_loss
    colocated = get_strategy("ps", **parse_options("ps", ["colocate=true", "staleness=2"]))
    assert colocated.extra_processes(3) == 0 and colocated.roles(3) == ["worker"] * 3
    assert not colocated.survives_worker_loss  # a dead worker takes its shard with it
    for bad in ({"servers": 0}, {"staleness": -1}, {"backup_workers": 1, "staleness": 2}, {"colocate": "yes"}):
        with pytest.raises(UsageError, match="Expected"):
            get_strategy("ps", **bad)


def test_a_frame_holds_header_and_parts_at_aligned_offsets():
    head = torch.arange(8, dtype=torch.float64)
    buf, (hp, grad) = frame(head, [(3, torch.float64), (5, torch.float32)])
    hp.copy_(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    grad.copy_(torch.arange(5, dtype=torch.float32))
    # the float32 part starts at 64 + 24 bytes; 5 of them take 20 bytes, padded to 24
    assert buf.numel() == 64 + 24 + 24 and buf.dtype == torch.uint8
    got_head, (got_hp, got_grad) = split_frame(buf.clone(), [(3, torch.float64), (5, torch.float32)])
    assert torch.equal(got_head, head) and got_hp.tolist() == [1.0, 2.0, 3.0]
    assert got_grad.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(RuntimeError, match="Expected a parameter-server frame of at least"):
        split_frame(buf[:70], [(3, torch.float64)])


def test_the_in_process_pipe_keeps_gloo_point_to_point_rules():
    """A colocated worker and its server thread talk through `LocalPipe`; the protocol assumes
    gloo's rules: FIFO, receives filled in the order posted, a larger buffer gets a prefix,
    and the sender may reuse its tensor at once."""
    pipe = LocalPipe("test pipe")
    first, second = torch.zeros(4), torch.zeros(2, dtype=torch.float64)
    w1, w2 = pipe.irecv(first), pipe.irecv(second)
    sent = torch.tensor([1.0, 2.0])
    pipe.isend(sent).wait()
    sent.fill_(9.0)  # copied at send: the receiver still gets 1, 2
    pipe.isend(torch.tensor([5.0, 6.0], dtype=torch.float64))
    w2.wait()  # waiting on the second receive fills the first one on the way
    assert first.tolist() == [1.0, 2.0, 0.0, 0.0] and second.tolist() == [5.0, 6.0] and w1.wait()
    small = pipe.irecv(torch.zeros(1))
    pipe.isend(torch.zeros(3))
    with pytest.raises(RuntimeError, match="message of 12 bytes for a 4-byte buffer"):
        small.wait()
    pipe.failed = "the other side died"
    with pytest.raises(RuntimeError, match="the other side died"):
        pipe.irecv(torch.zeros(1)).wait()
    with pytest.raises(RuntimeError, match="no message within"):
        LocalPipe("idle").irecv(torch.zeros(1)).wait(datetime.timedelta(seconds=0.01))


# ----- sync mode: equal to one process on the global batch, also across resume ---------------------
@pytest.mark.parametrize("servers", [1, 2, "colocated"])
def test_sync_equals_a_hand_written_loop(servers, tmp_path):
    # 1437 training samples, global batch 64: epoch 1 is 23 steps, its last batch of 29 split
    # 15 + 14 between the workers; StepLR halves the lr at the epoch's end on the workers, and
    # the servers must follow
    if servers == 1:
        state, history = by_hand(2, 26)
        ps = run_fit(ParameterServer(servers=1), 2, 32, epochs=2, max_steps=26)
        assert ps.final["step"] == 26
        assert ps.final["lr"] == 0.025  # both epochs ended
        assert_history_matches(ps.history, history)
        assert_states_close(ps.model_state, state)
        assert ps.final["ps_staleness_max"] == 0 and ps.final["ps_dropped"] == 0
        assert ps.final["ps_server0_version"] == 26
        return
    # 2 servers (processes, or threads of the 2 workers), and the servers' state (parameters,
    # momentum, version) through a checkpoint: epoch 1, then resume for 3 steps of epoch 2 = 26
    # uninterrupted single-process steps
    def make():
        return ParameterServer(colocate=True) if servers == "colocated" else ParameterServer(servers=2)

    first = run_fit(make(), 2, 32, epochs=1, out_dir=str(tmp_path))
    assert_states_close(first.model_state, by_hand(1)[0])
    resumed = run_fit(make(), 2, 32, epochs=2, max_steps=26, resume=str(tmp_path / "checkpoint.pt"))
    state, history = by_hand(2, 26)
    assert_history_matches(resumed.history, history)
    assert resumed.final["ps_server0_version"] == resumed.final["ps_server1_version"] == 26
    assert_states_close(resumed.model_state, state)


def test_a_checkpoint_crosses_server_counts_and_strategies_with_its_momentum(tmp_path):
    """One epoch each: ps on 2 servers (threads of the workers), ps on 1 server, allreduce,
    each resuming from the last one's checkpoint: equal to 3 epochs in one process. The
    servers hold the momentum: at each switch it must reach the other side (without it the
    next steps differ). The way into ps from another strategy's checkpoint is the one the
    change of server count takes (`adopt_optimizer_state`; `restore` calls it, and hands a
    ps checkpoint's state to another strategy: tests/train/test_resume.py)."""
    runs = [ParameterServer(colocate=True), ParameterServer(servers=1), "allreduce"]
    checkpoint = None
    for epochs, strategy in enumerate(runs, start=1):
        result = run_fit(strategy, 2, 32, epochs=epochs, out_dir=str(tmp_path / str(epochs)), resume=checkpoint)
        state, history = by_hand(epochs)
        assert_history_matches(result.history, history)
        assert_states_close(result.model_state, state)
        checkpoint = result.checkpoint


def test_a_ps_checkpoint_gives_its_servers_optimizer_state_by_parameter():
    """`ps_optimizer_states` by hand: each server's entries go back to the parameter
    numbers the shard plan gave it, with the checkpoint's plan or, for an older checkpoint
    without one, the plan of the resuming optimizer's parameter sizes."""
    numels = [6, 40, 3, 40, 5]
    plan = plan_shards(numels, 2)  # largest first, each to the lighter server: 1, 3, then 0 (46 | 40),
    assert plan == [[0, 1], [2, 3, 4]]  # 4 (46 | 45), 2 (46 | 48)
    shards = []
    for owned in plan:
        tensors = [torch.zeros(sum(numels[i] for i in owned))]  # the shard's parameters
        opt_state = []
        for j, i in enumerate(owned):
            opt_state.append({"param": j, "tensors": {"momentum_buffer": len(tensors)}, "values": {"k": i}})
            tensors.append(torch.full((numels[i],), float(i)))
        meta = {"shapes": [[numels[i]] for i in owned], "opt_state": opt_state}
        shards.append({"meta": json.dumps(meta), "tensors": tensors})
    for state in ({"format": "partrain.ps/1", "servers": shards, "plan": plan},
                  {"format": "partrain.ps/1", "servers": shards}):
        merged = ps_optimizer_states(state, numels)
        assert sorted(merged) == [0, 1, 2, 3, 4]
        for i, one in merged.items():
            assert one["k"] == i and torch.equal(one["momentum_buffer"], torch.full((numels[i],), float(i)))
    bad = {"format": "partrain.ps/1", "servers": shards, "plan": [[0, 1, 2], [3, 4]]}
    with pytest.raises(UsageError, match="Expected the ps checkpoint's server"):
        ps_optimizer_states(bad, numels)


class ServerDiesAfterStart(ParameterServer):
    """A parameter server whose process SIGKILLs itself shortly after it starts serving.

    The timer only picks the moment of the crash: wherever the workers are then (in
    their hello or training), the error must name the server, so no assertion
    depends on its length.
    """

    def run_role(self, role):
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return super().run_role(role)


def _train_forever(strategy):
    net = small_mlp64()
    model, opt = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    for step in range(100_000):
        x, y = _batch(step % 4, strategy.rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_a_dead_server_is_an_error_naming_it():
    with pytest.raises(WorkerError) as info:
        launch(_train_forever, workers=2, strategy=ServerDiesAfterStart(staleness=math.inf), timeout=60)
    assert info.value.rank == 0 and "server" in str(info.value)


# ----- bounded staleness ---------------------------------------------------------------------------
def _batch(step, rank, size=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (size,), generator=g)


def _bounded_worker(strategy, fast_steps, slow_steps, s):
    torch.manual_seed(0)
    net = small_mlp64()
    model, opt = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
    slow = strategy.rank == 1
    times = []
    for step in range(slow_steps if slow else fast_steps):
        x, y = _batch(step, strategy.rank)
        loss = F.cross_entropy(model(x), y)  # the forward waits for the pull the bound allows
        loss.backward()
        if slow:
            # slow by waiting, not sleeping: before its push number j = step + 1 (its clock is
            # step) the server has applied the fast worker's push number step + s + 1, so the fast
            # one is s + 1 ahead and its reply is held back. Every push is applied (bounded mode),
            # so the server's version counts both workers' pushes.
            version = step + (step + s + 1)
            wait_until(lambda version=version: strategy.metrics()["server0_version"] >= version,
                       f"the fast worker's push {step + s + 1}", interval=0.005)
            times.append(time.monotonic())  # before the push leaves: the server sees it later
        else:
            times.append(time.monotonic())  # after this step's parameters arrived
        opt.step()
        opt.zero_grad()
    return strategy.trace, times


@pytest.mark.parametrize("colocate", [False, True])
def test_bounded_staleness_never_lets_a_worker_run_more_than_s_ahead(colocate):
    s, slow_steps = 2, 5
    fast_steps = slow_steps + s + 2  # enough for the slow worker's last wait, and 2 more after it
    # colocated: server 0 is a thread of the fast worker, and the bound holds just the same
    (fast_trace, fast_times), (slow_trace, slow_pushes) = launch(
        _bounded_worker, fast_steps, slow_steps, s, workers=2,
        strategy=ParameterServer(staleness=s, colocate=colocate), timeout=60)
    # the lead the server granted with every reply (the step the worker then computed) is <= s
    assert max(lead for _, _, lead in fast_trace + slow_trace) <= s
    # the bound was reached: each slow push released a reply held at lead s + 1, now s
    assert max(lead for _, _, lead in fast_trace) == s
    # independent check from the workers' clocks: when the fast worker computed its step i it had
    # pushed i gradients, and the slow one had pushed at least i - s (until the slow one finished)
    for i, t in enumerate(fast_times):
        slow_clock = sum(tp < t for tp in slow_pushes)
        if slow_clock < slow_steps:
            assert slow_clock >= i - s, (i, slow_clock)
    # all gradients applied; the slow worker's ones saw updates from the fast one in between
    assert all(applied for _, applied, _ in fast_trace + slow_trace)
    assert max(tau for tau, _, _ in slow_trace) >= 1


# ----- overlap: the next step computes while the reply to the last push is in flight ---------------
def _overlap_worker(strategy, steps):
    torch.manual_seed(0)
    net = small_mlp64().double()
    model, opt = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
    for step in range(steps):
        x, y = _batch(step, 0)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in strategy.model_state_dict(model).items()}


@pytest.mark.parametrize("colocate", [False, True])
def test_overlap_is_sgd_on_the_gradient_one_step_back(colocate):
    """One worker, overlap=True: P[t+1] = P[t] - lr * grad(P[t-1]) (P[-1] = P[0]), in float64.

    The forward of step t runs before the reply to push t-1 is loaded, so each gradient
    is one update older than without overlap: an independent delayed-SGD loop must agree.
    Colocated, the one worker's server is a thread of its own process: only the in-process pipe.
    """
    steps = 5
    (state,) = launch(_overlap_worker, steps, workers=1,
                      strategy=ParameterServer(staleness=math.inf, overlap=True, colocate=colocate), timeout=60)
    torch.manual_seed(0)
    net = small_mlp64().double()
    params = [p.detach().clone() for p in net.parameters()]
    previous = [p.clone() for p in params]
    for step in range(steps):
        with torch.no_grad():
            for p, q in zip(net.parameters(), previous):
                p.copy_(q)
        x, y = _batch(step, 0)
        grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
        previous = [p.clone() for p in params]
        params = [p - 0.05 * g for p, g in zip(params, grads)]
    for (name, got), want in zip(state.items(), params):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=name)
    with pytest.raises(UsageError, match="Expected overlap only with staleness > 0"):
        ParameterServer(overlap=True)


# ----- backup workers ------------------------------------------------------------------------------
def _wait_for(path):
    wait_until(lambda: os.path.exists(path), path)


def _backup_worker(strategy, k, m, flag_dir):
    torch.manual_seed(0)
    net = small_mlp64()
    model, opt = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    if strategy.rank == 0:
        _wait_for(os.path.join(flag_dir, "w1-ready"))  # worker 1 holds version 0
        for step in range(k):
            x, y = _batch(step, 0)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        strategy.close()
        open(os.path.join(flag_dir, "w0-done"), "w").close()
        return strategy.trace, None, None
    open(os.path.join(flag_dir, "w1-ready"), "w").close()
    _wait_for(os.path.join(flag_dir, "w0-done"))  # so its first gradient (on version 0) is late
    for step in range(m):
        x, y = _batch(step, 1)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in strategy.model_state_dict(model).items()}
    return strategy.trace, state, strategy.metrics()


def test_backup_workers_drop_exactly_the_late_gradients(tmp_path):
    k, m = 4, 3
    (trace0, _, _), (trace1, state, metrics) = launch(
        _backup_worker, k, m, str(tmp_path), workers=2, strategy=ParameterServer(backup_workers=1), timeout=60)
    # with N=2, b=1 a version is applied from its first gradient: worker 0 never waits
    assert trace0 == [(0, 1, 0)] * k
    # worker 1's first gradient was computed on version 0 and arrived at version k: dropped
    assert trace1[0] == (k, 0, 0) and all(applied for _, applied, _ in trace1[1:])
    assert metrics["dropped"] == metrics["worker1_dropped"] == 1 and metrics["worker0_dropped"] == 0
    # reference: one process applying exactly the gradients that were not dropped, in order
    torch.manual_seed(0)
    ref = small_mlp64()  # float64: gradients computed here and in the workers round alike to 1e-10
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for rank, step in [(0, i) for i in range(k)] + [(1, i) for i in range(1, m)]:
        x, y = _batch(step, rank)
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert_states_close(state, ref.state_dict())


# ----- async: a killed worker, and accuracy ----------------------------------------------------------
class DiesMidEpoch(nn.Module):
    """A CNN whose process SIGKILLs itself at a training forward pass, on one global rank."""

    def __init__(self, rank: int, at_call: int) -> None:
        super().__init__()
        self.net = cnn()
        self.rank, self.at_call, self.calls = rank, at_call, 0

    def forward(self, x):
        if self.training and os.environ.get("RANK") == str(self.rank):
            self.calls += 1
            if self.calls == self.at_call:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


@pytest.mark.fresh_processes  # capfd sees the server's warning only in processes started inside the test,
def test_async_survives_a_killed_worker_and_learns_digits(capfd, monkeypatch):
    # and only with ``spawn``: a fork server's children write to the descriptors it started with
    monkeypatch.setenv("PARTRAIN_START_METHOD", "spawn")
    # ranks: 0 = server, 1 and 2 = workers; worker rank 2 dies at its 10th step of epoch 1
    model_fn = functools.partial(DiesMidEpoch, rank=2, at_call=10)
    opt = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    result = fit(model_fn, "digits", opt, strategy=ParameterServer(staleness=math.inf, staleness_lr=True),
                 workers=2, epochs=4, batch_size=32, quiet=True, timeout=60)
    assert [row["epoch"] for row in result.history] == [1, 2, 3, 4]
    assert result.final["ps_dead_workers"] == 1
    assert result.test_accuracy >= 0.9
    assert "worker 1 (rank 2) is gone" in capfd.readouterr().err
