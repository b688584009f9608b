"""partrain's CUDA code paths against references computed on the CPU.

How to run: on a machine with CUDA, ``python -m pytest -q tests/gpu`` (from the repository
root; about a minute on one H100). Without CUDA every test is skipped, with the reason.
``PARTRAIN_TEST_DEVICE=cpu python -m pytest -q tests/gpu`` lifts the skip and runs the same
bodies with the CPU as "the device": a dry run of the tests themselves (the references
still hold; assertions that only mean something on CUDA, such as a tensor's device type or
pinned memory, follow `DEVICE`).

Why: the rest of the suite runs on CPU-only CI, so every ``if device.type == "cuda"`` branch
(pinned memory and non-blocking copies, DDP's ``device_ids``, gloo collectives on CUDA
tensors, CUDA graphs under ``compile=True``, a served model's copies in and out, ...) is
otherwise never executed. Each test runs one user-facing API on the device and compares
with an independent reference on the CPU. Where to start reading: the training loop
(`test_fit_on_the_device_equals_a_hand_written_cpu_loop`), then one section per capability:
input pipeline, population, serving, placement, SyncBatchNorm and allreduce (two ranks
sharing one GPU through gloo: NCCL cannot put two ranks on one GPU), launch, online training
on a stream, RL.

Precision: everything runs in float64, so TensorFloat-32 (which only touches float32
matrix products and convolutions) plays no part. The device's kernels (cuBLAS, cuDNN,
Triton) add the same numbers in another order than the CPU's: in float64 that is about
1e-16 relative per operation and stays near 1e-14 over these few steps with momentum, so
`F64_ATOL` = 1e-10 (see `tests.helpers`) leaves a margin of about 10^4, while a real fault
(a batch lost or reordered, a copy read before it landed, a rank left out of a sum) moves
the results by 1e-4 or more. `fit`'s accuracies and counts are compared exactly, as in the CPU
tests (an argmax flips only between logits within rounding of each other).

Races: a copy between host and device that is read before it has landed gives wrong
numbers only when the device lags behind the host. `keep_device_busy` queues some
milliseconds of device work (``torch.cuda._sleep``, a kernel that spins) before such
copies, so a missing synchronisation shows up every time instead of now and then. It
waits for nothing on the host: it is the opposite of a sleep used as synchronisation.
"""

from __future__ import annotations

import copy
import functools
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import partrain
from partrain.data import Generated, LoaderSettings
from partrain.data.generated import GeneratedSampler
from partrain.data.pipeline import Feeder, ThreadBatches
from partrain.data.sharding import ShardedBatchSampler
from partrain.env import DistEnv, pick_device
from partrain.errors import UsageError, WorkerError
from partrain.launch import check_arguments
from partrain.models import cnn
from partrain.nn import SyncBatchNorm, convert_sync_batchnorm, place
from partrain.population import Population
from partrain.train.fit import fit
from tests.helpers import (
    F64_ATOL,
    assert_history_matches,
    assert_states_close,
    digits64,
    sgd,
    small_cnn64,
    small_mlp64,
    torch_threads,
    train_by_hand,
)
from tests.nn.test_placement import model64
from tests.nn.test_sync_batchnorm import (
    check_case,
    close,
    ddp_data,
    ddp_model,
    make_cases,
    reference_ddp,
    train_case,
)
from tests.population.test_population import CASES, SEED, batches, ref_step, reference
from tests.population.test_population import small_cnn as member_cnn
from tests.waiting import wait_until

#: the device under test: cuda:0, or what $PARTRAIN_TEST_DEVICE names (``cpu`` for a dry run)
DEVICE = torch.device(os.environ.get("PARTRAIN_TEST_DEVICE") or "cuda:0")
ON_CUDA = DEVICE.type == "cuda"
#: what a launch of 2 workers is given: "cuda" puts rank r on cuda:(r % GPUs), both on cuda:0 with one
LAUNCH_DEVICE = "cuda" if ON_CUDA else DEVICE.type

if ON_CUDA and not torch.cuda.is_available():  # one skip line for the module, not one per test
    pytest.skip("needs CUDA (torch.cuda.is_available() is False); PARTRAIN_TEST_DEVICE=cpu runs these tests "
                "on the CPU", allow_module_level=True)
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
#: spin cycles `keep_device_busy` queues: about 25 ms at an H100's ~2 GHz
BUSY_CYCLES = 50_000_000


def keep_device_busy() -> None:
    """Queue device work ahead of what follows, so the host runs ahead of the device (see the
    module docstring: a copy read before it lands then shows every time). Nothing on the CPU."""
    if ON_CUDA:
        torch.cuda._sleep(BUSY_CYCLES)


def to_cpu(obj):
    """Every tensor of a nested result on the CPU (what a worker sends back)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# ----- the training loop: fit on the device (src/partrain/train/loop.py, compiling.py) ----------

GLOBAL_BATCH = 96
FULL_BATCHES = 14  # 1437 = 14 * 96 + 93: drop_last keeps the 14 full batches of the epoch
#: compile=True on CUDA is inductor with CUDA graphs (mode "reduce-overhead"); the CPU dry run
#: takes the cheap aot_eager backend instead (the check there is the test, not inductor's C++)
COMPILE: bool | str = True if ON_CUDA else "aot_eager"
ONE_PROCESS = dict(batch_size=GLOBAL_BATCH, epochs=1, drop_last=True, quiet=True, timeout=60, threads=1,
                   device=str(DEVICE))


@functools.cache
def mlp_by_hand():
    """The reference: plain PyTorch on the CPU, the epoch's 14 full batches of 96."""
    return train_by_hand(small_mlp64, digits64, sgd, batch=GLOBAL_BATCH, epochs=1, max_steps=FULL_BATCHES)


def digits64_train_only():
    """`digits64` without a test set: a compiled forward then never compiles an evaluation too."""
    return digits64()[0], None


@pytest.mark.parametrize("data_on_device", [False, True], ids=["loader", "data_on_device"])
def test_fit_on_the_device_equals_a_hand_written_cpu_loop(data_on_device):
    """One process on the device: parameters and every figure of the epoch (train and test loss and
    accuracy, evaluated on the device) equal the CPU loop's; with the training set resident on the
    device too (batches gathered there)."""
    state, history = mlp_by_hand()
    result = fit(small_mlp64, digits64, sgd, data_on_device=data_on_device, **ONE_PROCESS)
    assert result.final["step"] == FULL_BATCHES
    assert result.final["loader"] == ("device" if data_on_device else "inline")
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


@pytest.mark.parametrize("data_on_device", [True, False], ids=["fused_step", "compiled_forward"])
def test_compiled_fit_on_the_device_equals_a_hand_written_cpu_loop(data_on_device, capfd):
    """``compile=True`` (on CUDA: inductor with CUDA graphs): the whole step as one compiled call
    with the data on the device, or the forward compiled alone. It must be compiled indeed (a
    failing compiler falls back to eager with one line, which would pass unnoticed: the line is
    in the failure message) and train as the CPU loop does."""
    from torch._dynamo.utils import counters

    state, history = mlp_by_hand()
    data = digits64 if data_on_device else digits64_train_only
    skipped = counters["inductor"]["cudagraph_skips"]
    result = fit(small_mlp64, data, sgd, data_on_device=data_on_device, compile=COMPILE,
                 **{**ONE_PROCESS, "quiet": False})
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("partrain:")]
    assert result.final.get("compiled") == ("step" if data_on_device else "forward"), said
    if ON_CUDA and data_on_device:
        # the fused step writes its inputs in place (parameters, momentum, sums): marked as fixed
        # addresses, CUDA graphs take them; unmarked, inductor skips the graphs with a warning
        assert counters["inductor"]["cudagraph_skips"] == skipped, "the fused step ran without CUDA graphs"
    assert result.final["step"] == FULL_BATCHES
    if data_on_device:
        assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


# ----- the input pipeline's transfer to the device (src/partrain/data/pipeline.py, generated.py) --

N = 53  # odd: the last global batch splits unevenly between 2 replicas
X_ALL = torch.stack([torch.arange(N, dtype=torch.float64), -torch.arange(N, dtype=torch.float64)], 1)
Y_ALL = torch.arange(N)


class Indexed(Dataset):
    """Sample i is ([i, -i], i), read one by one (not a TensorDataset): a batch says what it holds."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return X_ALL[i], int(Y_ALL[i])


def generated_batches(epoch: int, rank: int, workers: int):
    """A batch generator (`Generated`): 6 batches of 4 per rank, the ranks' interleaved."""
    for k in range(6):
        start = 4 * (workers * k + rank)
        yield X_ALL[start:start + 4] * (epoch + 1), Y_ALL[start:start + 4]


def _sampler(rank: int) -> ShardedBatchSampler:
    sampler = ShardedBatchSampler(N, 4, rank, 2, seed=5)
    sampler.set_epoch(3)
    return sampler


PIPELINES = {  # name: (loader, dataset, data_on_device)
    "inline_tensors": ("inline", TensorDataset(X_ALL, Y_ALL), False),
    "inline_samples": ("inline", Indexed(), False),
    "threads": ("threads", Indexed(), False),
    "processes": ("processes", Indexed(), False),
    "device_resident": ("auto", TensorDataset(X_ALL, Y_ALL), True),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_loader_hands_the_cpu_batches_to_the_device_in_order(name):
    """The reference is the sampler over the tensors themselves: each rank's batches, in order,
    none lost, none stale, for a whole epoch and for a resumed one (skip). The device is kept busy
    first, so the copies queue behind it while the loader goes on reusing its pinned buffers."""
    loader, ds, on_device = PIPELINES[name]
    feeder = Feeder(ds, DEVICE, LoaderSettings(loader, workers=2, prefetch=2, timeout=60), on_device=on_device)
    for rank, skip in ((0, 0), (1, 0), (1, 3)):
        expected = [(X_ALL[idx], Y_ALL[idx]) for idx in list(_sampler(rank))[skip:]]
        keep_device_busy()
        got = list(feeder.epoch(_sampler(rank), skip=skip))  # held on the device, compared after
        assert len(got) == len(expected), (name, rank, skip)
        for k, ((x, y), (want_x, want_y)) in enumerate(zip(got, expected)):
            assert x.device.type == DEVICE.type and y.device.type == DEVICE.type, (name, k)
            assert torch.equal(x.cpu(), want_x) and torch.equal(y.cpu(), want_y), (name, rank, skip, k)


def test_a_batch_generator_hands_its_batches_to_the_device_in_order():
    feeder = Feeder(Generated(generated_batches, 6), DEVICE, LoaderSettings(timeout=60))
    for rank in (0, 1):
        expected = list(generated_batches(2, rank, 2))[1:]
        sampler = GeneratedSampler(6, rank, 2)
        sampler.set_epoch(2)
        keep_device_busy()
        got = list(feeder.epoch(sampler, skip=1))
        assert len(got) == len(expected) == 5
        for (x, y), (want_x, want_y) in zip(got, expected):
            assert x.device.type == DEVICE.type
            assert torch.equal(x.cpu(), want_x) and torch.equal(y.cpu(), want_y)


def test_loader_threads_pin_host_memory_for_the_device():
    """On CUDA a loader thread's batch is in pinned memory (the non-blocking copy overlaps the step)."""
    batch = ThreadBatches(Indexed(), _sampler(0), DEVICE, None, 0, 1, 1, 60.0)._load([0, 5, 7])
    assert [t.is_pinned() for t in batch] == [ON_CUDA, ON_CUDA]
    assert torch.equal(batch[1], torch.tensor([0, 5, 7]))


def test_inline_gathers_are_staged_in_pinned_buffers_taken_in_turns():
    """The inline loader's gather for in-memory tensors (`PinnedGather`): pinned buffers, two sets
    in turn, a set grown for a bigger batch, and every batch's rows right although the copies queue
    behind device work while the next gathers go on."""
    if not ON_CUDA:
        pytest.skip("pinned memory needs CUDA")
    from partrain.data.pipeline import PinnedGather

    gather = PinnedGather((X_ALL, Y_ALL), DEVICE)
    keep_device_busy()
    sizes = [4, 4, 3, 4, 9, 2, 9, 9]  # smaller, then bigger than the first sets
    indices = [torch.randperm(N)[:k] for k in sizes]
    got = [gather(index) for index in indices]
    for (x, y), index in zip(got, indices):
        assert x.device.type == "cuda" and torch.equal(x.cpu(), X_ALL[index]) and torch.equal(y.cpu(), Y_ALL[index])
    staged = [slot[0] for slot in gather.slots]
    assert all(b.is_pinned() for buffers in staged for b in buffers)
    assert [buffers[0].shape[0] for buffers in staged] == [9, 9]


# ----- Population on the device (src/partrain/population/) --------------------------------------

@pytest.mark.parametrize("engine", ["vmap", "loop", "auto"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_population_on_the_device_equals_torch_optim_on_the_cpu(case, engine):
    """Members stepped on the device (vectorized, one by one, or timed both ways with device
    synchronisation) equal independent CPU modules trained with torch.optim: parameters,
    optimizer state, evaluation."""
    optimizer, nesterov, hp = CASES[case]
    pop = Population(member_cnn, 3, optimizer, hp, engine=engine, seed=SEED, nesterov=nesterov, device=DEVICE)
    refs = reference(member_cnn, 3, optimizer, hp, nesterov)
    for x, y in batches(3, 5):
        losses = pop.step(x.to(DEVICE), y.to(DEVICE))
        assert losses.device.type == DEVICE.type
        ref_step(refs, x, y)
    for i, (model, opt) in enumerate(refs):
        got = pop.member_model(i)
        for (name, a), b in zip(got.named_parameters(), model.parameters()):
            assert a.device.type == DEVICE.type
            torch.testing.assert_close(a.detach().cpu(), b.detach(), atol=F64_ATOL, rtol=0,
                                       msg=lambda m, name=name, i=i: f"member {i} {name}: {m}")
        _, state = pop.member_state(i)
        for k, st in opt.state_dict()["state"].items():
            for key, value in st.items():
                torch.testing.assert_close(state["state"][k][key].cpu(), value, atol=F64_ATOL, rtol=0,
                                           msg=lambda m, k=k, key=key, i=i: f"member {i} {k} {key}: {m}")
    x_test, y_test = batches(1, 1, batch=40, seed=9)[0]
    figures = pop.evaluate(x_test[0], y_test[0])
    with torch.no_grad():
        for i, (model, _) in enumerate(refs):
            out = model.eval()(x_test[0])
            want = torch.nn.functional.cross_entropy(out, y_test[0])
            assert abs(figures["loss"][i].item() - want.item()) < F64_ATOL
            # the same count of correct answers, divided on the device: equal to rounding
            assert abs(figures["accuracy"][i].item() - (out.argmax(1) == y_test[0]).double().mean().item()) < F64_ATOL


# ----- serving (src/partrain/serve/) --------------------------------------------------------------

def digits_net64() -> nn.Module:
    """The same float64 CNN every call (its own seed, the caller's random state untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cnn(width=8).double().eval()


class WhereItRuns(nn.Module):
    """The digits CNN, plus a second output saying whether the batch was on CUDA: what an HTTP
    client sees of where the server ran it."""

    example_input_shape = (1, 8, 8)

    def __init__(self) -> None:
        super().__init__()
        self.net = digits_net64()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x), torch.full((x.shape[0],), float(x.is_cuda), dtype=x.dtype, device=x.device)


def where_it_runs() -> nn.Module:
    """``partrain serve`` factory (``tests.gpu.test_cuda:where_it_runs``)."""
    return WhereItRuns()


def _digits_inputs(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_a_served_model_on_the_device_answers_what_the_cpu_model_does():
    from partrain.serve import ServedModel

    served = ServedModel.from_module("digits", digits_net64(), (1, 8, 8), dtype=torch.float64, device=DEVICE)
    reference_net = digits_net64()
    assert served.inputs[0].datatype == "FP64" and served.outputs[0].shape == (-1, 10)
    for n in (1, 5, 16):
        x = _digits_inputs(n, n)
        keep_device_busy()
        with torch.inference_mode():
            got = served.fn(x)
            want = reference_net(x)
        assert got.device.type == "cpu"  # answers come back to the host for encoding
        torch.testing.assert_close(got, want, atol=F64_ATOL, rtol=0)


def test_a_request_through_the_app_is_answered_by_the_model_on_the_device():
    """End to end in-process (ASGI, no sockets): JSON and the binary tensor extension, both ways."""
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from partrain.serve import ServedModel, create_app
    from partrain.serve.protocol import HEADER, decode_response, encode_request
    from tests.serve.conftest import TestClient  # imported there without starlette's httpx warning

    served = ServedModel.from_module("where", WhereItRuns(), (1, 8, 8), dtype=torch.float64, device=DEVICE)
    reference_net = digits_net64()
    with TestClient(create_app([served])) as client:
        meta = client.get("/v2/models/where").json()
        assert [t["datatype"] for t in meta["inputs"] + meta["outputs"]] == ["FP64", "FP64", "FP64"]
        for binary in (False, True):
            x = _digits_inputs(3, int(binary))
            body, headers = encode_request({"input": x}, binary=binary, binary_output=binary)
            r = client.post("/v2/models/where/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            out = decode_response(r.content, r.headers.get(HEADER))
            with torch.inference_mode():
                torch.testing.assert_close(out["output__0"], reference_net(x), atol=F64_ATOL, rtol=0)
            assert out["output__1"].tolist() == [float(ON_CUDA)] * 3


def test_run_server_builds_one_replica_per_visible_gpu(monkeypatch):
    """``run_server(device="cuda")``: one replica per visible GPU, replica i on cuda:i; asking for
    more replicas than GPUs gives one per GPU. With one GPU that is the in-process server on cuda:0
    (checked here up to the point where uvicorn would start); with several it spawns processes,
    which this test does not start."""
    if ON_CUDA and torch.cuda.device_count() > 1:
        pytest.skip("checks the one-GPU layout; this machine has several GPUs")
    pytest.importorskip("starlette")
    from partrain.serve import ServedModel, replicas

    built = []

    def make_models(device=None):
        net = digits_net64()
        served = ServedModel.from_module("digits", net, (1, 8, 8), dtype=torch.float64, device=device)
        built.append((device, next(net.parameters()).device.type))
        return [served]

    apps = []

    async def no_uvicorn(app, sock, *, on_ready=None, graceful_timeout=None):
        apps.append(app)
        sock.close()

    monkeypatch.setattr(replicas, "serve_app", no_uvicorn)
    asked = (1, 3) if ON_CUDA else (1,)  # on the CPU, 3 replicas would be 3 processes
    with torch_threads(torch.get_num_threads()):  # run_server sets the thread count of this process
        for n in asked:
            assert replicas.run_server(make_models, port=0, replicas=n, device=DEVICE.type, threads=1) == 0
    assert built == ([("cuda:0", "cuda")] * len(asked) if ON_CUDA else [(None, "cpu")])
    assert len(apps) == len(asked)


def test_partrain_serve_on_the_device_answers_over_http():
    """``partrain serve MODEL --device cuda`` as a user starts it: the answer is the CPU model's
    and the model ran on CUDA (the second output says where); SIGTERM ends it with status 0."""
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from partrain.serve.protocol import HEADER, decode_response, encode_request
    from tests.serve.test_app import _wait_for_url

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "partrain", "serve", "where=tests.gpu.test_cuda:where_it_runs", "--port", "0",
         "--threads", "1", "--device", DEVICE.type],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )
    try:
        url = _wait_for_url(proc, 120)
        x = _digits_inputs(4, 7)
        body, headers = encode_request({"input": x}, binary=True, binary_output=True)
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v2/models/where/infer", content=body, headers=headers)
        assert r.status_code == 200, r.text
        out = decode_response(r.content, r.headers.get(HEADER))
        with torch.inference_mode():
            torch.testing.assert_close(out["output__0"], digits_net64()(x), atol=F64_ATOL, rtol=0)
        assert out["output__1"].tolist() == [float(ON_CUDA)] * 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ----- placement across the CPU and the device (src/partrain/nn/placement.py) ---------------------

@pytest.mark.parametrize("layout, output_device", [
    (("cpu", "dev"), "cpu"),       # host -> device, and the output back to the host
    (("dev", "cpu"), None),        # device -> host between chunks
    (("dev", "cpu", "dev"), "cpu"),
], ids=["cpu-dev", "dev-cpu", "dev-cpu-dev"])
def test_a_model_placed_on_the_cpu_and_the_device_equals_the_unplaced_one(layout, output_device):
    """Outputs, input and parameter gradients and three SGD steps equal the unplaced CPU model's.
    The device is kept busy before each forward: an activation copied to the host and read before
    the copy has landed would show here."""
    devices = [str(DEVICE) if d == "dev" else "cpu" for d in layout]
    reference_net = model64()
    placed = place(copy.deepcopy(reference_net), "params", devices, output_device=output_device)
    assert [d.type for d, _ in placed.placement] == [torch.device(d).type for d in devices]
    opt_ref = torch.optim.SGD(reference_net.parameters(), lr=0.1, momentum=0.9)
    opt_placed = torch.optim.SGD(placed.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(7, 12, generator=g, dtype=torch.float64)
        x_ref, x_placed = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref = reference_net(x_ref)
        keep_device_busy()
        out_placed = placed(x_placed)
        assert out_placed.device.type == torch.device(output_device or devices[-1]).type
        torch.testing.assert_close(out_placed.cpu(), out_ref, atol=F64_ATOL, rtol=0,
                                   msg=lambda m, step=step: f"output, step {step}: {m}")
        for out, opt in ((out_ref, opt_ref), (out_placed, opt_placed)):
            opt.zero_grad()
            out.square().sum().backward()
        torch.testing.assert_close(x_placed.grad, x_ref.grad, atol=F64_ATOL, rtol=0)
        for (name, p), q in zip(placed.named_parameters(), reference_net.parameters()):
            assert p.device == placed.device_of(name.split(".")[0]) and p.grad.device == p.device, name
            torch.testing.assert_close(p.grad.cpu(), q.grad, atol=F64_ATOL, rtol=0,
                                       msg=lambda m, name=name: f"gradient of {name}: {m}")
        opt_ref.step()
        opt_placed.step()
    for (name, p), q in zip(placed.named_parameters(), reference_net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=F64_ATOL, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ----- SyncBatchNorm and allreduce: 2 ranks sharing the device through gloo ------------------------

def _case_on(case: dict, device: torch.device) -> dict:
    moved = dict(case)
    for key in ("xs", "rs"):
        moved[key] = [t.to(device) for t in case[key]]
    for key in ("weight", "bias"):
        moved[key] = case[key].to(device) if case[key] is not None else None
    return moved


def _sync_case_on_device(case: dict, rank: int, device: torch.device) -> dict:
    """`tests.nn.test_sync_batchnorm.run_sync_case` with the layer and the batches on ``device``."""
    sizes = case["sizes"]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    case = _case_on(case, device)
    m = SyncBatchNorm(case["xs"][0].shape[1], **case["kwargs"], dtype=case["xs"][0].dtype, device=device)
    out = train_case(m, case, lo, hi)
    out["eval"] = m(case["xs"][-1][lo:hi])
    out["device"] = out["y"][0].device.type
    return to_cpu(out)


def _ddp_on_device(strategy, accumulate: int) -> dict:
    """`tests.nn.test_sync_batchnorm.run_ddp` with the batches on the strategy's device: DDP with
    ``device_ids`` over gloo, SyncBatchNorm inside, gradient accumulation under no_sync."""
    model = convert_sync_batchnorm(ddp_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = strategy.prepare(model, opt)
    assert all(p.device == strategy.device for p in model.parameters())
    xs, ys = ddp_data()
    for step in range(xs.shape[0]):
        for micro in range(accumulate):
            x = xs[step, micro, strategy.rank].to(strategy.device)
            y = ys[step, micro, strategy.rank].to(strategy.device)
            ctx = strategy.no_sync(model) if micro < accumulate - 1 else torch.enable_grad()
            with ctx:
                (torch.nn.functional.cross_entropy(model(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return to_cpu(strategy.unwrap(model).state_dict())


def _captured(fn, *args):
    """``fn(*args)``, or the traceback of what it raised: one failing case must not hide the
    others (every rank runs the same cases, so a case that raises on one raises on both before
    its next collective)."""
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def two_ranks_on_the_device(strategy, cases):
    """Each rank: the float64 SyncBatchNorm cases through gloo's all-gather (CUDA tensors do not
    go through the shared-memory exchange), the first three again through all-reduces, and DDP."""
    import partrain.nn.sync_batchnorm as sbn

    device = strategy.device
    out = {"device": str(device), "backend": torch.distributed.get_backend(),
           "cases": [_captured(_sync_case_on_device, case, strategy.rank, device) for case in cases]}
    gather_max = sbn._GATHER_MAX_RANKS
    sbn._GATHER_MAX_RANKS = 1  # more gloo ranks than an all-gather pays for: the all-reduce path
    try:
        out["reduce_cases"] = [_captured(_sync_case_on_device, case, strategy.rank, device) for case in cases[:3]]
    finally:
        sbn._GATHER_MAX_RANKS = gather_max
    out["ddp"] = _captured(_ddp_on_device, strategy, 1)
    out["ddp_accumulate"] = _captured(_ddp_on_device, strategy, 2)
    return out


def assert_no_error(result: dict, what: str) -> None:
    assert "error" not in result, f"{what} raised on a rank:\n{result['error']}"


#: the float64 cases of the CPU test (its float32 large-mean case is about CPU kernels' error)
SYNC_CASES = [c for c in make_cases() if not c.get("large")]
#: (results key, case index): every case through the all-gather, the first three through all-reduces
SYNC_PATHS = [("cases", i) for i in range(len(SYNC_CASES))] + [("reduce_cases", i) for i in range(3)]


@pytest.fixture(scope="module")
def two_ranks():
    cases = SYNC_CASES
    try:
        results = partrain.launch(two_ranks_on_the_device, cases, workers=2, device=LAUNCH_DEVICE,
                                  backend="gloo", timeout=60)
    except WorkerError as exc:  # the worker's own traceback, not only its last line
        pytest.fail(f"{exc}\n{exc.traceback}")
    return cases, results


def test_two_ranks_share_the_device_through_gloo(two_ranks):
    _, results = two_ranks
    want = [str(pick_device(rank, LAUNCH_DEVICE)) for rank in range(2)]
    assert [r["device"] for r in results] == want and [r["backend"] for r in results] == ["gloo", "gloo"]
    assert all(case.get("device", DEVICE.type) == DEVICE.type for r in results for case in r["cases"])


@pytest.mark.parametrize("path, index", SYNC_PATHS, ids=[f"{p}-{i}" for p, i in SYNC_PATHS])
def test_sync_batchnorm_on_the_device_equals_batchnorm_on_the_global_batch(two_ranks, path, index):
    """Outputs, input gradients, local weight and bias gradient sums, running statistics and eval
    outputs of 2 ranks on the device equal nn.BatchNorm on the concatenated batch on the CPU
    (2D to 5D, empty and one-sample ranks, affine or not, momentum None, no running stats)."""
    cases, results = two_ranks
    case = cases[index]
    ranks = [r[path][index] for r in results]
    what = f"{path} {index} {tuple(case['xs'][0].shape[1:])} sizes={case['sizes']} {case['kwargs']}"
    for r in ranks:
        assert_no_error(r, what)
    check_case(case, ranks, what)


@pytest.mark.parametrize("key", ["ddp", "ddp_accumulate"])
def test_ddp_with_sync_batchnorm_on_the_device_equals_one_process_on_the_global_batch(two_ranks, key):
    """allreduce's DDP (``device_ids``, bucketed gloo all-reduces of CUDA tensors, the timed hook)
    around SyncBatchNorm, with and without no_sync accumulation: = one CPU process on the global batch."""
    _, results = two_ranks
    ref = reference_ddp(2 if key == "ddp_accumulate" else 1)
    a, b = results[0][key], results[1][key]
    assert_no_error(a, key)
    assert_no_error(b, key)
    assert a.keys() == ref.keys()
    for k in ref:
        assert torch.equal(a[k], b[k]), k
        close(a[k], ref[k], f"{key} {k}")


@functools.cache
def cnn_by_hand():
    """The reference for 2 workers: one CPU process, global batches of 96, the whole epoch (the last
    batch, 93 samples, splits 47 + 46 between the workers)."""
    return train_by_hand(small_cnn64, digits64, sgd, batch=GLOBAL_BATCH, epochs=1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fit_allreduce_with_two_ranks_on_the_device_equals_one_process_on_the_global_batch(accumulate):
    """``fit(strategy="allreduce", workers=2)`` on the device (gloo, both ranks on cuda:0 with one
    GPU): parameters and the epoch's figures (losses summed on the device and all-reduced) equal
    the CPU loop on the global batch; with 2 micro-batches per step, the lr scaled to match."""
    state, history = cnn_by_hand()
    optimizer = sgd if accumulate == 1 else functools.partial(sgd, lr=0.05 / (2 * accumulate))
    result = fit(small_cnn64, digits64, optimizer, strategy="allreduce", workers=2,
                 batch_size=GLOBAL_BATCH // (2 * accumulate), accumulate=accumulate, scale_lr=accumulate > 1,
                 epochs=1, quiet=True, timeout=60, device=LAUNCH_DEVICE, backend="gloo")
    assert result.final["step"] == FULL_BATCHES + 1 and result.final["workers"] == 2
    assert_history_matches(result.history, history)
    assert_states_close(result.model_state, state)


# ----- launch and device selection (src/partrain/env.py, launch.py) --------------------------------

def _auto_device(local_rank: int) -> torch.device:
    """What "auto" must pick, written out: cuda:<local rank> (modulo the GPUs) when CUDA exists."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def where_am_i(strategy):
    current = torch.cuda.current_device() if strategy.device.type == "cuda" else None
    return str(strategy.device), current, strategy.env.local_rank


def test_auto_picks_cuda_at_the_local_rank_and_nccl(monkeypatch):
    """Under torchrun's variables (no process started): the device is cuda:LOCAL_RANK when CUDA
    exists, and the default backend NCCL; an explicit device and backend win."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    env = DistEnv.from_environ()
    assert env.device == _auto_device(1)
    assert env.backend == ("nccl" if torch.cuda.is_available() else "gloo")
    assert DistEnv.from_environ(backend="gloo", device="cpu").device == torch.device("cpu")
    assert pick_device(0) == _auto_device(0)


def test_launched_workers_run_on_the_device_of_their_local_rank():
    """``launch`` with the default device ("auto"): each worker's strategy device is cuda:<local
    rank> and it is the current CUDA device there; one worker runs in this process, on cuda:0."""
    out = partrain.launch(where_am_i, workers=2, backend="gloo", timeout=60)
    want = [_auto_device(rank) for rank in range(2)]
    assert [(d, r) for d, _, r in out] == [(str(w), i) for i, w in enumerate(want)]
    assert [c for _, c, _ in out] == [w.index if w.type == "cuda" else None for w in want]
    [(device, current, _)] = partrain.launch(where_am_i, workers=1, strategy="single")
    assert (device, current) == (str(_auto_device(0)), _auto_device(0).index)


def test_a_gpu_this_machine_lacks_is_one_line_before_any_process_starts(tmp_path, capsys):
    """``--device cuda:N`` with N GPUs (indices 0..N-1): one line, nothing started, exit status 2
    from the command line. Without CUDA the line says none is visible (the CPU-only suite's case)."""
    from partrain.cli import main

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = f"cuda:{count}"
    if count:
        expected = (f"Expected a visible CUDA device for --device {device}. Received: {count} visible "
                    f"(cuda:0 to cuda:{count - 1})")
    else:
        expected = (f"Expected a CUDA device for --device {device}. Received: none visible "
                    "(torch.cuda.is_available() is False)")
    pool = partrain.WorkerPool(4)  # starts its processes at the first job only
    with pytest.raises(UsageError) as info:
        partrain.launch(where_am_i, workers=2, device=device, backend="gloo", timeout=30, pool=pool)
    assert str(info.value) == expected
    assert repr(pool) == "WorkerPool(processes=4, alive=0)"
    code = main(["train", "--quiet", "--epochs", "1", "--workers", "2", "--out", str(tmp_path), "--device", device])
    assert (code, capsys.readouterr().err.splitlines()) == (2, [f"partrain train: error: {expected}"])
    if count:  # what this machine has is accepted: the last GPU by index, one worker on it with NCCL
        check_arguments(1, 30.0, device=f"cuda:{count - 1}", backend="nccl")
        with pytest.raises(UsageError, match="Expected at most 1 worker"):  # NCCL puts no two ranks on one GPU
            check_arguments(2, 30.0, device=f"cuda:{count - 1}", backend="nccl")


# ----- online training on a stream (src/partrain/stream/trainer.py) ------------------------------

def test_online_training_with_the_model_on_the_device_equals_a_plain_cpu_loop_on_the_same_batches():
    """`OnlineTrainer` with its model on the device: items submitted as CPU tensors are moved there;
    each prediction is the model's output before its batch's update, and the final weights are the
    hand-written CPU loop's on the batches the trainer reports (float64)."""
    from partrain.stream import OnlineTrainer, Prediction
    from tests.stream.test_trainer import (
        HoldFirst,
        items,
        mlp64,
        reference_step,
        submit_from_threads,
    )

    model, ref = HoldFirst(mlp64()).to(DEVICE), mlp64()
    records = []
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "mse",
                            max_batch=16, on_step=records.append)
    stream = items(120)
    futures = submit_from_threads(trainer, stream, 2)
    keep_device_busy()
    model.gate.set()  # everything queued behind the first step: the next ones take 16 at a time
    stats = trainer.close()
    assert stats.accepted == stats.predicted == 120 and stats.unresolved == 0

    by_id = {it["id"]: it for it in stream}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for version, record in enumerate(records):
        expected = reference_step(ref, ref_opt, [by_id[i] for i in record.ids])
        assert record.version == version
        for row, item_id in enumerate(record.ids):
            got = futures[item_id].result(0)
            assert isinstance(got, Prediction) and got.version == version
            assert got.output.device == torch.device("cpu")  # prediction_device's default: one copy a batch
            torch.testing.assert_close(got.output, expected[row], atol=F64_ATOL, rtol=0)
    assert_states_close({k: v.cpu() for k, v in model.inner.state_dict().items()}, ref.state_dict())


def test_an_online_step_that_leaves_nothing_waiting_ends_after_its_update_on_the_device():
    """At a low rate the step's record (and its seconds) comes after the device finished the update:
    an optimizer whose step queues ~25 ms of device work after the update shows it, since a record
    sent at the update's launch would find the device still busy."""
    from partrain.stream import OnlineTrainer
    from tests.stream.test_trainer import mlp64

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            out = super().step(closure)
            keep_device_busy()
            return out

    model = mlp64().to(DEVICE)
    done = []
    trainer = OnlineTrainer(model, SlowSGD(model.parameters(), lr=0.1), "mse", on_step=lambda record: done.append(
        torch.cuda.current_stream(DEVICE).query() if ON_CUDA else True))
    for i in range(3):  # one at a time, the next after the last step's record: nothing waits behind a step
        trainer.submit(torch.randn(6, dtype=torch.float64), torch.randn(2, dtype=torch.float64)).result(60)
        wait_until(lambda n=i + 1: len(done) >= n, timeout=60, what="the step's record")
    trainer.close()
    assert done == [True] * 3


def test_online_predictions_stay_on_the_device_when_asked():
    """``prediction_device=None``: the answers are the device's rows, equal to the model's output."""
    from partrain.stream import OnlineTrainer
    from tests.stream.test_trainer import mlp64

    model = mlp64().to(DEVICE)
    x = torch.randn(6, dtype=torch.float64)
    expected = model(x[None].to(DEVICE))[0].detach()
    trainer = OnlineTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse", prediction_device=None)
    got = trainer.predict(x)
    trainer.close()
    assert got.output.device == expected.device
    torch.testing.assert_close(got.output, expected, atol=F64_ATOL, rtol=0)


def test_partrain_stream_on_the_device_trains_as_on_the_cpu(tmp_path, monkeypatch, capsys):
    """``partrain stream --device cuda``: the same JSON-lines items in the same batches of 16 give the
    CPU run's weights (float32, a 3-to-1 linear model: rounding apart), the summary names the device,
    and the checkpoint resumes on it."""
    from partrain.checkpoint import load_checkpoint
    from partrain.cli import main
    from tests.stream.test_cli import FACTORY, write_items

    (tmp_path / "stream_cli_model.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    write_items(tmp_path / "a.jsonl", list(range(160)))
    weights = {}
    for device in ("cpu", DEVICE.type):
        out = f"run-{device}"
        assert main(["stream", "stream_cli_model:build", "--input", "a.jsonl", "--out", out, "--quiet",
                     "--device", device, "--input-shape", "3", "--max-batch", "16", "--min-batch", "16",
                     "--max-wait-ms", "60000"]) == 0
        assert f"model version 10 on {device}" in capsys.readouterr().err
        weights[device] = load_checkpoint(f"{out}/checkpoint.pt")["model"]
    for name, value in weights["cpu"].items():
        torch.testing.assert_close(weights[DEVICE.type][name], value, atol=1e-5, rtol=1e-5)
    write_items(tmp_path / "b.jsonl", list(range(160, 176)))
    assert main(["stream", "stream_cli_model:build", "--input", "b.jsonl", "--out", f"run-{DEVICE.type}", "--quiet",
                 "--device", DEVICE.type, "--resume", "--max-batch", "16", "--min-batch", "16",
                 "--max-wait-ms", "60000"]) == 0
    assert f"model version 11 on {DEVICE.type}" in capsys.readouterr().err


def test_the_stream_benchmark_runs_every_variant_on_the_device(tmp_path, capsys):
    """``partrain bench stream --device cuda`` at toy size: every variant answers every item once
    (its ``stream.lost`` check) with the model on the device."""
    import json

    from partrain.cli import main

    out = tmp_path / "stream.json"
    assert main(["bench", "stream", "--toy", "--device", DEVICE.type, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["checks"]["stream.lost"]["met"] is True
    assert ("on the CPU" in capsys.readouterr().out) is not ON_CUDA


# ----- RL: a learner's update on the device (src/partrain/rl/algorithms.py) -----------------------

def _rl_batch(seed: int, steps: int = 6, envs: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f64 = {"generator": g, "dtype": torch.float64}
    return {"obs": torch.randn(steps + 1, envs, 4, **f64),
            "actions": torch.randint(0, 2, (steps, envs), generator=g),
            "logp": torch.log(torch.rand(steps, envs, **f64) * 0.6 + 0.2),
            "rewards": torch.randn(steps, envs, **f64),
            "dones": (torch.rand(steps, envs, generator=g) < 0.2).double(),
            "versions": torch.zeros(steps, envs, dtype=torch.int64)}


@pytest.mark.parametrize("name", ["vtrace", "ppo"])
def test_an_rl_update_on_the_device_equals_the_cpu_one(name):
    """Three updates of ActorCritic with the learner's optimizer (fused Adam on either device):
    parameters and reported figures equal the CPU's. PPO draws its minibatch order from the CPU's
    random stream, seeded alike for both runs."""
    pytest.importorskip("partrain.rl")
    from partrain.rl.algorithms import PPO, ActorCritic, VTrace, default_optimizer

    algorithm = VTrace(epochs=2) if name == "vtrace" else PPO(epochs=3, minibatches=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cpu_model = ActorCritic(4, 2, hidden=16).double()
    dev_model = copy.deepcopy(cpu_model).to(DEVICE)
    cpu_opt, dev_opt = default_optimizer(cpu_model, 3e-3), default_optimizer(dev_model, 3e-3)
    for seed in range(3):
        batch = _rl_batch(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(100 + seed)
            want = algorithm.update(cpu_model, cpu_opt, batch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(100 + seed)
            got = algorithm.update(dev_model, dev_opt, {k: v.to(DEVICE) for k, v in batch.items()})
        assert got.keys() == want.keys()
        for key in want:
            assert abs(got[key] - want[key]) <= F64_ATOL * max(1.0, abs(want[key])), (seed, key, got[key], want[key])
    for (name_, p), q in zip(dev_model.named_parameters(), cpu_model.parameters()):
        assert p.device.type == DEVICE.type
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=F64_ATOL, rtol=0,
                                   msg=lambda m, name_=name_: f"{name_}: {m}")


def test_a_learner_on_the_device_trains_acts_and_serves_weights_as_one_on_the_cpu():
    """`Learner` with its model on the device: the same segments give the CPU learner's weights
    (float32, rounding apart), central inference answers on the CPU with the CPU learner's logits,
    values and actions (one seeded sampler each), and the published weights decode to CPU tensors
    equal to the device model's."""
    pytest.importorskip("partrain.rl")
    from partrain.rl import ActorCritic, Learner, VTrace
    from partrain.rl.wire import Segment, decode_weights

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cpu_model = ActorCritic(4, 2, hidden=16)
    learners = [Learner(model, VTrace(), obs_shape=(4,), num_actions=2, unroll=6, seed=3)
                for model in (cpu_model, copy.deepcopy(cpu_model).to(DEVICE))]
    assert learners[0].device.type == "cpu" and learners[1].device.type == DEVICE.type
    for update in range(3):
        segments = [Segment({k: v.float() if v.is_floating_point() else v
                             for k, v in _rl_batch(10 * update + i, envs=2).items()}, 0, [], f"actor-{i}")
                    for i in range(2)]
        for learner in learners:
            learner._update(segments)  # what train() does with each batch it takes from the queue
    assert [learner.version for learner in learners] == [3, 3]
    for (name, p), q in zip(learners[1].model.named_parameters(), cpu_model.parameters()):
        assert p.device.type == DEVICE.type
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    obs = torch.randn(5, 4)
    want, got = learners[0].act(obs), learners[1].act(obs)
    for w, g in zip(want, got):
        assert g.device.type == "cpu"
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)

    blob_version, blob = learners[1].weights()
    state, version = decode_weights(blob)
    assert version == blob_version == 3
    for name, t in learners[1].acting.state_dict().items():
        assert state[name].device.type == "cpu" and torch.equal(state[name], t.cpu()), name
