"""compare's host-load accounting: /proc parsing by hand, a process outside the tree seen as
"other", and the caution printed when windows ran under different loads."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest

from partrain.compare.hostload import (
    CpuSample,
    parse_pid_stat,
    parse_proc_stat,
    sample,
    shares,
    spread_warning,
    tree_ticks,
)
from partrain.compare.measure import Measurement
from tests.waiting import wait_until

PROC_STAT = """cpu  100 5 40 800 20 3 2 30 7 0
cpu0 50 2 20 400 10 1 1 15 3 0
intr 12345
"""


def test_proc_stat_totals_by_hand():
    total, busy, steal = parse_proc_stat(PROC_STAT)
    assert total == 100 + 5 + 40 + 800 + 20 + 3 + 2 + 30  # guest (7) is already inside user
    assert busy == 100 + 5 + 40 + 3 + 2 and steal == 30
    with pytest.raises(ValueError, match="Expected /proc/stat to start with a 'cpu' line"):
        parse_proc_stat("intr 1\n")


def test_pid_stat_reads_past_a_name_with_spaces_and_parentheses():
    line = "4242 (my (odd) name) S 17 4242 4242 0 -1 4194304 100 0 0 0 250 31 0 0 20 0 1 0 99 0 0\n"
    assert parse_pid_stat(line) == (17, 250 + 31)


def test_tree_ticks_sum_the_root_and_its_descendants_only():
    def line(pid, ppid, ticks):
        return f"{pid} (p{pid}) S {ppid} 0 0 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0 1 0 0 0 0"

    stats = {10: line(10, 1, 5), 11: line(11, 10, 7), 12: line(12, 11, 11), 13: line(13, 1, 1000),
             14: "garbage"}
    assert tree_ticks(10, stats) == 5 + 7 + 11  # 13 is a sibling, 14 unreadable
    assert tree_ticks(99, stats) == 0


def test_shares_by_hand_and_unknown_without_samples():
    before, after = CpuSample(1000, 300, 10, 200), CpuSample(2000, 900, 110, 600)
    steal, other = shares(before, after)
    assert steal == pytest.approx(100 / 1000) and other == pytest.approx((600 - 400) / 1000)
    assert all(math.isnan(v) for v in shares(None, after) + shares(before, None))


def window(label, steal, other):
    return Measurement(label, label, {}, 2, host_steal=steal, host_other=other)


def test_the_caution_names_both_ends_of_a_wide_spread_only():
    line = spread_warning([window("allreduce", 0.0, 0.05), window("hogwild", 0.35, 0.05), window("single", 0.0, 0.1)])
    assert line is not None and "hogwild: 40%" in line and "allreduce: 5%" in line
    assert spread_warning([window("allreduce", 0.0, 0.05), window("hogwild", 0.05, 0.05)]) is None
    assert spread_warning([window("allreduce", math.nan, math.nan), window("hogwild", 0.5, 0.0)]) is None
    failed = Measurement("ps", "ps", {}, 2, status="failed", host_steal=0.9, host_other=0.0)
    assert spread_warning([window("allreduce", 0.0, 0.0), failed]) is None
    # a run-off window counts as a window of its own
    raced = window("hogwild", 0.0, 0.05)
    raced.runoff = [window("hogwild", 0.0, 0.02), window("hogwild", 0.3, 0.1)]
    line = spread_warning([window("allreduce", 0.0, 0.05), raced])
    assert line is not None and "hogwild's run-off window 2: 40%" in line and "hogwild's run-off window 1: 2%" in line


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc")
def test_a_process_outside_this_tree_counts_as_other_load(tmp_path):
    """A busy loop double-forked away from this process (its parent exits at once) burns about
    40 ticks; between two samples around it, busy time beyond this tree's own grows by at least
    about that much (other processes of the machine can only add to it)."""
    done = tmp_path / "done"
    burner = textwrap.dedent(f"""
        import os, time
        t = time.process_time()
        while time.process_time() - t < 0.4:
            pass
        with open({str(done)!r} + ".tmp", "w") as f:
            f.write(repr(time.process_time() - t))
        os.replace({str(done)!r} + ".tmp", {str(done)!r})
    """)
    before = sample()
    assert before is not None
    subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                    f"{burner!r}], start_new_session=True)"], check=True, timeout=60)
    wait_until(done.exists, "the detached busy loop to finish", timeout=60)
    after = sample()
    burned_ticks = float(done.read_text()) * os.sysconf("SC_CLK_TCK")
    other_ticks = (after.busy - before.busy) - (after.own - before.own)
    assert other_ticks >= 0.5 * burned_ticks, (other_ticks, burned_ticks)
    steal, other = shares(before, after)
    assert 0.0 <= steal <= 1.0 and 0.0 < other <= 1.0
