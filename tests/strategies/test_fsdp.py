"""fsdp (FSDP2's fully_shard) = one process on the concatenated global batch, each worker holding a shard.

The promise is allreduce's (see `tests/strategies/test_allreduce.py`): after k steps the
parameters of N workers with per-worker batch b equal those of one process with batch N*b,
written by hand (`train_by_hand`), including the uneven last batch of an epoch - now with
every parameter, gradient and optimizer state cut in N pieces. On top: gradient
accumulation (inner micro-batches skip the reduce-scatter), clipping by the whole model's
norm, frozen slices bit for bit, mixed precision, SyncBatchNorm, the checkpoint (full
tensors on worker 0) resumed by fsdp with the same or another worker count and by other
strategies, and each worker really holding 1/N of the model. Start with
`test_two_workers_equal_one_process_on_the_global_batch`.

Precision: float64, parameters and losses to `F64_ATOL` = 1e-10 after 30 steps (see
`tests.helpers`), accuracies and counts exactly. ``comm_bytes`` is counted from the model's
sizes (all-reduce-equivalent bytes, see `partrain.strategies.fsdp`), so it is checked exactly.
"""

import functools
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from partrain import _compat
from partrain.checkpoint import load_checkpoint, load_model
from partrain.cli import main
from partrain.errors import UsageError, WorkerError
from partrain.launch import launch
from partrain.models import bn_cnn, gpt
from partrain.nn import convert_sync_batchnorm, freeze, frozen_mask, idx
from partrain.strategies import FullyShard, get_strategy, parse_options
from partrain.strategies.fsdp import sharding_units
from partrain.train.fit import fit
from tests.helpers import (
    assert_history_matches,
    assert_states_close,
    digits64,
    sgd,
    small_mlp,
    small_mlp64,
    train_by_hand,
)

EPOCHS, GLOBAL_BATCH = 2, 96
STEPS_PER_EPOCH = 15  # 1437 = 14 * 96 + 93
N_PARAMS = 64 * 32 + 32 + 32 * 10 + 10  # small_mlp64: two Linear layers, the units `wrap="auto"` picks
S64 = N_PARAMS * 8  # its bytes in float64


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


@functools.cache
def by_hand(optimizer=sgd, scheduler_fn=None):
    return train_by_hand(small_mlp64, digits64, optimizer, batch=GLOBAL_BATCH, epochs=EPOCHS,
                         scheduler_fn=scheduler_fn)


def run(workers, batch, *, strategy="fsdp", optimizer=sgd, model=small_mlp64, data=digits64, **kw):
    kw.setdefault("epochs", EPOCHS)
    return fit(model, data, optimizer, strategy=strategy, workers=workers, batch_size=batch, quiet=True,
               return_state=True, timeout=60, **kw)


@pytest.mark.parametrize("optimizer, reshard", [(sgd, True), (adam, True), (sgd, False)],
                         ids=["sgd-zero3", "adam-zero3", "sgd-zero2"])
def test_two_workers_equal_one_process_on_the_global_batch(optimizer, reshard):
    """SGD with momentum and Adam, ZeRO-3 and ZeRO-2 (``reshard_after_forward=False``): the same
    parameters and figures; the bytes of ZeRO-3 are 1.5x an all-reduce's per step, ZeRO-2's 1x."""
    state, history = by_hand(optimizer)
    result = run(2, GLOBAL_BATCH // 2, optimizer=optimizer,
                 strategy=FullyShard(reshard_after_forward=reshard))
    assert result.final["step"] == EPOCHS * STEPS_PER_EPOCH
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)
    assert all(type(v) is torch.Tensor for v in result.model_state.values())  # full, plain tensors
    per_step = S64 * 3 // 2 if reshard else S64
    for row in result.history:
        assert row["comm_bytes"] == 2 * STEPS_PER_EPOCH * per_step
        assert row["fsdp_param_bytes"] == S64 / 2  # worker 0's half (see test_each_worker_holds_...)


def test_four_workers_equal_one_process_on_the_global_batch():
    """Uneven shards: a layer of 10 rows is cut 3 + 3 + 3 + 1; the epoch's last batch of 93 is
    24 + 23 + 23 + 23. A torch scheduler halving the rate each epoch steps the sharded optimizer;
    ``on_nan="skip"`` asks for the whole model's gradient norm every step (all finite here)."""
    state, history = by_hand(sgd, halving)
    result = run(4, GLOBAL_BATCH // 4, scheduler_fn=halving, on_nan="skip")
    assert [row["lr"] for row in result.history] == [0.025, 0.0125]
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


def test_accumulation_equals_the_hand_written_loop_and_skips_the_reduce_scatter():
    """2 workers x 2 micro-batches of 24 = the hand loop's batch of 96 (``scale_lr``: 0.0125 * 4 =
    0.05). Each micro-batch gathers the parameters for its forward and again for its backward
    (S all-reduce-equivalent bytes); only the window's last reduce-scatters (S/2)."""
    state, history = by_hand()
    result = run(2, GLOBAL_BATCH // 4, accumulate=2, optimizer=functools.partial(sgd, lr=0.0125), scale_lr=True)
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)
    for row in result.history:
        assert row["comm_bytes"] == 2 * STEPS_PER_EPOCH * (2 * S64 + S64 // 2)


def test_clipping_uses_the_whole_models_gradient_norm():
    """Each worker holds half of every gradient: clipping by its own half's norm would clip less.
    The reference is `fit`'s own loop in one process on the global batch (``single``)."""
    single = run(1, GLOBAL_BATCH, strategy="single", clip_grad=0.2, threads=1)
    sharded = run(2, GLOBAL_BATCH // 2, clip_grad=0.2)
    assert_history_matches(sharded.history, single.history)
    assert_states_close(sharded.model_state, single.model_state)
    unclipped, _ = by_hand()
    assert max((single.model_state[k] - unclipped[k]).abs().max() for k in unclipped) > 1e-3  # it did clip


def frozen_mlp64():
    """Frozen elements on both workers' shards: rows 10-19 of a weight whose rows 0-15 are worker
    0's and 16-31 worker 1's, and one bias element of worker 1 (5-9)."""
    model = small_mlp64()
    freeze(model[1].weight, idx[10:20, 3:7])
    freeze(model[3].bias, idx[7])
    return model


def test_frozen_slices_stay_exact_and_are_kept_in_the_checkpoint(tmp_path):
    """AdamW with weight decay moves any element it steps, and clipping must not count the frozen
    gradients: the run equals one process with the same freezing, and the frozen elements come
    out bit for bit as they went in."""
    single = run(1, GLOBAL_BATCH, strategy="single", model=frozen_mlp64, optimizer=adamw, clip_grad=0.5,
                 threads=1, epochs=1)
    sharded = run(2, GLOBAL_BATCH // 2, model=frozen_mlp64, optimizer=adamw, clip_grad=0.5, epochs=1,
                  out_dir=str(tmp_path / "run"))
    assert_states_close(sharded.model_state, single.model_state)
    torch.manual_seed(0)
    start = frozen_mlp64()
    masks = {name: frozen_mask(p) for name, p in start.named_parameters() if frozen_mask(p) is not None}
    for name, p in start.named_parameters():
        got = sharded.model_state[name]
        if name in masks:
            assert torch.equal(got[masks[name]], p.detach()[masks[name]]), name
            assert not torch.equal(got[~masks[name]], p.detach()[~masks[name]]), name
    saved = load_checkpoint(str(tmp_path / "run" / "checkpoint.pt"))["freeze"]
    assert saved.keys() == masks.keys() and all(torch.equal(saved[k], masks[k]) for k in masks)


def test_resume_within_an_epoch_equals_the_uninterrupted_run(tmp_path):
    """``max_steps=20`` stops inside epoch 2 and writes a mid-epoch checkpoint; going on from it
    gives the uninterrupted run (the hand loop's 30 steps)."""
    state, history = by_hand()
    out = str(tmp_path / "run")
    first = run(2, GLOBAL_BATCH // 2, max_steps=20, out_dir=out)
    assert first.final["step"] == 20
    result = run(2, GLOBAL_BATCH // 2, out_dir=out, resume="auto")
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


def test_checkpoints_resume_under_other_worker_counts_and_strategies(tmp_path):
    """The checkpoint holds the whole model and the whole optimizer state (Adam's moments and
    step), numbered as one process numbers them: fsdp on 4 workers and ``single`` go on from
    fsdp's epoch 1, fsdp goes on from ``allreduce``'s, all ending at the uninterrupted run."""
    state, history = by_hand(adam)
    sharded = str(tmp_path / "fsdp")
    run(2, GLOBAL_BATCH // 2, optimizer=adam, epochs=1, out_dir=sharded)
    ckpt = load_checkpoint(os.path.join(sharded, "checkpoint.pt"))
    assert all(type(v) is torch.Tensor for v in ckpt["model"].values())
    assert sorted(ckpt["optimizer"]["state"]) == [0, 1, 2, 3]
    assert ckpt["optimizer"]["state"][0]["exp_avg"].shape == (32, 64)
    resumes = [(4, GLOBAL_BATCH // 4, "fsdp", sharded), (1, GLOBAL_BATCH, "single", str(tmp_path / "single"))]
    shutil.copytree(sharded, resumes[1][3])
    replicated = str(tmp_path / "allreduce")
    run(2, GLOBAL_BATCH // 2, strategy="allreduce", optimizer=adam, epochs=1, out_dir=replicated)
    resumes.append((2, GLOBAL_BATCH // 2, "fsdp", replicated))
    for workers, batch, strategy, out in resumes:
        result = run(workers, batch, strategy=strategy, optimizer=adam, out_dir=out, resume="auto",
                     **({"threads": 1} if workers == 1 else {}))
        assert_history_matches(result.history, history)
        assert_states_close(result.model_state, state)


def shards_job(strategy):
    """Each worker's piece of every parameter and of the optimizer's state, after one step of two
    micro-batches; whether the first left the shards without a gradient (no reduce-scatter)."""
    torch.manual_seed(0)
    model = small_mlp64()
    model, optimizer = strategy.prepare(model, sgd(model.parameters()))
    x, y = torch.randn(4, 64, dtype=torch.float64), torch.arange(4)

    def loss_fn(out, y):
        return F.cross_entropy(out, y, reduction="none")

    strategy.train_step(model, optimizer, x, y, loss_fn, update=False)  # an inner micro-batch: not reduced
    inner = [p.grad is None for p in model.parameters()]
    strategy.train_step(model, optimizer, x, y, loss_fn)
    return {"inner_unreduced": all(inner), "local": [p.to_local().numel() for p in model.parameters()],
            "momentum": [optimizer.state[p]["momentum_buffer"].to_local().numel() for p in model.parameters()],
            "metrics": strategy.metrics()}


def test_each_worker_holds_half_of_the_parameters_and_optimizer_state():
    first, second = launch(shards_job, workers=2, strategy="fsdp", threads=1, timeout=60)
    assert [a + b for a, b in zip(first["local"], second["local"])] == [64 * 32, 32, 32 * 10, 10]
    for got in (first, second):
        assert got["inner_unreduced"]
        assert sum(got["local"]) == sum(got["momentum"]) == N_PARAMS // 2
        assert got["metrics"] == {"param_bytes": S64 / 2, "grad_bytes": S64 / 2, "optimizer_bytes": S64 / 2,
                                  "rank_bytes": 3 * S64 / 2}


def tiny_gpt64():
    return gpt(vocab_size=16, n_layer=2, n_head=2, n_embd=8, block_size=8).double()


def gpt_job(strategy):
    """A GPT built by shards (no worker holds a whole parameter: each builds its rows of every
    one, `FullyShard.build_model`) and sharded block by block (its repeated blocks, then the
    root with the tied embedding) takes 3 Adam steps on this worker's half of a batch; worker 0
    returns the full state."""
    torch.manual_seed(0)
    model = strategy.build_model(tiny_gpt64)
    whole_parameters = [n for n, p in model.named_parameters() if not p.is_meta]
    model, optimizer = strategy.prepare(model, adam(model.parameters()))
    tokens = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(1))
    mine = tokens.chunk(2)[strategy.rank]

    def loss_fn(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(len(y), -1).mean(1)

    for _ in range(3):
        strategy.train_step(model, optimizer, mine[:, :-1], mine[:, 1:], loss_fn, loss_scale=2 / 4)
    units = sorted(type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP"))
    return {"state": strategy.model_state_dict(model), "units": units, "whole_parameters": whole_parameters}


def test_a_gpt_is_sharded_by_its_blocks_and_trains_as_one_process():
    first, second = launch(gpt_job, workers=2, strategy="fsdp", threads=1, timeout=60)
    assert first["units"] == ["FSDPBlock", "FSDPBlock", "FSDPGPT"] and second["state"] == {}
    assert first["whole_parameters"] == second["whole_parameters"] == []
    torch.manual_seed(0)
    model = tiny_gpt64()
    optimizer = adam(model.parameters())
    tokens = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
    assert_states_close(first["state"], model.state_dict())


def test_sharding_units_are_the_repeated_blocks_or_the_top_level_children():
    model = tiny_gpt64()
    assert [name for name, _ in sharding_units(model)] == ["blocks.0", "blocks.1"]
    assert [name for name, _ in sharding_units(model, "Block,MLP")] == [  # inside out
        "blocks.0.mlp", "blocks.1.mlp", "blocks.0", "blocks.1"]
    assert sharding_units(model, "root") == []
    assert [name for name, _ in sharding_units(small_mlp64())] == ["1", "3"]  # no repeated blocks


def sync_bn_cnn64():
    return convert_sync_batchnorm(bn_cnn(width=4)).double()


def test_sync_batchnorm_trains_as_under_allreduce():
    """Global batch statistics, and BatchNorm's weights sharded like any other: the parameters and
    running statistics equal allreduce's."""
    replicated = run(2, GLOBAL_BATCH // 2, strategy="allreduce", model=sync_bn_cnn64, epochs=1, max_steps=6)
    sharded = run(2, GLOBAL_BATCH // 2, model=sync_bn_cnn64, epochs=1, max_steps=6)
    assert_states_close(sharded.model_state, replicated.model_state)


def test_mixed_precision_computes_in_bfloat16_and_steps_in_float32():
    """``param_dtype=bfloat16``: gathers of 2 bytes a value, reduce-scatters in float32, shards and
    the step in the parameters' float32; the result is near the float32 run's, not equal to it.
    ``offload`` on CPU is a no-op (nothing to move)."""
    steps = 10
    plain = run(2, GLOBAL_BATCH // 2, model=small_mlp, data="digits", epochs=1, max_steps=steps)
    mixed = run(2, GLOBAL_BATCH // 2, model=small_mlp, data="digits", epochs=1, max_steps=steps,
                strategy=FullyShard(param_dtype="bf16", reduce_dtype="float32", offload=True))
    assert all(v.dtype == torch.float32 for v in mixed.model_state.values())
    diff = max((mixed.model_state[k] - plain.model_state[k]).abs().max().item() for k in plain.model_state)
    assert 0 < diff < 0.05
    gather, reduce = N_PARAMS * 2, N_PARAMS * 4
    assert mixed.history[0]["comm_bytes"] == 2 * steps * (2 * gather + reduce) // 2


def test_bad_options_are_one_line():
    with pytest.raises(UsageError, match=r"^Bad options for strategy 'fsdp': Expected wrap to be 'auto', 'root' or module class names \('Block,MLP'\)\. "
                                         r"Received: wrap=''$"):
        get_strategy("fsdp", wrap="")
    with pytest.raises(UsageError, match=r"^Bad options for strategy 'fsdp': Expected param_dtype among \['bfloat16', 'float16', 'float32', 'float64'\]\. "
                                         r"Received: param_dtype='int8'$"):
        get_strategy("fsdp", param_dtype="int8")
    with pytest.raises(UsageError, match=r"^Expected option reshard_after_forward to be a bool\. Received: 'maybe'$"):
        parse_options("fsdp", ["reshard_after_forward=maybe"])
    with pytest.raises(UsageError, match=r"^Expected options of strategy 'fsdp' among \['wrap', 'reshard_after_forward', "
                                         r"'param_dtype', 'reduce_dtype', 'offload'\]\. Received: shards$"):
        get_strategy("fsdp", shards=2)
    options = parse_options("fsdp", ["wrap=Block,MLP", "reshard_after_forward=false", "param_dtype=bf16"])
    assert get_strategy("fsdp", **options).options() == {
        "wrap": "Block,MLP", "reshard_after_forward": False, "param_dtype": "bfloat16", "reduce_dtype": None,
        "offload": False}
    with pytest.raises(UsageError, match=r"^Expected 2 or more workers for fsdp's param_dtype / reduce_dtype \(one "
                                         r"worker shards nothing; fit's precision='bf16' runs one process in "
                                         r"bfloat16\)\. Received: 1 worker$"):
        run(1, GLOBAL_BATCH, strategy=FullyShard(param_dtype="bfloat16"), max_steps=1)
    # the model's classes, from the one model fit builds in the caller: no process started
    with pytest.raises(UsageError, match=r"^Expected modules of class Nope in Sequential to shard \(wrap='Nope'\)\. "
                                         r"Received: none; its classes are Flatten, Linear, ReLU, Sequential$"):
        run(2, GLOBAL_BATCH // 2, strategy=FullyShard(wrap="Nope"), max_steps=1)


def stepped_job(strategy):
    model = small_mlp64()
    optimizer = sgd(model.parameters())
    model(torch.zeros(1, 64, dtype=torch.float64)).sum().backward()
    optimizer.step()
    strategy.prepare(model, optimizer)


def test_an_optimizer_that_has_stepped_is_one_line_from_the_workers():
    """A hand-written loop's optimizer is known in the workers only."""
    with pytest.raises(WorkerError, match=r"UsageError: Expected an optimizer that has not stepped yet for strategy "
                                          r"'fsdp' \(its state is rebuilt on the shards\)\. Received: state for 4 "
                                          r"parameters \(tests/strategies/test_fsdp\.py:\d+, in stepped_job\)$"):
        launch(stepped_job, workers=2, strategy="fsdp", threads=1, timeout=60)


def test_the_command_line_trains_and_writes_a_checkpoint_any_strategy_loads(tmp_path, capsys):
    out = str(tmp_path / "run")
    code = main(["train", "--strategy", "fsdp", "--workers", "2", "--model", "mlp", "--dataset", "digits",
                 "--epochs", "1", "--max-steps", "3", "--out", out, "--quiet", "-o", "reshard_after_forward=false"])
    assert code == 0
    model, spec = load_model(os.path.join(out, "checkpoint.pt"))  # what `partrain serve` does
    assert spec["name"] == "mlp" and model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_the_compat_probes_name_torchs_fsdp2_and_dtensor():
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    assert _compat.fsdp2().fully_shard is fully_shard and _compat.fsdp2().FSDPModule is FSDPModule
    assert _compat.dtensor_class() is DTensor


class ItemInForward(torch.nn.Module):
    """small_mlp64 with a forward that reads a value (a data-dependent branch, as some models have)."""

    def __init__(self):
        super().__init__()
        self.net = small_mlp64()

    def forward(self, x):
        return self.net(x) * (1.0 if x.abs().sum().item() >= 0 else -1.0)


def recorded_build(path, kind="mlp"):
    """The model, after appending ``pid device`` (where a new tensor goes while it is built) to ``path``."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {torch.empty(0).device.type}\n")
    return ItemInForward() if kind == "item" else small_mlp64()


def test_the_caller_checks_the_model_on_the_meta_device_and_never_builds_it_whole(tmp_path):
    """Under fsdp the caller (under torchrun every process is one) checks the model against the data on
    its shapes; the workers build their shards. Shape errors are still one line before any worker
    starts; a forward that needs values is left to the workers' first step."""
    log = tmp_path / "builds"
    run(2, GLOBAL_BATCH // 2, model=functools.partial(recorded_build, str(log)), epochs=1, max_steps=2)
    builds = [line.split() for line in log.read_text().splitlines()]
    assert [device for pid, device in builds if int(pid) == os.getpid()] == ["meta"]  # the caller's one build
    assert {pid for pid, _ in builds} - {str(os.getpid())}  # the workers built too, in their processes
    with pytest.raises(UsageError, match=r"Expected samples that model can take\. Received: dataset with inputs tensor \(2, 1, 8, 8\)"):
        run(2, GLOBAL_BATCH // 2, model=functools.partial(torch.nn.Linear, 16, 10), epochs=1)
    item = run(2, GLOBAL_BATCH // 2, model=functools.partial(recorded_build, str(log), "item"), epochs=1, max_steps=2)
    plain = run(2, GLOBAL_BATCH // 2, epochs=1, max_steps=2)
    assert_states_close({k.removeprefix("net."): v for k, v in item.model_state.items()}, plain.model_state)
