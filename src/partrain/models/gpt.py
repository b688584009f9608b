"""A small decoder-only transformer (GPT) for language modelling, built in.

Vocabulary of this module: ``N`` is the batch (sequences), ``T`` the tokens of a
sequence, ``C`` the embedding width (``n_embd``), ``H`` the attention heads and ``D``
the width of one head (``C // H``). Token ids go in as ``[N, T]`` int64, logits come
out as ``[N, T, vocab_size]``: position ``t`` predicts token ``t + 1``, the contract of
the text datasets (`partrain.data.text`), whose targets are already shifted.

The shape is GPT-2's as nanoGPT writes it: token and learned position embeddings,
pre-LayerNorm blocks (causal self-attention, then an MLP four times as wide with
GELU), a final LayerNorm and an output layer that shares its weight with the token
embedding. Attention goes through ``torch.nn.functional.scaled_dot_product_attention``
so that PyTorch picks its fused kernel on each device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` sees positions ``0..t`` only."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # queries, keys, values in one matmul
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [N, T, C] -> [N, T, C]. ``attn_mask`` (bool, broadcast to [N, H, T, T],
        True = may attend) replaces the plain causal mask when given; it must be causal."""
        n, t, _ = x.shape
        # three equal parts, each as wide as the heads this process computes: all of them, or
        # under tensor parallel its share (the strategy sets n_head to the local count)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        c = q.size(-1)
        q, k, v = (z.view(n, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(n, t, c)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward layer: ``C -> 4C -> GELU -> C``."""

    def __init__(self, n_embd: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer: ``forward(input_ids [N, T]) -> logits [N, T, vocab_size]``.

    ``block_size`` is the longest sequence it takes (the learned position embeddings
    have that many rows); ``lm_head.weight`` is ``tok_emb.weight`` (one Parameter).
    """

    def __init__(self, vocab_size: int = 256, n_layer: int = 4, n_head: int = 4, n_embd: int = 256,
                 block_size: int = 256, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("n_layer", n_layer), ("n_head", n_head),
                            ("n_embd", n_embd), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"Expected a positive integer {name} for model 'gpt'. Received: {name}={value!r}")
        if n_embd % n_head:
            raise UsageError(f"Expected n_embd divisible by n_head for model 'gpt' (each head gets n_embd // n_head "
                             f"channels). Received: n_embd={n_embd}, n_head={n_head}")
        if not 0.0 <= dropout < 1.0:
            raise UsageError(f"Expected a dropout in [0, 1) for model 'gpt'. Received: dropout={dropout!r}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one matrix reads tokens in and scores them out
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, and the two projections that
        add into the residual stream scaled by 1/sqrt(2 * n_layer), so that the stream's variance
        does not grow with depth (each block adds twice to it)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[N, T, vocab_size]`` for token ids ``[N, T]``.

        ``attention_mask`` ([N, T], 1 for a real token, 0 for padding) matters only where
        padding comes before a real token (left padding): then the real tokens take their
        positions counted from their own first token and never attend to padding, so
        their logits equal the unpadded sequence's. Right padding needs no mask (causal
        attention never looks forward); the logits at padded positions mean nothing.
        """
        self._check_ids(input_ids)
        n, t = input_ids.shape
        positions, attn_mask = (None, None) if attention_mask is None else self._padding(attention_mask, n, t)
        if positions is None:
            positions = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x, attn_mask)
        return self.lm_head(self.ln_f(x))

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        """One line for ids the embedding would reject with a traceback (or a device assert)."""
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
            raise UsageError(f"Expected integer token ids shaped [N, T] for this gpt. Received: "
                             f"{input_ids.dtype} shaped {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.block_size:
            raise UsageError(f"Expected sequences of at most {self.block_size} tokens for this gpt (block_size). "
                             f"Received: {t}")
        if input_ids.numel():
            lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()  # one device sync for both
            if lo < 0 or hi >= self.vocab_size:
                raise UsageError(f"Expected token ids in [0, {self.vocab_size}) for this gpt (vocab_size). "
                                 f"Received: ids in [{lo}, {hi}]")

    def _padding(self, attention_mask: torch.Tensor, n: int, t: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Positions [N, T] and a boolean attention mask [N, 1, T, T] for padding before real
        tokens; ``(None, None)`` when no zero precedes a one (no padding, or right padding),
        so that attention keeps SDPA's causal fast path."""
        if tuple(attention_mask.shape) != (n, t):
            raise UsageError(f"Expected an attention_mask shaped like input_ids, {(n, t)}. Received: "
                             f"{tuple(attention_mask.shape)}")
        real = attention_mask.bool()
        if not bool((real[:, 1:] & ~real[:, :-1]).any()):
            return None, None
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        causal = torch.ones(t, t, dtype=torch.bool, device=real.device).tril()
        # a padded query attends to itself: a row with no key at all would give NaN, and NaN
        # in a padded position's values reaches real positions even at attention weight 0
        self_only = torch.eye(t, dtype=torch.bool, device=real.device)
        attn_mask = causal & (real[:, None, None, :] | self_only)
        return positions, attn_mask

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """``idx`` [N, T] followed by ``max_new_tokens`` sampled tokens: [N, T + max_new_tokens].

        Each step sees the last ``block_size`` tokens. ``temperature`` 0 takes the most
        likely token (greedy, deterministic); ``top_k`` samples among the k most likely;
        ``generator`` makes sampling reproducible. Dropout applies in training mode: call
        ``eval()`` first. No KV cache: each step reruns the context (partrain.serve has one).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise UsageError(f"Expected a number of new tokens >= 0. Received: max_new_tokens={max_new_tokens!r}")
        if temperature < 0:
            raise UsageError(f"Expected a temperature >= 0 (0: greedy). Received: temperature={temperature!r}")
        if top_k is not None and top_k < 1:
            raise UsageError(f"Expected top_k >= 1 or None. Received: top_k={top_k!r}")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1, :]
            if temperature == 0:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, token), dim=1)
        return idx


def gpt(vocab_size: int = 256, n_layer: int = 4, n_head: int = 4, n_embd: int = 256, block_size: int = 256,
        dropout: float = 0.0) -> GPT:
    """A small GPT (about 3.3M parameters with the defaults: bytes in, 256-token context)."""
    return GPT(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
               dropout=dropout)
