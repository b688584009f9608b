"""tp = one process on the same batches: tensor parallel over 2 processes against plain PyTorch.

`TensorParallel` splits the planned layers' matrices over the processes (torch's
``parallelize_module`` on a 1-D DeviceMesh) and gives every process the whole global batch.
Its promise is exactness: after k optimizer steps the parameters, gathered whole, equal those
of one process that trains the unsplit model on the same batches, in float64 to `F64_ATOL`
(two processes add the same products in another order: rounding, about 1e-16 here). The
references are plain hand loops: `tests.helpers.train_by_hand` (an MLP on digits) and
`hand_loop` below (token-level losses, like `tests.train.test_language_models.by_hand`, with
clipping and epochs). A wrong split (a fused q, k, v cut in the middle of k, a head count left
global, a tied weight split twice, the batch sharded) moves the parameters by 1e-3 or more.

Start with `test_the_built_in_gpt_equals_one_process`; `test_each_process_holds_half_of_each_split_matrix`
checks the memory the split is for, in a loop of one's own.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partrain._compat import dtensor_module
from partrain.checkpoint import load_checkpoint, load_model
from partrain.cli import main
from partrain.errors import UsageError
from partrain.launch import launch
from partrain.models.gpt import gpt
from partrain.strategies import get_strategy, parse_options
from partrain.strategies.tensor_parallel import TensorParallel
from partrain.train.fit import fit
from tests.helpers import (
    assert_history_matches,
    assert_states_close,
    digits64,
    epoch_order,
    sgd,
    small_mlp64,
    torch_threads,
    train_by_hand,
)
from tests.train.test_language_models import (
    COMMON,
    PaddedText,
    ShiftedText,
    T,
    V,
    causal_ce,
    hf_gpt2,
    logits_only,
    small_gpt,
    token_ce,
)

transformers = pytest.importorskip("transformers")

ROWS = 6  # the global batch: every process sees all 6 rows
TP = dict(COMMON, workers=2, batch_size=ROWS)


def lm_sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def shifted_text() -> tuple[ShiftedText, ShiftedText]:
    return ShiftedText(), ShiftedText(n=8, seed=2)


def padded_text() -> tuple[PaddedText, PaddedText]:
    return PaddedText(), PaddedText(n=8, seed=2)


def tiny_llama() -> nn.Module:
    """Llama's shape at toy size: 4 query heads, 2 key-value heads (grouped queries), SwiGLU MLP."""
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)
    return transformers.LlamaForCausalLM(config).double()


def hand_loop(model_fn, dataset, loss_of, *, batch: int = ROWS, epochs: int = 1,
              clip: float | None = None) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch: ``lm_sgd`` on the global batches of `epoch_order`, each epoch's
    own order, ``clip_grad_norm_`` between backward and step when ``clip`` is given."""
    with torch_threads(1):
        torch.manual_seed(0)
        model = model_fn()
        opt = lm_sgd(model.parameters())
        for epoch in range(epochs):
            order = epoch_order(len(dataset), epoch)
            for start in range(0, len(order), batch):
                glob = torch.utils.data.default_collate([dataset[int(i)] for i in order[start:start + batch]])
                opt.zero_grad()
                loss_of(model, glob).backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def gpt_by_hand(epochs: int = 1, clip: float | None = None) -> dict[str, torch.Tensor]:
    return hand_loop(small_gpt, ShiftedText(), token_ce, epochs=epochs, clip=clip)


# ----- equal to one process ----------------------------------------------------------------------
def test_an_mlp_with_the_automatic_plan_equals_one_process():
    """``mlp``'s Sequential (Flatten, Linear, ReLU, Linear): the pair is split colwise then rowwise.
    One data-parallel worker: the loop's figures are those of one process on the global batch of
    96, the odd last batch included."""
    state, history = train_by_hand(small_mlp64, digits64, sgd, batch=96, epochs=1)
    result = fit(small_mlp64, digits64, sgd, strategy="tp", workers=2, batch_size=96, epochs=1, quiet=True,
                 return_state=True, timeout=60)
    assert_states_close(result.model_state, state)
    assert_history_matches(result.history, history)
    assert result.history[-1]["workers"] == 1  # data-parallel workers: one, split over 2 processes


@pytest.mark.parametrize("options", [{}, {"sequence_parallel": True}, {"loss_parallel": True},
                                     {"sequence_parallel": True, "loss_parallel": True}],
                         ids=["plain", "sequence_parallel", "loss_parallel", "both"])
def test_the_built_in_gpt_equals_one_process(options):
    """The built-in GPT (2 layers, width 16, 2 heads) on a token-level loss with padding: its fused
    q, k, v split part by part, attention on its local head, the tied embedding and output layer
    split by vocabulary as one parameter; with sequence parallel (norms on half of the positions)
    and loss parallel (the loss on logits split by vocabulary) the same numbers."""
    result = fit(small_gpt, shifted_text, lm_sgd, strategy=TensorParallel(**options), **TP)
    assert_states_close(result.model_state, gpt_by_hand())
    assert torch.equal(result.model_state["lm_head.weight"], result.model_state["tok_emb.weight"])
    row = result.history[-1]
    assert row["comm_bytes"] > 0  # counted at the split layers
    assert 0.5 < row["tp_param_share"] < 0.6  # norms and position embedding are whole on each process


def test_a_plan_by_pattern_equals_one_process():
    """The user's plan, by fnmatch patterns: only the MLPs split, the rest whole on each process."""
    plan = "blocks.*.mlp.fc=colwise,blocks.*.mlp.proj=rowwise"
    result = fit(small_gpt, shifted_text, lm_sgd, strategy=TensorParallel(plan=plan), **TP)
    assert_states_close(result.model_state, gpt_by_hand())
    whole = sum(v.numel() for k, v in gpt_by_hand().items() if k != "lm_head.weight")  # tied: counted once
    mlp = sum(v.numel() for k, v in gpt_by_hand().items() if ".mlp." in k and not k.endswith("proj.bias"))
    assert result.history[-1]["tp_param_bytes"] == 8 * (whole - mlp / 2)  # float64; rowwise biases stay whole


@pytest.mark.parametrize("options", [{}, {"sequence_parallel": True, "loss_parallel": True}],
                         ids=["plain", "sequence_and_loss_parallel"])
def test_a_llama_style_hugging_face_model_equals_one_process(options):
    """A Llama from its config (nothing downloaded): ``self_attn.{q,k,v}_proj`` colwise, ``o_proj``
    rowwise, ``mlp.{gate,up}_proj`` colwise, ``down_proj`` rowwise, with grouped queries (2 of the 4
    query heads and 1 of the 2 key-value heads per process); a named token loss on its logits."""
    result = fit(tiny_llama, padded_text, lm_sgd, strategy=TensorParallel(**options), loss_fn="causal_lm",
                 forward_fn=logits_only, **TP)
    assert_states_close(result.model_state, hand_loop(tiny_llama, PaddedText(), causal_ce))


def test_gpt2s_conv1d_layers_equal_one_process():
    """Hugging Face's GPT-2: Conv1D layers (weights stored [in, out]) and a fused ``c_attn``."""
    result = fit(hf_gpt2, padded_text, lm_sgd, strategy="tp", loss_fn="causal_lm", forward_fn=logits_only, **TP)
    assert_states_close(result.model_state, hand_loop(hf_gpt2, PaddedText(), causal_ce))


def test_clipping_uses_the_whole_models_norm():
    """``clip_grad`` scales by the norm of the whole gradient: the split parts' squares summed over
    the processes, the whole ones' counted once. 0.3 clips every step here."""
    result = fit(small_gpt, shifted_text, lm_sgd, strategy=TensorParallel(loss_parallel=True), clip_grad=0.3, **TP)
    assert_states_close(result.model_state, gpt_by_hand(clip=0.3))


# ----- memory, a loop of one's own ---------------------------------------------------------------
def own_loop(strategy: TensorParallel) -> dict:
    """What a script writes: build, prepare, step by hand on the same batch on every process."""
    torch.manual_seed(0)
    model = small_gpt()
    optimizer = lm_sgd(model.parameters())
    model, prepared = strategy.prepare(model, optimizer)
    local = {n: tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
             for n, p in model.named_parameters()}
    data = ShiftedText()
    order = epoch_order(len(data), 0)
    for start in range(0, 2 * ROWS, ROWS):
        x, y = torch.utils.data.default_collate([data[int(i)] for i in order[start:start + ROWS]])
        tokens = int((y != -100).sum())
        strategy.train_step(model, prepared, x, y, lambda out, t: F.cross_entropy(
            out.transpose(1, 2), t, ignore_index=-100, reduction="none").sum(1), loss_scale=1 / tokens)
    return {"local": local, "state": strategy.model_state_dict(model), "same_optimizer": prepared is optimizer,
            "momentum": {k: tuple(v["momentum_buffer"].shape) for k, v in prepared.state_dict()["state"].items()},
            "metrics": strategy.metrics()}


def test_each_process_holds_half_of_each_split_matrix():
    """Each of the 2 processes holds half of every split matrix (rows for colwise, columns for
    rowwise; a rowwise bias whole), the same optimizer object steps them, its ``state_dict()`` is
    whole, and two steps of a loop of one's own equal one process."""
    first, second = launch(own_loop, workers=2, strategy=TensorParallel(), threads=1, timeout=60)
    two_steps = _first_steps(2)
    whole = {k: tuple(v.shape) for k, v in two_steps.items()}
    for result in (first, second):
        assert_states_close(result["state"], two_steps)
        assert result["same_optimizer"]
        assert sorted(result["momentum"].values()) == sorted(whole[n] for n in result["local"])
    local = first["local"]
    assert local["blocks.0.attn.qkv.weight"] == (24, 16)  # of (48, 16): 1 head's q, k and v
    assert local["blocks.0.attn.proj.weight"] == (16, 8)
    assert local["blocks.0.mlp.fc.weight"] == (32, 16) and local["blocks.0.mlp.fc.bias"] == (32,)
    assert local["blocks.0.mlp.proj.weight"] == (16, 32) and local["blocks.0.mlp.proj.bias"] == (16,)
    assert local["tok_emb.weight"] == (V // 2, 16)  # the output layer is the same parameter
    assert local["ln_f.weight"] == (16,) and local["pos_emb.weight"] == (T, 16)
    assert first["metrics"]["param_bytes"] == 8 * sum(torch.Size(s).numel() for s in local.values())
    assert second["metrics"] == first["metrics"]


@functools.cache
def _first_steps(steps: int) -> dict[str, torch.Tensor]:
    class FirstRows(ShiftedText):  # the epoch's first ``steps`` global batches, in their order
        def __init__(self) -> None:
            super().__init__()
            keep = epoch_order(len(self.ids), 0)[:steps * ROWS]
            self.ids, self.sizes = self.ids[keep], self.sizes[keep]

    data = FirstRows()
    with torch_threads(1):
        torch.manual_seed(0)
        model = small_gpt()
        opt = lm_sgd(model.parameters())
        for start in range(0, len(data), ROWS):
            batch = torch.utils.data.default_collate([data[i] for i in range(start, start + ROWS)])
            opt.zero_grad()
            token_ce(model, batch).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----- checkpoints -------------------------------------------------------------------------------
def test_a_tp_checkpoint_is_whole_and_resumes_under_tp_and_single(tmp_path):
    """The epoch-end checkpoint holds the whole model and optimizer state in plain tensors: tp resumes
    it to equal an uninterrupted run (momentum included), ``single`` resumes it too, and the model
    loads as ``partrain serve`` loads it."""
    fit(small_gpt, shifted_text, lm_sgd, strategy="tp", out_dir=str(tmp_path / "a"), **TP)
    ckpt = load_checkpoint(str(tmp_path / "a" / "checkpoint.pt"))
    assert all(type(v) is torch.Tensor for v in ckpt["model"].values())
    assert all(type(v["momentum_buffer"]) is torch.Tensor for v in ckpt["optimizer"]["state"].values())
    assert_states_close(ckpt["model"], gpt_by_hand())
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    two_epochs = gpt_by_hand(epochs=2)
    resumed = fit(small_gpt, shifted_text, lm_sgd, strategy="tp", out_dir=str(tmp_path / "a"), resume="auto",
                  **{**TP, "epochs": 2})
    assert_states_close(resumed.model_state, two_epochs)
    single = fit(small_gpt, shifted_text, lm_sgd, strategy="single", out_dir=str(tmp_path / "b"), resume="auto",
                 **{**TP, "workers": 1, "epochs": 2})
    assert_states_close(single.model_state, two_epochs)


def test_partrain_train_runs_tp_and_serve_loads_its_checkpoint(tmp_path, capsys):
    """The command line: the built-in GPT on the bundled text, a few steps, sequence and loss parallel."""
    code = main(["train", "--quiet", "--strategy", "tp", "--workers", "2", "--model", "gpt", "--dataset", "text",
                 "--model-opt", "n_layer=1", "--model-opt", "n_embd=32", "--model-opt", "n_head=2",
                 "--block-size", "16", "--epochs", "1", "--max-steps", "2", "-o", "sequence_parallel=true",
                 "-o", "loss_parallel=true", "--out", str(tmp_path)])
    assert code == 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[-1]["strategy"] == "tp" and rows[-1]["step"] == 2 and rows[-1]["tp_param_bytes"] > 0
    model, spec = load_model(str(tmp_path / "checkpoint.pt"))
    assert spec["name"] == "gpt" and model(torch.zeros(1, 4, dtype=torch.long)).shape[-1] == 256


# ----- refused in one line -----------------------------------------------------------------------
def gpt_3_heads() -> nn.Module:
    return gpt(vocab_size=V, n_layer=1, n_head=3, n_embd=18, block_size=T).double()


def llama_3_kv_heads() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=T)
    return transformers.LlamaForCausalLM(config).double()


LLAMA = {"data": padded_text, "loss_fn": "causal_lm", "forward_fn": logits_only}
REFUSED = [
    (gpt_3_heads, {}, r"^Expected attention heads divisible by the tensor-parallel size 2 \(each process computes "
                      r"whole heads\)\. Received: blocks\.0\.attn with n_head=3$"),
    (llama_3_kv_heads, LLAMA, r"^Expected attention heads divisible by the tensor-parallel size 2 .* Received: "
                           r"model\.layers\.0\.self_attn with num_key_value_heads=3$"),
    (small_gpt, {"plan": "blocks.*.mlp.fc1=colwise"},
     r"^Expected plan pattern 'blocks\.\*\.mlp\.fc1' to match a module of the model\. Received: no module named "
     r"like it \(modules: tok_emb, pos_emb, .*\)$"),
    (small_gpt, {"plan": "blocks.*.ln_1=colwise"},
     r"^Expected plan style colwise on an nn\.Linear, nn\.Embedding or Hugging Face Conv1D\. Received: "
     r"'blocks\.0\.ln_1', a LayerNorm$"),
    (small_gpt, {"plan": "blocks.*.attn.qkv=colwise,blocks.*.attn.proj=rowwise"},
     r"^Expected 'blocks\.0\.attn\.qkv', the built-in GPT's fused q, k, v projection, split 'colwise:3'"),
    (small_gpt, {"plan": "tok_emb=rowwise"},
     r"^Expected the modules that share one weight split alike by the plan .* Received: 'tok_emb' \(split on "
     r"dim 0\), 'lm_head' \(whole\)$"),
    (small_mlp64, {"data": digits64, "loss_parallel": True}, r"^Expected loss_parallel with a language model"),
    (small_mlp64, {"data": digits64, "sequence_parallel": True},
     r"^Expected sequence_parallel with a transformer's blocks"),
]


@pytest.mark.parametrize("model_fn, options, message", REFUSED,
                         ids=["gpt_heads", "llama_kv_heads", "no_match", "not_linear", "qkv_unfused", "tied_apart",
                              "loss_parallel_mlp", "sequence_parallel_mlp"])
def test_a_model_the_plan_cannot_split_is_refused_in_one_line_before_any_process_starts(model_fn, options, message):
    """The caller checks the plan on its one model (`Strategy.check_model`): the line comes from
    here, not from a worker ("worker rank 1 failed: ...")."""
    options = dict(options)
    data = options.pop("data", shifted_text)
    fit_options = {k: options.pop(k) for k in ("loss_fn", "forward_fn") if k in options}
    with pytest.raises(UsageError, match=message):
        fit(model_fn, data, lm_sgd, strategy=TensorParallel(**options), **TP, **fit_options)


@pytest.mark.parametrize("options, message", [
    ({"plan": "blocks.*.mlp.fc"}, r"Expected a tensor-parallel plan as PATTERN=STYLE\[,PATTERN=STYLE\.\.\.\] .* "
                                  r"Received: 'blocks\.\*\.mlp\.fc' in 'blocks\.\*\.mlp\.fc'$"),
    ({"plan": "fc=diagonal"}, r"^Expected a style among \['colwise', 'rowwise', 'colwise_gather'\] or 'colwise:K' "
                              r"\(K fused parts\) for plan pattern 'fc'\. Received: 'diagonal'$"),
    ({"plan": "fc=colwise:x"}, r"^Expected 'colwise:K' with K a positive integer"),
    ({"plan": "fc=colwise", "sequence_parallel": True}, r"^Expected sequence_parallel with plan='auto'"),
    ({"loss_parallel": "yes"}, r"^Expected loss_parallel to be true or false\. Received: loss_parallel='yes'$"),
    ({"plan": ""}, r"^Expected plan='auto' or 'PATTERN=STYLE,\.\.\.'\. Received: plan=''$"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(UsageError, match=r"^Bad options for strategy 'tp': " + message.removeprefix("^")):
        get_strategy("tp", **options)


def test_cli_options_reach_the_constructor():
    assert parse_options("tp", ["plan=blocks.*.mlp.fc=colwise,blocks.*.mlp.proj=rowwise", "sequence_parallel=true",
                                "loss_parallel=1"]) == {
        "plan": "blocks.*.mlp.fc=colwise,blocks.*.mlp.proj=rowwise", "sequence_parallel": True, "loss_parallel": True}
    strategy = get_strategy("tp")
    assert strategy.data_parallel_workers(4) == 1 and strategy.options() == {
        "plan": "auto", "sequence_parallel": False, "loss_parallel": False}


def test_dtensor_comes_from_torchs_public_module_here():
    """`partrain._compat.dtensor_module`: torch 2.13 has DTensor's public module (2.4 kept it private)."""
    import torch.distributed.tensor

    assert dtensor_module() is torch.distributed.tensor
