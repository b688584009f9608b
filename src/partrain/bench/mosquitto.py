"""A real MQTT broker on a free port of 127.0.0.1: mosquitto, for ``bench stream`` and the stream tests.

The binary comes from the system (``mosquitto``, or ``/usr/sbin/mosquitto`` where
Debian puts it outside a user's PATH). Where it is missing, the tests' set-up installs
it (tests/system_packages.py, as root: CI containers); the benchmark itself installs
nothing and reports its MQTT goals as not measured, saying why in one line. Readiness is the broker's port accepting a connection, never
a sleep.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

SYSTEM_PATH = "/usr/sbin/mosquitto"


def find_mosquitto() -> str | None:
    """The mosquitto binary on PATH or at Debian's `SYSTEM_PATH`; None when there is none."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return SYSTEM_PATH if os.access(SYSTEM_PATH, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """One mosquitto process on a free port, configured by ``settings`` (mosquitto.conf lines)
    besides the listener; `restart` keeps its port (and, with persistence, its sessions)."""

    def __init__(self, binary: str, directory: Path, settings: Sequence[str] = ()) -> None:
        self.binary = binary
        self.port = free_port()
        self.directory = directory
        self.config = directory / "mosquitto.conf"
        self.log = directory / "mosquitto.log"
        self.config.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            # as root mosquitto drops to user 'mosquitto', which cannot write into this directory
            + ("user root\n" if os.geteuid() == 0 else "")
            + "log_dest stderr\n"
            + "".join(f"{line}\n" for line in settings)
        )
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        with open(self.log, "a") as log:
            self.process = subprocess.Popen([self.binary, "-c", str(self.config)], stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.process.returncode}:\n{self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mosquitto did not listen on {self.port} within {timeout:g} s") from None
                time.sleep(0.01)  # polling the port: the condition itself

    def stop(self) -> None:
        """SIGTERM (mosquitto saves its sessions to disk when it persists them), SIGKILL if it lingers."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()
