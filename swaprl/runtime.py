"""The phase machine: which memory is on the device in `train` and in `generate`, and the steps between them.

Every transition is a list of steps (`swaprl.undo.Step`); each step that succeeds is recorded with its undo, so a
failure (an exception, an out-of-memory error, a KeyboardInterrupt) anywhere in a transition undoes what was done,
in reverse, and re-raises with the runtime still in the phase it was in. No tensor is ever lost: a tensor's device
copy is only dropped after its host copy is complete, and its host copy is only reused after it is back on the
device. Should an undo itself fail, the runtime says what it left out of place and the next phase entry completes it.

The machine decides the order; the steps come from those who move the memory: the placement the trainer's
(`Placement.offload_steps`, `reload_steps`), the engine's link its own (`swaprl.engine_link`: wake, sync, check, sleep),
the regions theirs. `swaprl.attach` wires the parts (docs/architecture.md walks through a switch both ways).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Literal, get_args

import torch

from . import distributed, interrupts, memory, regions
from .config import SwapConfig
from .errors import PhaseError, switch_out_of_memory
from .undo import Step, Undo, in_flight
from .verify import SyncReport, raise_if_failed

logger = logging.getLogger(__name__)

Phase = Literal["train", "generate"]
PHASES: tuple[Phase, ...] = get_args(Phase)


class PhaseMachine:
    """The phase state of one trainer (model + optimizer) and one engine, and the switches between the phases.
    `swaprl.attach` builds it wired to its parts (`swaprl.attach.Runtime`)."""

    def __init__(self, config: SwapConfig) -> None:
        self.config = config
        self.model = self.optimizer = self.engine = self.device = None
        self._unbound: str | None = None  # why nothing is bound yet (a pending runtime); None once bound
        self._phase: Phase = "train"
        self._depth, self._cycle, self._closed = 0, 0, False
        self._listeners: list[Callable[[dict], None]] = []
        self._detach_callbacks = Undo("detach")
        self._placement = self._link = None  # swaprl.placement.Placement, swaprl.engine_link.SharedWeights: set by attach
        self._regions: list = []  # swaprl.vmm.PausablePool: the trainer's memory paused in generate
        self._restore = Undo("attach")  # what detach() reverts (and a failed attach, at once)
        self._unsettled: str | None = None  # what a failed rollback left out of place; the next phase entry fixes it
        self._owner: threading.Thread | None = None  # the thread inside a `with phase(...)` block, if any
        self._owner_lock = threading.Lock()

    # ---------------------------------------------------------------- public API
    @property
    def current_phase(self) -> Phase:
        return self._phase

    def phase(self, name: Phase) -> PhaseBlock:
        """Make `name`'s resources resident for the `with` block; restore the previous phase on the way out. Entering
        and leaving are critical sections (`swaprl.interrupts`): a Ctrl-C that arrives during a switch is raised once
        the switch stands, or once it is undone."""
        self._check_bound()
        if name not in PHASES:
            raise PhaseError(f"unknown phase {name!r}; use one of {PHASES}")
        return PhaseBlock(self, name)

    def status(self) -> dict:
        """Where each resource is and how many device bytes it holds now, plus the device and host totals."""
        if self._unbound is not None:  # (after detach() it still answers: everything is back)
            raise PhaseError(f"this runtime has no trainer yet: {self._unbound}")
        out: dict = {"phase": self._phase, "cycle": self._cycle, "device": str(self.device)}
        if self._unsettled is not None:
            out["unsettled"] = self._unsettled
        out.update(self._placement.status())
        if self._regions:
            out["regions"] = regions.status(self._regions)
        out["engine"] = self.engine.memory()
        if (last := self.last_sync) is not None:
            out["last_sync"] = {"cycle": last.cycle, "weights": last.weights, "checked": last.checked,
                                "unreadable": len(last.unreadable), "differing": len(last.differing)}
        if self.device.type == "cuda":
            lender = self.engine.lender
            out["device_memory"] = memory.device_figures(self.device, lent=lender.lent_bytes if lender else 0)
        return out

    @property
    def last_sync(self) -> SyncReport | None:
        """What the check found at the last weight sync (`swaprl.verify.SyncReport`); None before the first."""
        return self._link.last_sync if self._link is not None else None

    def sync_weights(self) -> int:
        """Copy the trainer's parameters into the engine (bucketed, in place); returns the bytes sent."""
        self._check_bound()
        return self._link.sync_weights()

    def verify_sync(self, prompts: list[list[int]] | None = None) -> SyncReport:
        """Check the engine now: prove it holds the trainer's weights bit for bit, and measure the rollout-training
        mismatch on the engine's continuations of `prompts` (default: a fixed probe). Returns the report without
        raising (`report.ok`, `report.differing`). Needs the engine awake and the trainer's parameters on the device
        (phase 'generate', params='keep'); under torchrun every rank calls it (the forward is collective)."""
        self._check_bound()
        if self._placement.location("params") != "device":
            raise PhaseError("verify_sync() needs the trainer's parameters on the device; call it with "
                             "SwapConfig(params='keep')")
        return self._link.verify_sync(self._cycle, prompts)

    def wait_reload(self) -> None:
        """Make the compute stream wait for an optimizer reload still in flight (see overlap_optimizer_reload)."""
        if self._placement is not None:
            self._placement.wait_reload()

    def add_listener(self, fn: Callable[[dict], None]) -> Callable[[], None]:
        """Call `fn(event)` at every phase boundary and transition step; returns a function that removes it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def on_detach(self, fn: Callable[[], object]) -> None:
        """Call `fn()` at `detach()`, after the trainer's state is back and before the host buffers go (newest
        first; one that raises is logged and the others still run)."""
        self._check_open()
        self._detach_callbacks.push(fn)

    def detach(self) -> dict[str, int]:
        """Make the trainer's state resident again, run the `on_detach` callbacks, release the host buffers and
        unregister this runtime. Returns what it did: the bytes brought back to the device and the host buffer
        bytes released ({} when already detached)."""
        if self._closed:
            return {}
        try:
            with interrupts.held("detaching"):
                return self._detach()
        finally:
            if self._closed:
                interrupts.unguard()  # the signals' own handlers back: nothing is held any more

    def _detach(self) -> dict[str, int]:
        owner = self._owner
        if self._depth or owner is not None:
            where = "" if owner is None or owner is threading.current_thread() else f" (of thread {owner.name!r})"
            raise PhaseError(f"detach() called inside a `with phase(...)` block or a switch{where}; leave the "
                             "block first")
        if self._unbound is not None:  # pending: nothing was taken, only what was registered is undone
            try:
                self._detach_callbacks.run(raise_exits=True)
            finally:  # detached also when a callback exits
                self._close()
            logger.info("detached before binding to a trainer: nothing to bring back")
            return {}
        if self._unsettled is not None and self._phase == "train":  # a failed rollback left something out
            self._settle()
        # The run is ending: a mismatch past bounds is in the last sync's report and the profile, and stops nothing.
        back = self._transition(self._phase, "train", judge=False) if self._phase != "train" else 0
        self.wait_reload()
        if self._placement.streamer is not None:  # plain torch steps the states on the device again
            back += self._placement.states_to_device()
        released = self._placement.status()["host_buffers"]["bytes"]
        self._restore.run()  # the hooks, the streamed step, the host buffers
        try:
            self._detach_callbacks.run(raise_exits=True)
        finally:  # detached also when a callback exits
            self._close()
        logger.info("detached: %.2f GiB brought back to %s, %.2f GiB of host buffers released", memory.gib(back),
                    self.device, memory.gib(released))
        return {"brought_back_bytes": back, "host_released_bytes": released}

    # ---------------------------------------------------------------- transitions
    def _transition(self, src: Phase, dst: Phase, *, judge: bool = True) -> int:
        if src == dst:
            return 0
        with interrupts.held(f"switching {src} -> {dst}"):
            return self._switch(src, dst, judge=judge)

    def _switch(self, src: Phase, dst: Phase, *, judge: bool) -> int:
        self._link.judged = None
        start = time.perf_counter()
        steps = self._steps(dst)
        try:
            moved = self._run_steps(f"{src}->{dst}", steps)
        except torch.OutOfMemoryError as exc:
            # Undone exactly already, it goes again: under "auto" with more states swapped, every rank alike; else,
            # in one process (a rank going again alone would issue collectives the others do not), with the states
            # gone first if it ran out beside their copies (the room check reads torch's counters).
            settled = dst == "generate" and self._unsettled is None
            freed = self._placement.make_room(getattr(exc, "short_bytes", 0)) if settled else 0
            if freed:
                self._emit({"type": "demote", "short_bytes": exc.short_bytes, "bytes": freed})
            elif settled and in_flight(steps, exc.swaprl_failed_at) and not distributed.is_distributed():
                logger.warning("%s -> %s goes again with the states offloaded first (%s)", src, dst, exc)
                self._emit({"type": "retry", "transition": f"{src}->{dst}", "how": "the states offloaded first"})
            else:
                raise
            moved = self._run_steps(f"{src}->{dst}", self._steps(dst, overlap=bool(freed)))
        self._phase = dst
        self._unsettled = None  # every step of the switch moved what was out of place for `dst`
        if dst == "generate":
            self._cycle += 1
        seconds, ended = time.perf_counter() - start, time.time()  # the switch's end, not status()'s
        logger.info("%s -> %s: %.2f GiB moved in %.3f s", src, dst, memory.gib(moved), seconds)
        if self._listeners:  # status() reads NVML: only pay for it when someone listens
            self._emit({"t": ended, "type": "phase", "phase": dst, "from": src, "cycle": self._cycle,
                        "seconds": seconds, "bytes": moved, "status": self.status()})
        judged, self._link.judged = self._link.judged, None
        if judged is not None and judge:
            # The weights were proved before generating; a mismatch past the user's bounds stops the run before it
            # trains on those rollouts, in train, where leaving the `generate` block puts it.
            raise_if_failed(judged)
        return moved

    def _steps(self, dst: Phase, *, overlap: bool = True) -> list[Step]:
        """The steps into `dst`, in order. Into `generate`: the regions pause; torch's cache goes back to the driver
        (unless the engine wakes on its pages); the trainer's state starts leaving; the engine wakes its weights, is
        synced and checked (with room beside the states, the offload's copies run under that); the state has left;
        the engine wakes its KV cache. Into `train`: the engine sleeps, the state comes back, the regions resume."""
        place, link = self._placement, self._link
        # Freed blocks go to the driver for vLLM to map, unless the engine wakes on their pages where torch holds them.
        release = [Step("release cached memory", place.release_cache, moves=False)] if not self.engine.lender else []
        if dst == "train":
            resume = [Step("resume regions", lambda: regions.resume(self._regions),
                           lambda: regions.pause(self._regions))] if self._regions else []
            return link.sleep_steps() + place.reload_steps() + resume + link.train_steps()
        room = place.engine_room(link.room_bytes) if link.room_bytes and self.config.overlap_offload and overlap \
            else None
        first, then = place.offload_steps(room)
        pause = [Step("pause regions", lambda: regions.pause(self._regions),
                      lambda: regions.resume(self._regions))] if self._regions else []
        # Released before the copies start (with them in flight it took as long as they did); not if the weights fit.
        early = [s for s in first if s.blocking] + (release if room != "free now" else [])
        steps = pause + early + [s for s in first if not s.blocking] + link.wake_steps(self._cycle + 1) + then
        ready = link.ready_steps()
        return steps + (release if ready else []) + ready  # the sync's buckets, the state just moved

    def _settle(self) -> None:
        """Complete the moves a failed rollback left undone, for the phase the runtime is in: each step of a switch
        into it only moves what is not where that phase wants it, and the engine's sleep and wake-up leave parts
        already so as they are."""
        what = self._unsettled
        logger.warning("completing the moves a failed rollback left (%s)", what)
        try:
            self._run_steps(f"settle {self._phase}", self._steps(self._phase))
        except BaseException as exc:
            exc.add_note(f"swaprl: the runtime could not complete what a failed rollback left ({what}); it stays "
                         f"in phase {self._phase!r}. Fix the cause (free device memory for an out-of-memory error) "
                         "and enter a phase again, or detach()")
            raise
        self._unsettled = None
        logger.info("the runtime is settled in phase %r again", self._phase)

    def _run_steps(self, transition: str, steps: list[Step]) -> int:
        undo = Undo(transition)
        committed: list[Callable[[], object]] = []
        total, started = 0, {}  # started: each step's start time
        at, step = 0, Step("start", lambda: None)  # named in the error of a failure before the first step
        try:
            for at, step in enumerate(steps):
                t0 = started[step.name] = time.perf_counter()
                with torch.profiler.record_function(f"swaprl {transition}: {step.name}"):  # named in a trace
                    moved = step.do() or 0
                    if self.device.type == "cuda" and step.blocking:
                        # The compute stream only: an overlapped offload's copies on the side stream run on.
                        torch.cuda.current_stream(self.device).synchronize()
                t1 = time.perf_counter()
                if step.undo is not None:
                    undo.push(step.undo, step.name)
                if step.commit is not None:
                    committed.append(step.commit)
                total += int(moved) if step.moves else 0
                # "issued": timed to the queueing of copies left running, not to their end (the report gives no rate)
                event = {"type": "step", "transition": transition, "step": step.name, "bytes": int(moved),
                         "seconds": t1 - t0, "issued": self.device.type == "cuda" and not step.blocking}
                if step.started_by in started:  # the copies ran from their start step until now, under other work
                    event["span_seconds"] = t1 - started[step.started_by]
                self._emit(event)
        except BaseException as exc:
            logger.warning("%s failed at step %r (%s); undoing %d completed step(s)", transition, step.name,
                           type(exc).__name__, len(undo))
            exc.swaprl_failed_at = at  # which step failed, for the switch's retry
            failed = undo.run()
            if failed:
                # Where each resource is stays recorded as it is (status() tells it); the next phase entry moves
                # what is out of place for the phase the runtime is in.
                self._unsettled = f"the rollback of {transition} could not undo {'; '.join(failed)}"
                exc.add_note(f"swaprl: {self._unsettled}. The runtime stays in phase {self._phase!r} with that "
                             "left out of place (runtime.status() shows where everything is); the next "
                             "`with swaprl.phase(...)` completes the moves once the cause is fixed (free device "
                             "memory first for an out-of-memory error)")
            elif self.device.type == "cuda":
                torch.cuda.empty_cache()  # what the undone steps freed goes back to the driver, as before the switch
            if not failed and isinstance(exc, torch.OutOfMemoryError):  # undone whole: what would give it room
                exc.add_note(switch_out_of_memory(transition, step.name))
            # Once rolled back: a listener that exits or raises KeyboardInterrupt here must not cut the undo short.
            self._emit({"type": "error", "transition": transition, "step": step.name,
                        "error": f"{type(exc).__name__}: {exc}"[:500]})
            raise
        for commit in committed:
            commit()
        return total

    # ---------------------------------------------------------------- helpers
    def _take_phases(self) -> bool:
        """Hold the phases for this thread until its outermost `with phase(...)` block ends; another thread entering
        one meanwhile is refused (its switch would move memory under this thread's block). True if this block took
        them (the outermost of its thread)."""
        me = threading.current_thread()
        with self._owner_lock:
            owner = self._owner
            if owner is not None and owner is not me:
                raise PhaseError(f"phase() entered from thread {me.name!r} while thread {owner.name!r} is inside a "
                                 f"`with phase(...)` block (phase {self._phase!r}): switches move the memory that "
                                 "block uses. Enter phases from one thread (the training loop's), or wait for that "
                                 "block to end")
            self._owner = me
        return owner is None

    def _check_step(self) -> None:
        """`optimizer.step()`'s pre-hook: refuse a step that would not find the states where it needs them."""
        place = self._placement
        if (self._unsettled is not None and self._phase == "train" and place.swaps_states
                and place.location("optimizer") != "device"):
            raise PhaseError(f"optimizer.step() in phase 'train' found optimizer states in host memory: "
                             f"{self._unsettled}. Enter `swaprl.phase('train')` again (a nested `with` block is "
                             "enough): it brings them back; free device memory first if the cause was an "
                             "out-of-memory error")
        place.check_step(self._phase)

    def _check_backward(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (a hook on each trainable parameter): refuse a backward in
        'generate' while the gradients are not on the device, where it would accumulate into offloaded gradients
        (or make new ones beside those the switch back restores)."""
        if self._phase == "generate" and self._placement.location("grads") != "device":
            raise PhaseError("backward() was called in phase 'generate', where the gradients are "
                             f"{self._placement.location('grads')} (SwapConfig.grads={self.config.grads!r}): "
                             "compute losses and call backward() inside `with swaprl.phase('train')`, or keep the "
                             "gradients on the device while generating with SwapConfig(grads='keep')")

    def _check_open(self) -> None:
        if self._closed:
            raise PhaseError("this runtime was detached; call swaprl.attach(model, optimizer) again")

    def _check_bound(self) -> None:
        self._check_open()
        if self._unbound is not None:
            raise PhaseError(f"this runtime has no trainer yet: {self._unbound}")

    def _close(self) -> None:
        self._listeners.clear()
        self._closed = True

    def _emit(self, event: dict) -> None:
        if not self._listeners:
            return
        event = {"t": time.time(), **event}
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:  # a broken listener must never break a transition
                logger.exception("swaprl listener failed on %s event", event.get("type"))


class PhaseBlock:
    """`with runtime.phase(name):`, a class rather than a generator so that nothing runs between the switch into
    `name` and the block being entered, or between the block's end and the switch back, that an interrupt could
    land in (a generator's `__enter__` returns through `next()`, where CPython checks for signals). One object may
    be entered again once its block has ended (`block = rt.phase("generate")`, then `with block:` at every step),
    not inside its own block: what it returns to is kept per entry."""

    __slots__ = ("machine", "name", "previous", "took", "counted", "inside")

    def __init__(self, machine: PhaseMachine, name: Phase) -> None:
        self.machine, self.name = machine, name
        self.previous: Phase | None = None  # the phase the block returns to, once known
        self.took = self.counted = self.inside = False

    def __enter__(self) -> PhaseMachine:
        m = self.machine
        if self.inside:  # before anything changes: a second entry would overwrite what the first one returns to
            raise PhaseError(f"this `with phase({self.name!r})` block object is entered already (it was entered "
                             "again inside its own block); nest a new one: `with runtime.phase(...)` creates one "
                             "per block")
        try:
            with interrupts.held(f"switching into {self.name!r}"):
                self.inside = True
                self.took = m._take_phases()
                if m._unsettled is not None and self.name == m._phase:  # a switch to the other phase does it too
                    m._settle()
                # Outside every block the runtime belongs in "train": a block left there (its exit failed and was
                # undone) is not where the next one returns to.
                self.previous = m._phase if m._depth else "train"
                m._transition(m._phase, self.name)
                m._depth += 1
                self.counted = True
        except BaseException:
            interrupts.finish(f"switching back to {self.previous!r}", self._undo_enter)
            raise
        return m

    def _undo_enter(self) -> None:
        m = self.machine
        try:
            if self.counted:
                self.counted = False
                m._depth -= 1
            # The switch stood and what raised came after it (a bound on the mismatch, a deferred interrupt).
            if self.previous is not None and m._phase == self.name != self.previous:
                m._transition(self.name, self.previous, judge=False)
        finally:
            self._release()

    @interrupts.protected
    def __exit__(self, *exc) -> bool:
        interrupts.finish(f"switching back to {self.previous!r}", self._leave)
        return False

    def _leave(self) -> None:
        m = self.machine
        m._depth -= 1
        try:
            m._transition(self.name, self.previous)
        finally:
            self._release()

    def _release(self) -> None:
        self.counted = self.inside = False  # this entry is over: the object may be entered again
        self.previous = None
        if self.took:
            self.took = False
            self.machine._owner = None
