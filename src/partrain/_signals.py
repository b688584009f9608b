"""SIGINT and SIGTERM as an exception: a signal unwinds partrain the way Ctrl-C does.

By default SIGTERM ends a Python process on the spot: no ``finally`` runs, so the
worker processes it started keep training (and writing files) as orphans and its
temporary directories stay. `signals_raise` installs, for the duration of a
block, a handler that raises `Interrupted` (a `KeyboardInterrupt`) in the main
thread instead; the ordinary unwinding then stops every process and removes
every directory on its way out.

Two users:

- the ``partrain`` command (`partrain.cli.main`) owns its process: it takes both
  signals over (``take_over=True``) and, at the signal, also asks every child
  process it started to stop (``on_signal``), so that a child nobody is waiting
  for stops too;
- `partrain.launch`, called from someone else's program, only replaces the
  defaults (SIGTERM's "die now", Python's own SIGINT handler), only in the main
  thread (Python allows handlers nowhere else), and puts them back when it returns.

A second signal while the first is being handled does not interrupt the clean-up
(it is bounded: stopping processes takes seconds at most) unless ``REPEAT_AFTER``
seconds have passed, in case the clean-up itself is stuck in someone's code.

Python runs a handler at the next bytecode of the main thread, wherever that is:
inside a weakref callback or a ``__del__`` (importlib's module locks have one) the
raised `Interrupted` cannot propagate, and Python would only print "Exception
ignored in ..." and go on. While a handler of this module is installed such a
lost `Interrupted` is not printed: the signal is sent again (from another
thread), and the handler raises it once the main thread is out of the callback.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: seconds after a signal during which another one is ignored (the first is being handled)
REPEAT_AFTER = 10.0


class RaiseInterrupted:
    """A signal handler: raise `Interrupted`; ``on_signal(signum)`` first, if given."""

    def __init__(self, on_signal: Callable[[int], None] | None = None) -> None:
        self.on_signal = on_signal
        self.first: float | None = None  # time.monotonic() of the signal being handled
        self.received: list[int] = []
        self.resent = False  # the signal was sent again because its Interrupted was lost
        self.in_hook = False  # `lost` is running: an Interrupted raised now would be lost too

    def __call__(self, signum: int, frame: Any) -> None:
        if self.in_hook:
            return  # only a second signal can come now: the first is being sent again
        if self.resent:  # the same signal again, already counted and passed on
            self.resent = False
            raise Interrupted(signum)
        now = time.monotonic()
        if self.first is not None and now - self.first < REPEAT_AFTER:
            return  # the first one is unwinding the program: let its clean-up finish
        self.first = now
        self.received.append(signum)
        if self.on_signal is not None:
            self.on_signal(signum)
        raise Interrupted(signum)

    def lost(self, stop: Interrupted) -> None:
        """``stop`` was raised where it could not propagate: send its signal again."""
        self.in_hook = True
        self.resent = True
        threading.Thread(target=self._send_again, args=(stop.signum,), name="partrain-resend-signal",
                         daemon=True).start()
        self.in_hook = False  # the last statement: no signal is handled between it and the return

    def _send_again(self, signum: int) -> None:
        # From another thread, once `lost` has returned: the handler runs at the main thread's
        # next bytecode, which must be back in the code that was interrupted, not in `lost`.
        while self.in_hook:
            time.sleep(0.001)
        signal.pthread_kill(threading.main_thread().ident, signum)


def _resend_lost_interrupts(handler: RaiseInterrupted) -> Callable[[], None]:
    """Install a `sys.unraisablehook` that sends a lost `Interrupted`'s signal again; return its undo."""
    previous_hook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, Interrupted):
            handler.lost(unraisable.exc_value)
        else:
            previous_hook(unraisable)

    sys.unraisablehook = hook

    def undo() -> None:
        sys.unraisablehook = previous_hook
    return undo


@contextlib.contextmanager
def signals_raise(*, take_over: bool, on_signal: Callable[[int], None] | None = None
                  ) -> Iterator[RaiseInterrupted | None]:
    """Inside the block SIGINT and SIGTERM raise `Interrupted` in the main thread.

    ``take_over=False`` (library code) keeps any handler the program installed and
    replaces only the defaults; ``take_over=True`` (the command) replaces them all.
    Either way a signal the program ignores (``SIG_IGN``: a shell's background job)
    stays ignored. ``take_over=True`` also unblocks both in the main thread for the block
    (a blocked mask is inherited from whichever thread started the process). Outside the
    main thread nothing is installed and None is yielded.
    """
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    handler = RaiseInterrupted(on_signal)
    previous: dict[signal.Signals, Any] = {}
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if current == signal.SIG_IGN or current is None:  # None: set outside Python, leave it
            continue
        if take_over or current in (signal.SIG_DFL, signal.default_int_handler):
            previous[sig] = signal.signal(sig, handler)
    # a process started from a thread that blocked these signals inherits the mask: the
    # command would never see them (a Ctrl-C stays pending while it waits on its workers)
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS) if take_over else None
    undo_hook = _resend_lost_interrupts(handler)
    try:
        yield handler
    finally:
        undo_hook()
        for sig, old in previous.items():
            signal.signal(sig, old)
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def install_in_worker() -> None:
    """In a process partrain started: SIGTERM raises `Interrupted`, SIGINT is ignored.

    The process that started this one owns it: it stops it with SIGTERM (after
    which the job's ``finally`` blocks run: a checkpoint being written is either
    whole or not there) and it alone decides what Ctrl-C means. Without this, Ctrl-C
    in a terminal, which reaches every process of the foreground group, made each
    worker print its own traceback beside the launcher's one line.
    """
    handler = RaiseInterrupted()
    signal.signal(signal.SIGTERM, handler)
    _resend_lost_interrupts(handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
