"""Benchmarks behind ``partrain bench NAME``.

Each benchmark is a module ``partrain.bench.<module>`` exposing
``add_arguments(parser)`` (its own options; ``--quick`` and ``--json`` are added
for every benchmark) and ``run(args) -> dict[str, float]``: it prints a readable
table with ratios against the baseline a user would otherwise use, measured in
the same run, and returns every figure it printed; ``--json FILE`` writes them.
"""

BENCHMARKS = {
    "core": "partrain.bench.core",
    "async": "partrain.bench.async_",
    "syncbn": "partrain.bench.syncbn",
    "serve": "partrain.bench.serve",
    "population": "partrain.bench.population",
}
