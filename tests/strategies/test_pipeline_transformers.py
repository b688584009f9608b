"""pipeline on transformers: the built-in GPT and Hugging Face's GPT-2, cut between their blocks
over 2 processes, train exactly like one process on the global batch.

Neither traces (torch.export stops at the GPT's check of its token ids and in GPT-2's mask and
cache code), so the pipeline cuts them between the items of their block list (``blocks``,
``transformer.h``), each stage calling the model's own forward pass
(`partrain.strategies._pipeline_blocks`). Both tie the output layer to the token embedding: one
Parameter read by the first stage (the embedding) and by the last (the head), whose gradient
must be the sum of both uses, as one process accumulates it. Batches of 6 rows do not divide
into the 4 micro-batches: the padding rows must count nowhere. Evaluation runs through the
pipeline too (``test_loss``; GPT-2's ``ModelOutput`` reaches every stage).

References: the float64 hand loops of `tests.train.test_language_models` on the global batch
(one pipeline of 2 stages is one data-parallel worker: the global batch is ``batch_size``).
Start with `test_the_built_in_gpt_cut_between_its_blocks_equals_one_process`.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partrain.env import DistEnv
from partrain.errors import UsageError, WorkerError
from partrain.launch import launch
from partrain.strategies._pipeline_blocks import plan_blocks
from partrain.strategies.pipeline import Pipeline
from partrain.train.fit import fit
from tests.helpers import assert_states_close, torch_threads
from tests.train.test_language_models import (
    COMMON,
    PaddedText,
    ShiftedText,
    V,
    by_hand,
    causal_ce,
    hf_gpt2,
    logits_only,
    own_loss,
    padded_text,
    sgd,
    small_gpt,
    token_ce,
)

pytest.importorskip("transformers")

ROWS = 6  # a batch: 4 micro-batches of 2 rows, the last 2 of them padding
PIPELINE = dict(COMMON, strategy="pipeline", workers=2, batch_size=ROWS)


def shifted_text_and_test() -> tuple[ShiftedText, ShiftedText]:
    return ShiftedText(), ShiftedText(n=8, seed=2)


def padded_text_and_test() -> tuple[PaddedText, PaddedText]:
    return PaddedText(), PaddedText(n=8, seed=2)


def hand_test_loss(model_fn, state: dict[str, torch.Tensor], batch: dict | tuple, loss_of) -> float:
    """The mean loss over the test set's valid tokens of ``model_fn()`` holding ``state``."""
    with torch_threads(1), torch.no_grad():
        model = model_fn()
        model.load_state_dict(state)
        return loss_of(model.eval(), batch).item()


def whole(dataset) -> dict | tuple:
    return torch.utils.data.default_collate([dataset[i] for i in range(len(dataset))])


def test_the_built_in_gpt_cut_between_its_blocks_equals_one_process():
    result = fit(small_gpt, shifted_text_and_test, sgd, **PIPELINE)
    want = by_hand(small_gpt, ShiftedText(), token_ce, batch=ROWS)
    assert_states_close(result.model_state, want)
    # the tied weight, trained on both stages, is still one matrix (each stage saved one of its names)
    torch.testing.assert_close(result.model_state["lm_head.weight"], result.model_state["tok_emb.weight"],
                               rtol=0, atol=0)
    test_loss = hand_test_loss(small_gpt, want, whole(shifted_text_and_test()[1]), token_ce)
    assert result.history[-1]["test_loss"] == pytest.approx(test_loss, rel=1e-9)


def test_hugging_face_gpt2_with_a_named_token_loss_equals_one_process():
    result = fit(hf_gpt2, padded_text_and_test, sgd, loss_fn="causal_lm", forward_fn=logits_only, **PIPELINE)
    want = by_hand(hf_gpt2, PaddedText(), causal_ce, batch=ROWS)
    assert_states_close(result.model_state, want)
    test_loss = hand_test_loss(hf_gpt2, want, whole(padded_text_and_test()[1]), causal_ce)
    assert result.history[-1]["test_loss"] == pytest.approx(test_loss, rel=1e-9)


def test_hugging_face_gpt2_on_its_own_loss_equals_one_process():
    # 6 rows: micro-batches of 2 real rows and one of padding alone, which the loss leaves out
    result = fit(hf_gpt2, padded_text, sgd, **PIPELINE)
    # Hugging Face computes its loss in float32 (logits.float()) whatever the model's dtype
    assert_states_close(result.model_state, by_hand(hf_gpt2, PaddedText(), own_loss, batch=ROWS), atol=1e-6)


def test_its_own_loss_on_a_micro_batch_half_padding_is_one_line():
    # 5 rows: micro-batches of 2, the third holds one real row and one of padding, which the
    # model's own loss would count
    line = ("Expected the model to return one tensor (forward_fn=lambda m, x: m(**x).logits and a named loss) or "
            "batches that divide into 4 micro-batches, for strategy 'pipeline' (it pads the others with rows it "
            "drops from the output). Received: dict {'loss': tensor () float32, 'logits': tensor (2, 10, 40) float64, "
            "'cache': DynamicCache} on a batch of 5")
    with pytest.raises(WorkerError, match=re.escape(line)):
        fit(hf_gpt2, padded_text, sgd, **{**PIPELINE, "batch_size": 5})


# ----- where the cut goes, in one process -------------------------------------------------
def test_the_cut_keeps_the_tied_weight_on_the_first_and_last_stage():
    torch.manual_seed(0)
    model = small_gpt()
    cut, why = plan_blocks(model, torch.randint(0, V, (2, 10)), None, 2, "params")
    assert cut is not None and why == ""
    assert (cut.name, cut.bounds) == ("blocks", [0, 1, 2])
    tied = id(model.tok_emb.weight)
    assert tied in cut.held[0] and tied in cut.held[1]  # read by the embedding and by the head
    assert id(model.pos_emb.weight) in cut.held[0] and id(model.pos_emb.weight) not in cut.held[1]
    assert (cut.key_chunk["tok_emb.weight"], cut.key_chunk["lm_head.weight"], cut.key_chunk["blocks.1.mlp.fc.bias"]) \
        == (0, 1, 1)


class Outside(nn.Module):
    """A block list whose residual stream the model keeps itself (``h + block(h)``): the hidden
    state a block returns is not what the next one reads, so it must not be cut between blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, V)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.head(h)


def test_a_block_list_that_does_not_hand_one_hidden_state_along_is_refused_in_one_line():
    torch.manual_seed(0)
    inputs = {"input_ids": torch.randint(0, V, (4, 10)), "attention_mask": torch.ones(4, 10, dtype=torch.long)}
    cut, why = plan_blocks(Outside(), inputs, None, 2, "params")
    assert cut is None and why == "its block list 'blocks' does not hand one hidden state from each block to the next"
    pipe = Pipeline()
    pipe.setup(DistEnv(rank=0, world_size=2))
    model = Outside()
    model, _ = pipe.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    line = ("Expected a model that runs a block list (an nn.ModuleList of blocks, cut between them) or takes "
            "tensors (traced by torch.export) for strategy 'pipeline'; else strategy 'allreduce' (the whole model "
            "on each process). Received: Outside (its block list 'blocks' does not hand one hidden state from each "
            "block to the next) on dict {'input_ids': tensor (1, 10) int64, 'attention_mask': tensor (1, 10) int64}")
    with pytest.raises(UsageError, match=re.escape(line)), torch.no_grad():
        model(**inputs)  # cut at the first batch, before any message


class TiedOutside(Outside):
    """`Outside` (traced, not cut between blocks) with its head tied to the embedding: torch's
    tracer copies a weight that two stages use, which must train as one Parameter all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, V, bias=False)
        self.head.weight = self.embed.weight


def tied_outside() -> nn.Module:
    torch.manual_seed(0)
    return TiedOutside().double()


def tied_ids() -> torch.Tensor:
    return torch.randint(0, V, (8, 10), generator=torch.Generator().manual_seed(1))


def two_jobs(strategy: Pipeline) -> tuple[float, dict[str, torch.Tensor]]:
    """On the job's 2 processes: the built-in GPT's gradient norm after one step, as `fit`'s
    ``clip_grad`` takes it; then `TiedOutside` traced and trained 2 steps."""
    torch.manual_seed(0)
    model = small_gpt()
    model, optimizer = strategy.prepare(model, sgd(model.parameters()))
    x, y = whole(ShiftedText(n=4))
    norms = []

    def before_update() -> bool:
        norms.append(strategy.grad_norm(list(model.parameters())).item())
        return True

    strategy.train_step(model, optimizer, x, y, per_sequence_ce, loss_scale=1 / int((y != -100).sum()),
                        before_update=before_update)
    traced = Pipeline()
    traced.setup(strategy.env, timeout=30)
    tied = tied_outside()
    tied, optimizer = traced.prepare(tied, sgd(tied.parameters()))
    x, y = tied_ids(), tied_ids().roll(1, 1)
    for _ in range(2):
        traced.train_step(tied, optimizer, x, y, per_sequence_ce, loss_scale=1 / y.numel())
    return norms[0], traced.model_state_dict(tied)


def per_sequence_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.transpose(1, 2), y, ignore_index=-100, reduction="none").sum(1)


def test_tied_weights_sum_their_gradients_and_count_once_in_the_norm():
    """Both stages hold a tied weight's whole gradient after the step's sum: the gradient norm
    counts it once, and a traced model trains it as one process does."""
    (norm, state), (other_norm, _) = launch(two_jobs, workers=2, strategy=Pipeline(), threads=1, timeout=60)
    torch.manual_seed(0)
    model = small_gpt()
    token_ce(model, whole(ShiftedText(n=4))).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert norm == other_norm == pytest.approx(want, rel=1e-12)
    tied = tied_outside()
    optimizer = sgd(tied.parameters())
    ids = tied_ids()
    for _ in range(2):
        optimizer.zero_grad()
        F.cross_entropy(tied(ids).transpose(1, 2), ids.roll(1, 1)).backward()
        optimizer.step()
    assert_states_close(state, tied.state_dict())
