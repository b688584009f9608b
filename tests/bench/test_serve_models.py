"""`partrain bench serve`'s models and its ``--device`` option.

The 5x goal is set on "a compute-heavy model, e.g. a 3x32x32 CNN of >= 5 MFLOP per
sample": the models' costs are counted here by torch's own FLOP counter (an
independent count of every convolution and matmul), not taken from their docstrings.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from partrain.bench import serve
from partrain.cli import main


def _flops_per_sample(factory) -> int:
    model = factory()
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(2, *model.example_input_shape))
    return counter.get_total_flops() // 2


@pytest.mark.parametrize(("name", "low", "high"), [
    ("cnn", 5e6, 1e7),  # the floor: >= 5 MFLOP per 3x32x32 sample
    ("resnet18", 1.0e9, 1.2e9),  # CIFAR's ResNet-18: 0.56 G multiply-adds
])
def test_the_compute_heavy_models_cost_what_they_claim(name, low, high):
    factory = getattr(serve, f"{name}_factory")
    assert low <= _flops_per_sample(factory) <= high
    assert name in serve.COMPUTE_HEAVY and serve.REQUEST_SHAPE[name] == serve.COLOUR


def test_resnet18_answers_ten_logits_per_image_the_same_in_every_process():
    a, b = serve.resnet18_factory(), serve.resnet18_factory()  # seeded: every server builds the same weights
    x = torch.randn(3, *serve.COLOUR[1:], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ya, yb = a(x), b(x)
    assert ya.shape == (3, 10) and torch.equal(ya, yb)
    assert not a.training  # served in eval mode: batch norm uses its running statistics


def test_an_unknown_model_gets_one_line_and_status_2(capsys):
    assert main(["bench", "serve", "--toy", "--models", "lenet,vgg"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Expected models among" in err[0] and "'vgg'" in err[0], err


def _tf32(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)  # keep 10 of float32's 23 mantissa bits


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
def test_the_gpu_tolerance_passes_tf32_answers_and_catches_every_swapped_answer(name):
    from partrain.serve.loadtest import AnswerChecker, ModelInfo, TensorSpec, random_inputs

    shape = serve.REQUEST_SHAPE[name]
    info = ModelInfo(name, (TensorSpec("input", "FP32", (-1, *shape[1:])),))
    samples = random_inputs(info, 64, shape, seed=0)  # the benchmark's samples
    model = getattr(serve, f"{name}_factory")()
    checker = AnswerChecker(model, samples)
    serve.tf32_tolerance(checker)
    # a stand-in for the GPU's TF32 convolutions: weights and inputs rounded to TF32's mantissa
    rounded = getattr(serve, f"{name}_factory")()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(_tf32(p))
    inputs = torch.cat([torch.from_numpy(next(iter(s.values())).copy()) for s in samples])
    with torch.inference_mode():  # one batch each (eval mode: rows are independent)
        exact = [row[None] for row in model(inputs).numpy()]
        tf32 = [row[None] for row in rounded(_tf32(inputs)).numpy()]
    for i, answer in enumerate(tf32):
        assert checker.compare(i, {"output": answer}) == "", i
    for i in range(len(samples)):
        for j in range(len(samples)):
            if i != j:
                assert checker.compare(i, {"output": exact[j]}) != "", (i, j)
