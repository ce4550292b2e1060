"""`Undo`: changes recorded as they are made, so that a failure puts back everything done so far, in reverse; and
`Step`, one change of a phase switch with the function that reverts it.

Every multi-part change in swaprl (a phase transition's steps, attaching, patching an optimizer, wrapping a
trainer) records how to revert each part right after making it. Reverting keeps going when one part fails to
revert (the rest still hold tensors or methods to put back) and logs that failure, so the error a caller sees is
the one that started the rollback.

    undo = Undo("attach")
    with undo.on_error():          # an exception in the block reverts what was recorded, then re-raises
        hook = optimizer.register_step_pre_hook(check)
        undo.push(hook.remove)
    ...
    undo.run()                     # later (detach): revert it all
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import interrupts

logger = logging.getLogger(__name__)


class Undo:
    """A stack of functions that revert changes; `run()` calls them newest first, once."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._stack: list[tuple[Callable[[], object], str]] = []

    def push(self, fn: Callable[[], object], name: str = "") -> None:
        """Record `fn` as the way to revert the change just made (`name` labels it in logs)."""
        self._stack.append((fn, name or getattr(fn, "__name__", "")))

    def __len__(self) -> int:
        return len(self._stack)

    @interrupts.protected
    def run(self, *, raise_exits: bool = False) -> list[str]:
        """Revert every recorded change, newest first; a revert that raises is logged and the rest still run, and a
        Ctrl-C is held until all have run (stopping halfway would leave more out of place than finishing). Returns
        what could not be reverted ("name: error" per change), so the caller can say what is left. `raise_exits`:
        for callbacks of the user's, a sys.exit() or KeyboardInterrupt one raises is raised again once all have
        run (a rollback's own reverts keep the error that started it)."""
        failed: list[str] = []
        stops: list[BaseException] = []

        def undo_all() -> None:
            while self._stack:
                fn, name = self._stack[-1]
                try:
                    fn()
                except BaseException as exc:  # keep going: the remaining changes still have tensors or methods
                    logger.exception("undoing %r of %s failed", name, self.what)
                    failed.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
                    if raise_exits and not isinstance(exc, Exception):
                        stops.append(exc)
                self._stack.pop()  # after it ran: an entry that was not run stays on the stack

        interrupts.finish(f"undoing {self.what}", undo_all)
        if stops:
            raise stops[0]
        return failed

    def clear(self) -> None:
        """Keep the changes: forget how to revert them."""
        self._stack.clear()

    def take(self, other: Undo) -> None:
        """Take over `other`'s changes (reverted after the ones recorded here already, before later ones); `other`
        is left empty, so its `on_error` has nothing more to revert."""
        self._stack += other._stack
        other._stack = []

    @contextlib.contextmanager
    def on_error(self) -> Iterator[Undo]:
        """Revert what was recorded if the block raises (any exception, KeyboardInterrupt included), then re-raise."""
        try:
            yield self
        except BaseException:
            self.run()
            raise


@dataclass(slots=True)
class Step:
    """One change of a phase switch (`Runtime` runs them in order): `do` it; `undo` reverts it if a later step
    fails; `commit` runs once the whole switch stands (what the change keeps aside until then, it may let go)."""

    name: str
    do: Callable[[], object]
    undo: Callable[[], object] | None = None
    commit: Callable[[], object] | None = None
    blocking: bool = True  # False: its copies may still run when the next step starts (not timed to completion)
    started_by: str | None = None  # the step that queued this one's copies: its event also gets the whole span
    moves: bool = True  # False: the bytes `do` returns were freed, handed back or copied on the device, not moved
    # between the device and host memory (not in the switch's total)


def in_flight(steps: list[Step], at: int) -> bool:
    """Whether `steps[at]` ran while copies an earlier step queued were still running: after a step whose copies a
    later one waits for (`Step.started_by`), up to that one."""
    names = [s.name for s in steps]
    return any(names.index(s.started_by) < at <= i for i, s in enumerate(steps) if s.started_by in names)
