"""``--device`` of the benchmarks that can put their model on a GPU: a bad value is one line and status 2."""

from __future__ import annotations

import pytest
import torch

from partrain.cli import main

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize("bench", ["serve", "population", "data"])
@pytest.mark.parametrize(("device", "message"), [
    ("gpu", "Expected --device cpu or cuda. Received: 'gpu'"),
    pytest.param("cuda", "Expected a CUDA device for --device cuda. Received: none visible", marks=NO_CUDA),
])
def test_a_device_it_cannot_use_gets_one_line_and_status_2(bench, device, message, capsys):
    assert main(["bench", bench, "--toy", "--device", device]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
