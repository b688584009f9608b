"""Which extra a missing module means, and the one line the CLI prints for it.

The base install's commands are run for real in test_base_install.py; these tests pin the
mapping itself (an extra that includes another, a user's own missing module that must stay
the user's error) without building a virtual environment.
"""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from partrain import cli
from partrain.extras import MissingExtra, missing_extra, provides, require


def _missing(name: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named '{name}'", name=name)


def test_a_module_names_the_smallest_extra_unless_the_command_declares_a_larger_one() -> None:
    assert missing_extra(_missing("prometheus_client")).extra == "serve"
    assert missing_extra(_missing("starlette.requests")).extra == "serve"
    assert missing_extra(_missing("starlette"), "rl").extra == "rl"  # rl = serve + gymnasium + ...
    assert missing_extra(_missing("prometheus_client"), "stream").extra == "stream"
    assert missing_extra(_missing("paho.mqtt"), "serve").extra == "stream"  # serve does not bring paho
    assert provides("rl-bench", "starlette") and not provides("serve", "gymnasium")


def test_a_users_own_missing_module_is_not_taken_for_an_extra() -> None:
    assert missing_extra(_missing("my_model_package")) is None
    assert missing_extra(ImportError("cannot import name 'x'")) is None


def test_the_line_names_the_extra_and_the_install_command() -> None:
    assert str(MissingExtra("serve", "uvicorn")) == (
        "this command needs the 'serve' extra (No module named 'uvicorn'): pip install 'partrain[serve]'")


def test_require_passes_for_an_installed_extra() -> None:
    require("serve")  # the suite runs with the serve extra installed


def test_the_cli_turns_a_missing_extra_into_one_line_and_exit_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def register(sub: argparse._SubParsersAction) -> None:
        p = sub.add_parser("needy")
        p.set_defaults(func=lambda args: __import__("gymnasium_is_not_here"), extra="rl")

    fake = types.ModuleType("fake_cli")
    fake.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_cli", fake)
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"needy": "fake_cli"})
    monkeypatch.setattr("partrain.extras.MODULE_EXTRAS",
                        {"gymnasium_is_not_here": "rl", "starlette": "serve"})
    assert cli.main(["needy"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "partrain needy: error: this command needs the 'rl' extra (No module named "
        "'gymnasium_is_not_here'): pip install 'partrain[rl]'"]


def test_a_command_module_that_needs_its_extra_to_import_still_lists_and_says_so(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"broken": "partrain_test_no_such_cli"})

    def fake_import(name: str) -> None:
        raise ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn")

    monkeypatch.setattr(cli.importlib, "import_module", fake_import)
    assert cli.main(["broken", "x"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "partrain broken: error: this command needs the 'serve' extra (No module named 'uvicorn'): "
        "pip install 'partrain[serve]'"]
