"""Waiting on a condition instead of sleeping for a guessed time.

A test that sleeps 50 ms "so the request is in flight" passes on an idle
machine and fails at load average 8. These helpers poll the condition itself
and fail with a message naming it once a generous bound has passed; they never
make a test slower than the condition takes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

BOUND = 30.0  # seconds: generous, a loaded CI machine must never reach it on a healthy run


def wait_until(condition: Callable[[], object], what: str = "the condition", timeout: float = BOUND,
               interval: float = 0.001) -> None:
    """Return as soon as ``condition()`` is truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


async def async_wait_until(condition: Callable[[], object], what: str = "the condition",
                           timeout: float = BOUND, interval: float = 0.001) -> None:
    """`wait_until` for a coroutine: yields to the event loop between polls."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
