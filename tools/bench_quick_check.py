#!/usr/bin/env python3
"""Run every benchmark's ``--quick`` on a slowed machine and check that none ends badly.

Issue 53: a benchmark must never end in a traceback; a size that cannot produce its
scenario says so in one line and picks another. This runs ``partrain bench NAME --quick
--json FILE`` for each registered benchmark, pinned to one core (``taskset -c 0``: the
slowest machine the project supports), and checks for each: exit status 0, no
"Traceback" in its output, and a JSON file whose ``goals`` block names at least one goal,
each with a value (null when it could not be measured) and a verdict. It prints one line per benchmark and exits 1 when
any fails. It takes 10-20 minutes, so it is not part of the test suite: run it with
``make bench-check`` before a release or after changing a benchmark.

Usage: tools/bench_quick_check.py [NAME ...] [--cores 0] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def check(name: str, cores: str, timeout: float, python: str) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{name}.json")
        cmd = [python, "-m", "partrain", "bench", name, "--quick", "--json", out]
        if shutil.which("taskset") and cores:
            cmd = ["taskset", "-c", cores, *cmd]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"did not finish within {timeout:.0f} s"
        took = time.monotonic() - start
        text = proc.stdout + proc.stderr
        if proc.returncode != 0:
            tail = " | ".join(text.strip().splitlines()[-3:])
            return False, f"exit {proc.returncode} after {took:.0f} s: {tail}"
        if "Traceback" in text:
            return False, f"exit 0 but a traceback in its output after {took:.0f} s"
        try:
            with open(out) as f:
                goals = json.load(f).get("goals")
        except (OSError, ValueError) as exc:
            return False, f"exit 0 but no readable --json file: {exc}"
        if not isinstance(goals, dict) or not goals:
            return False, "exit 0 but no goals block in its --json file"
        malformed = [g for g, v in goals.items() if not isinstance(v, dict) or not {"value", "met"} <= set(v)]
        if malformed:
            return False, f"goals without a value and a verdict: {', '.join(malformed)}"
        unmeasured = [g for g, v in goals.items() if v["value"] is None]
        verdicts = ", ".join(f"{g}={v['value'] if v['value'] is None else format(v['value'], '.3g')}"
                             for g, v in goals.items())
        if unmeasured:  # allowed (a competitor not installed), but said
            verdicts += f"; not measured: {', '.join(unmeasured)}"
        return True, f"{took:.0f} s, {len(goals)} goals ({verdicts})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--cores", default="0", help="taskset core list (default 0: one core; '' for no pinning)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark (default 900)")
    args = parser.parse_args()
    from partrain.bench import BENCHMARKS

    names = args.names or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        print(f"Expected benchmark names among {sorted(BENCHMARKS)}. Received: {unknown}", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        ok, line = check(name, args.cores, args.timeout, sys.executable)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {line}", flush=True)
    print(f"{len(names) - failed} of {len(names)} benchmarks ended well on cores {args.cores or 'all'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
