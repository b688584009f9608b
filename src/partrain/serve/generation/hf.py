"""`HFRunner`: a Hugging Face causal language model over partrain's KV cache slots.

The model computes attention itself, through its own cache class (``DynamicCache``),
so partrain does not need to know its architecture: only its layers, key/value heads
and head width (from its config) to size the slots. A decode step hands the model a
cache holding the first ``B`` slots up to the longest sequence (``t`` positions), so
the new token's keys land at position ``t`` for every row; the 2-D attention mask
hides each row's positions past its own length and ``position_ids`` give each token
its own position (what Hugging Face's ``generate`` does for left-padded batches). The
new keys and values are then copied into each slot at the row's own position.

It runs models whose attention uses the plain ``DynamicCache`` and takes
``position_ids`` and a 2-D ``attention_mask``: GPT-2, Llama, Mistral, Qwen and most
decoder-only models. Sliding-window and recurrent caches are not covered.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .runners import Runner, padded


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class HFRunner(Runner):
    """A ``transformers`` causal LM (``...ForCausalLM`` / ``...LMHeadModel``) with slot caches."""

    def __init__(self, model: nn.Module) -> None:
        import transformers

        DynamicCache = transformers.DynamicCache  # noqa: N806 - the class, as transformers names it
        # the per-layer cache (``cache.layers[i].keys``, built from tensors by ``ddp_cache_data``)
        # came with transformers 4.54; before it the cache kept lists this runner does not read
        if not hasattr(DynamicCache(), "layers") or "ddp_cache_data" not in inspect.signature(DynamicCache).parameters:
            raise TypeError(f"Expected transformers 4.54 or later to generate with a Hugging Face model (its "
                            f"per-layer DynamicCache). Received: transformers {transformers.__version__}")
        self._cache_class = DynamicCache
        config = model.config
        self.model = model.eval()
        self.layers = _config_int(config, "num_hidden_layers", "n_layer")
        heads = _config_int(config, "num_attention_heads", "n_head")
        self.kv_heads = _config_int(config, "num_key_value_heads") or heads
        hidden = _config_int(config, "hidden_size", "n_embd")
        self.head_dim = _config_int(config, "head_dim") or (hidden // heads if hidden and heads else None)
        self.block_size = _config_int(config, "max_position_embeddings", "n_positions", "n_ctx")
        self.vocab_size = _config_int(config, "vocab_size")
        missing = [k for k, v in (("layers", self.layers), ("key/value heads", self.kv_heads),
                                  ("head width", self.head_dim), ("context length", self.block_size),
                                  ("vocabulary", self.vocab_size)) if v is None]
        if missing:
            raise TypeError(f"Expected a causal language model config giving its {', '.join(missing)}. "
                            f"Received: {type(config).__name__}")
        if getattr(config, "sliding_window", None) or getattr(config, "layer_types", None) and \
                any(t != "full_attention" for t in config.layer_types):
            raise TypeError(f"Expected a model with full attention in every layer. Received: {type(model).__name__} "
                            "with sliding-window layers (not supported by partrain's generation cache)")
        eos = getattr(config, "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = tuple(int(e) for e in eos if 0 <= int(e) < self.vocab_size)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        self.param = next(model.parameters())
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []

    def bytes_per_slot(self) -> int:
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * self.param.element_size()

    def allocate(self, slots: int) -> None:
        shape = (slots, self.kv_heads, self.block_size, self.head_dim)
        kw = {"dtype": self.param.dtype, "device": self.param.device}
        self.k = [torch.zeros(shape, **kw) for _ in range(self.layers)]
        self.v = [torch.zeros(shape, **kw) for _ in range(self.layers)]
        self.slots = slots

    def _run(self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> tuple[Tensor, Any]:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self._cache_kw: cache})
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != self.layers:
            raise RuntimeError(f"Expected the model to fill a cache of {self.layers} layers. Received: "
                               f"{type(cache).__name__}")
        return out.logits, cache

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> Tensor:
        ids, lengths = padded(prompts, self.param.device)
        n, t = ids.shape
        mask = (torch.arange(t, device=ids.device)[None, :] < lengths[:, None]).long()
        positions = torch.arange(t, device=ids.device).expand(n, t)
        logits, cache = self._run(ids, mask, positions, self._cache_class())
        where = torch.as_tensor(list(slots), device=ids.device)
        for layer, entry in enumerate(cache.layers):
            self.k[layer][where, :, :t] = entry.keys
            self.v[layer][where, :, :t] = entry.values
        return logits[torch.arange(n, device=ids.device), lengths - 1]

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], lengths: Sequence[int]) -> Tensor:
        dev = self.param.device
        b, t = len(tokens), max(lengths)
        pos = torch.as_tensor(list(lengths), device=dev)
        past = [(self.k[i][:b, :, :t], self.v[i][:b, :, :t]) for i in range(self.layers)]
        cache = self._cache_class(ddp_cache_data=past)
        # row i sees its own past (positions < lengths[i]) and its new token (position t in this cache)
        mask = torch.cat([torch.arange(t, device=dev)[None, :] < pos[:, None],
                          torch.ones(b, 1, dtype=torch.bool, device=dev)], dim=1).long()
        ids = torch.as_tensor(list(tokens), device=dev)[:, None]
        logits, cache = self._run(ids, mask, pos[:, None], cache)
        rows = torch.arange(b, device=dev)
        for layer, entry in enumerate(cache.layers):
            self.k[layer][rows, :, pos] = entry.keys[:, :, t]
            self.v[layer][rows, :, pos] = entry.values[:, :, t]
        return logits[:, -1]

    def move(self, src: int, dst: int, length: int) -> None:
        for cache in (*self.k, *self.v):
            cache[dst, :, :length] = cache[src, :, :length]
