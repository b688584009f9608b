"""How many processes a bare ``partrain train`` starts (issue 55, item 8).

The rule is tested on given timings against a hand computation of both runs' seconds; the
live path (the caller's probe, the start line, the recorded choice, --json) on its shape:
which one it picks depends on this host's speed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from partrain.cli import main
from partrain.scaling import Link
from partrain.train.processes import LOOPBACK, WORKER_START_S, choose, probe
from partrain.train.task import Task
from tests.data_fixtures import tiny_dataset, tiny_model

MB = 605_224  # the digits CNN's gradient, float32


def test_a_small_model_on_a_short_run_stays_in_one_process():
    # the bundled job as timed on a 2-core host: 3.4 ms a step on both cores' threads, 5.1 ms on one
    c = choose(0.0034, 0.0051, workers=2, batch=32, model_bytes=MB, run_samples=1437 * 8)
    comm = MB / LOOPBACK.bandwidth + 2 * LOOPBACK.latency_s  # ring of 2: 2(n-1)/n S/B + 2(n-1) a
    assert c.comm_s == pytest.approx(comm)
    assert (c.single_steps, c.parallel_steps) == (360, 180)  # ceil(11496 / 32), ceil(11496 / 64)
    assert c.single_run_s == pytest.approx(360 * 0.0034)
    assert c.parallel_run_s == pytest.approx(180 * (0.0051 + comm) + WORKER_START_S)
    assert c.workers == 1 and c.candidates == 2
    assert c.single_rate == pytest.approx(32 / 0.0034) and c.parallel_rate == pytest.approx(64 / (0.0051 + comm))
    line = c.line()
    assert line.startswith("partrain train: one process (single): estimated 1.2 s in one process against 3.1 s "
                           "with allreduce on 2 workers (9,412 against 7,020 samples/s; a step of 3.4 ms")
    assert line.endswith("--strategy allreduce uses every core as workers")


def test_a_compute_bound_run_takes_every_core_as_workers():
    # threads scale poorly (a worker's step on half the threads is only 10% longer): workers pay
    c = choose(0.100, 0.110, workers=2, batch=128, model_bytes=1_000_000, run_samples=12_800)
    comm = 1_000_000 / LOOPBACK.bandwidth + 2 * LOOPBACK.latency_s
    assert c.single_run_s == pytest.approx(100 * 0.100)
    assert c.parallel_run_s == pytest.approx(50 * (0.110 + comm) + WORKER_START_S)
    assert c.workers == 2
    assert c.line().startswith("partrain train: allreduce on 2 workers: estimated 10.0 s in one process against 7.3 s")
    assert c.line().endswith("--strategy single runs one process")


def test_max_steps_bounds_both_runs_and_a_few_steps_do_not_pay_for_the_start():
    c = choose(0.100, 0.110, workers=2, batch=128, model_bytes=1_000_000, run_samples=12_800, max_steps=5)
    assert (c.single_steps, c.parallel_steps) == (5, 5)
    assert c.workers == 1  # 0.5 s against 0.58 s + the start


def test_a_tie_starts_nothing():
    free = Link(bandwidth=math.inf, latency_s=0.0)
    c = choose(2.0, 2.0, workers=2, batch=8, model_bytes=4, run_samples=16, link=free, start_s=2.0)
    assert c.single_run_s == c.parallel_run_s == 4.0
    assert c.workers == 1


def test_the_probe_times_a_copy_and_leaves_the_caller_as_it_was():
    ds = tiny_dataset()
    task = Task("cross_entropy").resolve((ds.tensors[0][:2], ds.tensors[1][:2]))
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    c = probe(tiny_model, lambda p: torch.optim.SGD(p, lr=0.1), task, ds, batch=16, workers=2, cores=2,
              run_samples=120 * 3)
    assert c is not None and c.step_alone_s > 0 and c.step_worker_s > 0
    assert c.model_bytes == 4 * (6 * 16 + 16 + 16 * 2 + 2)  # the trainable parameters, float32
    assert (c.single_steps, c.parallel_steps) == (23, 12)  # ceil(360 / 16), ceil(360 / 32)
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads


class Broken(nn.Module):
    def forward(self, x):
        raise ValueError("not this one")


def test_a_model_that_cannot_step_leaves_the_choice_to_the_run_checks():
    ds = tiny_dataset()
    task = Task("cross_entropy").resolve((ds.tensors[0][:2], ds.tensors[1][:2]))
    assert probe(Broken, lambda p: torch.optim.SGD(p, lr=0.1), task, ds, batch=16, workers=2, cores=2,
                 run_samples=120) is None


def test_a_bare_train_says_what_it_chose_records_it_and_a_resume_goes_on_with_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PARTRAIN_CORES", "2")  # two cores to choose from, on any host
    out, summary = tmp_path / "run", tmp_path / "summary.json"
    common = ["train", "--model", "mlp", "--dataset", "tests.data_fixtures:tiny_dataset", "--out", str(out)]
    # --resume auto with nothing to resume starts afresh: it estimates like a bare run
    assert main([*common, "--epochs", "1", "--resume", "auto", "--json", str(summary)]) == 0
    printed = capsys.readouterr().out.splitlines()
    start = printed[0]
    assert start.startswith(("partrain train: one process (single): estimated ",
                             "partrain train: allreduce on 2 workers: estimated "))
    chosen = "single" if "(single)" in start else "allreduce"
    workers = 1 if chosen == "single" else 2
    assert f"({chosen}, {workers} worker" in printed[-1]
    result = json.loads(summary.read_text())
    config = json.loads((out / "config.json").read_text())
    assert (result["strategy"], result["workers"], config["cli"]["strategy"]) == (chosen, workers, chosen)
    assert result["processes"] == config["processes"] and result["processes"]["workers"] == workers
    assert result["epochs"] == 1 and result["stopped"] is None and result["startup_s"] > 0
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert result["final"]["train_loss"] == last["train_loss"] and result["final"]["strategy"] == chosen

    assert main([*common, "--epochs", "2", "--resume", "auto", "--quiet", "--json", str(summary)]) == 0
    assert f"({chosen}, {workers} worker" in capsys.readouterr().out  # no new estimate: the run goes on
    assert (json.loads(summary.read_text())["strategy"], json.loads(summary.read_text())["epochs"]) == (chosen, 2)


def test_a_strategy_or_workers_on_the_command_line_is_not_second_guessed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PARTRAIN_CORES", "2")
    argv = ["train", "--model", "mlp", "--dataset", "tests.data_fixtures:tiny_dataset", "--epochs", "1"]
    assert main([*argv, "--workers", "2", "--out", str(tmp_path / "a")]) == 0
    assert main([*argv, "--strategy", "allreduce", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "estimated" not in out and out.count("(allreduce, 2 workers") == 2
