"""Serving what `partrain train` and users' scripts produce: checkpoints with a preprocessing
step, factories found next to the user (current directory, the checkpoint's recorded path),
regression outputs, and weights that do not fit their model spec in one useful line.

Why: issue 10 found raw digits served through a model trained on scaled pixels (answers
silently wrong: the scaling was nowhere but in the training code), ``partrain serve
mymodel:fn`` not finding ``./mymodel.py`` from the console script, and a state-dict size
mismatch cut before the line that named the tensor.

Models run in float64 so answers compare with a hand computation at 1e-12 on any CPU.
Start with `test_preprocess_serves_raw_digits_like_the_model_on_scaled_pixels`.
"""

from __future__ import annotations

import copy
import os
import sys
import textwrap
import uuid

import numpy as np
import pytest
import torch
from torch import nn

from partrain.checkpoint import save_checkpoint
from partrain.cli import main
from partrain.errors import UsageError
from partrain.models import cnn
from partrain.serve import create_app
from partrain.serve.checkpoints import Preprocess
from partrain.serve.loading import load_model_spec
from partrain.serve.protocol import HEADER, decode_response, encode_request

from .conftest import TestClient

DIGITS_PREPROCESS = {"scale": 1 / 6.4, "offset": -0.75, "raw": "pixel values 0..16"}


def digits_cnn64() -> nn.Module:
    """The built-in digits CNN in float64 (a ``module:function`` spec, as a user's script gives)."""
    torch.manual_seed(0)
    return cnn().double()


def trained_weights() -> dict[str, torch.Tensor]:
    """Weights unlike the factory's seeded ones, so a served answer proves the checkpoint was loaded."""
    model = digits_cnn64()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.01 * (i + 1))
    return model.state_dict()


def raw_digits(n: int) -> torch.Tensor:
    """``n`` real handwritten digits as the dataset stores them: 8x8 integer pixels 0..16."""
    from sklearn.datasets import load_digits

    images = load_digits().images[:n]
    assert images.min() == 0 and images.max() == 16
    return torch.tensor(images, dtype=torch.float64).unsqueeze(1)


def infer(client: TestClient, model: str, x: torch.Tensor) -> torch.Tensor:
    body, headers = encode_request({"input": x}, binary=True, binary_output=True)
    r = client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    return decode_response(r.content, r.headers.get(HEADER))["output"]


def test_preprocess_serves_raw_digits_like_the_model_on_scaled_pixels(tmp_path) -> None:
    """Clients send raw pixels; the served model scales them as training did: x/16, then (x-0.3)/0.4."""
    ckpt = tmp_path / "digits.pt"
    save_checkpoint(str(ckpt), {"model": trained_weights(), "model_spec": {
        "name": "tests.serve.test_loading:digits_cnn64", "kwargs": {}, "input_shape": [1, 8, 8],
        "num_classes": 10, "task": "classification", "preprocess": DIGITS_PREPROCESS}})
    served = load_model_spec(f"digits={ckpt}")
    x = raw_digits(5)
    reference = digits_cnn64()
    reference.load_state_dict(trained_weights())
    reference.eval()
    with torch.inference_mode():
        expected = reference((x / 16 - 0.3) / 0.4)  # the training pipeline's own two steps, by hand
        unscaled = reference(x)
    with TestClient(create_app([served])) as c:
        got = infer(c, "digits", x)
        metadata = c.get("/v2/models/digits").json()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert not torch.allclose(got, unscaled, atol=1e-3)  # the scaling matters: it is not a no-op
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP64", "shape": [-1, 1, 8, 8]}]
    assert metadata["parameters"] == {"preprocess": DIGITS_PREPROCESS, "task": "classification"}


def test_preprocess_wrapper_scales_float_inputs_only() -> None:
    seen = []

    def model(*inputs: torch.Tensor) -> torch.Tensor:
        seen.extend(inputs)
        return inputs[0]

    wrapper = Preprocess(model, scale=0.5, offset=1.0)  # type: ignore[arg-type]
    wrapper(torch.tensor([2.0, 4.0], dtype=torch.float64), torch.tensor([3, 5]))
    assert seen[0].tolist() == [2.0, 3.0] and seen[1].tolist() == [3, 5]


class Regressor(nn.Module):
    """One number per row, returned as (N,) (``flat``) or (N, 1)."""

    def __init__(self, flat: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 1).double()
        self.flat = flat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y.reshape(-1) if self.flat else y


def regressor_flat() -> nn.Module:
    return Regressor(flat=True)


def regressor_column() -> nn.Module:
    return Regressor(flat=False)


@pytest.mark.parametrize(("factory", "out_shape"), [("regressor_flat", [-1]), ("regressor_column", [-1, 1])])
def test_regression_model_outputs_serve(factory, out_shape) -> None:
    """A regression model answers one number per row, shaped (N,) or (N, 1), each request its own rows."""
    served = load_model_spec(f"reg=tests.serve.test_loading:{factory}")
    model = Regressor(flat=factory == "regressor_flat")
    x = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]], dtype=torch.float64)
    with torch.inference_mode():
        expected = model(x)
    with TestClient(create_app([served])) as c:
        assert c.get("/v2/models/reg").json()["outputs"][0]["shape"] == out_shape
        got = infer(c, "reg", x)
        first_row = infer(c, "reg", x[:1])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(first_row, expected[:1], rtol=0, atol=1e-12)


# ----------------------------------------------------------------- user code found where the user is


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """A fresh module ``usermodel_<id>.py`` in ``tmp_path/project``; sys.path/modules restored after."""
    name = f"usermodel_{uuid.uuid4().hex[:8]}"
    project = tmp_path / "project"
    project.mkdir()
    (project / f"{name}.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build(width=4):
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 2)).double()
    """))
    # as under the `partrain` console script: neither the current directory nor '' on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    yield name, project
    sys.modules.pop(name, None)


def test_factory_in_the_current_directory_is_found(user_module, monkeypatch) -> None:
    name, project = user_module
    monkeypatch.chdir(project)
    served = load_model_spec(f"{name}:build")
    assert served.name == "build" and served.inputs[0].shape == (-1, 3)
    assert str(project) in sys.path


def test_checkpoint_spec_path_finds_the_training_scripts_module(user_module, tmp_path, monkeypatch) -> None:
    name, project = user_module
    weights = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().state_dict()
    spec = {"name": f"{name}:build", "kwargs": {"width": 4}, "input_shape": [3], "num_classes": 2}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # served from anywhere but the script's directory
    save_checkpoint(str(tmp_path / "no_path.pt"), {"model": weights, "model_spec": spec})
    with pytest.raises(UsageError, match=rf"Expected module '{name}' of model factory '{name}:build' in the "
                                         r"current directory, installed packages\. Received: no module"):
        load_model_spec(str(tmp_path / "no_path.pt"))
    save_checkpoint(str(tmp_path / "with_path.pt"),
                    {"model": weights, "model_spec": {**spec, "path": str(project)}})
    served = load_model_spec(f"m={tmp_path / 'with_path.pt'}")
    assert sys.path[-1] == str(project)  # at the end: a recorded path never shadows installed packages
    x = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model.load_state_dict(weights)
    with TestClient(create_app([served])) as c:
        got = infer(c, "m", x)
    with torch.inference_mode():
        torch.testing.assert_close(got, model(x), rtol=0, atol=1e-12)


# ----------------------------------------------------------------- bad input: one line, exit 2


def mismatched_checkpoint(tmp_path) -> str:
    """Weights of a 10-class CNN under a spec that builds 5 classes."""
    torch.manual_seed(0)
    path = str(tmp_path / "mismatch.pt")
    save_checkpoint(path, {"model": cnn().state_dict(), "model_spec": {
        "name": "cnn", "kwargs": {"num_classes": 5}, "input_shape": [1, 8, 8], "num_classes": 5}})
    return path


def missing_key_checkpoint(tmp_path) -> str:
    torch.manual_seed(0)
    weights = cnn().state_dict()
    del weights["0.bias"]
    weights["extra.weight"] = torch.zeros(2)
    path = str(tmp_path / "missing.pt")
    save_checkpoint(path, {"model": weights, "model_spec": {"name": "cnn", "kwargs": {}, "input_shape": [1, 8, 8]}})
    return path


def bad_preprocess_checkpoint(tmp_path) -> str:
    torch.manual_seed(0)
    path = str(tmp_path / "pre.pt")
    save_checkpoint(path, {"model": cnn().state_dict(), "model_spec": {
        "name": "cnn", "kwargs": {}, "input_shape": [1, 8, 8], "preprocess": {"scale": "1/16"}}})
    return path


def no_spec_checkpoint(tmp_path) -> str:
    path = str(tmp_path / "nospec.pt")
    save_checkpoint(path, {"model": cnn().state_dict(), "model_spec": None})
    return path


# (id, MODEL argument built in tmp_path, what the one line says); flags: test_app.py's table
SERVE_CASES = [
    ("state-dict-size-mismatch", mismatched_checkpoint,
     "Expected checkpoint weights to fit model 'cnn' built from its spec. Received: 2 mismatched tensors "
     "(8.weight: checkpoint (10, 128) vs model (5, 128); 8.bias: checkpoint (10,) vs model (5,))"),
    ("state-dict-missing-and-unexpected", missing_key_checkpoint,
     "Received: 1 missing from the checkpoint (0.bias), 1 not in the model (extra.weight)"),
    ("preprocess-not-numbers", bad_preprocess_checkpoint,
     "Expected the model spec's preprocess in"),
    ("checkpoint-without-spec", no_spec_checkpoint, "Expected a model spec in checkpoint"),
    ("factory-module-missing", lambda tmp: "no_such_module_xyz:build",
     "Expected module 'no_such_module_xyz' of model factory 'no_such_module_xyz:build' in the current "
     "directory, installed packages. Received: no module named 'no_such_module_xyz'"),
    ("factory-not-module-function", lambda tmp: "m=:build", "Expected a model factory as 'module:function'"),
]


@pytest.mark.parametrize(("make", "says"), [c[1:] for c in SERVE_CASES], ids=[c[0] for c in SERVE_CASES])
def test_partrain_serve_bad_model_is_one_line_exit_2(tmp_path, capsys, make, says) -> None:
    assert main(["serve", make(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert err.startswith("partrain serve: error: Expected ")


def test_raw_inputs_described_in_metadata_are_what_loadtest_checks_against(tmp_path) -> None:
    """``partrain loadtest --check CHECKPOINT`` runs the same preprocessing as the server."""
    from partrain.serve.loadtest import load_reference_model

    ckpt = tmp_path / "digits.pt"
    save_checkpoint(str(ckpt), {"model": trained_weights(), "model_spec": {
        "name": "tests.serve.test_loading:digits_cnn64", "kwargs": {}, "input_shape": [1, 8, 8],
        "preprocess": DIGITS_PREPROCESS}})
    reference = load_reference_model(str(ckpt))
    served = load_model_spec(str(ckpt))
    x = raw_digits(3)
    with torch.inference_mode():
        # float64; the served conv net runs channels-last on a CPU: equal up to rounding
        assert np.allclose(reference(x).numpy(), served.fn(x).numpy(), rtol=1e-12, atol=0)


def test_a_conv_net_is_served_channels_last_with_the_model_s_answers() -> None:
    """On a CPU, `from_module` runs conv nets channels-last: same answers (float64), any input layout."""
    from partrain.serve.protocol import ServedModel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1)).double()
    reference = copy.deepcopy(net)
    served = ServedModel.from_module("conv", net, (3, 5, 5), dtype=torch.float64)
    assert next(net.parameters()).is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64)
    with torch.inference_mode():
        got = served.fn(x)
        assert got.is_contiguous() and torch.allclose(got, reference(x), rtol=1e-12, atol=1e-12)


class Tagger64(nn.Module):
    """docs/data.md's tagger: an LSTM over packed sequences (padding never enters it), float64."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True, dtype=torch.float64)
        self.head = nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        from partrain.data import pack

        _, (h, _) = self.lstm(pack(x, lengths))
        return self.head(h[-1])


def tagger64() -> nn.Module:
    return Tagger64()


def sequences64(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(int(t), 4, generator=g, dtype=torch.float64)
            for t in torch.randint(2, 9, (n,), generator=g)]


def test_a_model_of_several_inputs_serves_as_it_trained(tmp_path) -> None:
    """docs/data.md's recipe end to end: trained on padded sequences and their lengths (a dict batch),
    served from the checkpoint alone with inputs named x (any length) and lengths; a request of two
    sequences padded by the client answers what the model answers for each sequence alone."""
    from partrain.data import PadCollate, Sequences
    from partrain.train.fit import fit

    from ..helpers import sgd

    train = Sequences(sequences64(24, 0), torch.arange(24) % 3)
    fit(tagger64, (train, None), sgd, collate_fn=PadCollate(), strategy="single", epochs=1, batch_size=8,
        out_dir=str(tmp_path / "run"), quiet=True)
    served = load_model_spec(f"tagger={tmp_path / 'run' / 'checkpoint.pt'}")
    model = tagger64()
    model.load_state_dict(torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"])
    model.eval()
    a, b = sequences64(2, 1)
    x = torch.zeros(2, max(len(a), len(b)), 4, dtype=torch.float64)
    x[0, :len(a)], x[1, :len(b)] = a, b
    lengths = torch.tensor([len(a), len(b)])
    with TestClient(create_app([served])) as c:
        metadata = c.get("/v2/models/tagger").json()
        body, headers = encode_request({"x": x, "lengths": lengths}, binary=True, binary_output=True)
        r = c.post("/v2/models/tagger/infer", content=body, headers=headers)
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP64", "shape": [-1, -1, 4]},
                                  {"name": "lengths", "datatype": "INT64", "shape": [-1]}]
    assert r.status_code == 200, r.text
    got = decode_response(r.content, r.headers.get(HEADER))["output"]
    with torch.inference_mode():
        alone = torch.cat([model(s[None], torch.tensor([len(s)])) for s in (a, b)])
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-12)


def test_several_inputs_on_the_command_line() -> None:
    """A factory that records nothing: --input-shape gives each input's shape (';'), --input-dtype each datatype."""
    served = load_model_spec("t=tests.serve.test_loading:tagger64", input_shape="-1,4;()", input_dtype="FP64,INT64")
    assert [(t.name, t.datatype, list(t.shape)) for t in served.inputs] == [
        ("input__0", "FP64", [-1, -1, 4]), ("input__1", "INT64", [-1])]
    with pytest.raises(UsageError, match="Received: 'FP64,INT9'"):
        load_model_spec("t=tests.serve.test_loading:tagger64", input_shape="-1,4;()", input_dtype="FP64,INT9")
    with pytest.raises(UsageError, match=r"\(an empty shape\)"):
        load_model_spec("t=tests.serve.test_loading:tagger64", input_shape="-1,4;", input_dtype="FP64,INT64")
