"""Turn ``partrain serve`` MODEL arguments into `ServedModel` descriptions.

A MODEL is ``[name=]source`` where source is one of (checked in this order):

- a ``.pt2`` file: a ``torch.export`` program (`torch.export.load`); its input
  shapes and dtypes are read from the program, and its batch dim must be dynamic;
- a TorchScript archive (``torch.jit.save``; recognised by its ``code/`` entries);
- a checkpoint written by ``partrain train`` (`partrain.serve.checkpoints`: read with ``weights_only=True``; the
  recorded model spec rebuilds the module, its ``input_shape`` describes inputs: for
  token ids, the first layer an ``Embedding``, any length up to the recorded one);
- a directory holding a Hugging Face causal language model (``save_pretrained``:
  ``config.json`` and weights; its tokenizer too when saved there), loaded with
  ``local_files_only``: nothing downloads;
- ``module:factory``: a function returning an ``nn.Module`` (or a `ServedModel`).

A causal language model (partrain's built-in GPT, from a checkpoint or a factory, or a
Hugging Face one) is served twice: logits on ``infer`` (token ids of any length up to
its context) and generation on ``generate`` / ``generate_stream``: its `ServedModel`
gets a ``generator``, the factory of its `GenerationEngine` (continuous batching).

None of these unpickles arbitrary code: checkpoints load with ``weights_only``,
TorchScript and exported programs carry their own graph format, and a factory
is code the user names explicitly.

Input shape, first found of: ``--input-shape``; what the source records (a
checkpoint's spec, a ``.pt2`` program, an ``example_input_shape`` attribute);
what the first parameterised layer determines (`partrain.serve.shapes`: Linear
``[-1, in_features]``, Conv ``[-1, channels, -1, ...]``, Embedding ``[-1, -1]``
INT64), checked by running the model on zeros. Only when none of these works is
``--input-shape`` asked for, in one line saying why.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import UsageError, error_line
from .checkpoints import (
    model_from_checkpoint,
    spec_parameters,
)
from .generation.models import (
    LanguageModel,
    context_of,
    engine_factory,
    gpt_language_model,
    hf_causal_lm,
    is_hf_causal_lm,
)
from .protocol import DATATYPES, ServedModel
from .shapes import ShapeNotInferred, infer_input

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def parse_model_arg(text: str) -> tuple[str | None, str]:
    """Split ``"name=source"`` (name optional) into its parts."""
    head, sep, tail = text.partition("=")
    if sep and _NAME.match(head) and "/" not in head:
        return head, tail
    return None, text


def default_name(source: str) -> str:
    """A model name from a file (its stem) or factory (the function name)."""
    if os.path.exists(source) or ":" not in source:
        stem = os.path.basename(source).split(".")[0]
    else:
        stem = source.rsplit(":", 1)[1]
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", stem).strip("._-")
    return cleaned or "model"


def model_names(specs: Sequence[str]) -> list[str]:
    """The names MODEL arguments are served under (as `load_model_spec` names them), without loading."""
    names = []
    for text in specs:
        name, source = parse_model_arg(text)
        names.append(name or default_name(source))
    return names


def parse_shape(text: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """``"1,28,28"`` -> ``(1, 28, 28)`` (one sample's shape, no batch dim)."""
    if text is None:
        return None
    if isinstance(text, str):
        parts = [p for p in re.split(r"[,x ]+", text.strip()) if p]
        try:
            shape = tuple(int(p) for p in parts)
        except ValueError:
            shape = ()
    else:
        shape = tuple(int(d) for d in text)
    if not shape or any(d < 1 and d != -1 for d in shape):
        raise UsageError("Expected --input-shape as positive integers (-1: a dynamic dim) like 1,28,28 "
                         f"(no batch dim). Received: {text!r}")
    return shape


def parse_shapes(text: str | Sequence[int] | None) -> tuple[int, ...] | list[tuple[int, ...]] | None:
    """`parse_shape`, or several inputs' shapes separated by ``;`` (``()``: one number per
    sample), e.g. ``"-1,8;()"`` for a sequence of any length and its length."""
    if not isinstance(text, str) or ";" not in text:
        return parse_shape(text)
    shapes = []
    for part in text.split(";"):
        if part.strip() in ("()", ""):
            if not part.strip():
                raise UsageError(f"Expected --input-shape as one shape per input, separated by ';' (() for one "
                                 f"number per sample), like -1,8;(). Received: {text!r} (an empty shape)")
            shapes.append(())
        else:
            shapes.append(parse_shape(part))
    return shapes  # type: ignore[return-value]


def parse_dtypes(text: str | None) -> torch.dtype | list[torch.dtype] | None:
    """``--input-dtype``: one OIP datatype, or one per input separated by commas (FP32,INT64)."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",")]
    bad = [n for n in names if n not in DATATYPES]
    if bad or not names:
        raise UsageError(f"Expected --input-dtype among {sorted(DATATYPES)} (one per input, comma-separated). "
                         f"Received: {text!r}")
    dtypes = [DATATYPES[n][0] for n in names]
    return dtypes if len(dtypes) > 1 else dtypes[0]


def _is_torchscript(path: str) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        return any("/code/" in n or n.endswith("constants.pkl") for n in zf.namelist())


def _exported(path: str, device: torch.device | None) -> tuple[nn.Module, list[tuple[int, ...]], list[torch.dtype], int | None]:
    """Load a ``torch.export`` program: its module, sample shapes, dtypes, static batch (or None)."""
    try:
        ep = torch.export.load(path)
    except Exception as exc:  # noqa: BLE001 - any failure means "not a valid .pt2"
        raise UsageError(f"Expected {path!r} to be a torch.export program (.pt2). Received: {type(exc).__name__}: {exc}") from None
    user_inputs = set(ep.graph_signature.user_inputs)
    shapes, dtypes, batch = [], [], set()
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 1:
            raise UsageError(f"Expected tensor inputs with a batch dim in {path!r}. Received input {node.name!r}: {val!r}")
        dims = list(val.shape)
        batch.add(dims[0] if isinstance(dims[0], int) else None)
        if not all(isinstance(d, int) for d in dims[1:]):
            raise UsageError(f"Expected static sample dims in {path!r} (only the batch dim may be dynamic). "
                             f"Received input {node.name!r} of shape {dims}")
        shapes.append(tuple(int(d) for d in dims[1:]))
        dtypes.append(val.dtype)
    static = batch.pop() if len(batch) == 1 else None
    module = ep.module()
    if device is not None:
        module.to(device)
    return module, shapes, dtypes, static


def load_model_spec(text: str, *, input_shape: str | Sequence[int] | None = None, input_dtype: str | None = None,
                    device: torch.device | str | None = None,
                    transform: Callable[[nn.Module], nn.Module] | None = None,
                    generation: Mapping[str, Any] | None = None, **settings: Any) -> ServedModel:
    """Load one MODEL argument as a `ServedModel` (``settings``: batching options).

    ``transform(module)``, when given, replaces the loaded ``nn.Module`` before it is
    served (``--stages``: its first stage); only checkpoints and factories give one.
    A causal language model gets a ``generator`` (not when transformed): its engine is
    built with ``generation`` (`GenerationEngine` options: ``max_running``,
    ``cache_bytes``, ``max_prefill_tokens``) and ``settings``' ``max_queue``.

    ``input_dtype`` (an OIP datatype) defaults to what the source records, else the
    first layer's (`partrain.serve.shapes.infer_input`), else FP32. Raises
    `UsageError` with one clear line for anything the user can fix.
    """
    name, source = parse_model_arg(text)
    name = name or default_name(source)
    shape = parse_shapes(input_shape)
    dtype = parse_dtypes(input_dtype)
    dev = torch.device(device) if device is not None else None
    module: Any
    parameters: dict[str, Any] = {}  # what the model metadata adds (preprocessing, task)
    shapes: list[tuple[int, ...]] | tuple[int, ...] | None = shape
    dtypes: Any = dtype
    names: list[str | None] | None = None
    keywords = False
    max_shape: tuple[int, ...] | None = None
    lm: LanguageModel | None = None
    if os.path.isdir(source) and not _sharded_checkpoint(source):
        lm = hf_causal_lm(source)
        module, shapes, max_shape = lm.logits, shape or (-1,), None if shape else (lm.context,)
    elif os.path.isfile(source) or os.path.isdir(source):  # a file, or a sharded checkpoint's directory
        if source.endswith(".pt2"):
            module, found, found_dtypes, static = _exported(source, dev)
            if static is not None and static != 1:
                raise UsageError(f"Expected {source!r} exported with a dynamic batch dim (torch.export.Dim). "
                                 f"Received: a static batch of {static}")
            if static == 1:
                settings["max_batch_size"] = 1  # a static batch of 1: batching is impossible
            if shape is None:
                shapes, dtypes = (found if len(found) > 1 else found[0]), (found_dtypes if len(found) > 1 else found_dtypes[0])
        elif os.path.isfile(source) and _is_torchscript(source):
            try:
                module = torch.jit.load(source, map_location=dev or "cpu")
            except Exception as exc:  # noqa: BLE001
                raise UsageError(f"Expected {source!r} to be a TorchScript archive. Received: {type(exc).__name__}: {exc}") from None
            shapes = shape or getattr(module, "example_input_shape", None)
        else:
            module, spec = model_from_checkpoint(source, weights=transform is None)  # a stage: its part only
            shapes = shape or (tuple(spec["input_shape"]) if spec.get("input_shape") else None)
            if shape is None and spec.get("inputs"):  # several inputs, as training fed them
                shapes, found_dtypes, names = _spec_inputs(spec["inputs"], source)
                dtypes = dtypes if dtypes is not None else found_dtypes
                keywords = all(names)  # a dict batch: the model took them by keyword
            elif shape is None and shapes is not None:  # one input: a language model's block is its limit
                shapes, max_shape = _token_length(module, shapes)
            parameters = spec_parameters(spec, source)
            lm = gpt_language_model(module, spec.get("tokenizer"))
    elif ":" in source and not os.path.exists(source):
        module = _call_factory(source)
        if isinstance(module, ServedModel):
            module.name = name
            for key, value in settings.items():
                setattr(module, key, value)
            return module
        if not isinstance(module, nn.Module) and not callable(module):
            raise UsageError(f"Expected {source!r} to return an nn.Module or ServedModel. Received: {type(module).__name__}")
        shapes = shape or getattr(module, "example_input_shape", None)
        lm = gpt_language_model(module, None) if isinstance(module, nn.Module) else None
        if lm is None and is_hf_causal_lm(module):
            lm = LanguageModel(module, context_of(module.config, source), None)
            module = lm.logits
        if lm is not None and shapes is None:  # token ids up to the context, as for a checkpoint
            shapes, max_shape = (-1,), (lm.context,)
    else:
        raise UsageError(f"Expected MODEL as [name=]PATH (checkpoint, TorchScript, .pt2, a Hugging Face model "
                         f"directory) or module:factory. "
                         f"Received: {text!r} (no such file)")
    if transform is not None:
        if not isinstance(module, nn.Module) or isinstance(module, torch.jit.ScriptModule) \
                or source.endswith(".pt2"):
            raise UsageError(f"Expected a partrain checkpoint or a module:factory giving an nn.Module to split. "
                             f"Received: {text!r}")
        module = transform(module)
        lm = None  # a stage of the model: no whole model to generate with
    if shapes is None:
        served = _served_with_inferred_shape(name, module, dtypes, dev, settings)
    else:
        try:
            served = ServedModel.from_module(name, module, shapes, dtype=dtypes, device=dev, input_names=names,
                                             keywords=keywords, max_shape=max_shape, **settings)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise UsageError(f"Model {name!r} failed on an example input of shape {shapes}: "
                             f"{error_line(exc)}") from None
    served.parameters.update(parameters)
    if lm is not None:
        options = dict(generation or {})
        if "max_queue" in settings:
            options.setdefault("max_queue", settings["max_queue"])
        served.generator = engine_factory(name, lm, options)
    return served


def _token_length(module: Any, recorded: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """A checkpoint's recorded sample shape as served: a sequence of indices (the first layer an
    ``Embedding``) of any length up to the recorded one, else the recorded shape itself.

    A language model trains on blocks of one length, which the spec records as the sample
    shape; it answers any shorter prompt too, and nothing longer than what it learned
    positions for (a GPT's ``block_size``). Other inputs (images, table rows) keep
    their recorded shape.
    """
    try:
        inferred = infer_input(module)
    except ShapeNotInferred:
        return recorded, None
    if inferred.value_range is None or inferred.shape != (-1,) or len(recorded) != 1:
        return recorded, None
    return (-1,), recorded


def _spec_inputs(inputs: Any, source: str) -> tuple[list[tuple[int, ...]], list[torch.dtype], list[str | None]]:
    """A checkpoint's several inputs (``model_spec["inputs"]``): shapes, dtypes, names."""
    try:
        shapes = [tuple(int(d) for d in i["shape"]) for i in inputs]
        dtypes = [getattr(torch, i["dtype"]) for i in inputs]
        names = [i.get("name") for i in inputs]
        if not all(isinstance(d, torch.dtype) for d in dtypes):
            raise TypeError("not a dtype")
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UsageError(f"Expected the model spec of {source!r} to list its inputs as name, shape and dtype. "
                         f"Received: {str(inputs)[:200]}") from None
    return shapes, dtypes, names


def _served_with_inferred_shape(name: str, module: Any, dtype: torch.dtype | None, device: torch.device | None,
                                settings: dict[str, Any]) -> ServedModel:
    """Serve ``module`` with the input its first layer determines, or ask for --input-shape saying why."""

    def ask(why: str) -> UsageError:
        return UsageError(f"Expected --input-shape like 1,28,28 for model {name!r}: it does not record its "
                          f"input shape and {why}. Received: no --input-shape")

    try:
        inferred = infer_input(module)
    except ShapeNotInferred as exc:
        raise ask(str(exc)) from None
    try:
        return ServedModel.from_module(name, module, inferred.shape, dtype=dtype or inferred.dtype, device=device,
                                       **settings)
    except (RuntimeError, ValueError, TypeError) as exc:
        shown = [-1, *inferred.shape]
        raise ask(f"its first layer, {inferred.layer}, suggests inputs of shape {shown} (-1: any size), "
                  f"but running it on zeros of that shape failed: {error_line(exc)}") from None


# --------------------------------------------------------------------------- importing user code


def import_callable(text: str, what: str, path: str | None = None) -> Callable[..., Any]:
    """`partrain.models.resolve_callable`: the current directory first, ``path`` last."""
    from ..models import resolve_callable

    return resolve_callable(text, what, path)


def _call_factory(source: str) -> Any:
    """What the ``module:factory`` named by ``source`` returns when called without arguments."""
    factory = import_callable(source, "model factory")
    try:
        return factory()
    except TypeError as exc:
        raise UsageError(f"Expected model factory {source!r} to be callable without arguments. "
                         f"Received: {exc}") from None


def _sharded_checkpoint(path: str) -> bool:
    """``path`` is a sharded checkpoint's directory (``RUN/checkpoint.dcp``: fsdp's, tp's), not a
    Hugging Face model's."""
    from ..sharded_checkpoint import latest_version

    return os.path.isdir(path) and latest_version(path) is not None


def module_from_source(source: str, weights: bool = True) -> tuple[nn.Module, dict[str, Any]]:
    """The ``nn.Module`` a partrain checkpoint or a ``module:factory`` gives, and its model spec
    (the checkpoint's; for a factory, its name and the current directory). One line otherwise.

    For the commands that need the module itself, not a served callable: ``partrain stream``
    (it trains it) and ``partrain serve --stages`` (it cuts it: ``weights=False``, then
    `materialize` on its part).
    """
    if os.path.isfile(source) or _sharded_checkpoint(source):
        return model_from_checkpoint(source, weights)
    if ":" in source and not os.path.exists(source):
        module = _call_factory(source)
        if not isinstance(module, nn.Module):
            raise UsageError(f"Expected {source!r} to return an nn.Module. Received: {type(module).__name__}")
        return module, {"name": source, "kwargs": {}, "path": os.getcwd()}
    raise UsageError(f"Expected MODEL as a checkpoint path or module:factory. Received: {source!r} (no such file)")


def load_models(specs: Sequence[str], *, device: torch.device | str | None = None, **options: Any) -> list[ServedModel]:
    """Load several MODEL arguments; names must be distinct (picklable, for replicas)."""
    models = [load_model_spec(s, device=device, **options) for s in specs]
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UsageError(f"Expected distinct model names (use name=PATH). Received: {dupes} more than once")
    return models
