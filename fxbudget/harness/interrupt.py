"""Ctrl-C that is never lost: `fxbudget compare` stops at the next safe point, not wherever the signal lands.

Python raises `KeyboardInterrupt` in whatever the main thread runs when SIGINT arrives; code that ignores exceptions
(weakref callbacks of torch._dynamo, `__del__`) swallows it, and the run goes on as if nothing was pressed. While
`deferred()` is active, the first Ctrl-C only records the request; `checkpoint()`, called where stopping leaves
nothing half done (between rows, between decode steps, between the kernel fingerprints and the compile, before the
report), raises `KeyboardInterrupt` once one was recorded. A second Ctrl-C raises at once, wherever it lands (and
the recorded request still stops the run at the next safe point if that one is swallowed too). `immediate()` marks
a stretch with no safe point inside and nothing to leave half done (the embedded model's first-use conversion,
which writes its cache atomically): there the first Ctrl-C raises too.

Only the main thread can install a signal handler: elsewhere `deferred()` changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

_requested = False  # a Ctrl-C was pressed while deferred
_immediate = False  # inside `immediate()`: raise on the first Ctrl-C
_installed = False
# Said at once on the first Ctrl-C: the safe point can be a row's seconds away, and silence reads as "not heard".
NOTICE = ("[fxbudget] Ctrl-C: stopping at the next safe point (every finished row is kept); press Ctrl-C again to "
          "stop at once.\n")


def _handler(signum, frame) -> None:
    global _requested
    first = not _requested
    _requested = True
    if first and not _immediate:
        # os.write, not print: a handler that runs while the main thread is inside sys.stderr.write would re-enter it.
        os.write(2, NOTICE.encode())
        return  # stop at the next `checkpoint()`
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a third Ctrl-C: Python's own behaviour
    raise KeyboardInterrupt


def requested() -> bool:
    """Whether a Ctrl-C was recorded (and not yet acted on by a checkpoint)."""
    return _requested


def checkpoint(where: str = "") -> None:
    """A safe point named `where` (tests interrupt the run at a named one): raise `KeyboardInterrupt` if a Ctrl-C
    was recorded."""
    if _requested:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred():
    """Install the deferring SIGINT handler for the block (main thread only), and restore the previous one after."""
    global _requested, _installed
    if threading.current_thread() is not threading.main_thread() or _installed:
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    _requested, _installed = False, True
    signal.signal(signal.SIGINT, _handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        _requested, _installed = False, False


@contextlib.contextmanager
def immediate():
    """Inside `deferred()`: a stretch with no safe point and nothing to leave half done, where the first Ctrl-C
    raises at once (a request recorded before it is acted on first)."""
    global _immediate
    checkpoint("before an uninterruptible stretch")
    before, _immediate = _immediate, True
    try:
        yield
    finally:
        _immediate = before
