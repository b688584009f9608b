"""One preflight: a run resolves its setup once in the caller, and each worker once more.

A resumed `partrain train` with 2 workers is counted across all of its processes: the
dataset function and the model factory append a line to a file each time they run, and
an audit hook (a ``sitecustomize`` on the processes' path) counts the checkpoint's opens
for reading (not its copy to ``best.pt``). The caller checks the data, the model and the checkpoint once; each worker
then loads the data, builds the model and reads the checkpoint for itself (what a worker
needs in its own process). A worker in the caller's process shares the caller's load.
"""

import collections
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from partrain.data.datasets import DataSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AUDIT = textwrap.dedent("""
    import os, sys
    def _hook(event, args):
        if event == "open" and isinstance(args[0], str) and args[0].endswith("checkpoint.pt") \\
                and (args[1] is None or "r" in args[1]) and not (args[2] or 0) & (os.O_WRONLY | os.O_RDWR) \\
                and not sys._getframe(1).f_code.co_filename.endswith("shutil.py"):  # best.pt is a copy
            with open(os.environ["PARTRAIN_TEST_COUNTS"], "a") as f:
                f.write("checkpoint\\n")
    sys.addaudithook(_hook)
""")


def _train(tmp_path, counts, *args):
    env = dict(os.environ, PARTRAIN_TEST_COUNTS=str(counts),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "partrain", "train", "--quiet", "--dataset", "tests.data_fixtures:counting_dataset",
           "--model", "tests.data_fixtures:counting_model", "--threads", "1", "--out", str(tmp_path / "run"), *args]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = collections.Counter(counts.read_text().split()) if counts.exists() else collections.Counter()
    counts.unlink(missing_ok=True)
    return seen


@pytest.fixture()
def site(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(AUDIT)
    return tmp_path


def test_a_resumed_two_worker_run_resolves_its_setup_once_plus_once_per_worker(site):
    counts = site / "counts.txt"
    first = _train(site, counts, "--workers", "2", "--epochs", "1")
    assert first == {"data": 3, "model": 3}  # no checkpoint to read yet
    recorded = json.loads((site / "run" / "config.json").read_text())["data"]
    assert set(recorded) == {f.name for f in dataclasses.fields(DataSpec)}  # the description, not what it loaded
    resumed = _train(site, counts, "--workers", "2", "--epochs", "2", "--resume", "auto")
    # was (2026-12-04): data 4, model 4, checkpoint 4 - the CLI, fit, then each worker
    assert resumed == {"data": 3, "model": 3, "checkpoint": 3}


def test_a_worker_in_the_callers_process_shares_the_callers_data(site):
    counts = site / "counts.txt"
    assert _train(site, counts, "--strategy", "single", "--epochs", "1")["data"] == 1
