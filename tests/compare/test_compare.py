"""`partrain.compare` end to end on tiny models, on the suite's pool of processes.

Each scenario of issue 16 is built so that the right answer wins by a wide, mostly
deterministic margin, on a loaded machine too:

- compute-bound (a convolutional net with 19 KB of parameters), against one process:
  allreduce, or one process where the machine cannot give two processes their cores (the
  rule's own answer from the figures it measured); this test also checks the table,
  compare.json, compare.csv and the PNG, and bytes per sample against the parameter count
  (exact: DDP all-reduces every gradient once per step). Other strategies stay out of this
  one: on a loaded machine two windows measured one after the other differ by tens of
  percent, and the unit tests of the rule (test_decide.py) pin the compute-bound choice
  among all of them;
- communication-bound: a dense MLP over a simulated 10 Mbit/s link (`bandwidth`): the
  measured bytes become seconds by the ring formula, an 8x difference for local SGD;
- a 3x straggler (an injected delay): hogwild's workers do not wait for it.

Bad options of ``partrain compare`` are one line and exit status 2 (no process starts).
"""

from __future__ import annotations

import functools
import json
import os

import pytest

import partrain
from partrain.bench.compare import clusters, conv_net, dense_mlp, sgd
from partrain.cli import main
from partrain.compare.decide import (
    MARGIN,
    MIN_WINDOW_S,
    TIE_FLOOR,
    at_depth,
    speed_noise,
    window_seconds,
)
from partrain.compare.report import format_result
from partrain.compare.run import warm_up


@pytest.fixture(scope="module", autouse=True)
def _warm_pool(suite_pool):
    """The pool's processes import what a window needs before the first budget starts (seconds each,
    the first time: a cold pool would spend a test's whole budget on it), and so does this process:
    torch's first optimizer imports torch._dynamo (1.5-2 s), which compare's first step guess would
    otherwise pay out of a 6 s budget when this file runs alone."""
    partrain.launch(warm_up, clusters(64, (1, 8, 8)), workers=2, threads=1)
    sgd(conv_net(16).parameters())


def _parameter_bytes(model) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def test_compute_bound_recommends_allreduce_with_table_json_csv_png(tmp_path):
    data = clusters(512, (1, 16, 16))  # 512 = 8 full global batches of 2 x 32: no partial batch
    model_fn = functools.partial(conv_net, 16)
    result = partrain.compare(model_fn, data, sgd, strategies=["single", "allreduce"], workers=2,
                              budget="6s", batch_size=32, out_dir=str(tmp_path))
    allreduce, single = result.measurement("allreduce"), result.measurement("single")
    # allreduce, unless this machine cannot give two processes their cores (a loaded CI runner):
    # then one process is as fast or faster, and the rule says so. Its speed ratio at the target and
    # at the deepest loss both windows reached (the rule ranks at both): allreduce when it leads by
    # more than the windows' noise and the margin at both, one process when allreduce leads by no
    # more than the 5% floor at either; in between (a lead inside the noise) either may be picked
    deep = at_depth(single, allreduce, result.target_loss)
    leads = [allreduce.speed / single.speed] + ([deep[1] / deep[2]] if deep else [])
    noise = max(speed_noise(allreduce), speed_noise(single), TIE_FLOOR)
    expected = {"allreduce"} if min(leads) > 1 + noise + MARGIN else {"single"} if max(leads) <= 1 + TIE_FLOOR \
        else {"allreduce", "single"}
    windows = sorted(window_seconds(m)[0] for m in (allreduce, single))
    if windows[0] == windows[0] and sum(windows) / 2 < MIN_WINDOW_S:  # a loaded runner's sub-second windows:
        expected = {max((allreduce, single), key=lambda m: m.speed).label}  # the fastest measured (the rule)
    assert result.recommendation is not None and result.recommendation.pick in expected, format_result(result)
    expected = result.recommendation.pick
    assert allreduce.ok and allreduce.steps >= 11 and allreduce.samples == allreduce.steps * 64
    assert allreduce.bytes_per_sample == _parameter_bytes(conv_net(16)) / 32
    assert single.bytes_per_sample == 0.0

    text = format_result(result)
    for needle in ("samples/s", "bytes/sample", "loss/single", f"{expected} *", f"recommended: {expected}",
                   "predicted scaling", "t(n) = h t1 + o + c + 2(n-1)/n * S/B + 2(n-1) k a", "512 workers",
                   "2-worker allreduce predicted", "beyond this machine: one worker per host (h = 1), o as here, c = 0"):
        assert needle in text, needle

    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["recommendation"]["pick"] == expected
    assert [s["label"] for s in saved["strategies"]][:1] != [] and {s["label"] for s in saved["strategies"]} == {
        "single", "allreduce"}
    assert len(saved["predictions"]) == 3 * 2 * 3  # allreduce, ps, localsgd x 2 links x 8/64/512 workers
    assert saved["validation"]["workers"] == 2.0 and saved["formulas"]["localsgd"]
    # h, measured with both workers stepping at once: at least 1 (clamped), and what the prediction used
    assert saved["constants"]["host_factor"] >= 1.0 and result.host_factor == saved["constants"]["host_factor"]
    assert saved["host_factors"] == {"host probe": result.host_factor}  # no local-update window to check it by
    # DDP's buckets hold every parameter once; k is their number; c is clamped at 0
    assert sum(saved["buckets"]) == _parameter_bytes(conv_net(16)) and saved["constants"]["messages"] == len(
        saved["buckets"])
    assert saved["constants"]["contention_s"] >= 0.0 and result.contention_s == saved["constants"]["contention_s"]
    # o, DDP's bookkeeping timed against the plain step: clamped at 0
    o = saved["constants"]["overhead_s"]
    assert o >= 0.0 and result.ddp_overhead_s == o and result.probe["ddp"] > 0
    # beyond this machine, by hand: h = 1, o as here, c = 0, k messages of 20 us, ring on 10 Gbit/s
    t1, k, size = saved["constants"]["step_s"], len(saved["buckets"]), saved["model_bytes"]
    step8 = t1 + o + 2 * 7 / 8 * size / 1.25e9 + 2 * 7 * k * 20e-6
    at8 = next(p for p in saved["predictions"] if (p["strategy"], p["workers"], p["bandwidth"]) == (
        "allreduce", 8, 1.25e9))
    assert at8["samples_per_s"] == pytest.approx(8 * 32 / step8, rel=1e-12)
    # here: the probe's h, c, k and link, by hand
    bw, lat = saved["link"]["bandwidth"], saved["link"]["latency_s"]
    step2 = saved["constants"]["host_factor"] * t1 + o + saved["constants"]["contention_s"] + size / bw + 2 * k * lat
    assert saved["validation"]["predicted"] == pytest.approx(2 * 32 / step2, rel=1e-12)
    # the host's CPU time that went elsewhere during each window (Linux's /proc): shares of every core's time
    for s in saved["strategies"]:
        if os.path.exists("/proc/stat"):
            assert 0.0 <= s["host_steal"] <= 1.0 and 0.0 <= s["host_other"] <= 1.0, s
    assert "host load" in text and ("caution: the windows ran under different host load" in text) == (
        saved["host_load_warning"] is not None)
    csv_lines = (tmp_path / "compare.csv").read_text().splitlines()
    assert csv_lines[0].startswith("label,strategy,workers") and len(csv_lines) == 3
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_communication_bound_recommends_local_sgd():
    data = clusters(512, (1, 8, 8))
    result = partrain.compare(functools.partial(dense_mlp, 64, 512, 1), data, functools.partial(sgd, lr=0.01),
                              strategies=["allreduce", "localsgd H=8"], workers=2, budget="6s", batch_size=8,
                              bandwidth="10Mbit")
    rec = result.recommendation
    assert rec is not None and rec.pick == "localsgd H=8", format_result(result)
    assert rec.why.startswith("comm is ") and "cuts the bytes per sample" in rec.why
    assert result.measurement("allreduce").simulated_comm_s > 0.1  # 150 KB at 1.25 MB/s


def test_a_3x_straggler_recommends_an_asynchronous_strategy():
    data = clusters(512, (1, 16, 16))
    for _ in range(3):
        result = partrain.compare(functools.partial(conv_net, 16), data, sgd, strategies=["allreduce", "hogwild"],
                                  workers=2, budget="7s", batch_size=16, straggler="worker=1,slowdown=3")
        rec = result.recommendation
        # the two windows run one after the other, and a shared host's speed can drift between them
        # by more than the straggler's 2x (quiet runs: hogwild at 2.2-3.3x allreduce's speed; in CI
        # once 0.92x, 11 s of a 7 s budget, and locally under 50-60% steal 1.2x). So it is measured
        # again, up to three times, as a user re-runs a comparison the host disturbed; a straggler
        # that did not slow allreduce, or a hogwild that waited for it, fails all three
        if rec is not None and rec.pick == "hogwild":
            break
    assert rec is not None and rec.pick == "hogwild", format_result(result)
    assert "waits for the slowest worker" in rec.why


@pytest.mark.parametrize("argv,line", [
    (["--budget", "soon"], "Expected a positive time budget such as 60s or 2m. Received: 'soon'"),
    (["--straggler", "worker=one"], "Expected --straggler as worker=INDEX,slowdown=FACTOR. Received: 'worker=one'"),
    (["--straggler", "slowdown=0.5"], "Expected a straggler worker >= 0 and a slowdown >= 1. Received: 'slowdown=0.5'"),
    (["--bandwidth", "fast"], "Expected a positive bandwidth such as 1Gbit, 100Mbit or 10GB. Received: 'fast'"),
    (["--strategies", "allreduce,magic"], "Expected strategies among ['single', 'allreduce', 'ps sync', 'ps async', "
                                          "'ps s=2', 'hogwild', 'localsgd H=8', 'diloco H=8', 'pipeline', 'fsdp', "
                                          "'tp']. Received: ['allreduce', 'magic']"),
    (["--memory-per-process", "lots"], "Expected a positive memory size such as 4GB or 512MiB. Received: 'lots'"),
    (["--workers", "0"], "Expected a positive number of workers. Received: --workers 0"),
    (["--workers", "2", "--straggler", "worker=2"], "Expected the straggler to be a worker index below workers=2. "
                                                    "Received: worker=2"),
])
def test_bad_options_are_one_line(argv, line, capsys):
    assert main(["compare", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"partrain compare: error: {line}"


def test_a_budget_too_small_for_any_window_says_how_much_start_up_took(tmp_path, capsys):
    """Every window skipped for the budget: one line naming the budget and the start-up, status 2
    (and the table, with each strategy's "over budget" reason, still printed and written)."""
    out = tmp_path / "cmp"
    assert main(["compare", "--model", "mlp", "--dataset", "synthetic", "--strategies", "allreduce,localsgd H=8",
                 "--budget", "0.2s", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err[-1].startswith("partrain compare: error: Expected a budget with room for the windows after "
                              "start-up. Received: --budget 0.2s, of which starting the processes took "), err
    assert err[-1].endswith("s: no strategy fitted in the rest (the default is 60s)"), err
    assert "allreduce: skipped: over budget" in captured.out and (out / "compare.json").exists()


def _buckets_in_worker(strategy, model_fn):
    import torch

    from partrain.compare.run import _bucket_sizes
    from partrain.train.task import Task

    torch.manual_seed(0)
    model = model_fn()
    inputs, target = torch.randn(4, 2048), torch.randint(0, 10, (4,))
    return _bucket_sizes(model, inputs, target, Task("cross_entropy"), strategy.group)


def test_the_probe_reads_ddps_real_bucket_layout():
    """Three 16 MiB layers do not fit DDP's 25 MB bucket: more than one all-reduce per step,
    and together the buckets hold every parameter once (read from DDP itself, on 2 workers)."""
    import torch

    model_fn = functools.partial(torch.nn.Sequential, torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048),
                                 torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 10))
    sizes = partrain.launch(_buckets_in_worker, model_fn, workers=2, strategy="allreduce", threads=1)
    total = _parameter_bytes(model_fn())
    assert sizes[0] == sizes[1] and sum(sizes[0]) == total and len(sizes[0]) >= 2, sizes
    one = partrain.launch(_buckets_in_worker, functools.partial(dense_mlp, 2048, 64, 1), workers=2,
                          strategy="allreduce", threads=1)
    assert one[0] == [_parameter_bytes(dense_mlp(2048, 64, 1))]  # a small model: one bucket


def test_out_is_numbered_like_train_runs(tmp_path, monkeypatch):
    """Without --out, a second comparison writes runs/compare-2 (the CLI's compare is replaced by a
    stub that records where it would write: the numbering, not the measuring, is under test)."""
    import importlib

    from partrain.compare.cli import DEFAULT_OUT

    run_module = importlib.import_module("partrain.compare.run")  # (partrain.compare is also the function)

    monkeypatch.chdir(tmp_path)
    written = []

    def fake_compare(*args, out_dir=None, **kwargs):
        written.append(out_dir)
        (tmp_path / out_dir).mkdir(parents=True, exist_ok=True)
        (tmp_path / out_dir / "compare.json").write_text("{}")
        raise SystemExit(0)  # stop before the report: nothing was measured

    monkeypatch.setattr(run_module, "compare", fake_compare)
    argv = ["compare", "--model", "mlp", "--dataset", "synthetic", "--budget", "5s"]
    for _ in range(3):
        with pytest.raises(SystemExit):
            main(argv)
    assert written == [DEFAULT_OUT, f"{DEFAULT_OUT}-2", f"{DEFAULT_OUT}-3"]


def test_ps_with_bounded_staleness_runs_only_when_named():
    import torch

    from partrain.compare.run import applicable

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    default, _ = applicable(None, model, 2, 32, None)
    assert "ps s=2" not in [c.label for c in default] and "ps async" in [c.label for c in default]
    named, _ = applicable(["single", "ps s=2"], model, 2, 32, None)
    assert [(c.label, c.strategy, c.options) for c in named] == [("single", "single", {}),
                                                                 ("ps s=2", "ps", {"staleness": 2})]


def test_the_host_probe_runs_on_the_windows_device_and_its_constants_are_its_parts_by_hand(monkeypatch):
    """`probe_host` launches its workers on the comparison's device (on a one-GPU workstation compare
    falls back to the CPU for two workers, and a probe on the GPU would put both ranks on it), and
    turns the medians of its parts into h, o, c and the link as its docstring writes them (the
    launch is replaced by one that records its arguments and returns set parts: the arithmetic,
    not the timing, is under test)."""
    import importlib

    from partrain.compare.measure import Job
    from partrain.compare.run import CompareResult, probe_host

    calls = []
    parts = [{"sizes": [4000, 2000], "alone": 0.010, "ddp": 0.0115, "together": 0.012, "small": 0.0004,
              "reduce": 0.004, "synced": 0.0175},
             {"sizes": [4000, 2000], "alone": float("nan"), "ddp": float("nan"), "together": 0.014,
              "small": 0.0006, "reduce": 0.006, "synced": 0.0195}]

    def fake_launch(fn, *args, **kwargs):
        calls.append(kwargs)
        return parts

    # the module (the package's `partrain.launch` is the function)
    monkeypatch.setattr(importlib.import_module("partrain.launch"), "launch", fake_launch)
    result = CompareResult([], None, 60.0, 0.0, 2, 32, 6000)
    probe_host(result, Job(dense_mlp, None, sgd, device="cpu"), 2, 0.01, 30.0, 1, seconds=1.0)
    assert calls[0]["device"] == "cpu" and calls[0]["workers"] == 2 and calls[0]["strategy"] == "allreduce"
    # medians over the workers: together 0.013, small 0.0005, reduce 0.005, synced 0.0185; alone and ddp rank 0's
    assert result.host_factor == pytest.approx(0.013 / 0.010)
    assert result.ddp_overhead_s == pytest.approx(0.0015)
    assert result.contention_s == pytest.approx(0.0185 - 0.013 - 0.005)
    # a = small / (2 (n-1)); transfer = reduce - 2 (n-1) k a with k = 2 buckets, at least half of reduce;
    # B = 2 (n-1)/n S / transfer over the buckets' 6000 bytes
    latency = 0.0005 / 2
    transfer = max(0.005 - 2 * 2 * latency, 0.005 / 2)
    assert result.link == pytest.approx((6000 / transfer, latency))
    assert result.buckets == [4000, 2000]


@pytest.mark.parametrize("loads, kept", [((0.40, 0.02), 1), ((0.40, 0.55), 0), ((0.05,), 0)])
def test_a_host_probe_that_shared_the_host_is_taken_again_and_the_quieter_kept(monkeypatch, loads, kept):
    """A probe during which more than `PROBE_LOAD_LIMIT` of the host's CPU went elsewhere is taken
    once more, and the constants of the less loaded one are kept; a quiet first probe is not
    repeated. The report and compare.json say when the kept probe was still loaded (the launch and
    the host's load are replaced: which probe is kept is under test, not the timing)."""
    import importlib

    from partrain.compare import hostload
    from partrain.compare.measure import Job
    from partrain.compare.report import to_json
    from partrain.compare.run import PROBE_LOAD_LIMIT, CompareResult, probe_quietly

    # probe i's steps: alone 10 ms, together 12 + i ms (h = 1.2, then 1.3)
    probes = iter([[{"sizes": [4000], "alone": 0.010, "ddp": 0.011, "together": 0.012 + 0.001 * i,
                     "small": 0.0004, "reduce": 0.004, "synced": 0.018}] * 2 for i in range(len(loads))])
    monkeypatch.setattr(importlib.import_module("partrain.launch"), "launch", lambda *a, **k: next(probes))
    shares = iter(loads)
    monkeypatch.setattr(hostload, "shares", lambda before, after: (0.0, next(shares)))
    result = CompareResult([], None, 60.0, 0.0, 2, 32, 4000)
    probe_quietly(result, Job(dense_mlp, None, sgd, device="cpu"), 2, 0.01, 30.0, 1, seconds=1.0)
    assert result.probes == len(loads)
    assert result.probe_load == loads[kept]
    assert result.host_factor == pytest.approx((0.012 + 0.001 * kept) / 0.010)
    assert next(probes, None) is None  # no third probe
    saved = to_json(result)
    assert saved["probes"] == len(loads) and saved["probe_load"] == loads[kept]
    if loads[kept] > PROBE_LOAD_LIMIT:
        assert f"{loads[kept]:.0%} of the host's CPU went elsewhere during the host probe" in saved["probe_warning"]
    else:
        assert saved["probe_warning"] is None
