"""Suite-wide fixtures.

Worker processes are started once per test session and reused: the whole suite runs
inside one `partrain.WorkerPool`, so each `launch` / `fit` gets a fresh process
group on a fresh store but not a fresh interpreter (importing torch in a new process
costs seconds; a suite with a hundred launches would spend minutes on it; one pool
per module cost about 45 s of the suite's 8 minutes). Under pytest-xdist (``make test``
runs two pytest workers) each worker has its own pool. The pool starts its processes
at the first launch only, and replaces a process whose job failed. A test that needs brand-new processes marks itself
``@pytest.mark.fresh_processes``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import partrain
from partrain.pool import no_pool

POOL_PROCESSES = 4  # 2 workers + 2 parameter servers: the largest job of the suite


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fresh_processes: run launches of this test in new processes, no pool")


@pytest.fixture(scope="session", autouse=True)
def suite_pool() -> Iterator[partrain.WorkerPool]:
    """The session's pool (every launch runs on it; request it to inspect it)."""
    with partrain.WorkerPool(POOL_PROCESSES) as pool:
        yield pool


@pytest.fixture(autouse=True)
def _fresh_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("fresh_processes") is None:
        yield
        return
    with no_pool():
        yield
