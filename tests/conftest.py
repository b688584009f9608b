"""Suite-wide fixtures.

Worker processes are started once per test module and reused: every module runs
inside a `partrain.WorkerPool`, so each `launch` / `fit` of its tests gets a fresh
process group on a fresh store but not a fresh interpreter (importing torch in a
new process costs seconds; a suite with a hundred launches would spend minutes
on it). The pool starts its processes at the first launch only, so modules that
launch nothing pay nothing. A test that needs brand-new processes marks itself
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


@pytest.fixture(scope="module", autouse=True)
def _module_pool() -> Iterator[partrain.WorkerPool]:
    with partrain.WorkerPool(POOL_PROCESSES) as pool:
        yield pool


@pytest.fixture(autouse=True)
def _fresh_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("fresh_processes") is None:
        yield
        return
    with no_pool():
        yield
