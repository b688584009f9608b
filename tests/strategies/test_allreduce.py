"""allreduce = one process on the concatenated global batch, written by hand.

The core promise of synchronous data parallel training: after k steps the
parameters of 2 workers with per-worker batch b equal those of one process
with batch 2b (and with gradient accumulation, of one process with the whole
accumulation window as its batch) - including the last batch of an epoch,
which the odd training set of `digits64` splits unevenly between the workers
(47 + 46 samples), so a loss averaged per worker would be wrong there.

The reference is `train_by_hand`: plain PyTorch, its own batching and
``F.cross_entropy(reduction="mean")``, no partrain sampler, loss normalisation or
strategy. `fit` must match it on the parameters and on every figure it reports
per epoch (train loss and accuracy, test loss and accuracy).

Precision: float64, parameters and losses to `F64_ATOL` = 1e-10 after 30 steps
with momentum (rounding differences between one process and two are about
1e-14 there; see `tests.helpers`), accuracies and counts exactly.
"""

import functools

import pytest

from partrain.errors import UsageError
from partrain.train.fit import fit
from tests.helpers import (
    assert_history_matches,
    assert_states_close,
    digits64,
    sgd,
    small_cnn64,
    train_by_hand,
)

EPOCHS, GLOBAL_BATCH = 2, 96
STEPS_PER_EPOCH = 15  # 1437 = 14 * 96 + 93


@functools.cache
def by_hand():
    return train_by_hand(small_cnn64, digits64, sgd, batch=GLOBAL_BATCH, epochs=EPOCHS)


def run(strategy, workers, batch, *, accumulate=1, optimizer=sgd, **kw):
    return fit(small_cnn64, digits64, optimizer, strategy=strategy, workers=workers, batch_size=batch,
               accumulate=accumulate, epochs=EPOCHS, quiet=True, return_state=True, timeout=60, **kw)


@pytest.mark.parametrize("strategy, workers", [("single", 1), ("allreduce", 2)])
def test_fit_equals_a_hand_written_loop_on_the_global_batch(strategy, workers):
    """``single`` checks fit's own loop (in this process); ``allreduce`` the 2-worker split."""
    state, history = by_hand()
    # one process runs in this one, with its thread count: 1 for speed only (float64, see above)
    result = run(strategy, workers, GLOBAL_BATCH // workers, **({"threads": 1} if workers == 1 else {}))
    assert result.final["step"] == EPOCHS * STEPS_PER_EPOCH
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


def test_accumulation_equals_the_hand_written_loop_and_is_counted():
    """2 workers x 2 micro-batches of 24 = the hand loop's batch of 96, with the bookkeeping of the run.

    With ``scale_lr`` the optimizer's lr of 0.0125 becomes 0.0125 * 2 workers * 2 micro-batches
    = 0.05 (exact in binary), the hand loop's. The epoch's last window is micro-batches of
    48 and 45 samples: fit normalises by their sum, 93, as the hand loop's mean does.
    """
    state, history = by_hand()
    result = run("allreduce", 2, GLOBAL_BATCH // 4, accumulate=2, optimizer=functools.partial(sgd, lr=0.0125),
                 scale_lr=True)
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)
    n_params = sum(v.numel() for v in state.values())
    for row in result.history:
        assert row["lr"] == 0.05
        assert row["time_compute"] > 0 and row["time_data"] >= 0 and row["time_comm"] >= 0
        # only the last micro-batch of a window communicates: each of the 2 workers all-reduces
        # every gradient (float64, 8 bytes) once per optimizer step
        assert row["comm_bytes"] == 2 * STEPS_PER_EPOCH * n_params * 8


def test_short_epochs_walk_through_the_data_as_the_hand_written_loop(tmp_path):
    """``samples_per_epoch``: 3 epochs of 600 of the 1437 samples go on through the shuffled passes (the
    second epoch ends in the second pass); with allreduce's 2 workers they equal the hand loop's
    epochs cut from the passes laid end to end, figures and parameters."""
    state, history = train_by_hand(small_cnn64, digits64, sgd, batch=GLOBAL_BATCH, epochs=3, samples_per_epoch=600)
    result = fit(small_cnn64, digits64, sgd, strategy="allreduce", workers=2, batch_size=GLOBAL_BATCH // 2,
                 epochs=3, samples_per_epoch=600, quiet=True, return_state=True, timeout=60,
                 out_dir=str(tmp_path / "run"))
    assert [row["samples"] for row in result.history] == [600] * 3
    assert result.final["step"] == 3 * 7  # 600 = 6 * 96 + 24
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)
    # resuming with another epoch length would go on from another place in the data: one line, nothing started
    with pytest.raises(UsageError, match=r"^Expected samples_per_epoch=600 \(the checkpoint's: another epoch length "
                                         r"would go on from another place in the training set\) to resume\. "
                                         r"Received: samples_per_epoch=500$"):
        fit(small_cnn64, digits64, sgd, strategy="allreduce", workers=2, batch_size=48, epochs=4, samples_per_epoch=500,
            quiet=True, timeout=60, out_dir=str(tmp_path / "run"), resume="auto")
