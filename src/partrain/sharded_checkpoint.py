"""Sharded checkpoints: every process writes its own shards with ``torch.distributed.checkpoint``.

A strategy whose processes each hold part of the model (``fsdp``, ``tp``) writes its
checkpoints this way (`partrain.strategies.base.Strategy.sharded_checkpoints`): no process
gathers the whole model, and a run with another mesh or process count (or one process)
reads them back, each process reading the pieces it needs (DCP reshards on load).

Layout of a checkpoint directory (``OUT/checkpoint.dcp``; ``OUT/best.dcp`` for the best epoch)::

    checkpoint.dcp/
      0000000030-000002/     one version, named by its step and epoch; the newest complete one counts
        state.pt             everything but the tensors: a partrain checkpoint (`partrain.checkpoint`)
                             without "model" and "optimizer", plus "sharded" (the optimizer's
                             groups by parameter name and its non-tensor state)
        __0_0.distcp ...     each process's shards (DCP's files)
        .metadata            DCP's index of the pieces, written last (by process 0)
      .tmp-0000000045-.../   a version being written: ignored, removed by the next save

A version is written under a ``.tmp-`` name and renamed when every process has written its
shards (DCP writes ``.metadata`` once they have), then older versions are removed: a crash
leaves the previous version whole, as `save_checkpoint`'s atomic replacement does for a file.

Tensor keys: ``model/<name>`` (the model's ``state_dict()``), ``optimizer/<parameter name>/<key>``
(the optimizer's state of each parameter, by the parameter's name, not its index). DCP's own
loader unpickles non-tensor values and its ``.metadata`` with plain ``pickle``; partrain keeps
every non-tensor value in ``state.pt`` (read with ``weights_only=True``) and reads ``.metadata``
with an unpickler that builds only DCP's metadata classes (`read_metadata`).

`consolidate` turns a sharded checkpoint into the one-file form in one process, with no process
group: what ``partrain export``, the run's end, ``partrain serve`` and strategies that hold the
whole model (``single``, ``allreduce``, ...) read.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer

from ._compat import dcp_file_reader
from .checkpoint import load_checkpoint, save_checkpoint
from .errors import UsageError

#: the name of a run's sharded checkpoint (next to ``checkpoint.pt``) and of its best epoch's
SHARDED_NAME, BEST_NAME = "checkpoint.dcp", "best.dcp"
STATE_FILE = "state.pt"
_VERSION = re.compile(r"^(\d{10})-(\d{6})$")

#: a tensor as the checkpoint holds it, from the tensor as training keeps it, and back
Layout = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


# ----- where versions live --------------------------------------------------------------------

def version_name(step: int, epoch: int) -> str:
    return f"{step:010d}-{epoch:06d}"


def latest_version(root: str) -> str | None:
    """The newest complete version under ``root`` (a directory of versions), or ``root`` itself
    when it is one version (holds ``.metadata``); None when there is none."""
    if _complete(root):
        return root
    if not os.path.isdir(root):
        return None
    names = sorted(n for n in os.listdir(root) if _VERSION.match(n) and _complete(os.path.join(root, n)))
    return os.path.join(root, names[-1]) if names else None


def is_sharded(path: str) -> bool:
    """Whether ``path`` is a sharded checkpoint (a directory of versions, or one version)."""
    return os.path.isdir(path)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, STATE_FILE))


def progress(path: str) -> tuple[int, int]:
    """``(step, epoch)`` of a checkpoint file or directory (the newest version), cheaply."""
    if is_sharded(path):
        version = latest_version(path)
        match = _VERSION.match(os.path.basename(version or ""))
        return (int(match.group(1)), int(match.group(2))) if match else (-1, -1)
    state = load_checkpoint(path, mmap=True)
    return int(state.get("step", -1)), int(state.get("epoch", -1))


def latest_checkpoint(out_dir: str) -> str | None:
    """The checkpoint ``resume="auto"`` continues in ``out_dir``: ``checkpoint.pt`` or
    ``checkpoint.dcp``, whichever went further (the sharded one when they tie: the run's end
    exported it to the file); None when neither is there."""
    file, sharded = os.path.join(out_dir, "checkpoint.pt"), os.path.join(out_dir, SHARDED_NAME)
    have_sharded = latest_version(sharded) is not None
    if not os.path.exists(file):
        return sharded if have_sharded else None
    if not have_sharded:
        return file
    return sharded if progress(sharded) >= progress(file) else file


def commit(tmp: str, root: str, name: str) -> str:
    """Rename the written version ``tmp`` to ``root/name``, then remove every other version and
    leftover under ``root`` (the new one is complete before the old ones go). Process 0 only."""
    final = os.path.join(root, name)
    if os.path.exists(final):  # the same step and epoch written again (a restarted run)
        aside = os.path.join(root, f".old-{name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    for entry in os.listdir(root):
        if entry != name:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    return final


def copy_version(version: str, root: str) -> str:
    """``version`` copied to ``root`` (hard links where the filesystem allows), committed there."""
    name = os.path.basename(version)
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp-{name}")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(version, tmp, copy_function=link)
    return commit(tmp, root, name)


def remove_leftovers(root: str) -> None:
    """Versions a crashed save left half written (process 0, before the first save of a run)."""
    if os.path.isdir(root):
        for entry in os.listdir(root):
            if entry.startswith("."):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


# ----- the tensors of a training process ------------------------------------------------------

def training_tensors(model: nn.Module, optimizer: Optimizer | None,
                     layout: Callable[[torch.Tensor], Layout | None]) -> tuple[dict[str, torch.Tensor], dict]:
    """This process's tensors for DCP (DTensors stay sharded: DCP writes each process's pieces and
    one copy of what is replicated) and what the optimizer holds besides tensors.

    ``layout(param)``: a parameter the checkpoint holds in another layout than training (tp's
    fused q, k, v) as ``(to_saved, from_saved)``; None: as it is.
    """
    named = dict(model.named_parameters(remove_duplicate=False))
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        found = layout(named[name]) if name in named else None
        tensors[f"model/{name}"] = found[0](value) if found else value
    extra: dict[str, Any] = {"param_groups": [], "state": {}}
    if optimizer is None:
        return tensors, extra
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        group_names = []
        for p in group["params"]:
            name = names[id(p)]
            group_names.append(name)
            found = layout(p)
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    same = found is not None and tuple(value.shape) == tuple(p.shape)
                    tensors[f"optimizer/{name}/{key}"] = found[0](value) if found is not None and same else value
                else:
                    extra["state"].setdefault(name, {})[key] = value
        extra["param_groups"].append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    return tensors, extra


def save_tensors(tensors: dict[str, torch.Tensor], path: str, *, process_group: Any = None,
                 asynchronous: bool = False) -> Future | None:
    """``dcp.save`` (collective: every process of the job) or ``dcp.async_save`` (returns the
    future of the write; the tensors are copied first, so training may go on)."""
    import torch.distributed.checkpoint as dcp

    if not asynchronous:
        with _one_process_quietly():
            dcp.save(tensors, checkpoint_id=path)
        return None
    response: Any = dcp.async_save(tensors, checkpoint_id=path, process_group=process_group)
    return response.upload_completion if hasattr(response, "upload_completion") else response


def load_in_place(version: str, model: nn.Module, optimizer: Optimizer | None,
                  layout: Callable[[torch.Tensor], Layout | None], extra: dict[str, Any]) -> None:
    """The checkpoint's tensors into this process's model and optimizer as they are laid out now
    (collective: every process; each reads the pieces of its own shards). ``optimizer`` None:
    the model only. ``extra``: ``state.pt``'s ``"sharded"`` entry."""
    import torch.distributed.checkpoint as dcp

    saved = read_metadata(version).state_dict_metadata
    named = dict(model.named_parameters(remove_duplicate=False))
    targets: dict[str, torch.Tensor] = {}
    after: list[Callable[[], None]] = []
    for name, value in model.state_dict().items():
        key = f"model/{name}"
        found = layout(named[name]) if name in named else None
        if found is None:
            targets[key] = value
            continue
        whole = _empty(saved, key, value.device)
        targets[key] = whole
        after.append(functools.partial(_copy_back, value, whole, found[1]))
    # per parameter: its state entries, each a loaded tensor with the way back to training's layout
    states: dict[torch.Tensor, dict[str, Any]] = {}
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        groups = extra.get("param_groups") or []
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
            raise UsageError(f"Expected an optimizer with groups of {[len(g['params']) for g in groups]} parameters "
                             f"(the checkpoint's) to resume {version!r}. Received: groups of "
                             f"{[len(g['params']) for g in optimizer.param_groups]}")
        for group, old in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in old.items() if k != "params"})
            for p in group["params"]:
                name = names[id(p)]
                prefix = f"optimizer/{name}/"
                found = layout(p)
                entry: dict[str, Any] = dict((extra.get("state") or {}).get(name, {}))
                for key in [k for k in saved if k.startswith(prefix)]:
                    shaped = tuple(saved[key].size) == tuple(p.shape)
                    if shaped and found is None:
                        target = torch.empty_like(p.detach())  # a DTensor laid out as its parameter
                    else:  # whole: a scalar (Adam's step, on the CPU as torch keeps it) or a fused layer's
                        target = _empty(saved, key, p.device if shaped else torch.device("cpu"))
                    targets[key] = target
                    entry[key[len(prefix):]] = _Loaded(target, found[1] if found is not None and shaped else None)
                if entry:
                    states[p] = entry
    with _one_process_quietly():
        dcp.load(targets, checkpoint_id=version, storage_reader=SafeReader(version))
    with torch.no_grad():
        for step in after:
            step()
    if optimizer is not None:
        optimizer.state.clear()
        for p, entry in states.items():
            optimizer.state[p] = {k: v.value() if isinstance(v, _Loaded) else v for k, v in entry.items()}


class _Loaded:
    """An optimizer state tensor as read, and the way to training's layout (None: as it is)."""

    def __init__(self, tensor: torch.Tensor, back: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.tensor, self.back = tensor, back

    def value(self) -> torch.Tensor:
        return self.back(self.tensor) if self.back is not None else self.tensor


@contextlib.contextmanager
def _one_process_quietly(always: bool = False) -> Iterator[None]:
    """Without a process group (one process) DCP warns that it assumes one process: that is meant."""
    import torch.distributed as dist

    if not always and dist.is_available() and dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
        yield


def _empty(saved: dict[str, Any], key: str, device: torch.device) -> torch.Tensor:
    meta = saved[key]
    return torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device=device)


def _copy_back(dst: torch.Tensor, whole: torch.Tensor, back: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``whole`` (as the checkpoint holds it) into the model's tensor ``dst``, in training's layout."""
    src = back(whole)
    dst_local = cast(Any, dst).to_local() if hasattr(dst, "to_local") else dst
    dst_local.copy_(cast(Any, src).to_local() if hasattr(src, "to_local") else src)


# ----- one process: the whole checkpoint ------------------------------------------------------

def read_state(path: str) -> dict[str, Any]:
    """A sharded checkpoint's ``state.pt`` (the newest version under ``path``) with ``"model"``
    as tensors on the meta device (the shapes and dtypes: enough to check a model against it),
    ``"optimizer"`` None and ``"sharded_path"`` the version's directory. `consolidate` fills them."""
    version = latest_version(path)
    if version is None:
        raise UsageError(f"Expected a sharded checkpoint (a directory with a complete version: .metadata and "
                         f"{STATE_FILE}) in {path!r}. Received: none")
    state = load_checkpoint(os.path.join(version, STATE_FILE))
    saved = read_metadata(version).state_dict_metadata
    state["model"] = {key[len("model/"):]: _empty(saved, key, torch.device("meta"))
                      for key in saved if key.startswith("model/")}
    state["optimizer"] = None
    state["sharded_path"] = version
    return state


def consolidate(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint in the one-file form: ``state`` itself when it is one, else (`read_state`'s)
    with the whole model and optimizer read into this process, no process group needed. The
    optimizer's state is numbered as one process's ``optimizer.state_dict()`` numbers it."""
    version = state.get("sharded_path")
    if version is None:
        return state
    import torch.distributed.checkpoint as dcp

    saved = read_metadata(version).state_dict_metadata
    targets = {key: _empty(saved, key, torch.device("cpu")) for key in saved}
    with _one_process_quietly(always=True):
        dcp.load(targets, checkpoint_id=version, storage_reader=SafeReader(version), no_dist=True)
    extra = state.get("sharded") or {}
    out = {k: v for k, v in state.items() if k not in ("sharded", "sharded_path", "format")}
    out["model"] = {key[len("model/"):]: t for key, t in targets.items() if key.startswith("model/")}
    numbered: dict[int, dict[str, Any]] = {}
    groups, index = [], 0
    for group in extra.get("param_groups") or []:
        ids = []
        for name in group["params"]:
            entry = dict((extra.get("state") or {}).get(name, {}))
            prefix = f"optimizer/{name}/"
            entry.update({key[len(prefix):]: t for key, t in targets.items() if key.startswith(prefix)})
            if entry:
                numbered[index] = entry
            ids.append(index)
            index += 1
        groups.append({**group, "params": ids})
    out["optimizer"] = {"state": numbered, "param_groups": groups} if groups else None
    return out


def export(source: str, out: str) -> str:
    """Write the checkpoint ``source`` (a sharded one: a run's ``checkpoint.dcp`` or one version)
    as one file ``out`` (`save_checkpoint`: atomic, plain tensors). Returns ``out``."""
    save_checkpoint(out, consolidate(read_state(source)))
    return out


# ----- DCP's metadata, read without running code ----------------------------------------------

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")
_SAFE_BUILTINS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                  ("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch's dtypes, layouts and sizes, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES or (module, name) in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        if module == "enum" or module == "copyreg" and name == "_reconstructor":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(version: str) -> Any:
    """DCP's ``Metadata`` of a version (which pieces of which tensors each file holds)."""
    path = os.path.join(version, ".metadata")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(io.BytesIO(f.read())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
        raise UsageError(f"Expected a torch.distributed.checkpoint directory at {version!r}. Received: "
                         f"{type(exc).__name__}: {exc}") from None


def SafeReader(path: str) -> Any:  # noqa: N802 - it stands for a reader class
    """DCP's file reader for ``path``, its ``.metadata`` read by `read_metadata`."""
    return dcp_file_reader(path, read_metadata)


__all__ = ["BEST_NAME", "SHARDED_NAME", "STATE_FILE", "commit", "consolidate", "copy_version", "export", "is_sharded",
           "latest_checkpoint", "latest_version", "load_in_place", "read_metadata", "read_state", "save_tensors",
           "training_tensors", "version_name"]
