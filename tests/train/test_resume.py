"""Resume continues exactly: same strategy and world size give the parameters of an uninterrupted run.

Precision: bit for bit. Both runs are the same 2 processes with one intra-op
thread each (pinned with ``threads=1``, so the launcher's share of the cores
cannot differ), doing the same operations on the same numbers in the same
order; any state the checkpoint fails to restore (momentum, data order, the
random stream) changes bits.
"""

import json
import os
from types import SimpleNamespace

import torch
from torch import nn

from partrain.checkpoint import load_checkpoint
from partrain.env import DistEnv
from partrain.strategies.local_sgd import LocalSGD
from partrain.strategies.single import Single
from partrain.train.fit import fit
from partrain.train.resume import restore
from partrain.train.schedule import Schedule
from tests.helpers import assert_states_close, sgd, small_cnn


def test_resume_equals_uninterrupted(tmp_path):
    common = dict(strategy="allreduce", workers=2, batch_size=32, quiet=True, timeout=60, return_state=True,
                  threads=1)
    full = fit(small_cnn, "digits", sgd, epochs=2, out_dir=str(tmp_path / "full"), **common)
    part = str(tmp_path / "part")
    fit(small_cnn, "digits", sgd, epochs=1, out_dir=part, **common)
    ckpt = load_checkpoint(os.path.join(part, "checkpoint.pt"))
    assert ckpt["epoch"] == 1 and ckpt["optimizer"]["state"], "momentum buffers must be saved"
    resumed = fit(small_cnn, "digits", sgd, epochs=2, out_dir=part, resume="auto", **common)
    assert [r["epoch"] for r in resumed.history] == [1, 2]
    assert_states_close(resumed.model_state, full.model_state, atol=0)
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert resumed.final[key] == full.final[key]
    lines = open(os.path.join(part, "metrics.jsonl")).read().splitlines()
    assert len(lines) == 2
    assert os.path.exists(os.path.join(part, "curves.png"))
    assert open(os.path.join(part, "metrics.csv")).read().count("\n") == 3


def frozen_mlp():
    from partrain.nn import freeze, idx
    from tests.helpers import small_mlp

    model = small_mlp()
    freeze(model[1].weight, idx[:4, :10])
    return model


def test_fit_keeps_frozen_slices_across_checkpoint_and_resume(tmp_path):
    """freeze() in the factory: frozen elements never move, also after a resume from the checkpoint."""
    import torch

    from partrain.nn import frozen_mask

    torch.manual_seed(0)
    initial = frozen_mlp()[1].weight.detach().clone()  # fit seeds the same way before the factory
    common = dict(strategy="allreduce", workers=2, batch_size=32, quiet=True, timeout=60, return_state=True)
    out = str(tmp_path / "run")
    fit(frozen_mlp, "digits", sgd, epochs=1, out_dir=out, **common)
    ckpt = load_checkpoint(os.path.join(out, "checkpoint.pt"))
    assert ckpt["freeze"]["1.weight"][:4, :10].all()
    resumed = fit(frozen_mlp, "digits", sgd, epochs=2, out_dir=out, resume="auto", **common)
    w = resumed.model_state["1.weight"]
    assert torch.equal(w[:4, :10], initial[:4, :10])
    assert (w[4:] != initial[4:]).float().mean() > 0.9, "the other elements train"
    assert frozen_mask(frozen_mlp()[1].weight) is not None


# ----- a checkpoint into a run whose optimizer differs (in one process: `restore` itself) ----------

SGD = "torch.optim.sgd.SGD"


class _Recording(Single):
    """``single``, noting what the resume hands to `adopt_optimizer_state`."""

    def adopt_optimizer_state(self, state):
        self.adopted.append(state)


def _single(cls=_Recording):
    strat = cls()
    strat.adopted = []
    strat.setup(DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    return strat


def _sgd_checkpoint(model, **settings):
    """A checkpoint of ``model`` after one SGD step with ``settings`` (its momentum buffers set)."""
    opt = torch.optim.SGD(model.parameters(), **settings)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    model.zero_grad()
    return {"config": {"strategy": "single"}, "optimizer": opt.state_dict(), "optimizer_class": SGD,
            "strategy": {}, "epoch": 1, "step": 1}, opt


def _parts(opt, cls=SGD, scheduler=None, schedule=None):
    return SimpleNamespace(optimizer=opt, scheduler=scheduler, schedule=schedule or Schedule(), optimizer_class=cls,
                           lengths=None)


def test_a_resume_takes_this_runs_optimizer_settings_and_says_which(capsys):
    """``optimizer.load_state_dict`` brings the checkpoint's lr and momentum: a resume with
    ``--lr 0.01`` trained on at the checkpoint's 0.05 without a word. This run's settings win,
    the state (momentum buffers) carries over, and one line names each change; an lr that a
    schedule sets is the schedule's."""
    model = nn.Linear(3, 2)
    ckpt, old = _sgd_checkpoint(model, lr=0.05, momentum=0.9)
    buffers = [old.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.8)
    position = restore(_single(), _parts(opt), ckpt)
    assert (position.epoch, position.step) == (1, 1)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["momentum"] == 0.8
    for p, buf in zip(model.parameters(), buffers, strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], buf)
    assert capsys.readouterr().out == ("partrain: resuming with this run's optimizer settings where the "
                                       "checkpoint's differ: lr 0.01 (the checkpoint's 0.05), momentum 0.8 "
                                       "(the checkpoint's 0.9)\n")

    for scheduled in ({"schedule": Schedule("cosine")}, {"scheduler": object()}):  # the lr is the schedule's
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.8)
        restore(_single(), _parts(opt, **scheduled), {**ckpt, "scheduler": None})
        assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["momentum"] == 0.8
        assert capsys.readouterr().out.endswith("momentum 0.8 (the checkpoint's 0.9)\n")

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # the same settings: nothing to say
    strat = _single()
    restore(strat, _parts(opt), ckpt)
    assert capsys.readouterr().out == "" and strat.adopted == []

    # another strategy's checkpoint (that kept nothing of its own): its optimizer state goes to
    # the strategy too (ps hands it to its servers), without a line
    strat = _single()
    restore(strat, _parts(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)),
            {**ckpt, "config": {"strategy": "allreduce"}})
    assert strat.adopted == [ckpt["optimizer"]] and capsys.readouterr().out == ""


def test_a_resume_with_another_optimizer_starts_it_afresh(capsys):
    """SGD's momentum means nothing to Adam (its first step failed with KeyError: 'step'): the
    model and the position carry over, the optimizer and the strategy start afresh."""
    model = nn.Linear(3, 2)
    ckpt, _ = _sgd_checkpoint(model, lr=0.05, momentum=0.9)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    strat = _single()
    position = restore(strat, _parts(adam, cls="torch.optim.adam.Adam"), {**ckpt, "strategy": {"kept": 1}})
    assert (position.epoch, position.step) == (1, 1)
    assert not adam.state and adam.param_groups[0]["lr"] == 1e-3
    assert strat.adopted == [None]  # a strategy holding optimizer state elsewhere (ps) resets it
    model(torch.ones(1, 3)).sum().backward()
    adam.step()  # Adam's own state from here
    assert capsys.readouterr().out == ("partrain: resuming a checkpoint of torch.optim.sgd.SGD with "
                                       "torch.optim.adam.Adam: the model and the position carry over; the "
                                       "optimizer starts afresh\n")


def test_a_diloco_checkpoint_resumed_without_its_outer_optimizer_says_what_is_unused(capsys):
    """Same strategy name, other options: local SGD without ``outer=nesterov`` has no use for a
    DiLoCo checkpoint's outer momentum; one line says so instead of dropping it silently."""
    state = {"steps": 8, "global": torch.zeros(3), "momentum": torch.zeros(3)}
    assert LocalSGD(outer="none").unused_state(state) == (
        "the outer Nesterov momentum of a DiLoCo checkpoint (outer=nesterov; this run: outer=none)")
    assert LocalSGD(outer="nesterov").unused_state(state) is None
    assert LocalSGD(outer="none").unused_state({"steps": 8}) is None

    class Unused(_Recording):
        def unused_state(self, state):
            return "something" if state else None

    model = nn.Linear(3, 2)
    ckpt, _ = _sgd_checkpoint(model, lr=0.05, momentum=0.9)
    strat = _single(Unused)
    restore(strat, _parts(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)), {**ckpt, "strategy": {"k": 1}})
    assert capsys.readouterr().out == "partrain: resuming with single: something is left unused\n"


def test_a_ps_checkpoint_gives_another_strategy_its_servers_momentum_and_says_what_is_left(capsys):
    """The servers held the optimizer state (the checkpoint's ``optimizer`` entry has only the
    hyperparameters): it reaches this run's optimizer by parameter, and one line names what
    stays behind; a checkpoint of a strategy that keeps nothing of its own, or of the same
    strategy, says nothing."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strat = _single()
    params = list(model.parameters())  # weight 2x3, bias 2: one server each
    shards = [{"meta": json.dumps({"shapes": [list(p.shape)], "opt_state": [
                   {"param": 0, "tensors": {"momentum_buffer": 1}, "values": {}}]}),
               "tensors": [torch.zeros(p.numel()), torch.full(p.shape, float(i + 1))]} for i, p in enumerate(params)]
    ps_ckpt = {"config": {"strategy": "ps"}, "optimizer": {"state": {}, "param_groups": opt.state_dict()["param_groups"]},
               "optimizer_class": SGD, "strategy": {"format": "partrain.ps/1", "servers": shards, "plan": [[0], [1]]},
               "epoch": 1, "step": 5}
    position = restore(strat, _parts(opt), ps_ckpt)
    assert (position.epoch, position.step) == (1, 5)
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], torch.full((2, 3), 1.0))
    assert torch.equal(opt.state[model.bias]["momentum_buffer"], torch.full((2,), 2.0))
    assert capsys.readouterr().out == ("partrain: resuming a ps checkpoint with single: the model, the optimizer "
                                       "state and the position carry over; ps's own state does not\n")
    quiet = {"config": {"strategy": "allreduce"}, "optimizer": opt.state_dict(), "strategy": {}, "epoch": 1, "step": 5}
    restore(strat, _parts(opt), quiet)
    restore(strat, _parts(opt), {**quiet, "config": {"strategy": "single"}})
    restore(strat, _parts(opt), ps_ckpt, quiet=True)
    assert capsys.readouterr().out == ""
