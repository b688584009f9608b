"""Resume continues exactly: same strategy and world size give the parameters of an uninterrupted run."""

import os

from partrain.train.checkpoint import load_checkpoint
from partrain.train.loop import fit
from tests.helpers import assert_states_close, sgd, small_cnn


def test_resume_equals_uninterrupted(tmp_path):
    common = dict(strategy="allreduce", workers=2, batch_size=32, quiet=True, timeout=60, return_state=True)
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
