"""Resume continues exactly: same strategy and world size give the parameters of an uninterrupted run.

Precision: bit for bit. Both runs are the same 2 processes with one intra-op
thread each (pinned with ``threads=1``, so the launcher's share of the cores
cannot differ), doing the same operations on the same numbers in the same
order; any state the checkpoint fails to restore (momentum, data order, the
random stream) changes bits.
"""

import os

from partrain.train.checkpoint import load_checkpoint
from partrain.train.loop import fit
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
