"""Critical sections that hold signals: a KeyboardInterrupt arriving inside one is raised once the section ends.

CPython raises a signal handler's exception (KeyboardInterrupt for Ctrl-C, whatever a SIGALRM or SIGTERM handler
raises) wherever the main thread checks for signals: at a function's entry, at a C call's return, between any two
bytecodes. Inside a phase switch, an attach or a detach, that can fall between a change and the record of its undo,
or between the last step of a switch and the runtime noting the phase it is in, and leave the runtime telling
something other than the truth. Rather than undo from every such point, each of those parts runs in `held(what)`:
a signal that arrives meanwhile is recorded, and its handler runs once the part has finished (or finished undoing
itself), when everything is consistent again.

A second signal of the same kind inside the same section runs its handler at once: the way out of a part that
hangs (a collective waiting for a rank that died), at the price of what the first one protected; the first one's
log line says so.

Signals reach Python's handlers in the main thread only, so in any other thread `held` changes nothing. Only
signals with a Python handler are held (the default SIGINT handler is one); those left to the OS are not.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

logger = logging.getLogger(__name__)

_held: list[str] = []  # what the sections entered in the main thread are doing, outermost first
_pending: dict[int, tuple[Callable, FrameType | None]] = {}  # a signal that arrived inside one -> its handler, frame


@contextlib.contextmanager
def held(what: str) -> Iterator[None]:
    """Run the block with the main thread's Python-handled signals deferred to its end (see the module's doc);
    `what` names the part for the log line a deferred signal writes. Sections nest: the outermost releases."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _held:  # inside another section: that one holds and releases
        _held.append(what)
        try:
            yield
        finally:
            _held.pop()
        return
    previous = {}
    for number in _handled():
        handler = signal.getsignal(number)
        previous[number] = handler
        signal.signal(number, _recording(number, handler))
    _held.append(what)
    try:
        yield
    finally:
        _held.pop()
        for number, handler in previous.items():
            signal.signal(number, handler)
        arrived = list(_pending.items())
        _pending.clear()
        for _number, (handler, frame) in arrived:
            handler(_number, frame)  # KeyboardInterrupt, or what the handler raises, from here


def _handled() -> list[int]:
    """The signals whose handler is a Python function now (not the OS's default, not ignored)."""
    out = []
    for number in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGALRM", None), getattr(signal, "SIGHUP", None),
                   getattr(signal, "SIGUSR1", None), getattr(signal, "SIGUSR2", None)):
        if number is not None and callable(signal.getsignal(number)):
            out.append(number)
    return out


def _recording(number: int, handler: Callable) -> Callable:
    def record(signum: int, frame: FrameType | None) -> None:
        if signum in _pending:  # the second one: at once
            _pending.pop(signum)
            logger.warning("%s again while swaprl was %s: raised now; the runtime may be left inconsistent",
                           signal.Signals(signum).name, _held[0] if _held else "busy")
            handler(signum, frame)
            return
        _pending[signum] = (handler, frame)
        logger.warning("%s while swaprl is %s: it is raised once that is done (send it again to raise it now)",
                       signal.Signals(signum).name, _held[0] if _held else "busy")

    return record
