"""A script that calls `launch` at import time gets one line telling it to add the main guard.

Why this exists: worker processes (spawned, or forked from partrain's fork server)
each import the user's script again before running anything. Without ``if __name__ == "__main__":``
the import calls `launch` again, and multiprocessing refused it with a traceback in
every worker, beneath the launcher's own: three nested tracebacks for a one-line fix.
Each test runs a script in a fresh interpreter (independent of the suite's pool). The
same script with the guard runs: `tests/test_signals.py`'s library script is one (it
launches twice from a guarded script in a fresh interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BODY = {
    "launch": "print(partrain.launch(rank_of, workers=2, timeout=60))",
    "pool": "with partrain.WorkerPool(2):\n    print(partrain.launch(rank_of, workers=2, timeout=60))",
    # fit checks and writes its run directory first: a worker must leave before it checks it again
    "fit": "import functools, torch, partrain.models\n"
           "partrain.fit(partrain.models.mlp, 'digits', functools.partial(torch.optim.SGD, lr=0.1), workers=2, "
           "epochs=1, threads=1, out_dir='run', quiet=True)",
}


def script(tmp_path: Path, body: str, guarded: bool) -> Path:
    if guarded:
        body = 'if __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    path = tmp_path / "train_me.py"
    path.write_text("import partrain\n\n\ndef rank_of(strategy):\n    return strategy.rank\n\n\n" + body + "\n")
    return path


def run(path: Path, start_method: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("PARTRAIN_START_METHOD", None)
    if start_method:
        env["PARTRAIN_START_METHOD"] = start_method
    return subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=240,
                          cwd=path.parent)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("how", "start_method"), [("launch", None), ("pool", None), ("fit", None),
                                                  ("launch", "spawn")])
def test_a_script_without_the_main_guard_gets_one_line(tmp_path: Path, how: str, start_method: str | None) -> None:
    # the default start method (a fork server on Linux) and spawn: each child exits with its own status
    path = script(tmp_path, BODY[how], guarded=False)
    proc = run(path, start_method)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"partrain: {path} calls fit/launch at import time; worker processes import it again. "
        'Put the call under `if __name__ == "__main__":`'
    ]
