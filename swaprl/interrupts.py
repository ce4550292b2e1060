"""Critical sections that hold signals: a KeyboardInterrupt arriving inside one is raised once the section ends.

CPython raises a signal handler's exception (KeyboardInterrupt for Ctrl-C, whatever a SIGALRM or SIGTERM handler
raises) wherever the main thread checks for signals: at a function's entry, at a C call's return, between any two
bytecodes. Inside a phase switch, an attach or a detach, that can fall between a change and the record of its undo,
or between the last step of a switch and the runtime noting the phase it is in, and leave the runtime telling
something other than the truth. Rather than undo from every such point, those parts run in `held(what)`: a signal
that arrives meanwhile is recorded, and its handler runs once the part has finished (or finished undoing itself),
when everything is consistent again.

How: each signal's Python handler is wrapped (`guard`, done at the first section and again wherever one was set
since) in a guard that looks at where the main thread was when the signal came. Inside a section, or inside a
function marked `@protected` (one that must run a section once it is called, such as leaving a `with phase(...)`
block or an undo: a signal at its first instruction, before its section has begun, would stop it from running at
all), the guard records the signal; the outermost section's end runs its handler. Elsewhere the handler runs at once,
as it would without swaprl. This is what trio does for Ctrl-C (it marks frames, and its handler looks at them).

A second signal of the same kind inside the same section runs its handler at once: the way out of a part that
hangs (a collective waiting for a rank that died), at the price of what the first one protected; the first one's
log line says so. Signals reach Python's handlers in the main thread only: in any other thread nothing is held.
Only signals with a Python handler are guarded (the default SIGINT handler is one); those left to the OS keep the
OS's behaviour. `unguard` (detach) gives each its handler back.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import TypeVar

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable)
_T = TypeVar("_T")
_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGALRM", None),
                             getattr(signal, "SIGHUP", None), getattr(signal, "SIGUSR1", None),
                             getattr(signal, "SIGUSR2", None)) if s is not None)

# Process-wide because signals are: the sections the main thread is inside (outermost first), the signals that
# arrived meanwhile (each with its handler and frame), the code of the functions marked @protected, and whether the
# outermost section is running the handlers now (a signal then is raised at once).
_sections: list[str] = []
_pending: dict[int, tuple[Callable, FrameType | None]] = {}
_protected: set[CodeType] = set()
_delivering = False


def protected(fn: _F) -> _F:
    """Mark `fn` as one whose every instruction is held, its first included: for a function that must run once
    called (it enters a `held` section itself, and a signal before that section would skip it)."""
    _protected.add(fn.__code__)
    return fn


class held:
    """`with held("switching train -> generate"):` runs the block with the main thread's Python-handled signals
    deferred to its end (see the module's doc). Sections nest: the outermost one's end runs what arrived."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> held:
        if threading.current_thread() is threading.main_thread():
            if not _sections:
                guard()
            _sections.append(self.what)
        return self

    def __exit__(self, *exc) -> bool:
        global _delivering
        if threading.current_thread() is not threading.main_thread():
            return False
        _sections.pop()
        if not _sections and _pending:
            arrived = list(_pending.items())
            _pending.clear()
            _delivering = True
            try:
                _run_handlers(arrived)  # KeyboardInterrupt, or what the handler raises, from here
            finally:
                _delivering = False
        return False


def _run_handlers(arrived: list[tuple[int, tuple[Callable, FrameType | None]]]) -> None:
    """Each handler in turn; one that raises (Ctrl-C's) still lets the others run, as CPython runs the signals
    still pending at its next check: a SIGTERM handler that asks the loop to stop is not lost to a Ctrl-C that came
    during the same section. What a handler raises comes out once all have run (a later one's exception with the
    earlier one as its context)."""
    if arrived:
        (number, (handler, frame)), *rest = arrived
        try:
            handler(number, frame)
        finally:
            _run_handlers(rest)


@protected
def finish(what: str, fn: Callable[[], _T]) -> _T:
    """`fn()` in `held(what)`, for what must run once it is due (leaving a phase block, an undo): protected, so a
    signal that arrives before the section has begun waits for it too."""
    with held(what):
        return fn()


def guard() -> None:
    """Wrap every Python signal handler not wrapped yet (main thread only)."""
    for number in _SIGNALS:
        handler = signal.getsignal(number)
        if callable(handler) and not hasattr(handler, "swaprl_guarded"):
            signal.signal(number, _guarded(handler))


def unguard() -> None:
    """Give each guarded signal its own handler back (main thread only; nothing while a section runs)."""
    if threading.current_thread() is not threading.main_thread() or _sections:
        return
    for number in _SIGNALS:
        handler = signal.getsignal(number)
        if hasattr(handler, "swaprl_guarded"):
            signal.signal(number, handler.swaprl_guarded)


def _inside_protected(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _protected:
            return True
        frame = frame.f_back
    return False


def _guarded(handler: Callable) -> Callable:
    def guarded(signum: int, frame: FrameType | None) -> None:
        if _delivering or not (_sections or _inside_protected(frame)):
            handler(signum, frame)
            return
        where = _sections[0] if _sections else "about to hold signals"
        if signum in _pending:  # the second one: at once
            _pending.pop(signum)
            logger.warning("%s again while swaprl was %s: raised now; the runtime may be left inconsistent",
                           signal.Signals(signum).name, where)
            handler(signum, frame)
            return
        _pending[signum] = (handler, frame)
        logger.warning("%s while swaprl is %s: it is raised once that is done (send it again to raise it now)",
                       signal.Signals(signum).name, where)

    guarded.swaprl_guarded = handler
    return guarded
