"""Build only part of a model, with the values a whole build would give that part.

A pipeline stage trains some of a model's layers. Building the whole model in every stage
process and then dropping the other stages' layers costs the whole model's memory at the
start, and the freed memory stays in the process's heap. Building the stage's layers alone
(on the meta device, then initialising its own part afresh) would give them other initial
values than one process building the whole model from the same seed: the layers before them
draw from the random generator first. Training from the same initial weights as one
process is what the pipeline's equivalence with one process rests on.

`build_part` builds ``model_fn()`` twice:

1. on the meta device (no memory, no random numbers drawn), to learn the model's shape and
   which parameters the caller keeps (``keep(skeleton)``: their qualified names);
2. for real, from the caller's random state, with every parameter the caller does not keep
   replaced by a meta tensor as it is registered on its module (`torch.nn` registration
   hooks). Initialisation that then runs on a meta parameter - ``reset_parameters``, a
   model's ``apply(init_weights)`` afterwards, ``orthogonal_``, anything that draws - draws
   the same random numbers into a scratch tensor of the same shape, dtype and strides, which is
   dropped at once (a dispatch mode on the ops torch tags ``nondeterministic_seeded``). So the
   random generator advances exactly as in a whole build, the kept parameters get the whole
   build's values bit for bit, and the process holds at most one other parameter at a time.

`build_shards` builds every parameter as rows of a dim-0 chunk (a worker's piece under sharded
data parallel: ``torch.chunk``'s rows, as FSDP2 cuts them) in the same way: a stand-in then
holds its chunk, a draw into it is made into the scratch tensor and its rows copied, and
element-wise writes (``fill_``, ``zero_``, ``mul_``, a ``copy_`` from a whole tensor) apply to
the chunk. A write through a view that is not the whole parameter (``w[0].zero_()``,
``orthogonal_``'s ``copy_`` of a matrix into a reshaped view) cannot be followed on a chunk and
falls back to the whole build.

The two builds are matched by the order in which parameters are registered (the same code
registers them in the same order). Whatever the trick cannot follow - a build that fails on
meta tensors, a parameter created on an accelerator (its draws would come from another
generator), builds that register different parameters - falls back to one ordinary build from
the same random state: never a different model, at worst the whole one.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .._compat import apply_to_tensors
from .freeze import frozen_mask

__all__ = ["build_part", "build_shards", "move_model"]

#: ``keep(skeleton)``: the qualified names (as ``named_parameters(remove_duplicate=False)``
#: gives them) of the parameters to build for real; None: build the whole model
KeepFn = Callable[[nn.Module], "set[str] | None"]


class _Unfollowable(Exception):
    """The real build does something the partial build cannot mirror: build it whole."""


def build_part(model_fn: Callable[[], nn.Module], keep: KeepFn) -> tuple[nn.Module, bool]:
    """``(model, partial)``: ``model_fn()`` with the parameters ``keep`` names built for real and
    every other parameter on the meta device (``partial`` True), or, when a partial build cannot
    be made faithfully, the whole model (``partial`` False). Either way the kept parameters and
    the random generator's state afterwards equal those of a plain ``model_fn()`` from the same
    random state."""
    registered = _shape_build(model_fn)
    skeleton = registered.model if registered is not None else None
    kept = keep(skeleton) if isinstance(skeleton, nn.Module) else None
    if registered is None or kept is None:
        return model_fn(), False
    names: dict[int, list[str]] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):  # type: ignore[union-attr]
        names.setdefault(id(param), []).append(name)
    plan = [(shape, dtype, any(n in kept for n in names.get(id(p), ())))
            for p, (shape, dtype) in zip(registered.params, registered.shapes)]
    if all(own for _, _, own in plan):
        return model_fn(), False  # nothing to leave out: the plain build, without the hooks
    del skeleton, registered
    state = torch.get_rng_state()
    try:
        with _RealBuild(plan) as build:
            model = model_fn()
        build.finish(model)
        return model, True
    except Exception:  # noqa: BLE001 - any failure of the mirrored build: the whole model, same state
        torch.set_rng_state(state)
        return model_fn(), False


def build_shards(model_fn: Callable[[], nn.Module], rank: int, world: int
                 ) -> tuple[nn.Module, dict[str, torch.Tensor]] | None:
    """``(model, shards)``: ``model_fn()`` with every parameter of one or more dimensions on the
    meta device, and ``shards[name]`` (for each name ``named_parameters(remove_duplicate=False)``
    gives) the rows of that parameter's chunk ``rank`` of ``world`` along dim 0 - the values a
    whole build from the same random state gives those rows, bit for bit, and the random
    generator left where the whole build leaves it. Buffers and 0-d parameters are built whole.
    None (nothing drawn, the random state as it was) when it cannot be built faithfully so: the
    caller builds the model whole."""
    if not 0 <= rank < world:
        raise ValueError(f"Expected 0 <= rank < world. Received: rank {rank}, world {world}")
    registered = _shape_build(model_fn)
    if registered is None or not any(shape for shape, _ in registered.shapes):
        return None
    plan = [(shape, dtype, not shape) for shape, dtype in registered.shapes]
    del registered
    state = torch.get_rng_state()
    try:
        with _RealBuild(plan, chunk=(rank, world)) as build:
            model = model_fn()
        shards = build.finish(model)
    except Exception:  # noqa: BLE001 - any failure of the mirrored build: the caller builds it whole
        torch.set_rng_state(state)
        return None
    return model, shards


def on_meta(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters is on the meta device (a shape without values)."""
    return any(p.is_meta for p in module.parameters())


def chunk_rows(length: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of chunk ``rank`` when ``torch.chunk`` cuts ``length`` rows into
    ``world`` chunks (chunks of ``ceil(length / world)`` rows; the last ones short or empty)."""
    size = -(-length // world)
    return min(rank * size, length), min((rank + 1) * size, length)


def move_model(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to(device)``, leaving its meta tensors (the parameters `build_part` left out) on meta."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return model.to(device)
    return apply_to_tensors(model, lambda t: t if t.is_meta else t.to(device))


class _Registered:
    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []
        #: each registration's shape and dtype as registered (a later ``model.double()`` casts them)
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.model: Any = None


def _shape_build(model_fn: Callable[[], nn.Module]) -> _Registered | None:
    """The model built on meta and its parameters in registration order (None: it does not build
    there). The caller's random state is untouched."""
    seen = _Registered()

    def record(module: nn.Module, name: str, param: Any) -> None:
        if param is not None:
            seen.params.append(param)
            seen.shapes.append((tuple(param.shape), param.dtype))

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), _hook(record):
            seen.model = model_fn()
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta is built whole
        return None
    return seen


@contextlib.contextmanager
def _hook(fn: Callable[[nn.Module, str, Any], Any]) -> Iterator[None]:
    handle = register_module_parameter_registration_hook(fn)
    try:
        yield
    finally:
        handle.remove()


class _RealBuild:
    """The second build: parameters not kept become `_StandIn` tensors as they are registered
    (see the module doc), and plain meta parameters once the build is done."""

    def __init__(self, plan: list[tuple[tuple[int, ...], torch.dtype, bool]],
                 chunk: tuple[int, int] | None = None) -> None:
        self.plan = plan
        self.chunk = chunk  # (rank, world): left-out parameters hold that chunk of their rows
        self.count = 0
        # keyed by the parameter itself, held weakly: an id could be reused once it is freed
        self.replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: the stand-ins made, by id (their original parameters, the keys above, may be gone)
        self.made: dict[int, weakref.ref[torch.Tensor]] = {}
        self._handle: Any = None

    def __enter__(self) -> _RealBuild:
        self._handle = register_module_parameter_registration_hook(self.registered)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()
        _Scratch.release()

    def registered(self, module: nn.Module, name: str, param: Any) -> nn.Parameter | None:
        if param is None:
            return None
        if isinstance(param, _StandIn) and self._made(param) is not param:
            return None  # made from a stand-in (``model.double()``): meta tensors cast in place, unregistered
        if self.count >= len(self.plan):
            raise _Unfollowable("more parameters than the shape build registered")
        shape, dtype, own = self.plan[self.count]
        self.count += 1
        if tuple(param.shape) != shape or param.dtype != dtype:
            raise _Unfollowable(f"parameter {self.count} differs between the builds")
        if isinstance(param, _StandIn):
            return None  # a stand-in registered again (a tie): it stays one
        if param.device.type != "cpu":
            raise _Unfollowable("a parameter on another device draws from its own generator")
        if own:
            return None
        if param not in self.replaced:  # one stand-in per parameter: ties stay tied
            stand_in = _StandIn(torch.empty_like(param, device="meta"))
            if self.chunk is not None:
                start, stop = chunk_rows(param.shape[0], *self.chunk)
                stand_in.chunk = _Chunk(torch.empty((stop - start, *param.shape[1:]), dtype=param.dtype),
                                        (start, stop))
            self.replaced[param] = made = nn.Parameter(stand_in, requires_grad=param.requires_grad)
            self.made[id(made)] = weakref.ref(made)
        return self.replaced[param]

    def _made(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param`` if this build made it as a stand-in (registered again: a tie), else None."""
        ref = self.made.get(id(param))
        return ref() if ref is not None else None

    def finish(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every stand-in left in ``model`` (parameters, and buffers computed from them) becomes a
        plain meta tensor; ties stay tied. Returns the chunks the stand-ins held, by parameter name
        (building by chunks: a buffer computed from a parameter cannot be, and stops it)."""
        if self.count != len(self.plan):
            raise _Unfollowable("fewer parameters than the shape build registered")
        shards = {}
        if self.chunk is not None:
            for name, param in model.named_parameters(remove_duplicate=False):
                if isinstance(param, _StandIn):
                    if param.chunk is None:
                        raise _Unfollowable(f"parameter {name} is not one of the build's chunks")
                    if frozen_mask(param) is not None:  # its mask would stay with the stand-in
                        raise _Unfollowable(f"parameter {name} has frozen elements")
                    shards[name] = param.shard
            if any(isinstance(b, _StandIn) for b in model.buffers()):
                raise _Unfollowable("a buffer computed from a parameter")
        meta: dict[int, torch.Tensor] = {}

        def plain(t: torch.Tensor, param: bool) -> torch.Tensor:
            if id(t) not in meta:
                # its own sizes and dtype: ``param.data = x`` (``model.double()``) changes them, not its elem's
                elem = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
                meta[id(t)] = nn.Parameter(elem, requires_grad=t.requires_grad) if param else elem
            return meta[id(t)]

        for module in model.modules():
            for key, value in list(module._parameters.items()):
                if isinstance(value, _StandIn):
                    module._parameters[key] = plain(value, True)  # type: ignore[assignment]
            for key, value in list(module._buffers.items()):
                if isinstance(value, _StandIn):
                    module._buffers[key] = plain(value, False)
        return shards


class _StandIn(torch.Tensor):
    """A parameter the build leaves out: shaped like it, on the CPU as far as the model's code can
    tell (``nn.init`` skips meta tensors, and must not: the draws are the point), holding no
    memory (its values live on the meta device). A draw into it is made on a scratch tensor of its
    sizes, strides and dtype, so the random generator advances as it would for the real one.
    Anything that would write its values into a real tensor stops the partial build."""

    elem: torch.Tensor
    #: building by chunks (`build_shards`): the rows of this parameter the build keeps, with their
    #: values (shared with its views of all of it: ``.data``); None elsewhere
    chunk: _Chunk | None
    #: a view of a chunked parameter that is not all of it: writing through it cannot be followed
    partial_view: bool
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _StandIn:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            device="cpu", requires_grad=elem.requires_grad)
        out.elem = elem
        out.chunk, out.partial_view = None, False
        return out

    @property
    def shard(self) -> torch.Tensor:
        """The values of this parameter's rows, in its dtype now (``param.data = x``, which
        ``model.double()`` does, changes the dtype of the parameter it keeps)."""
        chunk = cast(_Chunk, self.chunk)
        if chunk.values.dtype != self.dtype:
            chunk.values = chunk.values.to(self.dtype)
        return chunk.values

    @property
    def rows(self) -> tuple[int, int]:
        return cast(_Chunk, self.chunk).rows

    def __repr__(self) -> str:
        return f"_StandIn({tuple(self.shape)}, {self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        mutated = [args[0]] if torch.Tag.inplace in func.tags and args else []
        if "out" in kwargs:
            mutated.append(kwargs["out"])
        if any(isinstance(t, torch.Tensor) and not isinstance(t, _StandIn) for t in mutated):
            raise _Unfollowable(f"{func} writes a left-out parameter's values into a real tensor")
        if any(t.partial_view for t in mutated):
            raise _Unfollowable(f"{func} writes through a view of part of a chunked parameter")
        target = mutated[0] if mutated and mutated[0].chunk is not None else None
        if torch.Tag.nondeterministic_seeded in func.tags:
            drawn_args, drawn_kwargs = _Scratch.tensors(args), _Scratch.tensors(kwargs)
            func(*drawn_args, **drawn_kwargs)  # the draws, into scratch
            if target is not None:  # the chunk keeps its rows of them
                drawn = drawn_kwargs["out"] if "out" in kwargs else drawn_args[0]
                target.shard.copy_(drawn[target.rows[0]:target.rows[1]])
            if mutated:
                return mutated[0]
            out = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        else:
            if target is not None:
                _on_chunk(func, target, args, kwargs)
            out = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
            if mutated:
                return mutated[0]
        source = next((t for t in args if isinstance(t, _StandIn) and t.chunk is not None), None)
        aliases = bool(func._schema.returns) and func._schema.returns[0].alias_info is not None

        def wrap(t: Any) -> Any:
            if not (isinstance(t, torch.Tensor) and t.is_meta):
                return t
            out = _StandIn(t)
            if source is not None and func is torch.ops.aten._to_copy.default and t.shape == source.shape \
                    and kwargs.get("device") in (None, torch.device("cpu")):  # ``model.double()``
                out.chunk = _Chunk(source.shard.to(t.dtype), source.rows)
            elif source is not None and aliases:  # a view: all of the parameter (``.data``), or part of it
                if (t.size(), t.stride(), t.storage_offset()) == (source.size(), source.stride(),
                                                                  source.storage_offset()):
                    out.chunk = source.chunk
                else:
                    out.partial_view = True
            return out

        return tree_map(wrap, out)


class _Chunk:
    """A chunked parameter's rows ``[start, stop)`` and their values."""

    def __init__(self, values: torch.Tensor, rows: tuple[int, int]) -> None:
        self.values, self.rows = values, rows


def _meta(t: Any) -> Any:
    return t.elem if isinstance(t, _StandIn) else t


def _on_chunk(func: Any, target: _StandIn, args: Any, kwargs: Any) -> None:
    """An in-place write into a chunked parameter, made on its chunk: the other operands as
    numbers, 0-d tensors, or tensors of the parameter's whole shape (their chunk's rows)."""
    start, stop = target.rows

    def rows(t: Any) -> Any:
        if t is target:
            return target.shard
        if not isinstance(t, torch.Tensor) or t.dim() == 0 and not isinstance(t, _StandIn):
            return t
        if t.shape != target.shape:
            raise _Unfollowable(f"{func} mixes a chunked parameter with a tensor of another shape")
        if isinstance(t, _StandIn):
            if t.chunk is None or t.rows != target.rows:
                raise _Unfollowable(f"{func} reads a parameter the chunked build does not hold")
            return t.shard
        return t[start:stop]

    if "out" in kwargs:
        raise _Unfollowable(f"{func} writes a chunked parameter through out=")
    func(*tree_map(rows, args), **tree_map(rows, kwargs))


class _Scratch:
    """Scratch tensors for the draws into stand-ins, over buffers reused from draw to draw: a
    fresh allocation per draw left the freed blocks in the heap as holes the next, aligned
    allocation of the same size did not fit (16 MiB more resident per left-out layer)."""

    buffers: list[torch.Tensor] = []

    @classmethod
    def tensors(cls, tree: Any) -> Any:
        """``tree`` with every stand-in replaced by a CPU tensor of its sizes, strides and dtype (the
        generator advances by what it would for the real tensor), each over its own buffer."""
        slot = 0

        def swap(t: Any) -> Any:
            nonlocal slot
            if not isinstance(t, _StandIn):
                return t
            extent = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride()))
            nbytes = extent * t.element_size()
            if slot == len(cls.buffers):
                cls.buffers.append(torch.empty(0, dtype=torch.uint8))
            if cls.buffers[slot].numel() < nbytes:
                cls.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
            buffer = cls.buffers[slot]
            slot += 1
            return buffer[:nbytes].view(t.dtype).as_strided(t.size(), t.stride())

        return tree_map(swap, tree)

    @classmethod
    def release(cls) -> None:
        cls.buffers = []
