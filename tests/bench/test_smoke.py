"""Every benchmark runs end to end at toy size and reports its goals under the issue's names.

A benchmark is only run in full by hand (minutes of CPU), so without this test
a change elsewhere (a renamed `fit` argument, a moved load-test function) would
break it unseen. Each one runs here once through ``partrain bench NAME --toy
--json FILE`` (the hidden toy size: the fewest process launches that go through
its code) and must print its tables, say it is a smoke run, and write a goals
block with exactly its goal names, each goal ``{"value": float or null, "op",
"target": float, "met": bool}`` where ``met`` agrees with a comparison made here
(`tests.bench.goals_block`). The figures themselves are noise at this size and are not
checked, beyond a benchmark's own few (`EXTRA`).
"""

from __future__ import annotations

import pytest

from tests.bench.goals_block import run_and_check

# the names issue 9 gave, written out here rather than read from the harness
GOALS = {
    "core": {"core.fit_vs_plain", "core.allreduce_vs_ddp", "core.scaling", "core.startup_s"},
    "async": {"async.hogwild_scaling", "async.ps_vs_allreduce", "async.ps_straggler_time", "async.diloco_bytes", "async.diloco_loss"},
    "syncbn": {"syncbn.step_ratio"},
    "serve": {"serve.batched_vs_unbatched", "serve.batched_vs_limit", "serve.p99_over_p50",
              "serve.vs_litserve"},
    "population": {"population.auto_vs_best", "population.vs_pool", "population.memory_vs_pool"},
    "engines": {"engines.torchrun_vs_launch", "engines.ray_vs_launch", "engines.recovery_s"},
    "pipeline": {"pipeline.utilisation_vs_ideal", "pipeline.memory_per_stage", "pipeline.vs_raw_torch",
                 "pipeline.serve_memory_per_stage", "pipeline.serve_vs_unsplit"},
    "stream": {"stream.vs_per_item", "stream.vs_hand_queue", "stream.p99_vs_step", "stream.mqtt_vs_bare",
               "stream.mqtt_burst_loss", "stream.mqtt_p99_ms"},
    "data": {"data.overlap_speedup", "data.resident_vs_dataloader", "data.padding_vs_random"},
    "compare": {"compare.regret_max", "compare.prediction_error", "compare.budget_overrun"},
    "rl": {"rl.time_to_475_vs_sb3", "rl.fps_vs_sb3", "rl.policy_lag_p50"},
    "sharded": {"sharded.state_memory", "sharded.peak_memory", "sharded.largest_model",
                "sharded.step_vs_allreduce", "tp.scaling"},
}
# what each toy run must print besides its goals (a line of its main table)
TABLE_LINE = {
    "core": "fit allreduce, 2 workers",
    "async": "hogwild, 1 process",
    "syncbn": "partrain.nn.SyncBatchNorm",
    "serve": "unbatched",
    "population": "auto chose",
    "engines": "partrain.launch",
    "pipeline": "1f1b m=8",
    "stream": "hand queue",
    "data": "fit data_on_device + compile",
    "compare": "fastest to target",
    "rl": "partrain 1 local",
    "sharded": "fsdp, 2 processes",
}


def _needs(name: str) -> None:
    if name == "serve":  # the serve extra: the server and the load generator
        for module in ("uvicorn", "starlette", "httpx"):
            pytest.importorskip(module)
    if name == "rl":  # the rl extra: environments, the learner's server and the actors' client
        for module in ("gymnasium", "safetensors", "uvicorn", "httpx"):
            pytest.importorskip(module)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(GOALS))
def test_benchmark_runs_at_toy_size(name, tmp_path, capsys):
    _needs(name)
    out, data = run_and_check(name, GOALS[name], tmp_path, capsys)
    assert TABLE_LINE[name] in out
    assert data["figures"], "no figure written"
    for goal, entry in data["goals"].items():
        interval = entry["interval"]  # a figure over rounds: the median's interval
        assert interval is None or (len(interval) == 2 and interval[0] <= entry["value"] <= interval[1]), goal
        assert isinstance(entry["met"], bool), goal
    EXTRA.get(name, lambda out, data: None)(out, data)


def _sharded(out: str, data: dict) -> None:
    """bench sharded: both strategies' rows, all five goals measured, and the state counted (not
    measured): fsdp's 2 workers hold half of the parameters' bytes each (the toy GPT's rows split
    evenly), plus half of Adam's moments and the same step counters."""
    assert "tp, 2 processes" in out
    assert all(entry["value"] is not None for entry in data["goals"].values())
    assert 0.45 < data["goals"]["sharded.state_memory"]["value"] <= 0.55


#: what a benchmark's toy run must show beyond every benchmark's checks
EXTRA = {"sharded": _sharded}
