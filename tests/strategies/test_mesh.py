"""One device mesh for every axis: each composition equals one process on the global batch.

`fit(..., parallel={...})` builds one DeviceMesh (`partrain.mesh`) and composes the axes
(`partrain.strategies.mesh`): ``fsdp x tp`` (the layers split over ``tp``, the split parameters
sharded over ``fsdp``), ``dp x fsdp`` (HSDP: sharded within ``fsdp``, replicated across ``dp``),
``dp x tp`` and ``dp x pp`` (the pipeline's groups taken from the mesh). The promise is
``allreduce``'s: after k steps the parameters equal those of one process that trains the whole
model on the concatenated global batch, written by hand (`tests.helpers.train_by_hand`,
`tests.strategies.test_tensor_parallel.gpt_by_hand`), so a batch sharded over the wrong axis
(tp peers seeing different samples) or a gradient averaged over the wrong group moves them by
1e-3 or more. Each process holds the share of the model its axes say, computed by hand. A rank
killed mid-step fails the job naming it by its coordinates; bad meshes are one line in the
caller, before any process starts.

Start with `test_fsdp_by_tp_equals_one_process_and_each_process_holds_a_quarter`. Four processes
on two cores: the models are tiny, the runs short. Precision: float64, to `F64_ATOL`.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from partrain.checkpoint import load_checkpoint, load_model
from partrain.cli import main
from partrain.errors import UsageError, WorkerError
from partrain.launch import launch
from partrain.mesh import MeshSpec
from partrain.models.gpt import gpt
from partrain.strategies.mesh import MeshParallel, strategy_for, strategy_name
from partrain.train.fit import fit
from tests.helpers import (
    KillOnRank,
    assert_history_matches,
    assert_states_close,
    digits64,
    sgd,
    small_mlp64,
    train_by_hand,
)
from tests.strategies.test_pipeline import mlp64

GLOBAL_BATCH = 96  # digits64: 1437 = 14 * 96 + 93, an uneven last batch
#: small_mlp64's parameters: Linear(64, 32) and Linear(32, 10), float64
N_PARAMS = 64 * 32 + 32 + 32 * 10 + 10


@functools.cache
def by_hand(model_fn=small_mlp64):
    return train_by_hand(model_fn, digits64, sgd, batch=GLOBAL_BATCH, epochs=1)


def run(parallel, model=small_mlp64, **kw):
    """``fit`` on the mesh ``parallel``, the global batch of 96 split over its data-parallel workers."""
    spec = MeshSpec.of(parallel)
    kw = {"timeout": 60, **kw}
    return fit(model, digits64, sgd, parallel=parallel, batch_size=GLOBAL_BATCH // spec.data_parallel, epochs=1,
               quiet=True, return_state=True, threads=1, **kw)


# ----- each composition equals one process -------------------------------------------------------
def test_fsdp_by_tp_equals_one_process_and_each_process_holds_a_quarter():
    """2 x 2: Linear(64, 32) split by rows over tp (16 each), then each half cut by rows over fsdp
    (8 x 64 + 8); Linear(32, 10) split by columns over tp (10 x 16, its bias whole), then cut by rows
    over fsdp (5 x 16 + 5). The two fsdp workers take 48 samples each; the tp peers the same 48."""
    state, history = by_hand()
    result = run({"fsdp": 2, "tp": 2})
    assert result.history[-1]["workers"] == 2  # data-parallel workers: fsdp
    assert result.history[-1]["strategy"] == "mesh"
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)
    assert result.history[-1]["mesh_param_bytes"] == (8 * 64 + 8 + 5 * 16 + 5) * 8  # about N_PARAMS / 4


@pytest.mark.parametrize("parallel, workers, held", [
    ({"dp": 2, "fsdp": 2}, 4, N_PARAMS // 2),
    ({"dp": 2, "tp": 2}, 2, 16 * 64 + 16 + 10 * 16 + 10),
], ids=["hsdp", "dp-tp"])
def test_dp_replicas_of_fsdp_or_tp_equal_one_process(parallel, workers, held):
    """HSDP, 2 x 2: four data-parallel workers of 24 samples; the parameters are cut in two along
    fsdp and replicated along dp, so each process holds half of the model (not a quarter: that is
    fsdp=4). dp x tp, 2 x 2: two replicas of 48 samples, each split over its tp pair (rows of the
    first layer, columns of the second, whose bias stays whole), replicated along dp."""
    state, history = by_hand()
    result = run(parallel)
    assert result.history[-1]["workers"] == workers
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)
    assert result.history[-1]["mesh_param_bytes"] == held * 8


def test_hsdp_counts_the_gathers_and_reduce_scatters_within_fsdp_and_the_all_reduce_across_dp():
    """All-reduce-equivalent bytes (`partrain.strategies.fsdp`) of S = the model's 19,280 bytes per
    worker and step: gathered for the forward and again for the backward (S/2 each), gradients
    reduce-scattered within fsdp (S/2), each worker's half all-reduced across dp (S/2): 2 S; the
    epoch's row sums 4 workers x 15 steps."""
    result = run({"dp": 2, "fsdp": 2})
    assert result.history[-1]["comm_bytes"] == 4 * 15 * 2 * N_PARAMS * 8


def test_dp_by_tp_from_the_command_line_trains_and_its_checkpoint_loads_whole(tmp_path, capsys):
    """``partrain train --mesh dp=2,tp=2`` (4 processes, picked from the mesh): two replicas, each
    splitting the MLP over its tp pair; the checkpoint holds the whole model, which ``single``'s
    loader rebuilds, and equals one process's after the same 4 steps of 2 x 16 samples."""
    out = tmp_path / "run"
    code = main(["train", "--quiet", "--mesh", "dp=2,tp=2", "--model", "mlp", "--model-opt", "hidden=16",
                 "--threads", "1", "--epochs", "1", "--max-steps", "4", "--batch-size", "16", "--out", str(out)])
    assert code == 0
    assert "(mesh, 4 workers" in capsys.readouterr().out
    ckpt = load_checkpoint(str(out / "checkpoint.pt"))
    assert ckpt["config"]["strategy"] == "mesh" and ckpt["strategy"] == {"mesh": "dp=2,tp=2"} and ckpt["step"] == 4
    model, _ = load_model(str(out / "checkpoint.pt"))
    assert model[1].weight.shape == (16, 64)  # whole, not a tp or fsdp piece


def test_a_gpt_under_fsdp_by_tp_equals_one_process_and_its_optimizer_state_is_whole(tmp_path):
    """The built-in GPT (2 blocks, 2 heads, a fused q, k, v, the embedding tied to the output layer):
    split by heads over tp, sharded by blocks over fsdp. Its checkpoint's optimizer state is one
    process's (momentum of every parameter, the fused rows in their own order), and one process's
    checkpoint resumes under the mesh as if uninterrupted."""
    from tests.strategies.test_tensor_parallel import (
        TP,
        gpt_by_hand,
        lm_sgd,
        shifted_text,
        small_gpt,
    )

    common = {k: v for k, v in TP.items() if k not in ("workers", "batch_size")}
    result = fit(small_gpt, shifted_text, lm_sgd, parallel={"fsdp": 2, "tp": 2}, batch_size=3,
                 out_dir=str(tmp_path / "mesh"), **common)
    assert_states_close(result.model_state, gpt_by_hand())
    single = fit(small_gpt, shifted_text, lm_sgd, strategy="single", workers=1, batch_size=6,
                 out_dir=str(tmp_path / "single"), **common)
    got, want = load_checkpoint(result.checkpoint)["optimizer"], load_checkpoint(single.checkpoint)["optimizer"]
    assert sorted(got["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        assert_states_close(got["state"][index], entry)
    # and back: single's whole optimizer state split over the mesh (fused rows reordered) for epoch 2
    resumed = fit(small_gpt, shifted_text, lm_sgd, parallel={"fsdp": 2, "tp": 2}, batch_size=3,
                  resume=single.checkpoint, out_dir=str(tmp_path / "resumed"), **{**common, "epochs": 2})
    assert_states_close(resumed.model_state, gpt_by_hand(epochs=2))


def test_dp_by_pp_on_the_mesh_equals_one_process():
    """2 replicas x 2 stages: the pipeline of `partrain.strategies.pipeline` with its groups from the
    mesh; each replica takes 48 of every 96 samples, both stages of a replica the same 48."""
    state, history = by_hand(mlp64)
    result = run({"dp": 2, "pp": 2}, model=mlp64)
    assert result.history[-1]["strategy"] == "pipeline" and result.history[-1]["workers"] == 2
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


def _groups(strategy):
    return dist.get_process_group_ranks(strategy.pp_group), dist.get_process_group_ranks(strategy.dp_group)


def test_the_pipelines_groups_are_the_meshs_dimensions():
    """Rank r is stage r % 2 of replica r // 2: its pipeline is {2 (r // 2), 2 (r // 2) + 1}, the
    replicas of its stage {r % 2, r % 2 + 2}."""
    groups = launch(_groups, workers=4, strategy=strategy_for({"dp": 2, "pp": 2}), timeout=60)
    assert groups == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]


def _mortal_mlp() -> torch.nn.Module:
    layers = list(small_mlp64())
    return torch.nn.Sequential(KillOnRank(3), *layers)


@pytest.mark.timeout(60)
@pytest.mark.fresh_processes
def test_a_rank_killed_mid_step_fails_the_job_naming_it_by_its_coordinates():
    """The others wait in a collective of the mesh's groups (made with the run's timeout) and fail;
    the error names the rank that died first."""
    with pytest.raises(WorkerError) as info:
        run({"fsdp": 2, "tp": 2}, model=_mortal_mlp, timeout=20)
    assert info.value.rank == 3
    assert str(info.value).startswith("rank 3 (fsdp 1, tp 1) failed: died with SIGKILL"), str(info.value)


# ----- the mesh itself ---------------------------------------------------------------------------
def test_coordinates_and_groups_follow_the_axes_order_outermost_first():
    """dp outermost, tp innermost: rank r = dp * 4 + fsdp * 2 + tp, for dp = fsdp = tp = 2."""
    spec = MeshSpec(dp=2, fsdp=2, tp=2)
    assert spec.size == 8 and spec.data_parallel == 4
    assert spec.coordinates(5) == {"dp": 1, "pp": 0, "fsdp": 0, "tp": 1}
    assert spec.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert spec.groups("fsdp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert spec.groups("dp", "fsdp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert MeshSpec.of("dp=2,pp=2").groups("pp") == [[0, 1], [2, 3]]  # stage r % 2 of replica r // 2
    assert MeshSpec.of({"tp": 2}) == MeshSpec(tp=2) and str(MeshSpec(dp=2, tp=2)) == "dp=2,tp=2"


@pytest.mark.parametrize("parallel, name", [
    ({"dp": 4}, "allreduce"), ({"fsdp": 2}, "fsdp"), ({"tp": 2}, "tp"), ({"pp": 2}, "pipeline"),
    ({"dp": 2, "pp": 2}, "pipeline"), ({"dp": 2, "fsdp": 2}, "mesh"), ({"fsdp": 2, "tp": 2}, "mesh"),
    ({"dp": 2, "fsdp": 2, "tp": 2}, "mesh"), ({"dp": 1, "fsdp": 1, "tp": 2}, "tp"),
])
def test_the_mesh_picks_each_axis_strategy_alone_and_composes_the_rest(parallel, name):
    assert strategy_name(MeshSpec.of(parallel)) == name
    assert strategy_for(parallel).name == name


# ----- bad meshes: one line, before any process starts -------------------------------------------
def tiny_gpt_3_heads():
    return gpt(vocab_size=40, n_layer=1, n_head=3, n_embd=12, block_size=10).double()


@pytest.mark.parametrize("parallel, kw, message", [
    ({"dp": 2, "tp": 2}, {"workers": 3},
     "Expected mesh axes whose product is the number of processes, 3. Received: dp=2 x tp=2 = 4"),
    ({"dp": 2, "ep": 2}, {}, "Expected mesh axes among dp, pp, fsdp, tp. Received: ep"),
    ("dp=2,tp=two", {}, "Expected an integer size for mesh axis tp. Received: tp='two'"),
    ({"dp": 0, "tp": 2}, {}, "Expected the mesh axis dp to be a positive integer. Received: dp=0"),
    ({"pp": 2, "tp": 2}, {}, "Expected pp with dp alone (pipeline stages are not yet composed with fsdp or tp). "
                             "Received: mesh pp=2,tp=2"),
    ({"dp": 2, "pp": 2}, {"strategy": "fsdp"}, "Expected either strategy or parallel"),
])
def test_bad_meshes_are_one_line(parallel, kw, message):
    with pytest.raises(UsageError) as e:
        fit(small_mlp64, digits64, sgd, parallel=parallel, quiet=True, **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_model_the_mesh_cannot_hold_is_one_line():
    """3 heads do not divide over tp=2; 4 stages need 4 children of a Sequential (small_mlp64 has 4,
    8 stages do not fit). Both are said in the caller, from one model built there."""
    from tests.strategies.test_tensor_parallel import shifted_text

    with pytest.raises(UsageError, match="head") as e:
        fit(tiny_gpt_3_heads, shifted_text, sgd, parallel={"fsdp": 2, "tp": 2}, quiet=True)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="Expected at least 8 top-level children to cut into 8 stages"):
        fit(small_mlp64, digits64, sgd, parallel={"pp": 8}, quiet=True)


def test_the_command_line_refuses_a_mesh_with_a_strategy_or_the_wrong_workers(capsys):
    assert main(["train", "--mesh", "dp=2,tp=2", "--strategy", "fsdp"]) != 0
    assert "Expected either --strategy or --mesh" in capsys.readouterr().err
    assert main(["train", "--mesh", "dp=2,tp=2", "--workers", "2"]) != 0
    assert "Expected mesh axes whose product is the number of processes, 2" in capsys.readouterr().err


def test_errors_name_a_rank_by_its_coordinates():
    assert MeshParallel(dp=2, fsdp=2, tp=2).describe_rank(5, 8) == "rank 5 (dp 1, fsdp 0, tp 1)"


def test_mesh_parallel_needs_two_data_parallel_workers_and_the_processes_its_axes_multiply_to():
    with pytest.raises(UsageError, match="tensor parallel alone is strategy 'tp'"):
        MeshParallel(tp=2)
    with pytest.raises(UsageError, match="Expected mesh axes whose product is the number of processes, 2. "
                                         "Received: dp=2 x fsdp=2 = 4"):
        fit(small_mlp64, digits64, sgd, strategy=MeshParallel(dp=2, fsdp=2), workers=2, quiet=True)
