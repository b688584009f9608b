"""The one way partrain's children start (`partrain._process.start_child` / `child_started`).

Why it exists: the child-process preamble (signals, the parent-death watch) was written in four
places, and serve's stages started their children without the start-up signal rule. Every child
now starts through one helper; these tests run it in a real parent process and kill that parent
with SIGKILL (no unwinding, as a scheduler's ``kill -9`` or the OOM killer does), then wait for
the condition "no descendant of the parent is alive", bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

PARENT = """
import sys, threading
from partrain._process import child_started, process_context, start_child

def child(sigterm_raises):
    child_started(sigterm_raises=sigterm_raises, grace=2.0)
    threading.Event().wait(300)  # until the parent's death stops it (bounded: the test's limit)

if __name__ == "__main__":
    procs = []
    ctx = process_context()
    for raises in (True, False):
        start_child(ctx, child, (raises,), name="partrain-test-child", keep=procs.append)
    print(" ".join(str(p.pid) for p in procs), flush=True)
    threading.Event().wait(300)
"""


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Linux /proc), at this moment."""
    found, todo = set(), [pid]
    while todo:
        here = todo.pop()
        try:
            with open(f"/proc/{here}/task/{here}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        found.update(kids)
        todo.extend(kids)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_children_started_through_the_helper_die_with_a_parent_killed_by_sigkill(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        children = [int(p) for p in parent.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(children) == 2 and all(_alive(c) for c in children)
        everyone = _descendants(parent.pid) | set(children)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in everyone) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the condition, bounded by the deadline
        assert [p for p in everyone if _alive(p)] == []
    finally:
        with_group = parent.pid
        try:
            os.killpg(with_group, signal.SIGKILL)
        except OSError:
            pass


TERMINATED = """
import sys
from partrain._process import child_started, process_context, start_child
from partrain.errors import Interrupted

def child(conn, out):
    child_started()
    try:
        conn.send("ready")
        conn.recv()  # nothing comes: only the parent's SIGTERM ends this
    except Interrupted as stop:
        with open(out, "w") as f:
            f.write(f"unwound by {stop.signum}")

if __name__ == "__main__":
    procs = []
    ctx = process_context()
    here, there = ctx.Pipe()
    start_child(ctx, child, (there, sys.argv[1]), name="partrain-test-child", keep=procs.append)
    assert here.recv() == "ready"
    procs[0].terminate()
    procs[0].join(60)
    print(procs[0].exitcode)
"""


def test_sigterm_to_a_child_unwinds_it_as_interrupted(tmp_path):
    """The parent stops a child with SIGTERM: the child's code sees `Interrupted` (its
    ``finally`` and ``except`` blocks run), and the process ends normally, not killed."""
    script, out = tmp_path / "parent.py", tmp_path / "unwound"
    script.write_text(TERMINATED)
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]
    assert out.read_text() == f"unwound by {int(signal.SIGTERM)}"
