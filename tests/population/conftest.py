"""One intra-op thread for every population test, and the caller's setting back after each.

Speed only: the members are tiny, and on a loaded 2-core machine OpenMP threads
that spin-wait for a busy core made them about 10x slower with 2 threads than
with 1. No result depends on it: comparisons between runs are in float64 (see
`tests.helpers`) or between two runs in this same process. A fixture instead of
a module-level ``torch.set_num_threads(1)``, which would leak into every test
collected after it.
"""

import pytest

from tests.helpers import torch_threads


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield
