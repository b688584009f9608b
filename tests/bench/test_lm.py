"""`partrain bench lm` (issue 50, Measure): it runs, it states its four goals, and its parts measure what they say.

The full run takes minutes and is run by hand; here ``--quick`` runs end to end once
(its figures are noise and are not checked, only the goals block's names and form).
The rest checks the pieces the figures rest on without timing anything: the plain
loop's sample order is the one fit's sampler gives (else lm.loss_vs_plain compares two
different trainings), `peak_bytes` counts what is alive at once rather than what was
ever allocated, and checkpointing lowers a small GPT's step peak. Start with
`test_quick_run_reports_the_four_goals`.
"""

from __future__ import annotations

import pytest
import torch

from partrain.bench.lm import Shape, Workload, peak_bytes, sample_order, step_peak_bytes
from partrain.cli import main
from partrain.data.sharding import ShardedBatchSampler
from tests.bench.goals_block import run_and_check

GOALS = {"lm.fit_vs_plain", "lm.scaling", "lm.activation_memory", "lm.loss_vs_plain"}
MiB = 2**20


@pytest.mark.timeout(240)
def test_quick_run_reports_the_four_goals(tmp_path, capsys):
    out, data = run_and_check("lm", GOALS, tmp_path, capsys, size="--quick")
    assert "fit allreduce, 2 workers x 1 thread" in out
    assert all(entry["value"] is not None for entry in data["goals"].values())  # all four measured
    assert data["goals"]["lm.activation_memory"]["op"] == "<=" and data["goals"]["lm.loss_vs_plain"]["op"] == "<="


def test_a_device_it_cannot_use_is_one_line(capsys):
    assert main(["bench", "lm", "--toy", "--device", "gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Expected --device cpu or cuda. Received: 'gpu'" in err[0]


@pytest.mark.parametrize(("num_samples", "per_epoch", "epochs"), [(10, 4, 5), (12, 12, 2), (7, 3, 1)])
def test_the_plain_loops_order_is_fits(num_samples, per_epoch, epochs):
    order = sample_order(num_samples, per_epoch, epochs, seed=3)
    sampler = ShardedBatchSampler(per_epoch, batch_size=2, seed=3, dataset_size=num_samples)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        assert order[epoch * per_epoch:(epoch + 1) * per_epoch].tolist() == sampler.order().tolist(), epoch


def test_peak_bytes_counts_what_is_alive_at_once():
    kept = []

    def one_at_a_time() -> None:
        for _ in range(3):
            torch.empty(MiB, dtype=torch.uint8)  # freed before the next one

    def all_kept() -> None:
        kept.extend(torch.empty(MiB, dtype=torch.uint8) for _ in range(3))

    assert MiB <= peak_bytes(one_at_a_time) < 1.1 * MiB
    assert 3 * MiB <= peak_bytes(all_kept) < 3.1 * MiB
    before = torch.empty(4 * MiB, dtype=torch.uint8)
    assert peak_bytes(lambda: before.add_(1)) < 0.1 * MiB  # what was there before does not count
    del kept[:]


def test_checkpointing_lowers_a_small_gpts_step_peak():
    work = Workload(Shape(n_layer=3, n_head=2, n_embd=32, block_size=64), batch=8, steps=1, epochs=1, held_out=1)
    without, with_checkpointing = step_peak_bytes(work, False), step_peak_bytes(work, True)
    assert 0 < with_checkpointing < 0.8 * without
