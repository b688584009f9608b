"""Load generator for Open Inference Protocol v2 servers (``partrain loadtest``).

It sends ``POST {url}/v2/models/{model}/infer`` requests, JSON or with the binary
tensor data extension, and measures what a client sees: throughput, latency
percentiles, errors by kind. It also checks the two things a batching server can
get wrong without anyone noticing: every request gets exactly one answer (the
answer echoes the request's ``id``), and the answer is right (each request's
input is run through a local copy of the model and compared).

Vocabulary:

- *closed loop*: ``concurrency`` clients, each sends its next request when the
  previous one is answered (the load adapts to the server's speed).
- *open loop*: requests arrive at ``rate`` per second whatever the server does
  (Poisson or evenly spaced arrivals); latency counts from the scheduled arrival,
  so a slow server cannot hide its queueing delay (no coordinated omission).
- *sample*: one input, a dict ``{input name: array}`` with a leading batch
  dimension of 1. Requests cycle through a pool of samples so the reference
  model runs once per sample, not once per request.

One module per job, in the order a run uses them: `config` (what to run and
against which URL), `target` (the model's metadata), `inputs` (the samples),
`wire` (request bodies and answers, through the one OIP codec in
`partrain.serve.protocol`), `client` (HTTP connections), `runner` (closed and
open loop, timing, one outcome per request), `checking` (answers vs a local
model) and `report` (figures and text). `generate` loads a generative model's
``/generate_stream`` route with the same loops and connections, and times each token.
"""

from __future__ import annotations

from ..protocol import TensorSpec
from .checking import AnswerChecker, GreedyChecker, load_reference_model
from .client import ConnectionPool
from .config import LoadConfig, parse_target
from .generate import GenerateSettings, Prompt, prepare_generate, run_generate, run_generate_async
from .inputs import concrete_shape, npz_inputs, random_inputs
from .report import GenerateReport, LoadReport
from .runner import prepare, run_load, run_load_async
from .target import ModelInfo, fetch_model_info, parse_metadata
from .wire import RequestEncoder, read_answer

__all__ = [
    "AnswerChecker",
    "ConnectionPool",
    "GenerateReport",
    "GenerateSettings",
    "GreedyChecker",
    "LoadConfig",
    "LoadReport",
    "ModelInfo",
    "Prompt",
    "RequestEncoder",
    "TensorSpec",
    "concrete_shape",
    "fetch_model_info",
    "load_reference_model",
    "npz_inputs",
    "parse_metadata",
    "parse_target",
    "prepare",
    "prepare_generate",
    "random_inputs",
    "read_answer",
    "run_generate",
    "run_generate_async",
    "run_load",
    "run_load_async",
]
