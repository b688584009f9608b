"""Tensor-parallel plans: which module is split how (`partrain.strategies.tensor_parallel`).

Vocabulary: *tp* is the number of processes a layer is split over (the mesh's one axis); a
*style* says how one module's parameters are split and what its output is:

- ``colwise``: the output features (a Linear's weight rows, bias included): each process
  computes its slice of the output, which stays split for the next ``rowwise`` layer;
- ``colwise:K``: the same for an output made of K equal parts side by side (a fused q, k, v
  projection: K=3): each part is split alike, so each process gets its heads of q, of k and of v;
- ``rowwise``: the input features (a Linear's weight columns): each process multiplies its
  slice of the input, and the partial outputs are summed (one all-reduce); on an Embedding,
  the vocabulary rows (each process looks up the ids it holds; the lookups are summed);
- ``colwise_gather``: ``colwise`` with the output gathered whole (an output layer: the loss
  needs every class), or left split by class under loss parallel.

Sequence parallel adds three styles that the automatic plans place: ``norm`` (a norm that
computes on its process's share of the positions), ``gather_sequence`` (a block's attention or
MLP gets the whole sequence) and ``split_sequence`` (the first block takes its share of it).

A plan is ``{module name: Split}``. `auto_plan` finds one for the built-in GPT, Hugging Face
Llama-style decoders (Llama, Qwen, Mistral: ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``), Hugging Face GPT-2 (Conv1D layers, a fused ``c_attn``) and the
Linear pairs of ``nn.Sequential`` MLPs; `user_plan` reads ``"PATTERN=STYLE,..."`` with fnmatch
patterns over the module names.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from ..errors import UsageError

STYLES = ("colwise", "rowwise", "colwise_gather")
#: modules that act on each feature alone: a colwise layer's split output may pass through them
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus,
               nn.Hardswish, nn.Hardtanh, nn.ReLU6, nn.SELU, nn.CELU, nn.Dropout, nn.Identity)
#: attributes of an attention module that count its heads (checked against tp; the first two are
#: set to the local count after the split: the modules that have them reshape by them)
HEAD_COUNTS = ("n_head", "num_heads", "num_key_value_heads", "n_kv_heads", "num_attention_heads")
LOCAL_COUNTS = ("n_head", "num_heads", "num_key_value_heads", "n_kv_heads", "split_size")


@dataclass(frozen=True)
class Split:
    """How one module is split (see the module docstring for the styles)."""

    style: str
    #: colwise: equal parts side by side in the output features (fused q, k, v: 3)
    parts: int = 1
    #: sequence parallel: this colwise layer's input / rowwise layer's output is split by position
    sequence: bool = False

    def __str__(self) -> str:
        return f"{self.style}:{self.parts}" if self.parts > 1 else self.style


Plan = dict[str, Split]


@dataclass
class AutoPlan:
    """An automatic plan and what the strategy needs to know of the model it was made for."""

    plan: Plan
    family: str
    #: the output layer split by vocabulary (loss parallel can leave its output split)
    head: str | None = None
    #: the attention modules (head counts checked and made local)
    attention: tuple[str, ...] = ()


# ----- user plans ------------------------------------------------------------------------------
def parse_plan(text: str) -> list[tuple[str, Split]]:
    """``"blocks.*.mlp.fc=colwise,blocks.*.mlp.proj=rowwise"`` -> ``[(pattern, Split), ...]``."""
    entries = []
    for item in (part.strip() for part in str(text).split(",")):
        pattern, sep, style = (s.strip() for s in item.partition("="))
        if not item or not sep or not pattern or not style:
            raise UsageError(f"Expected a tensor-parallel plan as PATTERN=STYLE[,PATTERN=STYLE...] (e.g. "
                             f"'blocks.*.mlp.fc=colwise,blocks.*.mlp.proj=rowwise'). Received: {item!r} in {text!r}")
        entries.append((pattern, parse_style(style, pattern)))
    return entries


def parse_style(text: str, pattern: str) -> Split:
    name, _, parts = text.partition(":")
    if name not in STYLES or (parts and name != "colwise"):
        raise UsageError(f"Expected a style among {list(STYLES)} or 'colwise:K' (K fused parts) for plan pattern "
                         f"{pattern!r}. Received: {text!r}")
    if parts and (not parts.isdigit() or int(parts) < 1):
        raise UsageError(f"Expected 'colwise:K' with K a positive integer (the fused parts) for plan pattern "
                         f"{pattern!r}. Received: {text!r}")
    return Split(name, int(parts) if parts else 1)


def user_plan(model: nn.Module, text: str) -> Plan:
    """The modules the patterns of ``text`` name, each with its style; one line for a pattern that
    names no module, or a module two patterns give different styles."""
    names = [name for name, _ in model.named_modules() if name]
    plan: Plan = {}
    for pattern, split in parse_plan(text):
        matched = fnmatch.filter(names, pattern)
        if not matched:
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise UsageError(f"Expected plan pattern {pattern!r} to match a module of the model. Received: no module "
                             f"named like it (modules: {shown})")
        for name in matched:
            if plan.get(name, split) != split:
                raise UsageError(f"Expected one style per module in the plan. Received: {name!r} as {plan[name]} "
                                 f"and {split}")
            plan[name] = split
    return plan


def user_attention(model: nn.Module, plan: Plan) -> tuple[str, ...]:
    """The parents of a user plan's colwise modules that count heads: their heads must split too."""
    modules = dict(model.named_modules())
    found = []
    for name, split in plan.items():
        parent = name.rpartition(".")[0]
        if split.style == "colwise" and parent not in found and head_counts(modules[parent]):
            found.append(parent)
    return tuple(found)


# ----- automatic plans --------------------------------------------------------------------------
def auto_plan(model: nn.Module, sequence: bool) -> AutoPlan:
    """The plan for a model partrain knows the shape of; one line for any other."""
    from ..models.gpt import GPT, Block

    if isinstance(model, GPT) or any(isinstance(m, Block) for m in model.modules()):
        return _gpt_plan(model, sequence)
    layers = _llama_layers(model)
    if layers:
        return _llama_plan(model, layers, sequence)
    blocks = _gpt2_blocks(model)
    if blocks:
        return _gpt2_plan(model, blocks, sequence)
    plan = _sequential_pairs(model)
    if not plan:
        raise UsageError(f"Expected a model tensor parallel can split automatically (the built-in GPT, Llama-style "
                         f"Hugging Face decoders, GPT-2, or nn.Sequential Linear layers with elementwise layers between "
                         f"them). "
                         f"Received: {type(model).__name__}, with none of these; name the layers with plan="
                         f"'PATTERN=colwise,PATTERN=rowwise'")
    if sequence:
        raise UsageError("Expected sequence_parallel with a transformer's blocks (the built-in GPT, a Llama-style "
                         f"decoder). Received: {type(model).__name__}, split as Sequential MLP pairs")
    return AutoPlan(plan, "mlp")


def _gpt_plan(model: nn.Module, sequence: bool) -> AutoPlan:
    from ..models.gpt import GPT, Block

    plan: Plan = {}
    blocks = [name for name, m in model.named_modules() if isinstance(m, Block)]
    if sequence and not isinstance(model, GPT):
        raise UsageError(f"Expected sequence_parallel with the built-in GPT itself. Received: its blocks inside "
                         f"{type(model).__name__}")
    for b in blocks:
        plan[f"{b}.attn.qkv"] = Split("colwise", 3)
        plan[f"{b}.attn.proj"] = Split("rowwise", sequence=sequence)
        plan[f"{b}.mlp.fc"] = Split("colwise")
        plan[f"{b}.mlp.proj"] = Split("rowwise", sequence=sequence)
        if sequence:
            plan.update({f"{b}.ln_1": Split("norm"), f"{b}.ln_2": Split("norm"),
                         f"{b}.attn": Split("gather_sequence"), f"{b}.mlp": Split("gather_sequence")})
    head = None
    if isinstance(model, GPT):
        # the token embedding and the output layer share one matrix: both split by vocabulary rows
        plan["tok_emb"] = Split("rowwise")
        plan["lm_head"] = Split("colwise_gather", sequence=sequence)
        head = "lm_head"
        if sequence:
            # the position embedding is added to the whole sequence; the first block takes its share
            plan[blocks[0]] = Split("split_sequence")
            plan["ln_f"] = Split("norm")
    return AutoPlan(plan, "gpt", head, tuple(f"{b}.attn" for b in blocks))


def _llama_layers(model: nn.Module) -> list[str]:
    """Names of the decoder layers with ``self_attn.{q,k,v,o}_proj`` and ``mlp.{up,down}_proj`` Linears."""
    found = []
    for name, m in model.named_modules():
        attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
        if attn is None or mlp is None:
            continue
        if all(isinstance(getattr(attn, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) and \
                all(isinstance(getattr(mlp, p, None), nn.Linear) for p in ("up_proj", "down_proj")):
            found.append(name)
    return found


def _llama_plan(model: nn.Module, layers: list[str], sequence: bool) -> AutoPlan:
    modules = dict(model.named_modules())
    plan: Plan = {}
    for layer in layers:
        for p in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}.self_attn.{p}"] = Split("colwise")
        plan[f"{layer}.self_attn.o_proj"] = Split("rowwise", sequence=sequence)
        for p in ("gate_proj", "up_proj"):
            if isinstance(getattr(modules[f"{layer}.mlp"], p, None), nn.Linear):
                plan[f"{layer}.mlp.{p}"] = Split("colwise")
        plan[f"{layer}.mlp.down_proj"] = Split("rowwise", sequence=sequence)
        if sequence:
            plan[f"{layer}.self_attn"] = Split("gather_sequence")
            plan[f"{layer}.mlp"] = Split("gather_sequence")
            for child, m in modules[layer].named_children():
                if "norm" in type(m).__name__.lower():
                    plan[f"{layer}.{child}"] = Split("norm")
    head = _embeddings(model, plan, sequence)
    if sequence:
        final = _final_norm(modules, layers)
        if head is None or final is None:
            raise UsageError(f"Expected sequence_parallel with a decoder whose output layer and final norm tp "
                             f"finds (get_output_embeddings(), a 'norm' beside the layers). Received: "
                             f"{type(model).__name__} without {'an output layer' if head is None else 'a final norm'}")
        plan[layers[0]] = Split("split_sequence")
        plan[final] = Split("norm")
    return AutoPlan(plan, "llama", head, tuple(f"{layer}.self_attn" for layer in layers))


def _gpt2_blocks(model: nn.Module) -> list[str]:
    """Names of GPT-2's blocks: ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj`` Conv1D layers."""
    found = []
    for name, m in model.named_modules():
        attn, mlp = getattr(m, "attn", None), getattr(m, "mlp", None)
        if attn is not None and mlp is not None and all(
                is_conv1d(getattr(owner, p, None)) for owner, p in
                ((attn, "c_attn"), (attn, "c_proj"), (mlp, "c_fc"), (mlp, "c_proj"))):
            found.append(name)
    return found


def _gpt2_plan(model: nn.Module, blocks: list[str], sequence: bool) -> AutoPlan:
    if sequence:
        raise UsageError("Expected sequence_parallel with the built-in GPT or a Llama-style decoder. Received: "
                         f"{type(model).__name__} (GPT-2's blocks), which tp splits without it")
    plan: Plan = {}
    for b in blocks:
        plan.update({f"{b}.attn.c_attn": Split("colwise", 3), f"{b}.attn.c_proj": Split("rowwise"),
                     f"{b}.mlp.c_fc": Split("colwise"), f"{b}.mlp.c_proj": Split("rowwise")})
    head = _embeddings(model, plan, sequence=False)
    return AutoPlan(plan, "gpt2", head, tuple(f"{b}.attn" for b in blocks))


def _embeddings(model: nn.Module, plan: Plan, sequence: bool) -> str | None:
    """A Hugging Face model's token embedding ``rowwise`` and output layer ``colwise_gather``, both
    split by vocabulary (they may share one matrix); returns the output layer's name."""
    names = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(embed, nn.Embedding) and isinstance(out, nn.Linear) and id(embed) in names and id(out) in names:
        plan[names[id(embed)]] = Split("rowwise")
        plan[names[id(out)]] = Split("colwise_gather", sequence=sequence)
        return names[id(out)]
    return None


def is_conv1d(module: object) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a Linear whose weight is stored transposed, ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)


def features(module: nn.Module) -> tuple[int, int]:
    """A Linear's or a Conv1D's ``(in, out)`` features."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.nx, module.nf


def _final_norm(modules: dict[str, nn.Module], layers: list[str]) -> str | None:
    """The norm beside the layer list (``model.norm``): the module the last layer's output goes to."""
    owner = layers[0].rsplit(".", 2)[0] if layers[0].count(".") >= 2 else ""
    for child in ("norm", "final_layernorm", "ln_f", "final_norm"):
        name = f"{owner}.{child}" if owner else child
        if name in modules:
            return name
    return None


def _sequential_pairs(model: nn.Module) -> Plan:
    """In every ``nn.Sequential``: a Linear, elementwise layers, a Linear -> colwise, rowwise; on from there."""
    plan: Plan = {}
    for name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        i = 0
        while i < len(children):
            if isinstance(children[i][1], nn.Linear):
                j = i + 1
                while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
                    j += 1
                if j < len(children) and isinstance(children[j][1], nn.Linear):
                    prefix = f"{name}." if name else ""
                    plan[prefix + children[i][0]] = Split("colwise")
                    plan[prefix + children[j][0]] = Split("rowwise")
                    i = j + 1
                    continue
            i += 1
    return plan


# ----- checks ------------------------------------------------------------------------------------
def head_counts(module: nn.Module) -> dict[str, int]:
    """The head counts an attention module has (own attributes, else its ``config``'s)."""
    counts = {a: v for a in HEAD_COUNTS if isinstance(v := getattr(module, a, None), int) and not isinstance(v, bool)}
    config = getattr(module, "config", None)
    if config is not None and not counts:
        counts = {a: v for a in HEAD_COUNTS
                  if isinstance(v := getattr(config, a, None), int) and not isinstance(v, bool)}
    return counts


def check_plan(model: nn.Module, plan: Plan, attention: tuple[str, ...], tp: int) -> None:
    """One line for a module its style cannot split, a split that does not divide, heads that do not."""
    modules = dict(model.named_modules())
    for name, split in plan.items():
        module = modules[name]
        if split.style in ("norm", "gather_sequence", "split_sequence"):
            continue
        kind = type(module).__name__
        if not isinstance(module, (nn.Linear, nn.Embedding)) and not is_conv1d(module):
            raise UsageError(f"Expected plan style {split} on an nn.Linear, nn.Embedding or Hugging Face Conv1D. "
                             f"Received: {name!r}, a {kind}")
        if isinstance(module, nn.Embedding):
            if split.style == "colwise" or split.parts > 1:
                raise UsageError(f"Expected an nn.Embedding split 'rowwise' (by vocabulary) or 'colwise_gather'. "
                                 f"Received: {name!r} as {split}")
            continue
        if name.endswith(".qkv") and type(modules[name.rpartition(".")[0]]).__name__ == "CausalSelfAttention" \
                and split.style == "colwise" and split.parts != 3:
            raise UsageError(f"Expected {name!r}, the built-in GPT's fused q, k, v projection, split 'colwise:3' "
                             f"(each process gets its heads of q, of k and of v). Received: {split}")
        n_in, n_out = features(module)
        if split.style == "colwise" and n_out % (tp * split.parts):
            raise UsageError(f"Expected the output features of {name!r} ({n_out}) divisible by "
                             f"{tp * split.parts} (tp={tp}{f' x {split.parts} fused parts' if split.parts > 1 else ''})"
                             f" to split them 'colwise'. Received: {n_out} % {tp * split.parts} = "
                             f"{n_out % (tp * split.parts)}")
        if split.style == "rowwise" and n_in % tp:
            raise UsageError(f"Expected the input features of {name!r} ({n_in}) divisible by tp={tp} "
                             f"to split them 'rowwise'. Received: {n_in} % {tp} = {n_in % tp}")
    _check_ties(model, plan)
    for name in attention:
        for attr, count in head_counts(modules[name]).items():
            if count % tp:
                raise UsageError(f"Expected attention heads divisible by the tensor-parallel size {tp} (each process "
                                 f"computes whole heads). Received: {name} with {attr}={count}")


def _check_ties(model: nn.Module, plan: Plan) -> None:
    """A parameter two modules share (a tied embedding and output layer) must be split alike by both."""
    owners: dict[int, list[tuple[str, int | None]]] = {}
    for name, module in model.named_modules():
        weight = dict(module.named_parameters(recurse=False)).get("weight")  # its own, not a child's
        if weight is not None:
            owners.setdefault(id(weight), []).append((name, _weight_dim(module, plan.get(name))))
    for uses in owners.values():
        if len({dim for _, dim in uses}) > 1:
            said = ", ".join(f"{n!r} ({'whole' if d is None else f'split on dim {d}'})" for n, d in uses)
            raise UsageError(f"Expected the modules that share one weight split alike by the plan (a tied embedding "
                             f"'rowwise' and output layer 'colwise_gather': both by vocabulary). Received: {said}")


def _weight_dim(module: nn.Module, split: Split | None) -> int | None:
    """The dim of its weight a module's style splits (None: kept whole)."""
    if split is None or split.style not in STYLES:
        return None
    colwise = split.style != "rowwise"
    if isinstance(module, nn.Embedding) or is_conv1d(module):  # [vocab, dim], [in, out]
        return 1 if colwise else 0
    return 0 if colwise else 1


def with_parts(plan: Plan) -> dict[str, int]:
    """The fused modules of a plan and their parts."""
    return {name: s.parts for name, s in plan.items() if s.parts > 1}

