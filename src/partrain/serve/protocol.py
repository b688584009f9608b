"""Open Inference Protocol v2 (KServe / Triton) codec: JSON and binary tensors <-> torch.

No HTTP here: the functions take bytes and return tensors (and back), raising
`ProtocolError` with the HTTP status a bad request deserves. The app
(`partrain.serve.app`) only moves bytes.

Wire format, per the protocol and Triton's binary tensor data extension:

- request: ``{"id"?, "parameters"?, "inputs": [{"name", "shape", "datatype",
  "parameters"?, "data"}], "outputs"?: [{"name", "parameters"?}]}``. ``data`` is
  flat or nested, row-major. With the binary extension an input has
  ``"parameters": {"binary_data_size": N}`` instead of ``data``, the JSON header is
  followed by the raw little-endian bytes of those inputs in order, and the HTTP
  header ``Inference-Header-Content-Length`` gives the JSON header's length.
- outputs are returned as binary when the request output has
  ``"parameters": {"binary_data": true}`` or the request has
  ``"parameters": {"binary_data_output": true}``; the response then carries
  ``binary_data_size`` per binary output and ``Inference-Header-Content-Length``.
- request parameter ``"timeout"`` (microseconds, as in Triton) bounds the time a
  request may wait for its batch.
- the classification extension: a requested output with ``"parameters":
  {"classification": K}`` (an output of shape [batch, classes]) comes back as
  BYTES of shape [batch, K], each element ``"<value>:<index>"`` of the K highest
  values of its row, highest first (JSON strings, or with the binary extension
  each element as a 4-byte little-endian length and its UTF-8 bytes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from .shapes import DYNAMIC, PROBE_SIZES, ShapeNotInferred, infer_input, pads_right_exactly, probe

if TYPE_CHECKING:
    from .generation import GenerationEngine

try:  # orjson parses a request of 784 floats ~10x faster than json (optional, `serve` extra)
    import orjson

    _loads = orjson.loads

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)  # callers check floats are finite first: orjson would write null
except ImportError:  # pragma: no cover - depends on the environment
    def _no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")  # as orjson: standard JSON has no NaN or Infinity

    def _loads(text: bytes | str) -> Any:
        return json.loads(text, parse_constant=_no_constant)

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()

HEADER = "Inference-Header-Content-Length"

# OIP datatype -> (torch dtype, little-endian numpy dtype)
DATATYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "BOOL": (torch.bool, np.dtype("?")),
    "UINT8": (torch.uint8, np.dtype("u1")),
    "UINT16": (torch.uint16, np.dtype("<u2")),
    "UINT32": (torch.uint32, np.dtype("<u4")),
    "UINT64": (torch.uint64, np.dtype("<u8")),
    "INT8": (torch.int8, np.dtype("i1")),
    "INT16": (torch.int16, np.dtype("<i2")),
    "INT32": (torch.int32, np.dtype("<i4")),
    "INT64": (torch.int64, np.dtype("<i8")),
    "FP16": (torch.float16, np.dtype("<f2")),
    "FP32": (torch.float32, np.dtype("<f4")),
    "FP64": (torch.float64, np.dtype("<f8")),
}
TORCH_TO_DATATYPE = {t: name for name, (t, _) in DATATYPES.items()}


class ProtocolError(Exception):
    """A request the protocol rejects; ``status`` is the HTTP status to answer with.

    ``headers``: HTTP headers the answer carries (``Accept-Encoding`` of a 415).
    """

    def __init__(self, message: str, status: int = 400, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})


def datatype_of(dtype: torch.dtype) -> str:
    """The OIP datatype name of a torch dtype (``torch.float32`` -> ``"FP32"``)."""
    try:
        return TORCH_TO_DATATYPE[dtype]
    except KeyError:
        raise ValueError(
            f"Expected a tensor dtype among {sorted(str(t) for t in TORCH_TO_DATATYPE)}. "
            f"Received: {dtype}"
        ) from None


def datatype_of_array(a: np.ndarray) -> str:
    """The OIP datatype name of a numpy array (any byte order: ``>f4`` is ``"FP32"`` too)."""
    for name, (_, dtype) in DATATYPES.items():
        if a.dtype.kind == dtype.kind and a.dtype.itemsize == dtype.itemsize:
            return name
    raise ValueError(f"Expected an array of a datatype among {sorted(DATATYPES)}. Received: {a.dtype}")


# --------------------------------------------------------------------------- model metadata


@dataclass(frozen=True)
class TensorSpec:
    """Name, OIP datatype and shape of one model input or output (-1 = variable dim).

    An input may carry limits a request is checked against (400 otherwise), which the
    model metadata lists under ``parameters.input_limits`` (the protocol's tensor
    metadata has no place for them): ``max_shape``, the largest size of each dim
    (``-1``: none; a language model's context), and ``value_range``, the integers
    accepted, ``[low, high)`` (the rows of an embedding: token ids).
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    max_shape: tuple[int, ...] | None = None
    value_range: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    def limits(self) -> dict[str, list[int]]:
        """``{"max_shape": [...], "value_range": [low, high]}``, each only when set."""
        out = {}
        if self.max_shape is not None:
            out["max_shape"] = list(self.max_shape)
        if self.value_range is not None:
            out["value_range"] = list(self.value_range)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> TensorSpec:
        """Client side: one tensor of a model metadata response; `ValueError` if malformed."""
        try:
            return cls(str(obj["name"]), str(obj["datatype"]).upper(), tuple(int(d) for d in obj["shape"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"Expected tensor metadata with name, datatype and shape. "
                             f"Received: {str(obj)[:200]} ({type(exc).__name__}: {exc})") from None


@dataclass
class ServedModel:
    """One model the server exposes: its callable, metadata and batching settings.

    ``fn(batch)`` takes a Tensor (a tuple for several inputs) with the batch in dim
    0 and returns a Tensor or a tuple of Tensors, one per entry of ``outputs``.
    Shapes include the batch dim as -1. Build one from an ``nn.Module`` and an
    example sample shape with `from_module`.
    """

    name: str
    fn: Callable[..., Any]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    version: str = "1"
    platform: str = "pytorch"
    max_batch_size: int = 64
    policy: Any = "adaptive"
    max_queue: int = 4096
    pad: bool = False
    pad_value: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # the metadata's "parameters": e.g. {"preprocess": {"scale", "offset", "raw"}, "task": ...}
    parameters: dict[str, Any] = field(default_factory=dict)
    # a causal language model's engine factory: each app (replica) builds and starts its own
    # engine, which answers /generate and /generate_stream (`partrain.serve.generate_http`)
    generator: Callable[[], GenerationEngine] | None = None

    @classmethod
    def from_module(
        cls, name: str, module: Callable[..., Any],
        input_shape: Sequence[int] | Sequence[Sequence[int]] | None = None,
        *, dtype: torch.dtype | Sequence[torch.dtype] | None = None, version: str = "1",
        device: torch.device | str | None = None, input_names: Sequence[str | None] | None = None,
        keywords: bool = False, max_shape: Sequence[int] | None = None, **settings: Any,
    ) -> ServedModel:
        """Describe ``module`` by running it on zeros (see `partrain.serve.shapes.probe`).

        ``input_shape`` is one sample's shape (no batch dim; ``-1`` for a dynamic
        dim), or a list of them for a model with several inputs. Without it, the
        shape is read from the module's first parameterised layer
        (`partrain.serve.shapes.infer_input`: Linear, Conv, Embedding). ``dtype``
        defaults to that layer's (float32 when there is none). Outputs are named
        ``output`` (``output__k`` when several), inputs likewise. ``device``: where
        the model runs; inputs are moved there and outputs back to the CPU.
        ``input_names`` names the inputs (None keeps the default name of that place);
        with ``keywords`` the module is called with them as keyword arguments (a model
        trained on dict batches), else positionally in this order. Raises `ValueError`
        when the shape cannot be inferred or no example runs.

        Token inputs: a one-input model whose first layer is an ``Embedding`` refuses
        indices outside its rows (400); ``max_shape`` (one input's, ``-1`` for no
        bound) caps its dynamic dims, e.g. ``(-1, 32)`` with ``input_shape=(-1,)``: any
        length up to 32. Such a model pads requests of different lengths into one
        batch (at their end) when `partrain.serve.shapes.pads_right_exactly` finds its
        answers unchanged by it, unless ``pad`` is given.
        """
        inferred = None
        try:
            inferred = infer_input(module)
        except ShapeNotInferred:
            if input_shape is None:
                raise
        shapes = _shape_list(input_shape if input_shape is not None else inferred.shape)
        if dtype is None:
            dtype = inferred.dtype if inferred is not None else torch.float32
        dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)
        if len(dtypes) != len(shapes):
            raise ValueError(f"Expected one dtype per input. Received: {len(dtypes)} dtypes for {len(shapes)} inputs")
        bound = _bound(max_shape, shapes)
        # the first layer's indices bound the values of the one input that feeds it
        value_range = (inferred.value_range if inferred is not None and len(shapes) == 1
                       and not dtypes[0].is_floating_point and dtypes[0] != torch.bool else None)
        if isinstance(module, nn.Module):
            try:
                module.eval()
            except NotImplementedError:
                pass  # torch.export's module: train/eval was fixed at export time
        dev = torch.device(device) if device is not None else None
        if dev is not None and isinstance(module, nn.Module):
            module.to(dev)
        # 2-D convolutions on a CPU: batches in channels-last. oneDNN runs NCHW batches through a
        # layout conversion per layer; channels-last skips it: a conv net's batch of 64 cost 0.11
        # ms per sample instead of 0.40 (one sample: 0.27 either way), which is what batching
        # requests can win on a CPU. Answers differ from an NCHW run in the last bits, as a
        # different batch size's do.
        channels_last = (isinstance(module, nn.Module) and (dev is None or dev.type == "cpu")
                         and any(isinstance(m, nn.Conv2d) for m in module.modules()))
        if channels_last:
            module.to(memory_format=torch.channels_last)

        names = list(input_names) if input_names is not None else [None] * len(shapes)
        if len(names) != len(shapes):
            raise ValueError(f"Expected one name per input. Received: {len(names)} names for {len(shapes)} inputs")
        if keywords and not all(names):
            raise ValueError(f"Expected a name for every input of a model called by keyword. Received: {names}")

        def call(args: tuple[Tensor, ...]) -> Any:
            return module(**dict(zip(names, args))) if keywords else module(*args)  # type: ignore[arg-type]

        def fn(batch: Any) -> Any:
            args = batch if isinstance(batch, tuple) else (batch,)
            if dev is not None:
                args = tuple(a.to(dev, non_blocking=True) for a in args)
            if channels_last:
                args = tuple(a.contiguous(memory_format=torch.channels_last)
                             if a.dim() == 4 and a.is_floating_point() else a for a in args)
                out = call(args)
                return out.contiguous() if isinstance(out, Tensor) else tuple(o.contiguous() for o in out)
            out = call(args)
            if dev is not None and dev.type != "cpu":
                out = out.cpu() if isinstance(out, Tensor) else tuple(o.cpu() for o in out)
            return out

        described = probe(fn, shapes, dtypes, [bound] + [None] * (len(shapes) - 1))
        if bound is not None and DYNAMIC not in described.inputs[0]:
            bound = None  # one size ran, the dims are fixed to it: nothing left to cap
        inputs = [TensorSpec(names[i] or _io_name("input", i, len(shapes)), datatype_of(d), (-1, *s),
                             max_shape=(-1, *bound) if i == 0 and bound is not None else None,
                             value_range=value_range if i == 0 else None)
                  for i, (s, d) in enumerate(zip(described.inputs, dtypes))]
        n_out = len(described.outputs)
        outputs = [TensorSpec(_io_name("output", i, n_out), datatype_of(d), (-1, *s))
                   for i, (s, d) in enumerate(described.outputs)]
        if "pad" not in settings and value_range is not None and described.inputs[0] == (DYNAMIC,):
            longest = bound[0] if bound is not None and bound[0] != DYNAMIC else PROBE_SIZES[0]
            if pads_right_exactly(fn, dtypes[0], value_range, longest, float(value_range[0])):
                settings.update(pad=True, pad_value=float(value_range[0]))
        return cls(name=name, fn=fn, inputs=inputs, outputs=outputs, version=version, **settings)

    def metadata(self) -> dict[str, Any]:
        """The model metadata response of the protocol."""
        out = {
            "name": self.name,
            "versions": [self.version],
            "platform": self.platform,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }
        parameters = dict(self.parameters)
        limits = {t.name: t.limits() for t in self.inputs if t.limits()}
        if limits:
            parameters["input_limits"] = limits
        if parameters:  # not in the protocol's schema; clients ignore fields they do not know
            out["parameters"] = parameters
        return out


def _io_name(kind: str, i: int, n: int) -> str:
    return kind if n == 1 else f"{kind}__{i}"


def _bound(max_shape: Sequence[int] | None, shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """``max_shape`` checked against the first input's sample shape (it caps that input's dims)."""
    if max_shape is None:
        return None
    bound = tuple(int(d) for d in max_shape)
    if len(shapes) != 1 or len(bound) != len(shapes[0]) or any(d < 1 and d != DYNAMIC for d in bound):
        raise ValueError(f"Expected max_shape for a model of one input, one positive size or -1 per dim of its "
                         f"sample shape {[list(s) for s in shapes]}. Received: max_shape={list(bound)}")
    return bound


def _shape_list(input_shape: Sequence[int] | Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    items = list(input_shape)
    if items and all(isinstance(s, (list, tuple)) for s in items):
        shapes = [tuple(int(d) for d in s) for s in items]
    else:
        shapes = [tuple(int(d) for d in items)]
    for s in shapes:
        if any(d < 1 and d != -1 for d in s):
            raise ValueError(f"Expected positive sample dims or -1 (dynamic; no batch dim). "
                             f"Received: input_shape={list(s)}")
    return shapes


# --------------------------------------------------------------------------- requests


@dataclass
class InferRequest:
    """A decoded inference request: model inputs in the model's order, requested outputs."""

    id: str | None
    inputs: tuple[Tensor, ...]
    outputs: list[tuple[str, bool]]  # (output name, send as binary)
    timeout: float | None = None  # seconds, from the "timeout" parameter (microseconds)
    #: output name -> the top-k count of the classification extension, for outputs that asked for it
    classification: dict[str, int] = field(default_factory=dict)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(message, 400)


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    """Split a request body into its JSON header (parsed) and the binary part."""
    if header_length is None:
        n = len(body)
    else:
        try:
            n = int(header_length)
        except ValueError:
            n = -1
        if not 0 <= n <= len(body):
            raise _bad(f"Expected {HEADER} between 0 and the body length {len(body)}. "
                       f"Received: {header_length!r}")
    try:
        header = _loads(bytes(memoryview(body)[:n]) if n != len(body) else body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(_not_json(body, header_length, exc)) from None
    if not isinstance(header, dict):
        raise _bad(f"Expected a JSON object as the request. Received: {_json_kind(header)}")
    return header, memoryview(body)[n:]


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words, with a short excerpt: ``an array [1, 2]``."""
    kind = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
    return kind if value is None else f"{kind} {json.dumps(value)[:40]}"


def _not_json(body: bytes, header_length: str | None, exc: Exception) -> str:
    """Why a body is not a JSON request, saying what it looks like instead."""
    expected = "Expected the request body to be a JSON object (an inference request)"
    if header_length is not None:
        expected = f"Expected the body's first {header_length} bytes ({HEADER}) to be a JSON object"
    if not body:
        return f"{expected}. Received: an empty body"
    if body[:2] == b"\x1f\x8b":
        return (f"{expected}; a gzip-compressed body needs the header 'Content-Encoding: gzip'. "
                f"Received: gzip data without it")
    if header_length is None and body[:1] == b"{":
        # a JSON object followed by other bytes: binary tensors without their header length?
        try:
            head, end = json.JSONDecoder().raw_decode(body.decode("latin-1"))  # 1 char per byte
        except ValueError:
            head, end = None, 0
        if isinstance(head, dict) and end < len(body):
            return (f"{expected}, or a JSON header followed by binary tensor data with the header "
                    f"'{HEADER}'. Received: {len(body) - end} bytes after a {end}-byte JSON object "
                    f"and no {HEADER} header")
    first = " ".join(str(exc).split())[:160]
    if "number is infinity" in first:  # orjson: a literal beyond the double range, like 1e400
        return f"{expected} whose numbers fit FP64. Received: a number out of that range ({first})"
    return f"{expected}. Received invalid JSON ({first}), starting {bytes(body[:24])!r}"


def _float_values(label: str, raw: np.ndarray, datatype: str, np_dtype: np.dtype) -> np.ndarray:
    """``raw`` (numbers from JSON) as ``np_dtype``; 400 for a value the datatype cannot hold.

    A finite number that would become infinite in the datatype (1e300 as FP32,
    70000 as FP16) is out of range: refused rather than served as Infinity (whose
    outputs JSON could not carry either). Magnitudes too small to represent become
    zero, as rounding does.
    """
    if raw.dtype.kind == "O":  # Python ints beyond int64 (numpy keeps them as objects)
        try:
            raw = np.array(raw.tolist(), dtype=np.float64)
        except OverflowError:
            raw = np.array([float("inf")])  # beyond even FP64: reported below
    with np.errstate(over="ignore", invalid="ignore"):
        cast = raw.astype(np_dtype)
    overflow = ~np.isfinite(cast) & ~np.isnan(raw.astype(np.float64, copy=False))
    if overflow.any():
        limit = float(np.finfo(np_dtype).max)
        shown = raw.reshape(-1)[np.argmax(overflow.reshape(-1))]
        raise _bad(f"Expected {datatype} values within +-{limit:.8g} for {label}. "
                   f"Received: {float(shown):g} ({int(overflow.sum())} value(s) out of range)")
    return cast


def _tensor_from_json(label: str, data: Any, datatype: str, shape: list[int]) -> Tensor:
    torch_dtype, np_dtype = DATATYPES[datatype]
    if not isinstance(data, list):
        data = [data]
    try:
        raw = np.array(data)
    except (ValueError, OverflowError) as exc:
        received = ("nested lists of different lengths" if "inhomogeneous" in str(exc)
                    else " ".join(str(exc).split())[:120])
        raise _bad(f"Expected {label} data as a flat or evenly nested list of numbers (row-major). "
                   f"Received: {received}") from None
    kind = raw.dtype.kind
    count = math.prod(shape)
    if raw.size != count:
        raise _bad(f"Expected {count} elements for {label} of shape {shape}. Received: {raw.size}")
    if raw.size:
        if datatype == "BOOL":
            ok = kind == "b"
        elif datatype.startswith(("INT", "UINT")):
            ok = kind in "iu"
            if not ok and kind in "fO":
                # numpy turns ints beyond int64 (UINT64's upper half) into floats or objects
                values = np.array(data, dtype=object).reshape(-1)
                ok = all(type(v) is int for v in values)
                if ok:
                    raw = np.array(values.tolist(), dtype=object)
            if ok:
                info = np.iinfo(np_dtype)
                low, high = raw.min(), raw.max()
                if low < info.min or high > info.max:
                    raise _bad(f"Expected {datatype} values in [{info.min}, {info.max}] for {label}. "
                               f"Received: values in [{low}, {high}]")
        else:
            ok = kind in "iuf" or (kind == "O" and _all_numbers(raw))
        if not ok:
            want = {"BOOL": "true/false"}.get(datatype, "integers" if "INT" in datatype else "numbers")
            raise _bad(f"Expected {want} for {label} of datatype {datatype}. "
                       f"Received: {_first_offender(data, datatype)}")
    native = np_dtype.newbyteorder("=")
    if native.kind == "f":
        arr = _float_values(label, raw, datatype, native).reshape(shape)
    else:
        arr = raw.astype(native, copy=False).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(arr)).to(torch_dtype)


def _first_offender(data: list[Any], datatype: str) -> str:
    """The first element of ``data`` (nested lists, row-major) that ``datatype`` cannot hold, as JSON."""
    if datatype == "BOOL":
        def fits(v: Any) -> bool:
            return type(v) is bool
    elif "INT" in datatype:
        def fits(v: Any) -> bool:
            return type(v) is int
    else:
        def fits(v: Any) -> bool:
            return type(v) in (int, float)
    stack, index = [iter(data)], 0
    while stack:
        value = next(stack[-1], stack)
        if value is stack:
            stack.pop()
        elif isinstance(value, list):
            stack.append(iter(value))
        elif not fits(value):
            return f"{json.dumps(value)[:40]} at element {index}"
        else:
            index += 1
    return "elements of another type"


def _all_numbers(raw: np.ndarray) -> bool:
    return all(type(v) in (int, float) for v in raw.reshape(-1).tolist())


def _tensor_from_bytes(label: str, blob: memoryview, datatype: str, shape: list[int]) -> Tensor:
    torch_dtype, np_dtype = DATATYPES[datatype]
    want = math.prod(shape) * np_dtype.itemsize
    if len(blob) != want:
        raise _bad(f"Expected {want} bytes for {label} ({datatype} of shape {shape}). "
                   f"Received: binary_data_size={len(blob)}")
    arr = np.frombuffer(bytearray(blob), dtype=np_dtype)
    if datatype == "BOOL":
        arr = arr.view(np.uint8) != 0
    elif not np_dtype.isnative:
        arr = arr.astype(np_dtype.newbyteorder("="))
    return torch.from_numpy(arr.reshape(shape)).to(torch_dtype)


def _check_shape(label: str, shape: Any) -> list[int]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in shape):
        raise _bad(f"Expected {label} shape as a list of non-negative integers. Received: {shape!r}")
    return shape


def decode_infer_request(body: bytes, header_length: str | None, model: ServedModel) -> InferRequest:
    """Decode and validate an inference request for ``model`` (raises `ProtocolError`)."""
    header, binary = split_body(body, header_length)
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise _bad("Expected 'inputs' as a non-empty list of tensors. "
                   f"Received: {json.dumps(inputs)[:80] if inputs is not None else 'no inputs'}")
    params = header.get("parameters") or {}
    if not isinstance(params, dict):
        raise _bad(f"Expected request 'parameters' as an object. Received: {_json_kind(params)}")
    specs = {t.name: t for t in model.inputs}
    by_name: dict[str, Tensor] = {}
    offset = 0
    for i, item in enumerate(inputs):
        if not isinstance(item, dict):
            raise _bad(f"Expected inputs[{i}] as an object. Received: {_json_kind(item)}")
        name = item.get("name")
        if not isinstance(name, str):
            raise _bad(f"Expected inputs[{i}].name as a string. Received: {name!r}")
        spec = specs.get(name)
        if spec is None:
            raise _bad(f"Expected inputs named {sorted(specs)} for model {model.name!r}. Received: {name!r}")
        if name in by_name:
            raise _bad(f"Expected each input once. Received: {name!r} twice")
        datatype = item.get("datatype")
        if datatype not in DATATYPES:
            raise _bad(f"Expected input {name!r} datatype among {sorted(DATATYPES)}. Received: {datatype!r}")
        if datatype != spec.datatype:
            raise _bad(f"Expected datatype {spec.datatype} for input {name!r}. Received: {datatype}")
        shape = _check_shape(f"input {name!r}", item.get("shape"))
        if len(shape) != len(spec.shape) or any(w not in (-1, d) for w, d in zip(spec.shape, shape)):
            raise _bad(f"Expected input {name!r} of shape {list(spec.shape)} (-1: any). Received: {shape}")
        if shape[0] < 1:
            raise _bad(f"Expected at least one row (dim 0) in input {name!r}. Received: shape {shape}")
        if spec.max_shape is not None:
            _check_max_shape(spec, shape)
        tensor, offset = decode_tensor(item, binary, offset, "input")
        if spec.value_range is not None:
            _check_values(spec, tensor)
        by_name[name] = tensor
    if offset != len(binary):
        raise _bad(f"Expected {offset} bytes of binary input data after the JSON header. "
                   f"Received: {len(binary)}")
    missing = [n for n in specs if n not in by_name]
    if missing:
        raise _bad(f"Expected inputs {sorted(specs)} for model {model.name!r}. Received no {missing}")
    rows = {t.shape[0] for t in by_name.values()}
    if len(rows) > 1:
        raise _bad(f"Expected every input to have the same batch size (dim 0). Received: {sorted(rows)}")

    default_binary = params.get("binary_data_output", False)
    if not isinstance(default_binary, bool):
        raise _bad(f"Expected binary_data_output as true/false. Received: {default_binary!r}")
    out_names = [t.name for t in model.outputs]
    requested = header.get("outputs")
    outputs: list[tuple[str, bool]]
    classification: dict[str, int] = {}
    if requested is None:
        outputs = [(n, default_binary) for n in out_names]
    else:
        if not isinstance(requested, list):
            raise _bad(f"Expected 'outputs' as a list. Received: {_json_kind(requested)}")
        outputs = []
        for j, out in enumerate(requested):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise _bad(f"Expected outputs[{j}] as an object with a name. Received: {out!r}"[:200])
            if out["name"] not in out_names:
                raise _bad(f"Expected outputs among {out_names}. Received: {out['name']!r}")
            oparams = out.get("parameters") or {}
            if not isinstance(oparams, dict):
                raise _bad(f"Expected output {out['name']!r} parameters as an object. Received: {oparams!r}")
            as_binary = oparams.get("binary_data", default_binary)
            if not isinstance(as_binary, bool):
                raise _bad(f"Expected binary_data as true/false. Received: {as_binary!r}")
            if "classification" in oparams:
                classification[out["name"]] = _classification_count(model, out["name"], oparams["classification"])
            outputs.append((out["name"], as_binary))
    timeout = params.get("timeout")
    if timeout is not None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise _bad(f"Expected parameter timeout as non-negative microseconds. Received: {timeout!r}")
        timeout = timeout / 1e6
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise _bad(f"Expected 'id' as a string. Received: {_json_kind(request_id)}")
    ordered = tuple(by_name[t.name] for t in model.inputs)
    return InferRequest(request_id, ordered, outputs, timeout, classification)


def _check_max_shape(spec: TensorSpec, shape: list[int]) -> None:
    """400 for a request dim beyond the input's largest size (a language model's context)."""
    assert spec.max_shape is not None
    for d, (most, size) in enumerate(zip(spec.max_shape, shape)):
        if most != DYNAMIC and size > most:
            raise _bad(f"Expected input {spec.name!r} of shape {list(spec.shape)} with at most {most} at dim {d} "
                       f"(the longest the model takes). Received: {shape}")


def _check_values(spec: TensorSpec, tensor: Tensor) -> None:
    """400 for indices the model has no row for (an embedding's), before they reach a shared batch."""
    assert spec.value_range is not None
    if not tensor.numel():
        return
    low, high = spec.value_range
    least, most = (int(v) for v in torch.aminmax(tensor))
    if least < low or most >= high:
        raise _bad(f"Expected input {spec.name!r} values in [{low}, {high}) (indices into the model's {high - low} "
                   f"embeddings, e.g. token ids). Received: values in [{least}, {most}]")


def _classification_count(model: ServedModel, name: str, count: Any) -> int:
    """The classification extension's count for output ``name``: a positive integer, at most the
    output's classes, on an output of shape [batch, classes]."""
    spec = next(t for t in model.outputs if t.name == name)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise _bad(f"Expected the classification parameter of output {name!r} as a positive integer (how many "
                   f"top classes). Received: {count!r}")
    if len(spec.shape) != 2:
        raise _bad(f"Expected classification on an output of shape [batch, classes]. Received: output {name!r} "
                   f"of shape {list(spec.shape)}")
    classes = spec.shape[1]
    if classes >= 0 and count > classes:
        raise _bad(f"Expected a classification count of at most {classes} (the classes of output {name!r}). "
                   f"Received: {count}")
    return count


# --------------------------------------------------------------------------- tensors on the wire


class NonFiniteError(ValueError):
    """A tensor with NaN or Infinity cannot be sent as JSON (JSON numbers are finite).

    ``found`` says what it holds ("2 NaN, 1 +Infinity"), ``size`` its element count.
    """

    def __init__(self, name: str, arr: np.ndarray):
        flat = arr.reshape(-1)
        counts = {"NaN": int(np.isnan(flat).sum()), "+Infinity": int(np.isposinf(flat).sum()),
                  "-Infinity": int(np.isneginf(flat).sum())}
        self.name = name
        self.found = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        self.size = int(flat.size)
        super().__init__(f"Expected finite values in tensor {name!r} to send it as JSON (JSON numbers "
                         f"cannot be NaN or Infinity). Received: {self.found} among {self.size} values; "
                         f"send it as binary (the binary tensor data extension carries them)")


def encode_tensor(name: str, value: Tensor | np.ndarray, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    """One tensor as the protocol sends it, in a request's inputs or a response's outputs.

    Returns its JSON entry (``name``, ``shape``, ``datatype`` and flat row-major
    ``data``) and None, or with ``binary`` the entry with
    ``parameters.binary_data_size`` and the raw little-endian bytes that follow the
    JSON header. A torch tensor or a numpy array; bfloat16 (no OIP datatype) is sent
    as FP32. Raises `NonFiniteError` for NaN or Infinity in a JSON tensor (JSON
    cannot carry them; binary can).
    """
    if isinstance(value, Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        datatype = datatype_of(t.dtype)
        arr = t.contiguous().numpy()
    else:
        arr = np.asarray(value)
        datatype = datatype_of_array(arr)
    entry: dict[str, Any] = {"name": name, "shape": list(arr.shape), "datatype": datatype}
    if not binary:
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise NonFiniteError(name, arr)
        entry["data"] = arr.reshape(-1).tolist()
        return entry, None
    blob = np.ascontiguousarray(arr).astype(DATATYPES[datatype][1], copy=False).tobytes()
    entry["parameters"] = {"binary_data_size": len(blob)}
    return entry, blob


def decode_tensor(entry: dict[str, Any], binary: memoryview, offset: int,
                  kind: str = "output") -> tuple[Any, int]:
    """The tensor of one JSON entry: inline ``data``, or ``binary_data_size`` bytes at ``offset``.

    An output of datatype BYTES (the classification extension's) comes back as a numpy
    array of ``str`` of its shape; inputs are tensors of the numeric datatypes only.

    Returns it and the offset of the next binary tensor; raises `ProtocolError`
    whose message names the tensor as ``kind`` (input / output) and name.
    """
    name = entry.get("name")
    label = f"{kind} {name!r}"
    datatype = entry.get("datatype")
    if datatype == "BYTES" and kind == "output":
        return _strings(label, entry, binary, offset)
    if datatype not in DATATYPES:
        raise _bad(f"Expected {label} datatype among {sorted(DATATYPES)}. Received: {datatype!r}")
    shape = _check_shape(label, entry.get("shape"))
    params = entry.get("parameters") or {}
    if not isinstance(params, dict):
        raise _bad(f"Expected {label} parameters as an object. Received: {_json_kind(params)}")
    size = params.get("binary_data_size")
    if size is None:
        if "data" not in entry:
            raise _bad(f"Expected 'data' (or binary_data_size) for {label}. Received: neither")
        return _tensor_from_json(label, entry["data"], datatype, shape), offset
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _bad(f"Expected binary_data_size of {label} as a non-negative integer. Received: {size!r}")
    if "data" in entry:
        raise _bad(f"Expected either 'data' or binary_data_size for {label}. Received: both")
    if offset + size > len(binary):
        raise _bad(f"Expected {offset + size} bytes of binary data after the JSON header. Received: {len(binary)}")
    return _tensor_from_bytes(label, binary[offset:offset + size], datatype, shape), offset + size


def _strings(label: str, entry: dict[str, Any], binary: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """A BYTES output: inline ``data`` strings, or length-prefixed elements in the binary data."""
    shape = _check_shape(label, entry.get("shape"))
    count = math.prod(shape)
    size = (entry.get("parameters") or {}).get("binary_data_size")
    if size is None:
        data = entry.get("data")
        if not isinstance(data, list) or len(data) != count or not all(isinstance(v, str) for v in data):
            raise _bad(f"Expected {count} strings as the data of {label}. Received: {str(data)[:80]}")
        values, after = data, offset
    else:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
            raise _bad(f"Expected binary_data_size of {label} within the binary data. Received: {size!r}")
        values, after = _strings_from_bytes(label, bytes(binary[offset:offset + size]), count), offset + size
    array = np.empty(count, dtype=object)
    array[:] = values
    return array.reshape(shape), after


def encode_classification(name: str, value: Tensor, count: int, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    """Output ``name`` as the classification extension returns it: BYTES of shape [batch, count],
    each ``"<value>:<index>"`` of the ``count`` highest values of its row, highest first (compared
    in the output's own datatype; the value written as numpy prints it, shortest round trip)."""
    t = value.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    if t.dim() != 2:  # the model's answer does not match its own metadata
        raise ProtocolError(f"Expected output {name!r} of shape [batch, classes] for a classification. "
                            f"Received: {list(t.shape)}", 500)
    if count > t.shape[1]:  # the request's count, checkable only now where the metadata says -1 classes
        raise _bad(f"Expected a classification count of at most {t.shape[1]} (the classes of output {name!r}). "
                   f"Received: {count}")
    top, index = torch.topk(t, count, dim=1)
    labels = [f"{v!s}:{i}" for v, i in zip(top.numpy().reshape(-1), index.reshape(-1).tolist())]
    entry: dict[str, Any] = {"name": name, "shape": [t.shape[0], count], "datatype": "BYTES"}
    if not binary:
        entry["data"] = labels
        return entry, None
    blob = b"".join(len(b).to_bytes(4, "little") + b for b in (label.encode() for label in labels))
    entry["parameters"] = {"binary_data_size": len(blob)}
    return entry, blob


def _strings_from_bytes(label: str, raw: bytes, count: int) -> list[str]:
    """``count`` BYTES elements of the binary extension: each a 4-byte little-endian length, then its bytes."""
    out, at = [], 0
    for _ in range(count):
        if at + 4 > len(raw):
            raise _bad(f"Expected {count} length-prefixed elements in the binary data of {label}. Received: "
                       f"{len(out)} before its {len(raw)} bytes ran out")
        size = int.from_bytes(raw[at:at + 4], "little")
        if at + 4 + size > len(raw):
            raise _bad(f"Expected {size} bytes for element {len(out)} of {label}. Received: {len(raw) - at - 4}")
        out.append(raw[at + 4:at + 4 + size].decode("utf-8", errors="replace"))
        at += 4 + size
    return out


def _message(header: dict[str, Any], blobs: list[bytes | None]) -> tuple[bytes, dict[str, str]]:
    """A request or response body: the JSON header, then its binary tensors in order; and its HTTP headers."""
    head = _dumps(header)
    raw = [b for b in blobs if b is not None]
    if not raw:
        return head, {"content-type": "application/json"}
    return b"".join([head, *raw]), {"content-type": "application/octet-stream", HEADER: str(len(head))}


# --------------------------------------------------------------------------- responses


def encode_infer_response(model: ServedModel, request: InferRequest, result: Any) -> tuple[bytes, dict[str, str]]:
    """Encode ``result`` (the model's rows for this request) as a response body + headers."""
    outs = (result,) if isinstance(result, Tensor) else tuple(result)
    if len(outs) != len(model.outputs):
        raise ProtocolError(f"Model {model.name!r} returned {len(outs)} outputs; expected {len(model.outputs)}", 500)
    by_name = {spec.name: t for spec, t in zip(model.outputs, outs)}
    items, blobs = [], []
    for name, as_binary in request.outputs:
        if name in request.classification:
            entry, blob = encode_classification(name, by_name[name], request.classification[name], as_binary)
            items.append(entry)
            blobs.append(blob)
            continue
        try:
            entry, blob = encode_tensor(name, by_name[name], as_binary)
        except NonFiniteError as exc:
            # the model's answer is not wrong, but JSON cannot carry it: never send null instead
            raise ProtocolError(
                f"Expected finite values in output {name!r} of model {model.name!r} to answer in JSON "
                f"(JSON numbers cannot be NaN or Infinity). Received: {exc.found} among {exc.size} "
                f"values; ask for binary outputs (\"binary_data_output\": true) to receive them", 500,
            ) from None
        items.append(entry)
        blobs.append(blob)
    response: dict[str, Any] = {"model_name": model.name, "model_version": model.version, "outputs": items}
    if request.id is not None:
        response["id"] = request.id
    return _message(response, blobs)


# --------------------------------------------------------------------------- the client side


def encode_request(inputs: Mapping[str, Tensor | np.ndarray], *, binary: bool = False,
                   binary_output: bool = False, request_id: str | None = None,
                   outputs: Sequence[str] | None = None,
                   timeout_us: int | None = None) -> tuple[bytes, dict[str, str]]:
    """Client side: an inference request body + headers for ``inputs`` (torch tensors or numpy arrays).

    ``binary`` sends the inputs with the binary tensor data extension,
    ``binary_output`` asks for binary outputs, ``timeout_us`` is the request's
    ``timeout`` parameter. Used by the tests and by ``partrain loadtest``.
    """
    items, blobs = [], []
    for name, value in inputs.items():
        entry, blob = encode_tensor(name, value, binary)
        items.append(entry)
        blobs.append(blob)
    request: dict[str, Any] = {"inputs": items}
    if request_id is not None:
        request["id"] = request_id
    params: dict[str, Any] = {}
    if binary_output:
        params["binary_data_output"] = True
    if timeout_us is not None:
        params["timeout"] = timeout_us
    if params:
        request["parameters"] = params
    if outputs is not None:
        request["outputs"] = [{"name": n, "parameters": {"binary_data": binary_output}} for n in outputs]
    return _message(request, blobs)


@dataclass
class InferResponse:
    """A decoded inference response: the echoed request ``id`` and the output tensors by name."""

    id: str | None
    model_name: str | None
    outputs: dict[str, Any]  # Tensor; a numpy array of str for a BYTES output (classification)


def decode_infer_response(body: bytes, header_length: str | None = None) -> InferResponse:
    """Client side: decode an inference response (JSON or binary outputs); raises `ProtocolError`.

    An ``{"error": ...}`` body raises `ProtocolError` with that message.
    """
    header, binary = split_body(body, header_length)
    if "error" in header:
        raise ProtocolError(str(header["error"]), 500)
    items = header.get("outputs")
    if not isinstance(items, list):
        raise _bad(f"Expected 'outputs' as a list in the response. Received: {str(items)[:80]}")
    outputs: dict[str, Any] = {}
    offset = 0
    for entry in items:
        if not isinstance(entry, dict):
            raise _bad(f"Expected each output as an object. Received: {_json_kind(entry)}")
        outputs[str(entry.get("name"))], offset = decode_tensor(entry, binary, offset)
    request_id = header.get("id")
    name = header.get("model_name")
    return InferResponse(None if request_id is None else str(request_id),
                         None if name is None else str(name), outputs)


def decode_response(body: bytes, header_length: str | None = None) -> dict[str, Tensor]:
    """Client side: the output tensors of an inference response (JSON or binary), by name."""
    return decode_infer_response(body, header_length).outputs
