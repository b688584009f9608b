"""The README and docs/ against the code: their examples must name what exists.

Documentation drifts silently when an option or a function is renamed. Two checks,
neither runs an example (most are fragments, or need a broker, a GPU or a cluster):

- every ``partrain ...`` command line in a code block parses with the CLI's own parser
  (`partrain.cli.build_parser`): each subcommand and flag exists and takes its values;
- every Python code block compiles, every name it imports from ``partrain`` exists,
  every ``partrain.NAME`` it uses exists, and every keyword argument it passes to a
  partrain callable is one that callable accepts (unless it takes ``**kwargs``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import re
import shlex
from pathlib import Path

import pytest

from partrain.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*/*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)


def blocks(kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """(where, text) of every fenced block whose language is among ``kinds`` ("" = unmarked)."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) in kinds:
                line = text.count("\n", 0, m.start()) + 1
                found.append((f"{path.relative_to(ROOT)}:{line}", m.group(2)))
    return found


def command_lines() -> list[tuple[str, str]]:
    """``partrain COMMAND ...`` lines of shell blocks (continuations joined), not output lines."""
    commands = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001 - the CLI's own table
    found = []
    for where, text in blocks(("", "bash", "sh", "shell", "console")):
        for line in text.replace("\\\n", " ").splitlines():
            words = line.strip().removeprefix("$ ").split()
            if len(words) >= 2 and words[0] == "partrain" and words[1] in commands:
                found.append((where, line.strip().removeprefix("$ ")))
    return found


COMMANDS = command_lines()


def test_the_docs_have_commands_and_python_to_check():
    assert len(COMMANDS) >= 30 and len(blocks(("python",))) >= 20  # the extraction found them


@pytest.mark.parametrize("where, line", COMMANDS, ids=[f"{w} {line[:60]}" for w, line in COMMANDS])
def test_every_documented_command_parses(where, line):
    argv = shlex.split(line, comments=True)[1:]
    if argv[:2] == ["bench", "--list"]:
        argv = argv[:2]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: {line!r} does not parse: {err.getvalue().strip().splitlines()[-1:]}")
    assert isinstance(args, argparse.Namespace)


def _resolve(module: str, name: str) -> object:
    mod = importlib.import_module(module)
    if not hasattr(mod, name):  # a submodule imported by name
        return importlib.import_module(f"{module}.{name}")
    return getattr(mod, name)


def _fit_options() -> set[str]:
    """What ``fit(**options)`` takes: the fields of its two configs."""
    import dataclasses

    from partrain import FitConfig, LaunchConfig

    return {f.name for cls in (FitConfig, LaunchConfig) for f in dataclasses.fields(cls)}


def _accepts(obj: object, keyword: str) -> bool:
    import partrain

    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return True  # a builtin without a signature: nothing to check
    if keyword in params:
        return True
    if obj is partrain.fit:  # its **options are the configs' fields, no others
        return keyword in _fit_options()
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


PYTHON = blocks(("python",))


@pytest.mark.parametrize("where, code", PYTHON, ids=[w for w, _ in PYTHON])
def test_every_documented_python_block_names_what_exists(where, code):
    try:
        tree = compile(code, where, "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        pytest.fail(f"{where}: does not compile: {exc}")
    # names bound to partrain objects: ``partrain`` itself always (fragments leave out ``import partrain``)
    known: dict[str, object] = {"partrain": importlib.import_module("partrain")}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "partrain":
            for alias in node.names:
                try:
                    known[alias.asname or alias.name] = _resolve(node.module, alias.name)
                except (ImportError, AttributeError):
                    pytest.fail(f"{where}: 'from {node.module} import {alias.name}': no such name")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "partrain":
                    module = importlib.import_module(alias.name)  # ``import partrain.ray`` loads partrain.ray
                    known[alias.asname or "partrain"] = module if alias.asname else importlib.import_module("partrain")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "partrain":
            assert hasattr(known["partrain"], node.attr), f"{where}: partrain.{node.attr}: no such name"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        target = None
        if isinstance(func, ast.Name) and func.id in known:
            target, label = known[func.id], func.id
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in known
              and inspect.ismodule(known[func.value.id]) and hasattr(known[func.value.id], func.attr)):
            target, label = getattr(known[func.value.id], func.attr), f"{func.value.id}.{func.attr}"
        if target is None or not callable(target):
            continue
        for kw in node.keywords:
            if kw.arg is not None:
                assert _accepts(target, kw.arg), f"{where}: {label}(..., {kw.arg}=...): no such parameter"
