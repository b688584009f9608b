"""System packages the tests need (an MQTT broker, a shell's tools), found or installed.

Where a package is missing and the tests run as root (CI containers), it is installed with
apt-get (``apt-get update`` then ``apt-get install -y``, bounded); where it still cannot be
had, the caller skips with the reason this returns. partrain itself installs nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

INSTALL_TIMEOUT = 240  # seconds for apt-get update + install


def apt_install(package: str) -> str:
    """apt-get install ``package`` (root only, bounded); the reason it could not, as text ("" when it ran)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return f"{package} is not installed and the tests do not run as root to install it"
    if not shutil.which("apt-get"):
        return f"{package} is not installed and there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", package]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        except subprocess.TimeoutExpired:
            return f"{' '.join(command)} took over {INSTALL_TIMEOUT} s"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
            return f"{' '.join(command)} failed: {tail[0]}"
    return ""


def find_or_install(find: Callable[[], str | None], package: str) -> tuple[str | None, str]:
    """``(path, "")`` from ``find()``, installing ``package`` first where it is missing; else ``(None, why)``."""
    found = find()
    if found is None:
        why = apt_install(package)
        found = find()
        if found is None:
            return None, why or f"{package} not found after installing it"
    return found, ""


def mosquitto() -> tuple[str | None, str]:
    """The mosquitto binary, installed where it can be; else ``(None, why)``."""
    from partrain.bench.mosquitto import find_mosquitto

    return find_or_install(find_mosquitto, "mosquitto")
