"""Token-level training: Hugging Face models through `fit` on their own loss, named token
losses (``cross_entropy`` on ``[N, T, V]``, ``causal_lm``) with padding, the built-in GPT.

References are hand-written float64 PyTorch loops on the concatenated global batch (the
sample order of `tests.helpers.epoch_order`), with the mean over the batch's valid tokens
that ``F.cross_entropy(..., ignore_index=-100)`` or the model itself computes: two workers
whose batches hold different numbers of valid tokens must equal that one process exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from partrain.data import Sequences, TokenCollate
from partrain.errors import UsageError
from partrain.models.gpt import gpt
from partrain.train.fit import fit
from partrain.train.task import Task, class_dim, token_accuracy
from tests.helpers import assert_states_close, epoch_order, torch_threads

transformers = pytest.importorskip("transformers")

V, T, N = 40, 10, 24  # vocabulary, sequence length, training sequences
COMMON = dict(batch_size=4, epochs=1, quiet=True, timeout=120, threads=1, return_state=True)


class PaddedText(Dataset):
    """Right-padded token sequences of random lengths (so every batch, and every worker's share of
    it, holds a different number of valid tokens) as Hugging Face batches them:
    ``{"input_ids", "attention_mask", "labels"}`` with ``labels`` -100 at the padding."""

    def __init__(self, n: int = N, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, V, (n, T), generator=g)
        self.sizes = torch.randint(2, T + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(T) < self.sizes[i]).long()
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.ids[i].masked_fill(mask == 0, -100)}


class ShiftedText(PaddedText):
    """The same sequences as ``(x, y)`` with the targets already shifted (the built-in text data's
    contract): ``y[t] = x[t + 1]``, -100 where there is no next real token."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.ids[i]
        y = torch.cat([x[1:], torch.tensor([-100])]).masked_fill(torch.arange(T) >= self.sizes[i] - 1, -100)
        return x, y


def padded_text() -> tuple[Dataset, None]:
    return PaddedText(), None


def shifted_text() -> tuple[Dataset, None]:
    return ShiftedText(), None


def hf_gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                     loss_type="ForCausalLM")
    return transformers.GPT2LMHeadModel(config).double()


def small_gpt() -> nn.Module:
    return gpt(vocab_size=V, n_layer=2, n_head=2, n_embd=16, block_size=T).double()


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def by_hand(model_fn, dataset: Dataset, loss_of, *, batch: int, steps: int | None = None,
            collate=torch.utils.data.default_collate) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch, on the global batches of `epoch_order`: ``loss_of(model, batch)``
    is the mean over the global batch's valid tokens."""
    with torch_threads(1):
        torch.manual_seed(0)
        model = model_fn()
        opt = sgd(model.parameters())
        order = epoch_order(len(dataset), 0)
        for k, start in enumerate(range(0, len(order), batch)):
            if steps is not None and k == steps:
                break
            samples = [dataset[int(i)] for i in order[start:start + batch]]
            glob = collate(samples)
            opt.zero_grad()
            loss_of(model, glob).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def own_loss(model, batch):
    return model(**batch).loss


def token_ce(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-100)


def causal_ce(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)


def logits_only(model, inputs):
    return model(**inputs).logits


# ----- two workers equal one process on the global batch ----------------------------------
def test_a_hugging_face_gpt2_trains_on_its_own_loss_like_one_process(capfd):
    result = fit(hf_gpt2, padded_text, sgd, strategy="allreduce", workers=2, **{**COMMON, "quiet": False},
                 progress=False)
    want = by_hand(hf_gpt2, PaddedText(), own_loss, batch=8)
    # Hugging Face computes its loss in float32 (logits.float()), whatever the model's dtype:
    # the sums over two workers and over one batch differ in float32's last bits
    assert_states_close(result.model_state, want, atol=1e-6)
    err = capfd.readouterr().err
    assert "training on GPT2LMHeadModel's own loss, a mean over the valid targets after the shift by one" in err
    row = result.history[-1]
    assert {"train_token_accuracy", "train_perplexity", "tokens", "tokens_per_s"} <= set(row)
    assert row["tokens"] == int((PaddedText().sizes - 1).sum())  # every valid target once


def test_a_named_causal_lm_loss_on_a_hugging_face_model_equals_one_process_exactly():
    result = fit(hf_gpt2, padded_text, sgd, strategy="allreduce", workers=2, loss_fn="causal_lm",
                 forward_fn=logits_only, **COMMON)
    assert_states_close(result.model_state, by_hand(hf_gpt2, PaddedText(), causal_ce, batch=8))


def test_the_built_in_gpt_with_token_cross_entropy_equals_one_process_exactly():
    result = fit(small_gpt, shifted_text, sgd, strategy="allreduce", workers=2, **COMMON)
    assert_states_close(result.model_state, by_hand(small_gpt, ShiftedText(), token_ce, batch=8))
    row = result.history[-1]
    assert row["train_perplexity"] == pytest.approx(torch.tensor(row["train_loss"]).exp().item())


def test_accumulated_micro_batches_divide_by_the_window_s_tokens():
    # one worker, two micro-batches of 4 per step: the step's mean is over both micro-batches' tokens
    result = fit(small_gpt, shifted_text, sgd, strategy="single", workers=1, accumulate=2, **COMMON)
    assert_states_close(result.model_state, by_hand(small_gpt, ShiftedText(), token_ce, batch=8))


# ----- the pieces, against hand computations ---------------------------------------------
def test_the_named_token_loss_is_f_cross_entropy_s_mean_over_the_valid_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, T, V, dtype=torch.float64, generator=g)
    target = torch.randint(0, V, (3, T), generator=g)
    target[0, 4:] = -100
    target[2, :] = -100
    task = Task("cross_entropy").resolve((logits, target))
    assert task.units == "tokens" and task.count(target) == 4 + T
    got = task.loss(logits, target).sum() / task.count(target)
    want = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(got, want)
    hits = token_accuracy(logits, target).sum()
    assert hits == ((logits.argmax(-1) == target) & (target != -100)).sum()


def test_class_dimension_is_dim_1_for_images_and_last_for_token_logits():
    assert class_dim(torch.zeros(2, 5, 7, 7), torch.zeros(2, 7, 7)) == 1
    assert class_dim(torch.zeros(2, 9, 30), torch.zeros(2, 9)) == 2
    assert class_dim(torch.zeros(2, 30), torch.zeros(2)) == 1
    assert class_dim(torch.zeros(2, 4, 4), torch.zeros(2, 5)) is None


def per_sequence(out, y):
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)


def test_a_users_per_sample_loss_on_token_logits_is_never_second_guessed():
    # the case: [N, T, V] logits and a per-sample token loss of the user's own
    result = fit(small_gpt, shifted_text, sgd, strategy="single", workers=1, loss_fn=per_sequence, metrics=[],
                 **COMMON)
    assert result.history[-1]["train_loss"] > 0


# ----- bad input, one line ----------------------------------------------------------------
class Beyond(ShiftedText):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, y.masked_fill(y == 3, V + 5)


def test_labels_beyond_the_vocabulary_are_one_line():
    with pytest.raises(UsageError, match=rf"Expected class labels in \[0, {V - 1}\] for a model with {V} outputs "
                                         rf"\(-100: padding\)\. Received labels from 0 to {V + 5}"):
        fit(small_gpt, (Beyond(), None), sgd, strategy="single", **COMMON)


def shorter_gpt():
    return gpt(vocab_size=V, n_layer=1, n_head=2, n_embd=16, block_size=T - 2).double()


def test_a_sequence_longer_than_block_size_is_one_line():
    with pytest.raises(UsageError, match=rf"Expected sequences of at most {T - 2} tokens .* Received: {T}"):
        fit(shorter_gpt, shifted_text, sgd, strategy="single", **COMMON)


class Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8)

    def forward(self, x):
        return {"hidden_states": self.emb(x)}


def test_a_model_whose_output_has_neither_loss_nor_logits_is_one_line():
    with pytest.raises(UsageError, match="Expected a model output that is a tensor, a tuple starting with one, or a "
                                         "dict with one of .*logits"):
        fit(Hidden, shifted_text, sgd, strategy="single", **COMMON)


def test_an_unknown_hugging_face_head_is_refused_for_two_workers(monkeypatch):
    import partrain.train.task as task_module

    monkeypatch.setattr(task_module, "own_loss_units", lambda model: None)
    with pytest.raises(UsageError, match="Expected a model whose own loss partrain can re-weight exactly .* "
                                         "Received: GPT2LMHeadModel"):
        fit(hf_gpt2, padded_text, sgd, strategy="allreduce", workers=2, **COMMON)


def test_own_loss_with_a_model_that_returns_none_is_refused_for_loss_own():
    with pytest.raises(UsageError, match="Expected a model whose output carries a 'loss' for loss_fn='own'"):
        fit(small_gpt, shifted_text, sgd, strategy="single", loss_fn="own", **COMMON)


@pytest.mark.parametrize("strategy", ["hogwild", "localsgd", "ps"])
def test_asynchronous_strategies_train_a_transformer_on_each_worker_s_token_mean(strategy):
    # no per-step all-reduce under them: each worker's step is the mean over its own tokens
    result = fit(small_gpt, shifted_text, functools.partial(torch.optim.SGD, lr=0.1), strategy=strategy, workers=2,
                 **{**COMMON, "epochs": 2})
    losses = [row["train_loss"] for row in result.history]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]


# ----- activation checkpointing -------------------------------------------------------------
def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward pass keeps for the backward pass (what activation checkpointing saves)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).sum()
    loss.backward()
    return total


def test_activation_checkpointing_keeps_less_and_changes_no_number():
    from partrain.nn.checkpointing import checkpoint_blocks

    x = torch.randint(0, V, (4, T))
    torch.manual_seed(0)
    plain = small_gpt()
    torch.manual_seed(0)
    checkpointed = small_gpt()
    assert checkpoint_blocks(checkpointed, True) == ["blocks.0", "blocks.1"]
    assert saved_bytes(checkpointed, x) < 0.6 * saved_bytes(plain, x)
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert list(dict(plain.named_parameters())) == list(dict(checkpointed.named_parameters()))


def test_fit_with_activation_checkpointing_equals_one_process():
    result = fit(hf_gpt2, padded_text, sgd, strategy="allreduce", workers=2, loss_fn="causal_lm",
                 forward_fn=logits_only, activation_checkpointing=True, **COMMON)
    assert_states_close(result.model_state, by_hand(hf_gpt2, PaddedText(), causal_ce, batch=8))


def test_activation_checkpointing_without_blocks_is_one_line():
    with pytest.raises(UsageError, match="Expected modules of class Nope in GPT for activation_checkpointing. "
                                         "Received: none"):
        fit(small_gpt, shifted_text, sgd, strategy="single", activation_checkpointing="Nope", **COMMON)


# ----- variable-length text: padded per batch, bucketed -----------------------------------------
def variable_text() -> tuple[Dataset, None]:
    """Sequences of 2..T tokens (ids only: the labels are the ids, shifted by ``causal_lm``)."""
    data = PaddedText()
    seqs = [data.ids[i, : int(data.sizes[i])] for i in range(len(data))]
    return Sequences(seqs, seqs), None


def gpt_logits(model, inputs):
    return model(inputs["input_ids"], inputs["attention_mask"])


def causal_ce_gpt(model, batch):
    logits = gpt_logits(model, batch)
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)


def test_padding_counts_nowhere_each_worker_padding_to_its_own_longest():
    # each worker pads its share of the global batch to its own longest sequence, the reference
    # pads the whole global batch at once: equal results, since padding counts in no loss
    result = fit(small_gpt, variable_text, sgd, strategy="allreduce", workers=2, loss_fn="causal_lm",
                 collate_fn=TokenCollate(), bucket=False, **COMMON)
    train, _ = variable_text()
    assert_states_close(result.model_state, by_hand(small_gpt, train, causal_ce_gpt, batch=8,
                                                    collate=TokenCollate()))
    assert result.history[-1]["tokens"] == int((train.lengths - 1).sum())


def test_variable_length_text_is_bucketed_by_length_and_trains():
    result = fit(small_gpt, variable_text, sgd, strategy="allreduce", workers=2, loss_fn="causal_lm",
                 collate_fn=TokenCollate(), **{**COMMON, "epochs": 3})
    train, _ = variable_text()
    rows = result.history
    assert all(row["tokens"] == int((train.lengths - 1).sum()) for row in rows)  # every target once an epoch
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]


def test_token_collate_pads_ids_mask_and_labels():
    batch = TokenCollate(pad_id=7)([torch.tensor([1, 2, 3]), torch.tensor([4])])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    with pytest.raises(UsageError, match=r"Expected token samples as ids \[T\] or \(ids \[T\], labels \[T\]\)"):
        TokenCollate()([(torch.tensor([1, 2]), torch.tensor([1]))])


def gpt32() -> nn.Module:
    return gpt(vocab_size=V, n_layer=2, n_head=2, n_embd=16, block_size=T)


def test_bf16_clipping_and_accumulation_train_the_gpt_as_they_train_a_cnn():
    result = fit(gpt32, shifted_text, functools.partial(torch.optim.AdamW, lr=3e-3), strategy="allreduce", workers=2,
                 precision="bf16", clip_grad=0.5, accumulate=2, **{**COMMON, "epochs": 4})
    losses = [row["train_loss"] for row in result.history]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
