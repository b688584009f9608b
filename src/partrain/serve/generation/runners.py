"""Model runners: a causal language model's forward pass over a slot-based KV cache.

Vocabulary: a *slot* is one running sequence's place in the cache; ``S`` slots, ``L``
layers, ``H`` heads of width ``D`` (``C = H * D``), ``T`` the longest sequence
(the model's context, ``block_size``). The cache of one layer is keys and values shaped
``[S, H, T, D]``, allocated once: a sequence never reallocates, and the memory a
server needs is known at start (`Runner.bytes_per_slot`).

The engine keeps its running sequences in slots ``0..B-1`` (it moves the last one
into a slot that frees up, `Runner.move`), so that a decode step reads the first
``B`` slots as one view, up to the longest sequence's length, with no gather.

`GPTRunner` runs partrain's built-in GPT with the model's own modules (its answers
equal ``GPT.forward`` on the whole sequence). `partrain.serve.generation.hf` runs a
Hugging Face causal LM through its own cache classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Runner(ABC):
    """One model's prefill and decode over ``slots`` cache slots (call `allocate` first)."""

    block_size: int  # longest sequence (prompt + generated tokens)
    vocab_size: int
    slots: int = 0
    eos_token_ids: tuple[int, ...] = ()  # the model's own end-of-text tokens (its config's)

    @abstractmethod
    def bytes_per_slot(self) -> int:
        """Cache bytes one sequence of ``block_size`` tokens takes."""

    @abstractmethod
    def allocate(self, slots: int) -> None:
        """Allocate the cache for ``slots`` sequences."""

    @abstractmethod
    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> Tensor:
        """Run ``prompts`` (token ids) into ``slots``; the logits [n, V] after each prompt's last token."""

    @abstractmethod
    def decode(self, tokens: Sequence[int], lengths: Sequence[int]) -> Tensor:
        """One step of slots ``0..B-1``: ``tokens[i]`` goes at position ``lengths[i]`` of slot ``i``
        (its sequence so far has ``lengths[i]`` tokens). The logits [B, V] after each."""

    @abstractmethod
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""


def padded(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Prompts as one right-padded id tensor [n, P] (0 after each end) and their lengths [n]."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.as_tensor(p, dtype=torch.int64)
    return ids.to(device), torch.tensor([len(p) for p in prompts], device=device)


class GPTRunner(Runner):
    """partrain's built-in GPT (`partrain.models.gpt.GPT`) with a KV cache.

    Each block's attention runs the block's own ``qkv`` and ``proj`` layers; only the
    keys and values of earlier positions come from the cache. Prefill pads prompts of
    different lengths at their end: attention is causal, so no real position sees the
    padding, and the padded positions' cache rows are written over before any query
    reads them (a decode step writes position ``length`` before attending to it).
    """

    def __init__(self, model: nn.Module) -> None:
        from ...models.gpt import GPT

        if not isinstance(model, GPT):
            raise TypeError(f"Expected partrain's built-in GPT. Received: {type(model).__name__}")
        self.model = model.eval()
        self.block_size = model.block_size
        self.vocab_size = model.vocab_size
        first = model.blocks[0].attn
        self.heads = first.n_head
        self.width = model.tok_emb.embedding_dim
        self.layers = len(model.blocks)
        self.param = model.tok_emb.weight
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []

    def bytes_per_slot(self) -> int:
        return 2 * self.layers * self.block_size * self.width * self.param.element_size()

    def allocate(self, slots: int) -> None:
        shape = (slots, self.heads, self.block_size, self.width // self.heads)
        kw = {"dtype": self.param.dtype, "device": self.param.device}
        self.k = [torch.zeros(shape, **kw) for _ in range(self.layers)]
        self.v = [torch.zeros(shape, **kw) for _ in range(self.layers)]
        self.slots = slots

    def _heads(self, z: Tensor) -> Tensor:
        n, t, _ = z.shape
        return z.view(n, t, self.heads, self.width // self.heads).transpose(1, 2)

    def _block(self, block: nn.Module, x: Tensor, layer: int, attend) -> Tensor:  # noqa: ANN001
        attn = block.attn
        q, k, v = attn.qkv(block.ln_1(x)).split(self.width, dim=2)
        y = attend(self._heads(q), self._heads(k), self._heads(v), layer)
        n, t, c = x.shape
        x = x + attn.proj(y.transpose(1, 2).contiguous().view(n, t, c))
        return x + block.mlp(block.ln_2(x))

    def _logits(self, x: Tensor) -> Tensor:
        m = self.model
        return m.lm_head(m.ln_f(x))

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> Tensor:
        m = self.model
        ids, lengths = padded(prompts, self.param.device)
        n, t = ids.shape
        where = torch.as_tensor(list(slots), device=ids.device)

        def attend(q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
            self.k[layer][where, :, :t] = k
            self.v[layer][where, :, :t] = v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        x = m.tok_emb(ids) + m.pos_emb(torch.arange(t, device=ids.device))
        for layer, block in enumerate(m.blocks):
            x = self._block(block, x, layer, attend)
        last = x[torch.arange(n, device=ids.device), lengths - 1]  # [n, C]: only the last position is scored
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], lengths: Sequence[int]) -> Tensor:
        m = self.model
        dev = self.param.device
        b = len(tokens)
        t = max(lengths) + 1  # keys up to the longest sequence's new position
        pos = torch.as_tensor(list(lengths), device=dev)
        rows = torch.arange(b, device=dev)
        # key j is visible to row i when j <= lengths[i] (its past and its new token)
        visible = (torch.arange(t, device=dev)[None, :] <= pos[:, None])[:, None, None, :]

        def attend(q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
            keys, values = self.k[layer], self.v[layer]
            keys[rows, :, pos] = k[:, :, 0]
            values[rows, :, pos] = v[:, :, 0]
            return F.scaled_dot_product_attention(q, keys[:b, :, :t], values[:b, :, :t], attn_mask=visible)

        ids = torch.as_tensor(list(tokens), device=dev)[:, None]
        x = m.tok_emb(ids) + m.pos_emb(pos)[:, None, :]
        for layer, block in enumerate(m.blocks):
            x = self._block(block, x, layer, attend)
        return self._logits(x[:, 0])

    def move(self, src: int, dst: int, length: int) -> None:
        for cache in (*self.k, *self.v):
            cache[dst, :, :length] = cache[src, :, :length]


def runner_for(model: nn.Module) -> Runner:
    """The runner of ``model``: the built-in GPT's, or a Hugging Face causal LM's."""
    from ...models.gpt import GPT

    if isinstance(model, GPT):
        return GPTRunner(model)
    if type(model).__module__.startswith("transformers."):
        from .hf import HFRunner

        return HFRunner(model)
    raise TypeError(f"Expected partrain's built-in GPT or a Hugging Face causal language model to generate with. "
                    f"Received: {type(model).__name__}")
