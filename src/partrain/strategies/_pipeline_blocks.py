"""Cutting a model between the blocks of its block list, without tracing.

A transformer (the built-in GPT, Hugging Face's GPT-2, Llama, ...) runs a *prologue* (the
embeddings, masks, positions), then its *block list* (an ``nn.ModuleList`` whose items the
forward pass calls once each, in order, each passing one hidden state to the next), then an
*epilogue* (the final norm and the output layer). torch.export cannot trace many of them
(data-dependent checks on the input, cache objects), yet they cut naturally between blocks:
chunk ``c`` runs blocks ``bounds[c]:bounds[c + 1]``, the first chunk the prologue too, the
last the epilogue.

Every chunk calls the model's own forward pass on the batch's inputs, so whatever the
prologue computes besides the hidden state (attention masks, positions) is at hand, with the
blocks it does not run replaced by pass-throughs for the call: the block where it begins is
given the previous chunk's hidden state instead of its input, and the block where it ends
stops the forward pass (`_StageDone`, carrying the hidden state it returned). What a later
chunk's prologue computes for the hidden state is thrown away (an embedding lookup), so it
gets no gradient there.

Before any process keeps its part, each checks the cut on an example micro-batch: the chunks
run one after the other in one process must give the whole model's output (else its blocks do
not hand one hidden state along, a skip connection across blocks say, and the model is traced
instead). The same run says which parameters each chunk uses: those that receive a gradient.
A parameter used by two chunks (an embedding tied to the output layer: the prologue reads it on
the first, the head on the last) is trained by both, with the gradient summed over them before
the step (`partrain.strategies._pipeline_runtime.Runtime.sum_shared_grads`), as in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..batch import call_model, tensors_of
from ..errors import UsageError, error_line
from ..nn.split import balance

ForwardFn = Callable[[nn.Module, Any], Any]


class _StageDone(BaseException):
    """Stops the forward pass after a chunk's last block (a BaseException: a model's own
    ``except Exception`` does not swallow it)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _hidden_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


def _hidden_out(out: Any) -> Any:
    return out if isinstance(out, torch.Tensor) else out[0]


class _Slot(nn.Module):
    """What stands in the block list at one position during a chunk's call: the block, or nothing
    (a pass-through returning its input as a block's output); fed the received hidden state
    instead of its own input, and stopping the forward pass after it, where the chunk says so."""

    def __init__(self, block: nn.Module | None, received: torch.Tensor | None, stop: bool, width: int) -> None:
        super().__init__()
        object.__setattr__(self, "block", block)  # not a child: the block keeps its own name
        object.__setattr__(self, "received", received)
        self.stop, self.width, self.called = stop, width, False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.called = True
        if self.received is not None:
            if args:
                args = (self.received, *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": self.received}
        if self.block is None:
            hidden = _hidden_in(args, kwargs)
            out = hidden if self.width == 0 else (hidden, *([None] * (self.width - 1)))
        else:
            out = self.block(*args, **kwargs)
        if self.stop:
            raise _StageDone(_hidden_out(out))
        return out


class BlockSplit:
    """A model cut between the items of its block list ``name``: the chunks, which parameters
    each trains (``held``), which chunk saves each state-dict key (``key_chunk``).

    One object per process; `run` calls one chunk (with a process's other chunks' blocks
    put aside for the call), `keep` drops the blocks of chunks other processes run.
    """

    def __init__(self, model: nn.Module, name: str, bounds: list[int], width: int) -> None:
        self.model, self.name, self.bounds, self.width = model, name, bounds, width
        self.blocks: nn.ModuleList = model.get_submodule(name)  # type: ignore[assignment]
        self.n = len(self.blocks)
        self.real: dict[int, nn.Module] = dict(enumerate(self.blocks))
        #: the forward function of a training step (None: `call_model`, as evaluation calls it)
        self.forward_fn: ForwardFn | None = None
        self.held: list[set[int]] = [set() for _ in range(self.chunks)]
        self.key_chunk: dict[str, int] = {}
        #: the last chunk's latest output and the tensors it handed torch for it (`structure`)
        self.last_output: tuple[Any, tuple[torch.Tensor, ...]] | None = None

    @property
    def chunks(self) -> int:
        return len(self.bounds) - 1

    def chunk_of(self, block: int) -> int:
        return next(c for c in range(self.chunks) if self.bounds[c] <= block < self.bounds[c + 1])

    def names(self, chunk: int) -> list[str]:
        a, e = self.bounds[chunk], self.bounds[chunk + 1]
        return [f"{self.name}.{i}" for i in range(a, e)] or [f"(the model outside {self.name})"]

    def run(self, chunk: int, received: torch.Tensor | None, inputs: Any) -> Any:
        """Chunk ``chunk`` on ``inputs`` (the batch's, on every chunk) from ``received`` (the hidden
        state the previous chunk returned; None on the first): a hidden state, or on the last chunk
        the forward function's output."""
        a, e = self.bounds[chunk], self.bounds[chunk + 1]
        last = chunk == self.chunks - 1
        slots: dict[int, nn.Module] = {}
        entry = None
        for i in range(self.n):
            feed = received if chunk > 0 and (i == a or (a == self.n and i == self.n - 1)) else None
            stop = not last and (i == e - 1 or (e == 0 and i == 0))
            block = self.real.get(i) if a <= i < e else None
            if block is not None and feed is None and not stop:
                slots[i] = block
                continue
            slots[i] = _Slot(block, feed, stop, self.width)
            entry = slots[i] if feed is not None else entry
        try:
            for i, module in slots.items():
                self.blocks._modules[str(i)] = module
            out = (self.forward_fn or call_model)(self.model, inputs)
        except _StageDone as done:
            return done.hidden
        finally:
            self._rest()
        if not last or (entry is not None and not entry.called):
            raise UsageError(f"Expected {type(self.model).__name__}'s forward pass to run every block of "
                             f"{self.name} on every batch (strategy 'pipeline' cuts between them). Received: "
                             f"a pass that skipped block {e - 1 if not last else a}")
        return out

    def structure(self, output: Any) -> Any:
        """The last chunk's output as the model returned it (a Hugging Face ``ModelOutput`` with
        its ``loss``), from the tensors torch's stage passed on (it takes tensors only)."""
        if self.last_output is None:
            return output
        whole, leaves = self.last_output
        got = output if isinstance(output, tuple) else (output,)
        if len(got) != len(leaves) or any(a is not b for a, b in zip(got, leaves)):
            return output
        return whole

    def _rest(self) -> None:
        """The block list between calls: this process's blocks, pass-throughs for the others'."""
        for i in range(self.n):
            block = self.real.get(i)
            self.blocks._modules[str(i)] = block if block is not None else _Slot(None, None, False, self.width)

    def keep(self, chunks: list[int]) -> None:
        """Keep the blocks of ``chunks`` (this process's), drop the others'."""
        self.real = {i: b for i, b in self.real.items() if self.chunk_of(i) in chunks}
        self._rest()


class BlockStage(nn.Module):
    """One chunk of a `BlockSplit` as torch's ``PipelineStage`` calls it: ``stage(*received,
    inputs=batch)``. Its parameters are those the chunk trains, its state dict the keys it saves,
    under the model's own names."""

    def __init__(self, split: BlockSplit, chunk: int) -> None:
        super().__init__()
        object.__setattr__(self, "split", split)
        self.chunk = chunk

    def forward(self, *received: torch.Tensor, inputs: Any) -> Any:
        out = self.split.run(self.chunk, received[0] if received else None, inputs)
        if isinstance(out, torch.Tensor):
            return out
        leaves = tuple(t for _, t in tensors_of(out))  # torch's stages pass tensors only
        self.split.last_output = (out, leaves)
        return leaves

    def named_parameters(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        held = self.split.held[self.chunk]
        for name, p in self.split.model.named_parameters():
            if id(p) in held:
                yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        for _, p in self.named_parameters():
            yield p

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        full = self.split.model.state_dict()
        return {k: v for k, v in full.items() if self.split.key_chunk.get(k) == self.chunk}


# ----- finding the block list and checking the cut --------------------------------------
def _observe(model: nn.Module, example: Any, forward_fn: ForwardFn) -> tuple[dict[str, list[int]], dict, Any]:
    """One forward pass, watched: the tick of each module's first call (and each list item's
    calls), each list item's hidden input/output structure; and the output (no gradients)."""
    tick = [0]
    first: dict[str, list[int]] = {}
    shapes: dict[str, tuple[bool, int, int]] = {}  # item -> (hidden in is a tensor, output width, end tick)
    handles = []
    for name, module in model.named_modules():
        def pre(_m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            tick[0] += 1
            first.setdefault(name, []).append(tick[0])
            shapes.setdefault(name, (isinstance(_hidden_in(args, kwargs), torch.Tensor), -1, 0))

        def post(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any, name: str = name) -> None:
            tick[0] += 1
            ok = isinstance(out, torch.Tensor) or (isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor))
            width = 0 if isinstance(out, torch.Tensor) else len(out) if ok else -1
            shapes[name] = (shapes[name][0] and ok, width, tick[0])
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            out = forward_fn(model, example)
    finally:
        for handle in handles:
            handle.remove()
    return first, shapes, out


def _block_list(model: nn.Module, first: dict[str, list[int]], shapes: dict, split: str) -> tuple[str, int] | None:
    """The block list (its name and its items' output width): named by ``split``'s points, else
    the list of items called once each, in order, with the most parameters."""
    points = [p.strip() for p in split.split(",") if p.strip()] if split != "params" else []
    best: tuple[int, str, int] | None = None
    for name, module in model.named_modules():
        if not name or not isinstance(module, nn.ModuleList) or not len(module):
            continue
        items = [f"{name}.{i}" for i in range(len(module))]
        if points and not all(p.rpartition(".")[0] == name and p in items for p in points):
            continue
        calls = [first.get(item, []) for item in items]
        if any(len(c) != 1 for c in calls) or [c[0] for c in calls] != sorted(c[0] for c in calls):
            continue
        widths = {shapes[item][1] for item in items}
        if not all(shapes[item][0] for item in items) or len(widths) != 1 or -1 in widths:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, widths.pop())
    return None if best is None else (best[1], best[2])


def plan_blocks(model: nn.Module, example: Any, forward_fn: ForwardFn | None, chunks: int,
                split: str) -> tuple[BlockSplit | None, str]:
    """``model`` cut between its blocks into ``chunks`` (``split``: ``"params"`` balances the
    parameters; else the names of the blocks where chunks 1, 2, ... begin), checked on
    ``example``; or ``(None, why not)``."""
    if not any(isinstance(m, nn.ModuleList) and len(m) for m in model.modules()):
        return None, ""  # nothing to look for: no forward pass spent
    fn = forward_fn or call_model
    modes = [m.training for m in model.modules()]
    model.eval()  # no dropout: the check compares outputs
    try:
        with torch.random.fork_rng(devices=[]):
            first, shapes, want = _observe(model, example, fn)
            found = _block_list(model, first, shapes, split)
            if found is None:
                return None, "no nn.ModuleList whose blocks its forward pass calls once each, in order"
            name, width = found
            blocks: nn.ModuleList = model.get_submodule(name)  # type: ignore[assignment]
            n = len(blocks)
            begin, end = first[f"{name}.0"][0], shapes[f"{name}.{n - 1}"][2]
            epilogue = {m for m, ticks in first.items() if ticks[0] > end}
            ancestors = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)} | {""}
            prologue = [model.get_submodule(m) for m, ticks in first.items()
                        if ticks[0] < begin and m not in ancestors]
            bounds = _bounds(model, name, blocks, first, begin, epilogue, chunks, split)
            cut = BlockSplit(model, name, bounds, width)
            cut.forward_fn = forward_fn
            try:
                used, got = _simulate(cut, example, prologue)
            except Exception as exc:  # noqa: BLE001 - a forward pass that needs its blocks in place: traced instead
                return None, f"its forward pass fails with blocks of {name} set aside ({error_line(exc)})"
    finally:
        for module, mode in zip(model.modules(), modes):
            module.training = mode
    want_t = [t for _, t in tensors_of(want) if t.is_floating_point()]
    got_t = [t for _, t in tensors_of(got) if t.is_floating_point()]
    if len(want_t) != len(got_t) or not all(torch.allclose(a.double(), b.detach().double(), rtol=1e-4, atol=1e-6)
                                            for a, b in zip(want_t, got_t)):
        return None, f"its block list {name!r} does not hand one hidden state from each block to the next"
    _assign(cut, epilogue, used)
    return cut, ""


def _bounds(model: nn.Module, name: str, blocks: nn.ModuleList, first: dict[str, list[int]], begin: int,
            epilogue: set[str], chunks: int, split: str) -> list[int]:
    n = len(blocks)
    if split != "params":
        points = [int(p.rpartition(".")[2]) for p in split.split(",") if p.strip()]
        if len(points) != chunks - 1 or points != sorted(set(points)) or points[0] == 0:
            raise UsageError(f"Expected {chunks - 1} increasing block names after {name}.0 where stages begin, "
                             f"for {chunks} stages. Received: split={split!r}")
        return [0, *points, n]
    # costs of the prologue, each block, the epilogue: what each chunk would train
    inside = name + "."
    seen: set[int] = {id(p) for p in blocks.parameters()}
    pro = epi = 0.0
    for mname, module in model.named_modules():
        if mname == name or mname.startswith(inside) or mname not in first:
            continue
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if mname in epilogue:
                epi += p.numel()
            elif first[mname][0] < begin:
                pro += p.numel()
    costs = [pro, *(float(sum(p.numel() for p in b.parameters())) for b in blocks), epi]
    if chunks > len(costs):
        raise UsageError(f"Expected at most {len(costs)} stages for {type(model).__name__} (its {n} blocks in "
                         f"{name}, the layers before and after them). Received: {chunks} stages")
    cuts = balance(costs, chunks, [c > 0 for c in costs])
    return [0, *(u - 1 for u in cuts), n]


class _Disturb:
    """A forward hook that makes a prologue module's output wrong (on a later chunk, only the
    hidden state it receives may count), from its own generator (no run's random state moves)."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, _module: nn.Module, _args: Any, out: Any) -> Any:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        noise = torch.randn(out.shape, generator=self.generator, dtype=out.dtype).to(out.device)
        return out + noise * (out.detach().abs().mean() + 1)


def _simulate(cut: BlockSplit, example: Any, prologue: list[nn.Module]) -> tuple[list[set[int]], Any]:
    """The chunks one after the other, each's backward pass from its output: the parameters
    each chunk reaches (its ``used`` set) and the last chunk's output. On the later chunks the
    prologue's outputs are disturbed: a model that reads them there besides the hidden state
    (a residual kept outside the blocks) gives another output than the whole model, and is
    not cut between blocks (its later stages would see other dropout, say, than the first)."""
    params = list(cut.model.parameters())
    grads = [p.grad for p in params]
    used: list[set[int]] = []
    received = None
    out: Any = None
    handles: list[Any] = []
    try:
        for c in range(cut.chunks):
            for p in params:
                p.grad = None
            if c == 1:
                disturb = _Disturb()
                handles = [m.register_forward_hook(disturb) for m in prologue]
            out = cut.run(c, received, example)
            leaves = [t for _, t in tensors_of(out) if t.requires_grad]
            if leaves:
                torch.autograd.backward([t.sum() for t in leaves])
            used.append({id(p) for p in params if p.grad is not None})
            received = out.detach().requires_grad_(True) if c < cut.chunks - 1 else None
    finally:
        for handle in handles:
            handle.remove()
        for p, g in zip(params, grads):
            p.grad = g
    return used, out


def _assign(cut: BlockSplit, epilogue: set[str], used: list[set[int]]) -> None:
    """Which chunks train each parameter and which saves each state-dict key: a block's are its
    chunk's; others' those of the chunks that use them, saved by the chunk that runs their module
    (the last for the epilogue's, else the first) when it is one of them."""
    last = cut.chunks - 1
    inside = cut.name + "."
    for key, value in cut.model.state_dict(keep_vars=True).items():
        if key.startswith(inside):
            cut.key_chunk[key] = cut.chunk_of(int(key[len(inside):].split(".")[0]))
            continue
        home = last if key.rpartition(".")[0] in epilogue else 0
        users = [c for c in range(cut.chunks) if id(value) in used[c]]
        cut.key_chunk[key] = home if home in users or not users else users[0]
    for key, value in cut.model.named_parameters():
        block = cut.chunk_of(int(key[len(inside):].split(".")[0])) if key.startswith(inside) else None
        users = {c for c in range(cut.chunks) if id(value) in used[c]}
        for c in users | ({block} if block is not None else set()) or {cut.key_chunk[key]}:
            cut.held[c].add(id(value))
