"""The phase machine: which memory is on the device in `train` and in `generate`, and the steps between them.

Every transition is a list of steps; each step that succeeds is recorded with its undo, so a failure (an
exception, an out-of-memory error, a KeyboardInterrupt) anywhere in a transition undoes what was done, in reverse,
and re-raises with the runtime still in the phase it was in. No tensor is ever lost: a tensor's device copy is only
dropped after its host copy is complete, and its host copy is only reused after it is back on the device.

The runtime decides the order (`_to_generate`, `_to_train`; docs/architecture.md walks through both);
`swaprl.placement` moves the trainer's memory and keeps the host budget, `swaprl.verify` checks the engine after
each sync, the engine moves its own memory. Optimizer states with the "host" home (`SwapConfig.optimizer_states`)
never move at a switch: `optimizer.step()` streams them through the device (`swaprl.streaming`); those with the
"device" home never move at all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from . import checks, distributed, fingerprint, memory, regions
from .config import SwapConfig
from .engines.base import Engine
from .errors import PhaseError
from .placement import Placement, resolve_auto
from .streaming import install_step
from .undo import Undo
from .verify import SyncReport, Verifier, raise_if_failed

logger = logging.getLogger(__name__)

Phase = Literal["train", "generate"]
PHASES: tuple[Phase, ...] = get_args(Phase)

_attached: Runtime | None = None  # one runtime per process: `swaprl.phase()` and the TRL wrapper find it here


def current() -> Runtime:
    """The attached runtime; raises if there is none."""
    if _attached is None:
        raise PhaseError("no swaprl runtime is attached: call swaprl.attach(model, optimizer) first")
    return _attached


def check_none_attached() -> None:
    if _attached is not None:
        raise PhaseError("swaprl.attach() was already called and its runtime is still attached; call "
                         "swaprl.detach() first (or keep the Runtime that attach() returned)")


@dataclass(slots=True)
class _Step:
    name: str
    do: Callable[[], object]
    undo: Callable[[], object] | None = None
    commit: Callable[[], object] | None = None
    blocking: bool = True  # False: its copies may still run when the next step starts (not timed to completion)
    started_by: str | None = None  # the step that queued this one's copies: its event also gets the whole span


def _unmeasurable(engine: Engine | Callable[[], Engine]) -> str | None:
    """Why what `engine` holds while it generates cannot be measured at attach (`placement.resolve_auto`), or None."""
    if not isinstance(engine, Engine):
        return "attach builds the engine, which takes the memory the states leave when they go"
    if engine.shares_trainer_weights:
        return "the engine generates with the trainer's weights, taking memory as it goes"
    if engine.memory().get("location") != "device":
        return "the engine is asleep, so what it holds awake cannot be measured"
    return None


class Runtime:
    """Owns the phase state of one trainer (model + optimizer) and one engine. `swaprl.attach` builds it (and
    builds the engine); building it directly checks and registers it the same way."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 engine: Engine | Callable[[], Engine], config: SwapConfig) -> None:
        check_none_attached()
        self._start(config)
        self._bind(model, optimizer, engine)

    @classmethod
    def _pending(cls, config: SwapConfig, *, until: str) -> Runtime:
        """A runtime registered now and bound to its trainer later, with `_bind`: for a trainer whose model and
        optimizer only take their final form once its training loop has started (TRL under FSDP2, where `train()`
        shards the model and re-points the optimizer at the shards). Until then it holds nothing and stays in
        "train"; listeners and detach callbacks can be added, and what needs the trainer raises a `PhaseError`
        saying `until` (when it will be bound)."""
        global _attached
        check_none_attached()
        if not isinstance(config, SwapConfig):
            raise TypeError(f"config must be a swaprl.SwapConfig, not {type(config).__name__}")
        rt = cls.__new__(cls)
        rt._start(config)
        rt._unbound = until
        _attached = rt
        return rt

    def _start(self, config: SwapConfig) -> None:
        """What a runtime has from its creation on, bound to a trainer or not."""
        self.config = config
        self.model = self.optimizer = self.engine = self.device = None
        self._unbound: str | None = None  # why nothing is bound yet (see _pending); None once bound
        self._phase: Phase = "train"
        self._auto_states = False  # optimizer_states="auto" was resolved at attach: a wake-up may demote states
        self._depth = 0
        self._cycle = 0
        self._closed = False
        self._listeners: list[Callable[[dict], None]] = []
        self._detach_callbacks = Undo("detach")
        self._placement: Placement | None = None
        self._verifier: Verifier | None = None
        self._judged: SyncReport | None = None  # the report the switch under way completed, judged when it stands
        self._synced: tuple[float, int] | None = None  # the last sync's seconds and bytes, for its report
        self._regions: list = []  # swaprl.kernels.PausablePool: the trainer's memory paused in generate
        self._restore = Undo("attach")  # what detach() reverts (and a failed attach, at once)
        self._unsettled: str | None = None  # what a failed rollback left out of place; the next phase entry fixes it
        self._owner: threading.Thread | None = None  # the thread inside a `with phase(...)` block, if any
        self._owner_lock = threading.Lock()

    def _bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              engine: Engine | Callable[[], Engine]) -> None:
        """Take charge of `model`, `optimizer` and `engine` (checked first; a callable builds it once the host
        buffers are being locked); a failure leaves nothing behind."""
        global _attached
        if _attached is not None and _attached is not self:
            check_none_attached()
        if self._closed:
            raise PhaseError("this runtime was detached; call swaprl.attach(model, optimizer) again")
        config = self.config
        checks.check_trainer(model, optimizer, config)
        if isinstance(engine, Engine) or not callable(engine):
            checks.check_engine(engine, config)
        try:
            self._take(model, optimizer, engine)
        except BaseException:
            # What the attach steps did is undone already; a pending runtime must not keep half a trainer.
            self.model = self.optimizer = self.engine = self.device = None
            self._placement = self._verifier = None
            raise
        self._unbound = None
        _attached = self

    def _take(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              engine: Engine | Callable[[], Engine]) -> None:
        """The attach proper: host buffers, the engine (built now if `engine` builds it), the optimizer's hooks, the
        engine asleep (undone on failure)."""
        self.model, self.optimizer = model, optimizer
        self.device = checks.model_device(model)
        self._auto_states = self.config.optimizer_states == "auto"
        self.config, why = resolve_auto(self.config, optimizer, self.device, unmeasurable=_unmeasurable(engine))
        config = self.config
        if why:
            logger.info("optimizer_states='auto': %s", why)
        self._placement = placement = Placement(model, optimizer, self.device, config, auto=self._auto_states,
                                                on_streamed_step=self._on_streamed_step)
        built = Undo("the engine attach built")  # closed if attach then fails; kept (the caller's) once attached
        with self._restore.on_error(), built.on_error():
            self._restore.push(placement.release)  # a failed attach leaves no host memory behind
            # Under "auto", room to swap what the first steps may show does not fit after all (`_transition`).
            headroom = memory.default_reserve_bytes(torch.cuda.mem_get_info(self.device)[1]) \
                if self._auto_states and self.device.type == "cuda" else 0
            placement.prepare_host(headroom=headroom)
            if config.verify_sync and not (isinstance(engine, Engine) and engine.shares_trainer_weights):
                fingerprint.warm_up(self.device)  # the first weight check's kernel, compiled under what follows
            if not isinstance(engine, Engine):
                # Built while the host buffers are being locked: the locking (tens of seconds for tens of GiB where
                # pages are faulted in slowly) runs under the engine's start instead of before the first step.
                engine = engine()
                if isinstance(engine, Engine):
                    built.push(engine.close)
                checks.check_engine(engine, config)
            self.engine = engine
            self._engine_stale = not engine.shares_trainer_weights
            self.sleep_level = (1 if engine.shares_trainer_weights else 2) if config.sleep_level == "auto" \
                else int(config.sleep_level)
            self._verifier = None if engine.shares_trainer_weights else Verifier(model, engine,
                                                                                  bounds=config.verify_tolerance)
            engine.bind(model)
            self._restore.push(optimizer.register_step_pre_hook(lambda *_: self._check_step()).remove)
            self._restore.push(optimizer.register_state_dict_pre_hook(lambda opt: self.wait_reload()).remove)
            steps = []
            if placement.streamer is not None:
                self._restore.push(install_step(placement.streamer, detached=lambda: self._closed))
                steps.append(_Step("optimizer states to host", placement.states_to_host, placement.states_to_device))
            if not engine.shares_trainer_weights:
                steps.append(_Step("engine sleep", self._engine_sleep, lambda: self._engine_wake(None)))
            self._run_steps("attach", steps)
            # What attach started in the background ends before it returns. Page-locking holds the CUDA driver's
            # lock: one 16 GiB cudaHostRegister stalled every CUDA call of another thread for its 1.0 s on the H100,
            # and under TRL, whose engine exists before attach, locking during the first step stalled its rollout
            # by 3.0 s. The first steps call CUDA without pause, so waiting here costs less; an engine built
            # in between (tens of seconds) has hidden both already.
            waited = placement.finish_host() + fingerprint.finish_warm_up(self.device)
            if waited > 0.1:
                logger.info("attach waited %.2f s for host memory to be locked and the check's kernel compiled",
                            waited)

    # ---------------------------------------------------------------- public API
    @property
    def current_phase(self) -> Phase:
        return self._phase

    @contextlib.contextmanager
    def phase(self, name: Phase) -> Iterator[Runtime]:
        """Make `name`'s resources resident for the `with` block; restore the previous phase on the way out."""
        self._check_bound()
        if name not in PHASES:
            raise PhaseError(f"unknown phase {name!r}; use one of {PHASES}")
        with self._owning():
            if self._unsettled is not None and name == self._phase:  # a switch to the other phase completes it too
                self._settle()
            previous = self._phase
            self._transition(previous, name)
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
                self._transition(name, previous)

    @contextlib.contextmanager
    def _owning(self) -> Iterator[None]:
        """Hold the phases for this thread until its outermost `with phase(...)` block ends; another thread entering
        one meanwhile is refused (its switch would move memory under this thread's block)."""
        me = threading.current_thread()
        with self._owner_lock:
            owner = self._owner
            if owner is not None and owner is not me:
                raise PhaseError(f"phase() entered from thread {me.name!r} while thread {owner.name!r} is inside a "
                                 f"`with phase(...)` block (phase {self._phase!r}): switches move the memory that "
                                 "block uses. Enter phases from one thread (the training loop's), or wait for that "
                                 "block to end")
            self._owner = me
        try:
            yield
        finally:
            if owner is None:
                self._owner = None

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
        if self.last_sync is not None:
            last = self.last_sync
            out["last_sync"] = {"cycle": last.cycle, "weights": last.weights, "checked": last.checked,
                                "unreadable": len(last.unreadable), "differing": len(last.differing)}
        if self.device.type == "cuda":
            out["device_memory"] = memory.device_figures(self.device)
        return out

    def pausable(self, name: str, *, keep: str = "allocated"):
        """A region of device memory the runtime releases while the engine generates and maps again at the same
        addresses for training (a `swaprl.kernels.PausablePool`; `swaprl.regions` says what it is for and what
        must stay out of it). keep: what a pause preserves, "allocated" (live tensors' bytes) or "nothing" (a
        CUDA graph's private pool)."""
        self._check_bound()
        from . import kernels

        if self.device.type != "cuda" or not kernels.available():
            why = kernels.unavailable() if self.device.type == "cuda" else f"the trainer is on {self.device}"
            raise RuntimeError(f"Runtime.pausable() needs swaprl's pausable pool on a CUDA device ({why}); without "
                               "it, leave the memory where it is (a graph's pool then stays reserved in generate)")
        if name in {r.name for r in self._regions}:
            raise ValueError(f"a pausable region named {name!r} exists already; give each region its own name")
        with torch.cuda.device(self.device):
            region = kernels.PausablePool(name, keep=keep)
        self._regions.append(region)
        return region

    @property
    def last_sync(self) -> SyncReport | None:
        """What the check found at the last weight sync (`swaprl.verify.SyncReport`); None before the first."""
        return self._verifier.last if self._verifier is not None else None

    def sync_weights(self) -> int:
        """Copy the trainer's parameters into the engine (bucketed, in place); returns the bytes sent."""
        from .sync import push_weights

        self._check_bound()
        if self.engine.shares_trainer_weights:
            return 0
        start = time.perf_counter()
        sent = push_weights(self.model, self.engine, bucket_bytes=self.config.sync_bucket_bytes)
        self._synced = (time.perf_counter() - start, sent)
        self._engine_stale = False
        return sent

    def verify_sync(self, prompts: list[list[int]] | None = None) -> SyncReport:
        """Check the engine now: prove it holds the trainer's weights bit for bit, and measure the rollout-training
        mismatch on the engine's continuations of `prompts` (default: a fixed probe). Returns the report without
        raising (`report.ok`, `report.differing`).

        Needs the engine awake and the trainer's parameters on the device (phase 'generate' with params='keep').
        Under torchrun every rank must call it (the trainer's forward is collective), with as many prompts.
        """
        self._check_bound()
        if self._placement.location("params") != "device":
            raise PhaseError("verify_sync() needs the trainer's parameters on the device; call it with "
                             "SwapConfig(params='keep')")
        if self._verifier is None:  # the engine generates with the trainer's own parameters
            self._verifier = Verifier(self.model, self.engine, bounds=self.config.verify_tolerance)
        self._verifier.check_weights(self._cycle)
        return self._verifier.add_mismatch(prompts)

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
        if self._depth:
            raise PhaseError("detach() called inside a `with phase(...)` block; leave the block first")
        if self._unbound is not None:  # pending: nothing was taken, only what was registered is undone
            self._detach_callbacks.run()
            self._close()
            logger.info("detached before binding to a trainer: nothing to bring back")
            return {}
        # The run is ending: a mismatch past bounds is in the last sync's report and the profile, and stops nothing.
        back = self._transition(self._phase, "train", judge=False) if self._phase != "train" else 0
        self.wait_reload()
        if self._placement.streamer is not None:  # plain torch steps the states on the device again
            back += self._placement.states_to_device()
        released = self._placement.status()["host_buffers"]["bytes"]
        self._restore.run()  # the hooks, the streamed step, the host buffers
        self._detach_callbacks.run()
        self._close()
        logger.info("detached: %.2f GiB brought back to %s, %.2f GiB of host buffers released", memory.gib(back),
                    self.device, memory.gib(released))
        return {"brought_back_bytes": back, "host_released_bytes": released}

    # ---------------------------------------------------------------- transitions
    def _transition(self, src: Phase, dst: Phase, *, judge: bool = True) -> int:
        if src == dst:
            return 0
        steps = self._to_generate() if dst == "generate" else self._to_train()
        self._judged = None
        start = time.perf_counter()
        try:
            moved = self._run_steps(f"{src}->{dst}", steps)
        except torch.OutOfMemoryError as exc:
            # "auto" measured at attach what fits beside the engine; training adds what attach could not see (DDP's
            # buckets, FSDP2's buffers, the allocator's cache): the wake-up found it out, before mapping anything.
            # Rolled back exactly already: swap more, and go again. Every rank does the same, or none does.
            short = getattr(exc, "short_bytes", 0)
            if dst != "generate" or not self._placement.auto or not short or self._unsettled is not None:
                raise
            freed = self._placement.demote(short + 2**28)
            if not distributed.all_reduce([freed], "min")[0]:
                raise
            logger.warning("optimizer_states='auto': the engine's wake-up lacked %.2f GiB; %.2f GiB more of the "
                           "optimizer states are swapped from now on", memory.gib(short), memory.gib(freed))
            self._emit({"type": "demote", "short_bytes": short, "bytes": freed})
            moved = self._run_steps(f"{src}->{dst}", self._to_generate())
        self._phase = dst
        self._unsettled = None  # every step of the switch moved what was out of place for `dst`
        if dst == "generate":
            self._cycle += 1
        seconds = time.perf_counter() - start
        logger.info("%s -> %s: %.2f GiB moved in %.3f s", src, dst, memory.gib(moved), seconds)
        if self._listeners:  # status() reads NVML: only pay for it when someone listens
            self._emit({"type": "phase", "phase": dst, "from": src, "cycle": self._cycle, "seconds": seconds,
                        "bytes": moved, "status": self.status()})
        judged, self._judged = self._judged, None
        if judged is not None and judge:
            # The weights were proved before generating; a mismatch past the user's bounds stops the run before it
            # trains on those rollouts, in train, where leaving the `generate` block puts it.
            raise_if_failed(judged)
        return moved

    def _settle(self) -> None:
        """Complete the moves a failed rollback left undone, for the phase the runtime is in: each step of a switch
        into it only moves what is not where that phase wants it, and the engine's sleep and wake-up leave parts
        already so as they are."""
        what = self._unsettled
        logger.warning("completing the moves a failed rollback left (%s)", what)
        steps = self._to_generate() if self._phase == "generate" else self._to_train()
        try:
            self._run_steps(f"settle {self._phase}", steps)
        except BaseException as exc:
            exc.add_note(f"swaprl: the runtime could not complete what a failed rollback left ({what}); it stays "
                         f"in phase {self._phase!r}. Fix the cause (free device memory for an out-of-memory error) "
                         "and enter a phase again, or detach()")
            raise
        self._unsettled = None
        logger.info("the runtime is settled in phase %r again", self._phase)

    def _run_steps(self, transition: str, steps: list[_Step]) -> int:
        undo = Undo(transition)
        committed: list[Callable[[], object]] = []
        total = 0
        current = "?"
        started: dict[str, float] = {}
        try:
            for step in steps:
                current = step.name
                t0 = started[step.name] = time.perf_counter()
                moved = step.do() or 0
                if self.device.type == "cuda" and step.blocking:
                    # The compute stream only: an overlapped offload's copies on the side stream run on.
                    torch.cuda.current_stream(self.device).synchronize()
                t1 = time.perf_counter()
                if step.undo is not None:
                    undo.push(step.undo, step.name)
                if step.commit is not None:
                    committed.append(step.commit)
                total += int(moved)
                event = {"type": "step", "transition": transition, "step": step.name, "bytes": int(moved),
                         "seconds": t1 - t0}
                if step.started_by in started:  # the copies ran from their start step until now, under other work
                    event["span_seconds"] = t1 - started[step.started_by]
                self._emit(event)
        except BaseException as exc:
            logger.warning("%s failed at step %r (%s); undoing %d completed step(s)", transition, current,
                           type(exc).__name__, len(undo))
            self._emit({"type": "error", "transition": transition, "step": current,
                        "error": f"{type(exc).__name__}: {exc}"[:500]})
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
            raise
        for commit in committed:
            commit()
        return total

    def _to_generate(self) -> list[_Step]:
        cfg, engine, place = self.config, self.engine, self._placement
        place.check_host_budget()
        separate = not engine.shares_trainer_weights
        # With room for the engine's weights next to the trainer's state, the optimizer's (and gradients') copies
        # to the host run under the engine's weight wake-up, the weight sync and the weight check; their device
        # memory is released before the KV cache is mapped either way.
        room = place.engine_room(engine.weights_bytes + cfg.sync_bucket_bytes) \
            if separate and cfg.overlap_offload else None
        # Only what is on the device: a switch into the phase the runtime is in already completes what a failed
        # rollback left (`_settle`) and moves nothing twice.
        offloads = [name for name in (["optimizer"] if place.swaps_states else []) + (["grads"] if cfg.grads ==
                                                                                        "offload" else [])
                    if place.location(name) == "device"]
        steps = []
        if self._regions:  # first: their memory is free before anything else needs room
            steps.append(_Step("pause regions", lambda: regions.pause(self._regions),
                               lambda: regions.resume(self._regions)))
        for name in offloads:
            if room:
                steps.append(_Step(f"start offload {name}", lambda n=name: place.start_offload(n),
                                   lambda n=name: place.cancel_offload(n), blocking=False))
            else:
                steps.append(_Step(f"offload {name}", lambda n=name: place.offload(n), lambda n=name: place.reload(n)))
        if cfg.grads == "free" and place.location("grads") == "device":
            steps.append(_Step("free grads", place.free_grads, place.restore_grads, place.keep_grads_freed))
        if room != "free now":
            # Hands freed blocks to the driver for the engine; it also waits for every stream (the offload's
            # copies), so it is skipped when the engine's weights fit in what the driver has free already.
            steps.append(_Step("release cached memory", place.release_cache))
        if separate:
            # Staged wake-up: weights first, synced while the trainer's parameters are still on the device; the
            # KV cache last, once the trainer's state has left, so old + new weights + KV never coexist.
            steps += [_Step("engine wake weights", lambda: self._engine_wake(["weights"]), self._engine_sleep),
                      _Step("sync weights", self.sync_weights)]
            if cfg.verify_sync:  # while the trainer's parameters are surely on the device
                steps.append(_Step("verify weights", self._verify_weights))
        if room:
            steps += [_Step(f"finish offload {name}", lambda n=name: place.finish_offload(n),
                            lambda n=name: place.reload(n), started_by=f"start offload {name}") for name in offloads]
        # params="offload" only with an engine of its own weights (attach refuses it otherwise)
        if cfg.params == "offload" and place.location("params") == "device":
            steps.append(_Step("offload params", lambda: place.offload("params"), lambda: place.reload("params")))
        if separate:
            steps += [_Step("release cached memory", place.release_cache),  # the sync's buckets, the state just moved
                      _Step("engine wake kv_cache", lambda: self._engine_wake(["kv_cache"]), self._engine_sleep)]
            if cfg.verify_sync:  # the mismatch's engine half; the trainer scores it when training starts
                steps.append(_Step("sample probe", self._verifier.sample_mismatch, self._verifier.drop_probe))
        return steps

    def _to_train(self) -> list[_Step]:
        place = self._placement
        steps = []
        if not self.engine.shares_trainer_weights:
            steps.append(_Step("engine sleep", self._engine_sleep, self._engine_rewake))
        for name in ("params", "grads", "optimizer"):
            location = place.location(name)
            if name == "optimizer" and not place.swaps_states:
                continue  # no state is swapped: those in host memory stay, the streamed step brings them through
            if location == "host":
                overlap = name == "optimizer" and self.config.overlap_optimizer_reload
                steps.append(_Step(f"reload {name}", lambda n=name, o=overlap: place.reload(n, defer=o),
                                   lambda n=name: place.offload(n), blocking=not overlap))
            elif location == "released":  # freed for good; the next backward allocates them afresh
                steps.append(_Step("grads to device", lambda: place.set_location("grads", "device"),
                                   lambda: place.set_location("grads", "released")))
        if self._regions:  # the engine's memory and the trainer's state are where training wants them
            steps.append(_Step("resume regions", lambda: regions.resume(self._regions),
                               lambda: regions.pause(self._regions)))
        if self._verifier is not None and self._verifier.probe_pending:
            # Last, with the engine asleep: the trainer's forward (under FSDP it gathers the root's parameters and
            # two layers, 8 GiB in bf16 at 72B's width, and the allocator keeps about as much again) takes room
            # training has anyway rather than the KV cache's; its parameters are back even when they left for
            # generate; and a model whose forward replays graphs from a paused region finds them resumed.
            steps.append(_Step("score probe", self._score_probe))
        return steps

    # ---------------------------------------------------------------- the engine and its check
    def _engine_sleep(self) -> None:
        self.engine.sleep(self.sleep_level)
        if self.sleep_level == 2:
            self._engine_stale = True

    def _engine_wake(self, tags: list[str] | None) -> None:
        try:
            self.engine.wake(tags)
        except torch.OutOfMemoryError as exc:
            kept = self._placement.home_bytes()["device"]
            if not kept:
                raise
            # The engine's KV cache was sized when it was built; the states a split keeps on the device came later.
            named = type(exc)(
                f"{exc} Of what is not free, {kept / 2**30:.2f} GiB are optimizer states kept on the device while "
                "generating (the 'device' home of SwapConfig.optimizer_states): build the engine with "
                "reserve_bytes=swaprl.engines.engine_reserve_bytes(optimizer, config) before the first optimizer "
                "step, or give the 'device' home a smaller share")
            named.short_bytes = getattr(exc, "short_bytes", 0)  # what `_transition` swaps more of, under "auto"
            raise named from exc
        if tags is None or "kv_cache" in tags:
            self.engine.reset_prefix_cache()

    def _engine_rewake(self) -> None:
        self._engine_wake(None)
        if self._engine_stale:
            self.sync_weights()

    def _verify_weights(self) -> None:
        seconds, sent = self._synced or (None, None)
        report = self._verifier.check_weights(self._cycle + 1, sync_seconds=seconds, sync_bytes=sent)
        if not report.ok:  # nothing is generated: the report is complete without its mismatch
            self._emit({"type": "sync", **report.as_dict()})
        raise_if_failed(report)

    def _score_probe(self) -> None:
        try:
            report = self._verifier.score_mismatch()
        except torch.OutOfMemoryError as exc:
            fix = ("The trainer scores 8 short sequences as training starts, a forward smaller than a training micro "
                   "batch's: leave training more room (a smaller micro batch, more of the optimizer states swapped), "
                   "or SwapConfig(verify_sync=False) skips the check")
            if distributed.is_distributed():
                # The other ranks may wait in this forward's collectives: going on would pair them with training's.
                raise type(exc)(f"{exc} This was the on-policy check's probe. {fix}") from exc
            # A figure, not a proof (the weights were proved before generating): the switch goes on without it.
            self._verifier.drop_probe()
            report = self._verifier.last
            logger.warning("the on-policy check's probe ran out of memory (%s); this sync's mismatch is not measured. "
                           "%s", exc, fix)
        self._emit({"type": "sync", **report.as_dict()})
        self._judged = report  # bounds set by the user are applied once the switch to train stands

    # ---------------------------------------------------------------- helpers
    def _check_step(self) -> None:
        """`optimizer.step()`'s pre-hook: refuse a step that would not find the states where it needs them."""
        place = self._placement
        if (self._unsettled is not None and self._phase == "train" and place.swaps_states
                and place.location("optimizer") != "device"):
            raise PhaseError(f"optimizer.step() in phase 'train' found optimizer states in host memory: "
                             f"{self._unsettled}. Enter `swaprl.phase('train')` again (a nested `with` block is "
                             "enough): it brings them back; free device memory first if the cause was an "
                             "out-of-memory error")
        self._placement.check_step(self._phase)

    def _on_streamed_step(self, info: dict) -> None:
        self._emit({"type": "step", "transition": "optimizer.step", "step": "stream optimizer states", **info})

    def _check_open(self) -> None:
        if self._closed:
            raise PhaseError("this runtime was detached; call swaprl.attach(model, optimizer) again")

    def _check_bound(self) -> None:
        self._check_open()
        if self._unbound is not None:
            raise PhaseError(f"this runtime has no trainer yet: {self._unbound}")

    def _close(self) -> None:
        global _attached
        self._listeners.clear()
        self._closed = True
        if _attached is self:
            _attached = None

    def _emit(self, event: dict) -> None:
        if not self._listeners:
            return
        event = {"t": time.time(), **event}
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:  # a broken listener must never break a transition
                logger.exception("swaprl listener failed on %s event", event.get("type"))
