"""The base install (no extra) runs every command that needs none: `make run` on a fresh clone.

Why it exists: the rest of the suite runs with every extra installed, so a command module that
imported `prometheus_client` while the parser was built broke `partrain --help`, `partrain train`
and `make run` for every `pip install partrain` user, and no test noticed. Here partrain is
installed alone into a new virtual environment (torch the way the Makefile takes it) and the
README's first command runs from there; a command that needs an extra says which, in one line.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXTRA_MODULES = ("starlette", "uvicorn", "prometheus_client", "httpx", "gymnasium", "paho", "ray")


def _uv() -> list[str]:
    try:
        import uv  # noqa: F401  (the Makefile installs it into .venv)
    except ImportError:
        pytest.skip("uv is not installed here (make test installs it into .venv)")
    return [sys.executable, "-m", "uv"]


def _torch_wheels() -> str | None:
    """The folder the Makefile takes the torch 2.13.0 CPU wheel from, when it has it."""
    folder = (os.environ.get("PIP_FIND_LINKS") or "/opt/wheels").split()[0]
    return folder if glob.glob(os.path.join(folder, "torch-2.13.0+cpu-*.whl")) else None


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("base") / "venv"
    uv = _uv()
    subprocess.run(uv + ["venv", "--quiet", "--python", sys.executable, str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = uv + ["pip", "install", "--quiet", "--python", str(python), "--constraint",
                    str(REPO / "constraints.txt")]
    wheels = _torch_wheels()
    if wheels is None:  # as the Makefile does: pip, whose configuration finds the CPU wheel
        subprocess.run([str(python), "-m", "ensurepip", "--upgrade"], check=True, timeout=300,
                       capture_output=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--constraint",
                        str(REPO / "constraints.txt"), "torch==2.13.0"], check=True, timeout=900)
    else:
        subprocess.run(install + ["--find-links", wheels, "torch==2.13.0"], check=True, timeout=600)
    subprocess.run(install + [str(REPO)], check=True, timeout=600)
    return venv


def _partrain(venv: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / "partrain"), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def test_the_base_install_has_no_extra(base_venv: Path) -> None:
    """The premise of the tests below: nothing an extra installs came in with the base package."""
    probe = f"import importlib.util as u; print(*[m for m in {EXTRA_MODULES!r} if u.find_spec(m)])"
    out = subprocess.run([str(base_venv / "bin" / "python"), "-c", probe], capture_output=True,
                         text=True, check=True, timeout=60)
    assert out.stdout.split() == []


def test_help_lists_every_command_without_any_extra(base_venv: Path) -> None:
    done = _partrain(base_venv, "--help")
    assert done.returncode == 0, done.stderr
    for command in ("train", "population", "serve", "stream", "rl", "loadtest", "bench", "compare"):
        assert f"    {command}" in done.stdout  # building this parser imported every command's module
    done = _partrain(base_venv, "bench", "--help")
    assert done.returncode == 0, done.stderr
    assert "(needs the" not in done.stdout  # every benchmark's module imports without its extra


def test_serve_help_names_its_extra_and_serve_says_it_in_one_line(base_venv: Path) -> None:
    done = _partrain(base_venv, "serve", "--help")
    assert done.returncode == 0, done.stderr
    assert "--max-batch-size" in done.stdout  # the real options, not a stand-in
    assert "pip install 'partrain[serve]'" in " ".join(done.stdout.split())

    done = _partrain(base_venv, "serve", "model.pt")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "partrain serve: error: this command needs the 'serve' extra (No module named "
        "'prometheus_client'): pip install 'partrain[serve]'"]


def test_rl_names_the_rl_extra(base_venv: Path) -> None:
    done = _partrain(base_venv, "rl", "train")
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("partrain rl: error: this command needs the 'rl' extra")
    assert line.endswith("pip install 'partrain[rl]'")


def test_make_run_trains_on_the_base_install(base_venv: Path, tmp_path: Path) -> None:
    """`make run` is `partrain train` on the base install; one epoch here."""
    done = _partrain(base_venv, "train", "--epochs", "1", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "test accuracy:" in done.stdout
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
