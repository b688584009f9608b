"""Library code never imports ``partrain.bench``: benchmarks measure the library, not the reverse.

A library module that reaches into the benchmarks drags their dependencies
(LitServe adapters, timing harness) into every user's import and ties the
library's behaviour to code that is only run by hand. The ``partrain bench``
subcommand is registered by module name in ``partrain/cli.py`` (a string,
imported only when the command runs), which is not an import and is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import partrain

SRC = Path(partrain.__file__).parent


def _imports_of_bench(path: Path, src: Path = SRC) -> list[str]:
    """The import statements of ``path`` (in the package at ``src``) that resolve into ``partrain.bench``."""
    package = ".".join(("partrain", *path.relative_to(src).parent.parts))
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        if any(n == "partrain.bench" or n.startswith("partrain.bench.") for n in names):
            found.append(f"{path.relative_to(src)}:{node.lineno}")
    return found


def test_no_library_module_imports_the_benchmarks():
    offenders = [hit for path in sorted(SRC.rglob("*.py")) if "bench" not in path.relative_to(SRC).parts[:1]
                 for hit in _imports_of_bench(path)]
    assert offenders == []


def test_the_check_finds_relative_and_absolute_imports(tmp_path):
    # the detector itself, on a fake package laid out like partrain's
    root = tmp_path / "partrain"
    (root / "population").mkdir(parents=True)
    cases = {"from ..bench.common import format_table": True, "from ..bench import harness": True,
             "import partrain.bench.serve": True, "from partrain.bench import core": True,
             "from ..benchmarks import x": False, "from .report import y": False, "import partrain": False}
    for i, (line, flagged) in enumerate(cases.items()):
        module = root / "population" / f"m{i}.py"
        module.write_text(line + "\n")
        assert bool(_imports_of_bench(module, root)) is flagged, line
