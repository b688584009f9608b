"""Where `partrain compare` trains: the GPUs when there is one per worker, else the CPU.

The GPU count is faked (nothing touches a GPU: the decision only counts them).
"""

from __future__ import annotations

import pytest
import torch

from partrain.cli import main
from partrain.compare.run import compare_device
from partrain.errors import UsageError


@pytest.fixture()
def gpus(monkeypatch):
    def visible(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return visible


def test_auto_takes_the_gpus_only_when_each_worker_gets_one(gpus):
    said = []
    gpus(1)
    assert compare_device("auto", 4, said.append) == "cpu"
    assert said == ["4 workers and 1 GPU(s): comparing on the CPU (--device cuda --workers 1 compares on the GPUs)"]
    assert compare_device(None, 1) is None  # one worker, one GPU: fit's auto puts it there
    gpus(4)
    assert compare_device("auto", 4) == "auto"
    gpus(0)
    assert compare_device(None, 8) is None and compare_device("cpu", 8) == "cpu"


def test_an_explicit_gpu_with_more_workers_than_gpus_is_one_line(gpus):
    gpus(2)
    with pytest.raises(UsageError) as info:
        compare_device("cuda", 3)
    assert str(info.value) == ("Expected at most 2 worker(s) for --device cuda, one per GPU. Received: 3 workers; "
                               "use --workers 2, or --device cpu")
    assert compare_device("cuda", 2) == "cuda"
    with pytest.raises(UsageError, match="Expected a device such as cpu, cuda, cuda:1 or auto. Received: 'gpu'"):
        compare_device("gpu", 2)


def test_the_cli_refuses_before_the_data_loads(gpus, capsys, tmp_path):
    gpus(1)
    code = main(["compare", "--device", "cuda", "--workers", "2", "--dataset", str(tmp_path / "missing.npz"),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["partrain compare: error: Expected at most 1 worker(s) for --device cuda, one per "
                                 "GPU. Received: 2 workers; use --workers 1, or --device cpu"]
