"""``partrain serve MODEL --stages 2``: the model split over 2 processes behind one endpoint.

The reference is the unsplit model in this process, float64: every answer must equal
its output on the same rows (to float64 rounding: a batch goes through the stages in
pieces, and a matrix product over fewer rows may round differently). Requests are sent
concurrently, so the batcher forms batches larger than the micro-batch count, and
uneven ones. Then: SIGTERM stops the stage process too; a stage that dies turns every
later request into an error naming the stages, never a hang; bad input is one line
before any process starts.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal

import httpx
import pytest
import torch
from torch import nn

from partrain.cli import main
from partrain.serve.protocol import HEADER, decode_response, encode_request

from ..test_signals import Command, _alive, no_survivors, started_children

pytestmark = pytest.mark.timeout(240)
SPEC = "deep=tests.serve.test_stages:deep_model"


def deep_model() -> nn.Sequential:
    """Float64, 9 children: cut by parameters into 2 stages. Module-level: stages import it."""
    g = torch.Generator().manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        lin = nn.Linear(12, 12).double()
        with torch.no_grad():
            lin.weight.copy_(torch.randn(12, 12, generator=g, dtype=torch.float64) / 3)
            lin.bias.copy_(torch.randn(12, generator=g, dtype=torch.float64))
        layers += [lin, nn.Tanh()]
    head = nn.Linear(12, 3).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(3, 12, generator=g, dtype=torch.float64))
        head.bias.copy_(torch.randn(3, generator=g, dtype=torch.float64))
    return nn.Sequential(*layers, head)


def not_sequential() -> nn.Module:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(x)

    return Branchy()


def _infer(url: str, x: torch.Tensor) -> tuple[int, torch.Tensor | str]:
    body, headers = encode_request({"input": x})
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v2/models/deep/infer", content=body, headers=headers)
    if r.status_code != 200:
        return r.status_code, r.json().get("error", r.text)
    return 200, decode_response(r.content, r.headers.get(HEADER))["output"]


def _start() -> tuple[Command, str]:
    cmd = Command(["serve", SPEC, "--stages", "2", "--microbatches", "3", "--min-microbatch-rows", "1",
                   "--threads", "1", "--port", "0", "--input-dtype", "FP64"])
    cmd.wait_for(lambda: any("serving" in line for line in cmd.out), "the server's announcement")
    url = next(line for line in cmd.out if "serving" in line).split(" at ")[1].split("/v2/")[0]
    return cmd, url


def test_answers_equal_the_unsplit_model_and_sigterm_stops_the_stage() -> None:
    cmd, url = _start()
    try:
        stages = started_children(cmd.proc.pid)
        assert len(stages) == 1, stages  # stage 1; stage 0 is the server
        reference = deep_model().eval()
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(rows, 12, generator=g, dtype=torch.float64) for rows in (1, 2, 5, 7, 3, 1, 4, 6) * 3]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda x: _infer(url, x), xs))
        with torch.no_grad():
            for x, (status, y) in zip(xs, answers, strict=True):
                assert status == 200, y
                torch.testing.assert_close(y, reference(x), rtol=0, atol=1e-12)
        os.kill(cmd.proc.pid, signal.SIGTERM)
        assert cmd.finish() == 0, cmd.output()
        assert not any(_alive(pid) for pid in stages)
        no_survivors(cmd)
        assert cmd.leftover_dirs() == []
    finally:
        cmd.close()


def test_a_dead_stage_is_an_error_naming_the_stages_not_a_hang() -> None:
    cmd, url = _start()
    try:
        (stage,) = started_children(cmd.proc.pid)
        os.kill(stage, signal.SIGKILL)
        x = torch.zeros(4, 12, dtype=torch.float64)
        status, error = _infer(url, x)
        assert status == 500 and "the model's stages stopped answering" in str(error), (status, error)
        status, error = _infer(url, x)  # and every request after it, at once
        assert status == 500 and "the model's stages stopped answering" in str(error), (status, error)
    finally:
        cmd.close()


@pytest.mark.parametrize("argv, line", [
    ([SPEC, "--stages", "2", "--replicas", "2"],
     "Expected --stages with one MODEL, one replica and --device cpu. Received: 1 model(s), --replicas 2, "
     "--device cpu"),
    (["b=tests.serve.test_stages:not_sequential", "--stages", "2"],
     "Expected an nn.Sequential model for partrain serve --stages (its children run in order and are cut "
     "between stages; wrap your layers in one). Received: Branchy"),
    ([SPEC, "--stages", "10"], "Expected at least 10 top-level children to cut into 10 stages. Received: a model "
                               "with 9 (0, 1, 2, 3, 4, 5, 6, 7, 8)"),
    ([SPEC, "--stages", "0"], "Expected --stages >= 1. Received: --stages=0"),
    ([SPEC, "--stages", "2", "--microbatches", "0"], "Expected --microbatches >= 1. Received: --microbatches=0"),
    ([SPEC, "--stages", "2", "--min-microbatch-rows", "0"],
     "Expected --min-microbatch-rows >= 1. Received: --min-microbatch-rows=0"),
], ids=["replicas", "not sequential", "too many stages", "zero stages", "zero microbatches", "zero piece rows"])
def test_bad_input_is_one_line_before_any_process(argv, line, capsys) -> None:
    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"partrain serve: error: {line}"]
