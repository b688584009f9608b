"""Benchmarks behind ``partrain bench NAME``.

Each benchmark is a module ``partrain.bench.<module>`` exposing
``add_arguments(parser)`` (its own options; ``--quick`` and ``--json`` are added
for every benchmark) and ``run(args) -> harness.Report``. It measures a capability
and the alternative a user would otherwise pick, in the same run, on the one
harness (`partrain.bench.harness`): variants in alternating rounds, medians with
their min-max spread, ratios, and goals under stable names; ``--json FILE``
writes every figure and goal.

Library code never imports this package: it measures the library, not the reverse.
"""

BENCHMARKS = {
    "core": "partrain.bench.core",
    "async": "partrain.bench.async_",
    "syncbn": "partrain.bench.syncbn",
    "serve": "partrain.bench.serve",
    "population": "partrain.bench.population",
    "engines": "partrain.bench.engines",
    "pipeline": "partrain.bench.pipeline",
    "stream": "partrain.bench.stream",
    "data": "partrain.bench.data",
    "compare": "partrain.bench.compare",
    "rl": "partrain.bench.rl",
    "lm": "partrain.bench.lm",
    "generate": "partrain.bench.generate",
    "sharded": "partrain.bench.sharded",
}
