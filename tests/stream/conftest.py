"""A real MQTT broker for the stream tests: mosquitto on a free port of 127.0.0.1.

Finding the binary (and installing it with apt-get where it is missing and the
tests run as root) and running it are `partrain.bench.mosquitto`'s, shared with
``partrain bench stream``; where no broker can be had, the MQTT tests are skipped
with the reason. Each test gets its own broker with persistence in its temporary
directory, so a test can restart it on the same port (`Broker.restart`) and find
its sessions again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from partrain.bench import mosquitto
from partrain.bench.mosquitto import free_port
from tests import system_packages

__all__ = ["Broker", "free_port"]  # test modules import both from here


class Broker(mosquitto.Broker):
    """The tests' broker: sessions persisted in its directory (a restart finds them again), and a
    queue per client that no test fills."""

    def __init__(self, binary: str, directory: Path) -> None:
        super().__init__(binary, directory, settings=(
            "persistence true",
            f"persistence_location {directory}/",
            "max_queued_messages 100000",
        ))


@pytest.fixture(scope="session")
def mosquitto_binary() -> str:
    binary, why = system_packages.mosquitto()
    if binary is None:
        pytest.skip(f"no MQTT broker: {why}")
    return binary


@pytest.fixture
def broker(mosquitto_binary: str, tmp_path: Path) -> Iterator[Broker]:
    directory = tmp_path / "broker"
    directory.mkdir()
    b = Broker(mosquitto_binary, directory)
    b.start()
    try:
        yield b
    finally:
        b.stop()
