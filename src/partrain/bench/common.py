"""Kept only for ``partrain.population.report``, which still imports `format_table` from here.

Library code should not import ``partrain.bench``; once that import is gone, delete
this module. Benchmarks use `partrain.bench.harness`.
"""

from .harness import format_table

__all__ = ["format_table"]
