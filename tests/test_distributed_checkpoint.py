"""Sharded checkpoints (torch.distributed.checkpoint): each process writes its own shards, and a
run on another mesh or process count goes on from them as if it had never stopped.

The promise of `partrain.sharded_checkpoint`: ``fsdp`` and ``tp`` write ``checkpoint.dcp``
(every process its pieces, no whole model gathered anywhere), and a resume under fsdp with
another process count, under ``tp``, on an fsdp x tp mesh and under ``single`` (the last two
read the whole checkpoint in each process, then split it as they train) ends at the parameters
and figures of one uninterrupted process on the global batch:
the hand-written loop of `tests.helpers.train_by_hand`, or for the GPT one ``single`` run.
Background writes (``checkpoint_async``) give the same checkpoints as synchronous ones;
``partrain export`` writes the one-file form that ``partrain serve`` and ``single`` load. Start
with `test_resume_on_other_process_counts_and_strategies_equals_the_uninterrupted_run`.

Precision: float64, parameters and losses to `F64_ATOL` (see `tests.helpers`); checkpoints
written synchronously and in the background compare bit for bit.

A process killed as a save starts is an error naming it, and the previous version stays the
newest (the last test). Not tested: a kill during a background write, whose collectives run
over a process group of their own with the same timeout.
"""

import functools
import os
import pickle
import shutil
import signal

import pytest
import torch

from partrain.checkpoint import load_checkpoint, load_model, save_checkpoint
from partrain.cli import main
from partrain.errors import UsageError, WorkerError
from partrain.launch import launch
from partrain.serve.loading import load_model_spec, module_from_source
from partrain.sharded_checkpoint import (
    STATE_FILE,
    commit,
    consolidate,
    latest_checkpoint,
    latest_version,
    read_metadata,
    read_state,
    save_tensors,
    training_tensors,
    version_name,
)
from partrain.train.fit import fit
from tests.helpers import (
    assert_history_matches,
    assert_states_close,
    digits64,
    small_mlp64,
    train_by_hand,
)
from tests.train.test_language_models import COMMON, ShiftedText, small_gpt

EPOCHS, GLOBAL_BATCH = 2, 96


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def lm_sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def shifted_text():
    return ShiftedText(), ShiftedText(n=8, seed=2)


@functools.cache
def by_hand(epochs=EPOCHS):
    return train_by_hand(small_mlp64, digits64, adam, batch=GLOBAL_BATCH, epochs=epochs)


def run(workers, strategy="fsdp", **kw):
    """``workers`` processes of ``strategy`` on the digits MLP with Adam, the global batch of 96."""
    kw.setdefault("epochs", EPOCHS)
    batch = GLOBAL_BATCH if strategy in ("tp", "single") else GLOBAL_BATCH // workers
    return fit(small_mlp64, digits64, adam, strategy=strategy, workers=workers, batch_size=batch, quiet=True,
               return_state=True, timeout=60, threads=1, **kw)


def first_epoch_sharded(tmp_path, **kw):
    """fsdp on 2 processes for one epoch; the one-file export of its end removed, so that what
    goes on from here reads the shards."""
    out = str(tmp_path / "fsdp2")
    run(2, epochs=1, out_dir=out, **kw)
    assert os.path.isfile(os.path.join(out, "checkpoint.pt"))  # the run's end exported it
    os.remove(os.path.join(out, "checkpoint.pt"))
    return out


def test_each_process_writes_only_its_own_shards(tmp_path):
    """DCP's index: every split tensor of the model and of Adam's state is in two pieces of half
    the rows, process 0's piece in its file and process 1's in its own; nothing is held whole."""
    out = first_epoch_sharded(tmp_path)
    version = latest_version(os.path.join(out, "checkpoint.dcp"))
    assert os.path.basename(version) == f"{15:010d}-{1:06d}"  # step 15, after epoch 1
    assert sorted(f for f in os.listdir(version) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    metadata = read_metadata(version)
    files: dict[str, set] = {}
    for index, where in metadata.storage_data.items():
        files.setdefault(index.fqn, set()).add((tuple(index.offset), where.relative_path))
    split = [k for k in metadata.state_dict_metadata if k.startswith("model/") or k.endswith(("exp_avg", "exp_avg_sq"))]
    assert len(split) == 12  # 4 parameters, their two moments
    for key in split:
        rows = metadata.state_dict_metadata[key].size[0]
        want = {((0,) + (0,) * (len(metadata.state_dict_metadata[key].size) - 1), "__0_0.distcp"),
                ((rows // 2,) + (0,) * (len(metadata.state_dict_metadata[key].size) - 1), "__1_0.distcp")}
        assert files[key] == want, key
    # what is not tensors is in state.pt, read with weights_only=True
    state = load_checkpoint(os.path.join(version, "state.pt"))
    assert state["step"] == 15 and state["epoch"] == 1 and state["config"]["strategy"] == "fsdp"
    assert state["sharded"]["param_groups"][0]["params"] == ["1.weight", "1.bias", "3.weight", "3.bias"]


def test_resume_on_other_process_counts_and_strategies_equals_the_uninterrupted_run(tmp_path):
    """fsdp's epoch-1 shards go on under fsdp on 4 processes, under tp on 2 (each process a slice
    of every matrix, the whole batch) and under ``single`` (the whole checkpoint read in one
    process): each ends at the hand-written loop's 30 steps, figures included."""
    state, history = by_hand()
    first = first_epoch_sharded(tmp_path)
    for label, workers, strategy in (("fsdp4", 4, "fsdp"), ("tp2", 2, "tp"), ("single", 1, "single")):
        out = str(tmp_path / label)
        shutil.copytree(first, out)
        result = run(workers, strategy, out_dir=out, resume="auto")
        assert_history_matches(result.history, history)
        assert_states_close(result.model_state, state)


def test_fsdps_shards_resume_on_an_fsdp_by_tp_mesh(tmp_path):
    """fsdp on 2 processes, then 2 x 2 processes: fsdp over 2 data-parallel workers, each matrix
    split over tp inside them (`partrain.strategies.mesh`); the end is the uninterrupted run's."""
    state, history = by_hand()
    out = first_epoch_sharded(tmp_path)
    result = fit(small_mlp64, digits64, adam, parallel={"fsdp": 2, "tp": 2}, batch_size=GLOBAL_BATCH // 2,
                 epochs=EPOCHS, quiet=True, return_state=True, timeout=60, threads=1, out_dir=out, resume="auto")
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


def test_a_mid_epoch_checkpoint_resumes_under_tp_as_the_uninterrupted_run(tmp_path):
    """``max_steps`` stops inside epoch 2 with a mid-epoch checkpoint (random states, partial sums,
    the batch to go on from); tp goes on from it in place with more steps."""
    state, history = by_hand()
    out = str(tmp_path / "tp")
    first = run(2, "tp", out_dir=out, max_steps=20)
    assert first.final["step"] == 20
    os.remove(os.path.join(out, "checkpoint.pt"))
    assert read_state(os.path.join(out, "checkpoint.dcp"))["within_epoch"]["batch"] == 5
    result = run(2, "tp", out_dir=out, resume="auto")
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


def test_a_gpts_fused_attention_reshards_from_tp_to_fsdp(tmp_path):
    """tp keeps a GPT's fused q, k, v rows reordered for its split; the shards hold them in the
    model's own order, so fsdp on 2 processes goes on from tp's epoch as one process would."""
    common = dict(COMMON, epochs=2)
    reference = fit(small_gpt, shifted_text, lm_sgd, strategy="single", **dict(common, workers=1, batch_size=6))
    out = str(tmp_path / "tp")
    fit(small_gpt, shifted_text, lm_sgd, strategy="tp", out_dir=out, **dict(common, workers=2, batch_size=6,
                                                                              epochs=1))
    os.remove(os.path.join(out, "checkpoint.pt"))
    metadata = read_metadata(latest_version(os.path.join(out, "checkpoint.dcp")))
    pieces: dict[str, int] = {}
    for index in metadata.storage_data:
        pieces[index.fqn] = pieces.get(index.fqn, 0) + 1
    assert pieces["model/blocks.0.attn.qkv.weight"] == 1  # whole, once (it is the same on both processes)
    assert pieces["model/blocks.0.mlp.fc.weight"] == pieces["optimizer/blocks.0.mlp.fc.weight/momentum_buffer"] == 2
    resumed = fit(small_gpt, shifted_text, lm_sgd, strategy="fsdp", out_dir=out, resume="auto",
                  **dict(common, workers=2, batch_size=3))
    for got, want in zip(resumed.history, reference.history, strict=True):
        assert got["step"] == want["step"] and got["train_token_accuracy"] == want["train_token_accuracy"]
        assert got["train_loss"] == pytest.approx(want["train_loss"], abs=1e-10)
        assert got["test_loss"] == pytest.approx(want["test_loss"], abs=1e-10)
    assert_states_close(resumed.model_state, reference.model_state)


def test_an_fsdp_by_tp_mesh_writes_its_own_pieces_and_resumes_on_the_mesh_and_under_tp(tmp_path):
    """A GPT on a 2 x 2 mesh (fsdp over 2, each matrix split over tp inside them) writes sharded
    checkpoints: the split matrices in four pieces, one per process, the fused q, k, v whole in the
    model's order. Its epoch-1 shards go on on the same mesh and under tp on 2 processes, each
    ending as one process does."""
    common = dict(COMMON, epochs=2)
    reference = fit(small_gpt, shifted_text, lm_sgd, strategy="single", **dict(common, workers=1, batch_size=6))
    out = str(tmp_path / "mesh")
    fit(small_gpt, shifted_text, lm_sgd, parallel={"fsdp": 2, "tp": 2}, out_dir=out,
        **dict(common, batch_size=3, epochs=1))
    os.remove(os.path.join(out, "checkpoint.pt"))  # the run's end exported it: go on from the shards
    metadata = read_metadata(latest_version(os.path.join(out, "checkpoint.dcp")))
    pieces: dict[str, set] = {}
    for index, where in metadata.storage_data.items():
        pieces.setdefault(index.fqn, set()).add(where.relative_path)
    assert len(pieces["model/blocks.0.mlp.fc.weight"]) == 4  # each process its own quarter
    assert len(pieces["optimizer/blocks.0.mlp.fc.weight/momentum_buffer"]) == 4
    assert len(pieces["model/blocks.0.attn.qkv.weight"]) == 1  # whole, in the model's own order
    for label, how in (("again", {"parallel": {"fsdp": 2, "tp": 2}, "batch_size": 3}),
                       ("tp", {"strategy": "tp", "workers": 2, "batch_size": 6})):
        again = str(tmp_path / label)
        shutil.copytree(out, again)
        resumed = fit(small_gpt, shifted_text, lm_sgd, out_dir=again, resume="auto", **dict(common, **how))
        for got, want in zip(resumed.history, reference.history, strict=True):
            assert got["step"] == want["step"] and got["train_token_accuracy"] == want["train_token_accuracy"]
            assert got["train_loss"] == pytest.approx(want["train_loss"], abs=1e-10)
        assert_states_close(resumed.model_state, reference.model_state)


def test_background_writes_equal_synchronous_ones(tmp_path):
    """``checkpoint_async``: the shards are copied, then written while training goes on; the
    checkpoints (mid-epoch every 4 steps, then at max_steps) are bit for bit the synchronous ones,
    and going on from them equals the uninterrupted run."""
    state, history = by_hand()
    written = {}
    for mode in (False, True):
        out = str(tmp_path / f"async-{mode}")
        run(2, out_dir=out, max_steps=18, checkpoint_every=4, checkpoint_async=mode)
        written[mode] = consolidate(read_state(os.path.join(out, "checkpoint.dcp")))
        assert sorted(os.listdir(os.path.join(out, "checkpoint.dcp"))) == [f"{18:010d}-{1:06d}"]
    assert written[True]["step"] == written[False]["step"] == 18
    assert_states_close(written[True]["model"], written[False]["model"], atol=0)
    for index, entry in written[False]["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(written[True]["optimizer"]["state"][index][key], value), (index, key)
    assert torch.equal(written[True]["within_epoch"]["rng"], written[False]["within_epoch"]["rng"])
    result = run(2, out_dir=str(tmp_path / "async-True"), resume="auto", checkpoint_async=True)
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


def test_export_writes_one_file_that_serve_loads_and_single_resumes(tmp_path, capsys):
    """``partrain export RUN_DIR``: the newest shards as one file in this process (no workers):
    `load_model` rebuilds the model from it as ``partrain serve`` does, and ``single`` goes on
    from it to the uninterrupted run."""
    out = str(tmp_path / "cli")
    assert main(["train", "--strategy", "fsdp", "--workers", "2", "--model", "mlp", "--dataset", "digits",
                 "--epochs", "1", "--max-steps", "3", "--out", out, "--quiet", "--checkpoint-async"]) == 0
    os.remove(os.path.join(out, "checkpoint.pt"))
    assert main(["export", out]) == 0
    assert "partrain export: wrote" in capsys.readouterr().out
    model, spec = load_model(os.path.join(out, "checkpoint.pt"))
    assert spec["name"] == "mlp" and model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert load_model(os.path.join(out, "checkpoint.dcp"))[0](torch.zeros(1, 1, 8, 8)).shape == (1, 10)
    # `partrain serve RUN/checkpoint.dcp` serves the shards as the exported file
    served, _ = module_from_source(os.path.join(out, "checkpoint.dcp"))
    x = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(served(x), module_from_source(os.path.join(out, "checkpoint.pt"))[0](x))
    assert load_model_spec(os.path.join(out, "checkpoint.dcp")).name == "checkpoint"

    state, history = by_hand()
    sharded = first_epoch_sharded(tmp_path)
    file = str(tmp_path / "export.pt")
    assert main(["export", os.path.join(sharded, "checkpoint.dcp"), "--out", file]) == 0
    ckpt = load_checkpoint(file)
    assert all(type(v) is torch.Tensor for v in ckpt["model"].values())
    assert sorted(ckpt["optimizer"]["state"]) == [0, 1, 2, 3] and ckpt["optimizer"]["state"][0]["exp_avg"].shape == (32, 64)
    result = run(1, "single", out_dir=str(tmp_path / "single"), resume=file)
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


def test_export_of_nothing_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"partrain export: error: Expected a run directory with a sharded checkpoint (checkpoint.dcp) or "
                   f"a sharded checkpoint directory. Received: {str(tmp_path)!r} (neither it nor checkpoint.dcp in it "
                   f"holds a complete one)")


def test_a_half_written_version_is_ignored_and_removed(tmp_path):
    """A save that crashed leaves a ``.tmp-`` version (no ``.metadata``): resume reads the newest
    complete one, and the next save of the run removes the leftover."""
    out = first_epoch_sharded(tmp_path)
    root = os.path.join(out, "checkpoint.dcp")
    complete = latest_version(root)
    leftover = os.path.join(root, f".tmp-{20:010d}-{1:06d}")
    os.makedirs(leftover)
    open(os.path.join(leftover, "__0_0.distcp"), "wb").close()
    assert latest_version(root) == complete and latest_checkpoint(out) == root
    state, history = by_hand()
    result = run(2, out_dir=out, resume="auto")
    assert_states_close(result.model_state, state)
    assert sorted(os.listdir(root)) == [f"{30:010d}-{2:06d}"]


def test_resume_auto_takes_whichever_checkpoint_went_further(tmp_path):
    """``checkpoint.pt`` and ``checkpoint.dcp`` side by side (an allreduce run went on from fsdp's
    shards): ``resume="auto"`` takes the one with more steps; a tie is the run's own export."""
    out = first_epoch_sharded(tmp_path)
    run(2, "allreduce", epochs=1, out_dir=str(tmp_path / "ar"))
    shutil.copy(tmp_path / "ar" / "checkpoint.pt", os.path.join(out, "checkpoint.pt"))
    assert latest_checkpoint(out) == os.path.join(out, "checkpoint.dcp")  # both at step 15
    ckpt = load_checkpoint(os.path.join(out, "checkpoint.pt"))
    ckpt["step"] = 16
    torch.save(ckpt, os.path.join(out, "checkpoint.pt"))
    assert latest_checkpoint(out) == os.path.join(out, "checkpoint.pt")


def test_metadata_that_would_run_code_is_refused(tmp_path):
    """DCP reads its ``.metadata`` with plain ``pickle``; partrain reads it with an unpickler that
    builds DCP's metadata classes only, so a checkpoint from elsewhere runs no code."""
    out = first_epoch_sharded(tmp_path)
    version = latest_version(os.path.join(out, "checkpoint.dcp"))

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(os.path.join(version, ".metadata"), "wb") as f:
        pickle.dump(Payload(), f)
    with pytest.raises(UsageError, match=r"^Expected a torch.distributed.checkpoint directory at .*Received: "
                                         r"UnpicklingError: (posix|nt).system is not part of a checkpoint's metadata$"):
        load_checkpoint(os.path.join(out, "checkpoint.dcp"))


def test_a_finished_sharded_run_resumed_auto_returns_its_whole_model(tmp_path):
    """``resume="auto"`` on a run that already reached its epochs trains nothing and returns the
    checkpoint's model: read whole from the shards, plain tensors."""
    out = first_epoch_sharded(tmp_path)
    result = run(2, epochs=1, out_dir=out, resume="auto")
    assert all(type(v) is torch.Tensor and not v.is_meta for v in result.model_state.values())
    assert_states_close(result.model_state, by_hand(epochs=1)[0])


def test_background_writes_for_a_strategy_that_writes_one_file_are_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"^Expected checkpoint_async with a strategy that writes sharded checkpoints "
                                         r"\(fsdp, tp\)\. Received: strategy 'allreduce', whose checkpoint is one "
                                         r"file written by worker 0$"):
        run(2, "allreduce", out_dir=str(tmp_path / "ar"), checkpoint_async=True)


def save_twice_rank_1_dies(strategy, root):
    """Two versions written as `Checkpointer.save_sharded` writes them; process 1 dies as the
    second starts, before writing its shards."""
    torch.manual_seed(0)
    model = small_mlp64()
    model, optimizer = strategy.prepare(model, adam(model.parameters()))
    for step in (1, 2):
        tensors, extra = training_tensors(model, optimizer, strategy.checkpoint_layout)
        name = version_name(step, 0)
        tmp = os.path.join(root, f".tmp-{name}")
        os.makedirs(tmp, exist_ok=True)
        if strategy.rank == 0:
            save_checkpoint(os.path.join(tmp, STATE_FILE), {"step": step, "epoch": 0, "sharded": extra})
        if step == 2 and strategy.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        save_tensors(tensors, tmp)
        if strategy.rank == 0:
            commit(tmp, root, name)


@pytest.mark.timeout(120)
@pytest.mark.fresh_processes
def test_a_process_killed_during_a_save_is_named_and_the_last_version_stays(tmp_path):
    root = str(tmp_path / "checkpoint.dcp")
    with pytest.raises(WorkerError) as info:
        launch(save_twice_rank_1_dies, root, workers=2, strategy="fsdp", threads=1, timeout=20)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    assert os.path.basename(latest_version(root)) == version_name(1, 0)
    whole = consolidate(read_state(root))
    assert whole["step"] == 1 and whole["model"]["1.weight"].shape == (32, 64)


def test_one_process_of_fsdp_writes_shards_without_a_process_group(tmp_path):
    """fsdp on one worker (nothing to shard) still writes ``checkpoint.dcp``, with no process group;
    fsdp on 2 goes on from it to the uninterrupted run."""
    state, history = by_hand()
    out = str(tmp_path / "one")
    run(1, epochs=1, out_dir=out, checkpoint_async=True)
    assert latest_version(os.path.join(out, "checkpoint.dcp")) is not None
    os.remove(os.path.join(out, "checkpoint.pt"))
    result = run(2, out_dir=out, resume="auto")
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)
