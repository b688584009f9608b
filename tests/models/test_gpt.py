"""The built-in GPT (partrain.models.gpt): what a language-model run and generation rely on.

Start with `test_attention_equals_a_hand_written_causal_softmax`: it checks the
attention against the textbook formula computed independently, so that the other
tests (causality, padding) rest on a model known to compute the right thing.
Numbers are compared in float64 so that the tests hold on any CPU and thread count.
"""

from __future__ import annotations

import math

import pytest
import torch

from partrain.errors import UsageError
from partrain.models import MODELS, build_model, model_kwargs_for
from partrain.models.gpt import GPT, Block


def small(**kwargs) -> GPT:
    torch.manual_seed(0)
    options = {"vocab_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 12}
    return GPT(**{**options, **kwargs}).double().eval()


def test_logits_are_batch_by_tokens_by_vocabulary():
    model = small()
    ids = torch.randint(0, 32, (3, 7))
    assert model(ids).shape == (3, 7, 32)
    assert model(ids[:, :1]).shape == (3, 1, 32)


def test_the_output_layer_is_the_token_embedding():
    model = small()
    assert model.lm_head.weight is model.tok_emb.weight
    params = list(model.parameters())
    assert sum(p is model.tok_emb.weight for p in params) == 1  # counted (and optimised) once
    n = sum(p.numel() for p in params)
    assert n == sum(p.numel() for name, p in model.state_dict().items() if name != "lm_head.weight")


def test_changing_a_token_never_changes_the_logits_before_it():
    model = small()
    ids = torch.randint(0, 32, (2, 10))
    base = model(ids)
    for t in (0, 4, 9):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % 32
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
        assert not torch.allclose(out[:, t], base[:, t])  # the token itself does matter


def test_left_padding_with_a_mask_gives_the_unpadded_sequences_logits():
    model = small()
    seqs = [torch.randint(0, 32, (n,)) for n in (8, 5, 2)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    mask = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    padded = model(ids, attention_mask=mask)
    assert torch.isfinite(padded).all()  # padded rows too: no query without a key (NaN would spread)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(padded[i, width - len(s):], model(s[None])[0])


def test_right_padding_and_a_full_mask_change_nothing_at_real_positions():
    model = small()
    ids = torch.randint(0, 32, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, 6:] = 0
    torch.testing.assert_close(model(ids, attention_mask=mask), model(ids))


def test_attention_equals_a_hand_written_causal_softmax():
    torch.manual_seed(1)
    n_embd, n_head, t = 12, 3, 6
    block = Block(n_embd, n_head).double()
    x = torch.randn(2, t, n_embd, dtype=torch.float64)
    got = block.attn(x)

    attn = block.attn
    d = n_embd // n_head
    w, b = attn.qkv.weight, attn.qkv.bias
    heads = []
    for h in range(n_head):
        q = x @ w[h * d:(h + 1) * d].T + b[h * d:(h + 1) * d]
        k = x @ w[n_embd + h * d:n_embd + (h + 1) * d].T + b[n_embd + h * d:n_embd + (h + 1) * d]
        v = x @ w[2 * n_embd + h * d:2 * n_embd + (h + 1) * d].T + b[2 * n_embd + h * d:2 * n_embd + (h + 1) * d]
        scores = q @ k.transpose(1, 2) / math.sqrt(d)
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    want = torch.cat(heads, dim=-1) @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(got, want)


def test_a_sequence_longer_than_the_block_is_one_line():
    model = small()
    with pytest.raises(UsageError) as info:
        model(torch.zeros(1, 13, dtype=torch.int64))
    assert str(info.value) == "Expected sequences of at most 12 tokens for this gpt (block_size). Received: 13"


@pytest.mark.parametrize("bad", [-1, 32])
def test_token_ids_outside_the_vocabulary_are_one_line(bad):
    model = small()
    ids = torch.zeros(1, 4, dtype=torch.int64)
    ids[0, 2] = bad
    with pytest.raises(UsageError) as info:
        model(ids)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("Expected token ids in [0, 32) for this gpt (vocab_size). Received: ids in [")
    assert str(bad) in message


def test_heads_that_do_not_divide_the_width_are_one_line():
    with pytest.raises(UsageError) as info:
        GPT(n_embd=30, n_head=4)
    assert "\n" not in str(info.value) and "n_embd=30, n_head=4" in str(info.value)


def test_generate_appends_tokens_and_greedy_is_deterministic():
    model = small()
    prompt = torch.randint(0, 32, (2, 3))
    out = model.generate(prompt, 15, temperature=0)  # 18 tokens > block_size 12: the context is cropped
    assert out.shape == (2, 18)
    assert torch.equal(out[:, :3], prompt)
    assert torch.equal(out, model.generate(prompt, 15, temperature=0))
    assert int(out.min()) >= 0 and int(out.max()) < 32


def test_sampling_follows_its_generator_and_top_k():
    model = small()
    prompt = torch.randint(0, 32, (2, 3))
    a = model.generate(prompt, 6, top_k=3, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 6, top_k=3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    top1 = model.generate(prompt, 6, top_k=1, generator=torch.Generator().manual_seed(9))
    assert torch.equal(top1, model.generate(prompt, 6, temperature=0))  # top_k=1 is greedy


def test_the_same_seed_gives_the_same_initial_weights():
    first, second = small(), small()
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    std = first.blocks[0].mlp.proj.weight.std().item()
    assert std < 0.02 / math.sqrt(2 * 2) * 1.5  # residual projections start smaller (GPT-2)


def test_build_model_makes_a_gpt_for_a_text_dataset():
    assert "gpt" in MODELS
    kwargs = model_kwargs_for("gpt", (64,), 256)
    assert kwargs == {"vocab_size": 256, "block_size": 64}
    torch.manual_seed(0)
    model = build_model("gpt", n_layer=1, n_head=2, n_embd=8, **kwargs)
    assert isinstance(model, GPT)
    assert model(torch.zeros(2, 64, dtype=torch.int64)).shape == (2, 64, 256)
    with pytest.raises(UsageError):
        model_kwargs_for("gpt", (1, 8, 8), 10)
