"""The phase controller: which memory is on the device in `train` and in `generate`, and the moves between them.

Every transition is a list of steps; each step that succeeds is recorded with its undo, so a failure (an
exception, an out-of-memory error, a KeyboardInterrupt) anywhere in a transition undoes what was done, in reverse,
and re-raises with the runtime still in the phase it was in. No tensor is ever lost: a tensor's device copy is only
dropped after its host copy is complete, and its host copy is only reused after it is back on the device.

    train -> generate: offload optimizer states, offload/free gradients, [engine: wake weights, sync weights from
                       the trainer, score the probe with the trainer], offload trainer parameters (if configured),
                       [engine: wake KV cache, score the probe with the engine]. When the device has room for
                       the engine's weights next to the optimizer, the offloads' copies run under the wake-up, the
                       sync and the trainer's scoring (`SwapConfig.overlap_offload`).
    generate -> train: [engine: sleep], reload parameters, gradients, optimizer states

With `SwapConfig(optimizer_states="host")` the optimizer states stay in host memory in both phases and neither
transition moves them; `optimizer.step()` streams them through the device instead (`swaprl.streaming`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from . import distributed, memory
from .config import SwapConfig
from .engines.base import Engine
from .residency import HostBuffer, HostBufferError, Moved, Mover, PendingOffload, layout_bytes, local_tensor, nbytes
from .streaming import StateStreamer
from .verify import SyncReport, Verifier, raise_if_failed

logger = logging.getLogger(__name__)

Phase = Literal["train", "generate"]
PHASES: tuple[Phase, ...] = ("train", "generate")
Location = Literal["device", "host", "released"]


class PhaseError(RuntimeError):
    """A phase request that cannot be honoured (unknown name, nothing attached, wrong nesting)."""


@dataclass(slots=True)
class _Step:
    name: str
    do: Callable[[], object]
    undo: Callable[[], object] | None = None
    commit: Callable[[], object] | None = None
    blocking: bool = True  # False: its copies may still run when the next step starts (not timed to completion)
    started_by: str | None = None  # the step that queued this one's copies: its event also gets the whole span


@dataclass(slots=True)
class _Resource:
    """One kind of trainer memory ("optimizer", "grads", "params") and where it is now."""

    name: str
    buffer: HostBuffer
    location: Location = "device"
    moved: list[Moved] = field(default_factory=list)
    dropped: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    pending: PendingOffload | None = None

    def host_bytes(self) -> int:
        return sum(nbytes(m.tensor) for m in self.moved)


class Runtime:
    """Owns the phase state of one trainer (model + optimizer) and one engine. Build it with `swaprl.attach`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine: Engine,
                 config: SwapConfig) -> None:
        self.model, self.optimizer, self.engine, self.config = model, optimizer, engine, config
        self.device = _model_device(model)
        self._mover = Mover(self.device)
        pin = config.pin_memory and self.device.type == "cuda"
        self._resources = {name: _Resource(name, HostBuffer(name, pin=pin)) for name in ("optimizer", "grads",
                                                                                          "params")}
        self._phase: Phase = "train"
        self._depth = 0
        self._cycle = 0
        self._engine_stale = not engine.shares_trainer_weights
        self._listeners: list[Callable[[dict], None]] = []
        self._closed = False
        self._pending_reload: torch.cuda.Event | None = None
        self._streamer: StateStreamer | None = None
        self._streaming = False  # inside the streamed step installed on the optimizer
        self._restore_methods: Callable[[], None] | None = None
        self.sleep_level = self._resolve_sleep_level()
        self._verifier = (None if engine.shares_trainer_weights
                          else Verifier(model, engine, bounds=config.verify_tolerance))
        self._synced: tuple[float, int] | None = None  # the last sync's seconds and bytes, for its report
        self._hooks = [optimizer.register_step_pre_hook(self._check_step_allowed),
                       optimizer.register_state_dict_pre_hook(lambda opt: self.wait_reload())]
        steps = []
        if config.optimizer_states == "host":
            res = self._resources["optimizer"]
            self._streamer = StateStreamer(optimizer, self.device, res.buffer, chunk_bytes=config.stream_chunk_bytes,
                                           reserve=self._reserve_for_states, on_step=self._on_streamed_step)
            res.location = "host"
            # Loaded states belong in the host buffer (and with a load_state_dict captured before attach, torch
            # put them on the device).
            self._hooks.append(optimizer.register_load_state_dict_post_hook(
                lambda opt: self._streamer.settle("The loaded states are intact where the load put them.")))
            steps += [_Step("optimizer states to host", lambda: self._streamer.settle("Nothing was moved."),
                            self._states_to_device),
                      _Step("install streamed step", self._install_streamed_methods,
                            lambda: self._restore_methods())]
        if not engine.shares_trainer_weights:
            steps.append(_Step("engine sleep", lambda: self._engine_sleep(), lambda: self._engine_wake(None)))
        try:
            self._run_steps("attach", steps)
        except BaseException:
            for hook in self._hooks:
                hook.remove()
            raise

    # ---------------------------------------------------------------- public API
    @property
    def current_phase(self) -> Phase:
        return self._phase

    @contextlib.contextmanager
    def phase(self, name: Phase) -> Iterator[Runtime]:
        """Make `name`'s resources resident for the `with` block; restore the previous phase on the way out."""
        self._check_open()
        if name not in PHASES:
            raise PhaseError(f"unknown phase {name!r}; use one of {PHASES}")
        previous = self._phase
        self._transition(previous, name)
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            self._transition(name, previous)

    def status(self) -> dict:
        """Where each resource is and how many device bytes it holds now, plus the device and host totals."""
        out: dict = {"phase": self._phase, "cycle": self._cycle, "device": str(self.device)}
        for name, res in self._resources.items():
            moved = self._streamer.moved() if name == "optimizer" and self._streamer is not None else res.moved
            on_host = {id(m.tensor) for m in moved}  # on a CPU-only machine host and device look alike
            on_device = sum(nbytes(t) for t in self._tensors(name) if id(t) not in on_host)
            out[name] = {"location": res.location, "bytes": on_device,
                         "host_bytes": sum(nbytes(m.tensor) for m in moved)}
        out["engine"] = self.engine.memory()
        out["host_buffers"] = {"bytes": sum(r.buffer.capacity for r in self._resources.values()),
                               "pinned": any(r.buffer.pin for r in self._resources.values())}
        if self.device.type == "cuda":
            out["device_memory"] = {"used": memory.device_used_bytes(self.device),
                                    "total": memory.device_total_bytes(self.device),
                                    "torch_allocated": torch.cuda.memory_allocated(self.device),
                                    "torch_reserved": torch.cuda.memory_reserved(self.device)}
        return out

    @property
    def last_sync(self) -> SyncReport | None:
        """What the check found at the last weight sync (`swaprl.verify.SyncReport`); None before the first."""
        return self._verifier.last if self._verifier is not None else None

    def sync_weights(self) -> int:
        """Copy the trainer's parameters into the engine (bucketed, in place); returns the bytes sent."""
        from .sync import push_weights

        self._check_open()
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
        self._check_open()
        if self._resources["params"].location != "device":
            raise PhaseError("verify_sync() needs the trainer's parameters on the device; call it with "
                             "SwapConfig(params='keep')")
        if self._verifier is None:  # the engine generates with the trainer's own parameters
            self._verifier = Verifier(self.model, self.engine, bounds=self.config.verify_tolerance)
        self._verifier.check_weights(self._cycle)
        return self._verifier.add_mismatch(prompts)

    def wait_reload(self) -> None:
        """Make the compute stream wait for an optimizer reload still in flight (see overlap_optimizer_reload)."""
        if self._pending_reload is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending_reload)
            self._pending_reload = None

    def add_listener(self, fn: Callable[[dict], None]) -> Callable[[], None]:
        """Call `fn(event)` at every phase boundary and transition step; returns a function that removes it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def profile(self, path):
        """Start recording a memory profile to `path` (JSON Lines); it stops at `detach()` or `.close()`."""
        from .profile import attach_profiler

        self._check_open()
        return attach_profiler(self, path)

    def detach(self) -> None:
        """Make the trainer's state resident again, release the host buffers and unregister this runtime."""
        if self._closed:
            return
        if self._depth:
            raise PhaseError("detach() called inside a `with phase(...)` block; leave the block first")
        if self._phase != "train":
            self._transition(self._phase, "train")
        self.wait_reload()
        if self._streamer is not None:  # plain torch steps the states on the device again
            self._states_to_device()
            self._restore_methods()
        for hook in self._hooks:
            hook.remove()
        self._emit({"type": "detach", "status": self.status()})
        self._listeners.clear()
        for res in self._resources.values():
            res.buffer.release()
        self._closed = True
        from . import _unregister

        _unregister(self)

    # ---------------------------------------------------------------- transitions
    def _transition(self, src: Phase, dst: Phase) -> None:
        if src == dst:
            return
        steps = self._to_generate() if dst == "generate" else self._to_train()
        start = time.perf_counter()
        moved = self._run_steps(f"{src}->{dst}", steps)
        self._phase = dst
        if dst == "generate":
            self._cycle += 1
        seconds = time.perf_counter() - start
        logger.info("%s -> %s: %.2f GiB moved in %.3f s", src, dst, memory.gib(moved), seconds)
        if self._listeners:  # status() reads NVML: only pay for it when someone listens
            self._emit({"type": "phase", "phase": dst, "from": src, "cycle": self._cycle, "seconds": seconds,
                        "bytes": moved, "status": self.status()})

    def _run_steps(self, transition: str, steps: list[_Step]) -> int:
        done: list[_Step] = []
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
                done.append(step)
                total += int(moved)
                event = {"type": "step", "transition": transition, "step": step.name, "bytes": int(moved),
                         "seconds": t1 - t0}
                if step.started_by in started:  # the copies ran from their start step until now, under other work
                    event["span_seconds"] = t1 - started[step.started_by]
                self._emit(event)
        except BaseException as exc:
            logger.warning("%s failed at step %r (%s); undoing %d completed step(s)", transition, current,
                           type(exc).__name__, len(done))
            self._emit({"type": "error", "transition": transition, "step": current,
                        "error": f"{type(exc).__name__}: {exc}"[:500]})
            for step in reversed(done):
                if step.undo is None:
                    continue
                try:
                    step.undo()
                except Exception:  # keep undoing: the remaining steps still hold tensors to put back
                    logger.exception("undoing %r after a failed %s also failed", step.name, transition)
            raise
        for step in done:
            if step.commit is not None:
                step.commit()
        return total

    def _to_generate(self) -> list[_Step]:
        cfg, engine = self.config, self.engine
        self._check_host_budget()
        separate = not engine.shares_trainer_weights
        # With room for the engine's weights next to the trainer's state, the optimizer's (and gradients') copies
        # to the host run under the engine's weight wake-up, the weight sync and the trainer's half of the
        # on-policy check; their device memory is released before the KV cache is mapped either way.
        overlap = self._room_for_engine_weights() if separate and cfg.overlap_offload else None
        offloads = (["optimizer"] if self._streamer is None else []) + (["grads"] if cfg.grads == "offload" else [])
        steps = []
        for name in offloads:
            if overlap:
                steps.append(_Step(f"start offload {name}", lambda n=name: self._start_offload(n),
                                   lambda n=name: self._cancel_offload(n), blocking=False))
            else:
                steps.append(_Step(f"offload {name}", lambda n=name: self._offload(n), lambda n=name: self._reload(n)))
        if cfg.grads == "free":
            steps.append(_Step("free grads", self._drop_grads, self._restore_grads, self._forget_dropped_grads))
        if overlap != "room":
            # Hands freed blocks to the driver for the engine; it also waits for every stream (the offload's
            # copies), so it is skipped when the engine's weights fit in what the driver has free already.
            steps.append(_Step("release cached memory", self._release_cache))
        if separate:
            # Staged wake-up: weights first, synced while the trainer's parameters are still on the device; the
            # KV cache last, once the trainer's state has left, so old + new weights + KV never coexist.
            steps += [_Step("engine wake weights", lambda: self._engine_wake(["weights"]), self._engine_sleep),
                      _Step("sync weights", self.sync_weights)]
            if cfg.verify_sync:  # while the trainer's parameters are surely on the device
                steps.append(_Step("verify weights", self._verify_weights))
        if overlap:
            steps += [_Step(f"finish offload {name}", lambda n=name: self._finish_offload(n),
                            lambda n=name: self._reload(n), started_by=f"start offload {name}") for name in offloads]
        if cfg.params == "offload":  # only with an engine of its own weights (attach refuses it otherwise)
            steps.append(_Step("offload params", lambda: self._offload("params"), lambda: self._reload("params")))
        if separate:
            steps += [_Step("release cached memory", self._release_cache),  # the sync's buckets, the state just moved
                      _Step("engine wake kv_cache", lambda: self._engine_wake(["kv_cache"]), self._engine_sleep)]
            if cfg.verify_sync and cfg.params == "keep":  # the engine samples (KV cache), the trainer scores
                steps.append(_Step("measure mismatch", self._measure_mismatch))
        return steps

    def _to_train(self) -> list[_Step]:
        steps = []
        if not self.engine.shares_trainer_weights:
            steps.append(_Step("engine sleep", self._engine_sleep, self._engine_rewake))
        for name in ("params", "grads", "optimizer"):
            res = self._resources[name]
            if name == "optimizer" and self._streamer is not None:
                continue  # host-resident for good: the streamed step brings them through the device
            if res.location == "host":
                overlap = name == "optimizer" and self.config.overlap_optimizer_reload
                steps.append(_Step(f"reload {name}", lambda n=name, o=overlap: self._reload(n, defer=o),
                                   lambda n=name: self._offload(n), blocking=not overlap))
            elif res.location == "released":  # freed for good; the next backward allocates them afresh
                steps.append(_Step("grads to device", lambda: self._set_grads_location("device"),
                                   lambda: self._set_grads_location("released")))
        return steps

    # ---------------------------------------------------------------- steps
    def _tensors(self, name: str) -> list[torch.Tensor]:
        """The distinct tensors of a resource that live on the runtime's device now."""
        if name == "optimizer":
            candidates = (v for state in self.optimizer.state.values() for v in state.values())
        elif name == "grads":
            candidates = (p.grad for p in self.model.parameters())
        else:
            candidates = self.model.parameters()
        seen: set[int] = set()
        out = []
        for t in candidates:
            if not isinstance(t, torch.Tensor):
                continue
            lt = local_tensor(t)
            if lt.device != self.device or lt.numel() == 0 or id(lt) in seen:
                continue
            seen.add(id(lt))
            out.append(lt)
        return out

    def _offload(self, name: str) -> int:
        self._start_offload(name)
        return self._finish_offload(name)

    def _start_offload(self, name: str) -> int:
        self.wait_reload()
        res = self._resources[name]
        res.pending = self._mover.start_offload(self._tensors(name), res.buffer)
        return 0  # counted when it finishes

    def _finish_offload(self, name: str) -> int:
        res = self._resources[name]
        pending, res.pending = res.pending, None
        res.moved = self._mover.finish(pending)
        res.location = "host"
        return pending.bytes

    def _cancel_offload(self, name: str) -> None:
        res = self._resources[name]
        if res.pending is not None:
            self._mover.cancel(res.pending)
            res.pending = None

    def _room_for_engine_weights(self) -> str | None:
        """Whether the engine's weights (and a sync bucket) fit while the trainer's optimizer is still resident:
        "room" in what the driver has free now, "after release" once torch's cache and freed gradients are handed
        back, None if not at all."""
        if self.device.type != "cuda":
            return "after release"
        need = self.engine.weights_bytes + self.config.sync_bucket_bytes + 512 * 2**20
        free = memory.device_free_bytes(self.device)
        if free >= need:
            return "room"
        grads = sum(nbytes(t) for t in self._tensors("grads")) if self.config.grads == "free" else 0
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return "after release" if free + cached + grads >= need else None

    def _reload(self, name: str, defer: bool = False) -> int:
        res = self._resources[name]
        moved = res.host_bytes()
        try:
            event = self._mover.reload(res.moved, wait=not defer, buffer=res.buffer)
            if defer:
                self._pending_reload = event
        except torch.OutOfMemoryError as exc:
            free = memory.device_free_bytes(self.device) if self.device.type == "cuda" else 0
            raise torch.OutOfMemoryError(
                f"swaprl could not bring the {name} back to {self.device}: {memory.gib(moved):.2f} GiB needed, "
                f"{memory.gib(free):.2f} GiB free. Something allocated during 'generate' is still alive "
                f"(rollout tensors, a cache): delete it before leaving the phase. ({exc})") from exc
        res.moved = []
        res.location = "device"
        return moved

    def _drop_grads(self) -> int:
        res = self._resources["grads"]
        freed = 0
        for p in self.model.parameters():
            if p.grad is not None and local_tensor(p.grad).device == self.device:
                res.dropped.append((p, p.grad))
                freed += nbytes(local_tensor(p.grad))
                p.grad = None
        res.location = "released"
        return freed

    def _restore_grads(self) -> None:
        res = self._resources["grads"]
        for p, g in res.dropped:
            p.grad = g
        res.dropped = []
        res.location = "device"

    def _forget_dropped_grads(self) -> None:
        self._resources["grads"].dropped = []  # the transition stands: let the gradients go

    def _set_grads_location(self, location: Location) -> None:
        self._resources["grads"].location = location

    def _check_host_budget(self) -> None:
        """Refuse before moving a byte if the host buffers would have to grow past the budget."""
        wanted = {}
        if self._streamer is None:  # host-resident states are in their buffer already
            wanted["optimizer"] = layout_bytes(self._tensors("optimizer"))
        if self.config.grads == "offload":
            wanted["grads"] = layout_bytes(self._tensors("grads"))
        if self.config.params == "offload":
            wanted["params"] = layout_bytes(self._tensors("params"))
        growth = sum(max(0, n - self._resources[k].buffer.capacity) for k, n in wanted.items())
        if growth == 0 and not distributed.is_distributed():
            return
        over, worst, available, source = self._over_host_budget(growth)
        if worst <= 0:
            return
        elsewhere = "" if over > 0 else f" (this rank fits; another is {memory.gib(worst):.2f} GiB over)"
        parts = ", ".join(f"{k} {memory.gib(n):.2f} GiB" for k, n in wanted.items())
        raise HostBufferError(
            f"offloading for 'generate' needs {growth} more bytes ({memory.gib(growth):.2f} GiB: {parts}) of "
            f"host memory but only {max(available, 0)} bytes ({memory.gib(max(available, 0)):.2f} GiB) are "
            f"allowed ({source}){elsewhere}. Nothing was moved. Free host memory, raise host_budget_bytes, or "
            f"move less: grads='free' or 'keep', params='keep'.")

    def _reserve_for_states(self, growth: int, releasing: int, context: str) -> None:
        """Refuse to grow the host-resident optimizer states' buffer by `growth` bytes past the budget; `releasing`
        bytes of ordinary host memory (states waiting to move into the buffer) are freed as it fills."""
        if growth <= 0 and not distributed.is_distributed():
            return
        # Collective under torchrun: data-parallel replicas create their states at the same step, so all get here.
        over, worst, available, source = self._over_host_budget(max(growth, 0), releasing)
        if worst <= 0:
            return
        elsewhere = "" if over > 0 else f" (this rank fits; another is {memory.gib(worst):.2f} GiB over)"
        raise HostBufferError(
            f"keeping the optimizer states in host memory (SwapConfig(optimizer_states='host')) needs {growth} more "
            f"bytes ({memory.gib(growth):.2f} GiB) of host memory but only {max(available, 0)} bytes "
            f"({memory.gib(max(available, 0)):.2f} GiB) are allowed ({source}){elsewhere}. {context} Free host "
            "memory or raise host_budget_bytes.")

    def _over_host_budget(self, growth: int, releasing: int = 0) -> tuple[int, int, int, str]:
        """(bytes by which growing the host buffers by `growth` overshoots the budget on this rank, the same on the
        worst rank, bytes allowed, where the budget comes from). Collective under torchrun."""
        held = sum(r.buffer.capacity for r in self._resources.values())
        if self.config.host_budget_bytes is not None:
            available = self.config.host_budget_bytes - held
            source = f"SwapConfig.host_budget_bytes={self.config.host_budget_bytes}"
        else:
            # The ranks of a node share its host memory and size their buffers at the same moment.
            ranks = distributed.local_world_size()
            available = (memory.host_available_bytes() - self.config.host_margin_bytes) // ranks + releasing
            source = (f"available host memory less SwapConfig.host_margin_bytes "
                      f"({memory.gib(self.config.host_margin_bytes):.1f} GiB)"
                      + (f", shared by the {ranks} ranks of this node" if ranks > 1 else ""))
        over = growth - available if growth else 0
        (worst,) = distributed.all_reduce([over], "max")  # every rank refuses, or none: see swaprl.distributed
        return over, int(worst), available, source

    def _release_cache(self) -> None:
        # One call per transition, not per tensor: hands the blocks just freed back to the driver, so an engine
        # with its own memory pool (vLLM) can map them and NVML shows the drop.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _engine_sleep(self) -> None:
        self.engine.sleep(self.sleep_level)
        if self.sleep_level == 2:
            self._engine_stale = True

    def _engine_wake(self, tags: list[str] | None) -> None:
        self.engine.wake(tags)
        if tags is None or "kv_cache" in tags:
            self.engine.reset_prefix_cache()

    def _engine_rewake(self) -> None:
        self._engine_wake(None)
        if self._engine_stale:
            self.sync_weights()

    def _verify_weights(self) -> None:
        seconds, sent = self._synced or (None, None)
        report = self._verifier.check_weights(self._cycle + 1, sync_seconds=seconds, sync_bytes=sent)
        if self.config.params != "keep" or not report.ok:  # no mismatch step follows: the report is complete
            self._emit({"type": "sync", **report.as_dict()})
        raise_if_failed(report)

    def _measure_mismatch(self) -> None:
        report = self._verifier.add_mismatch()
        self._emit({"type": "sync", **report.as_dict()})
        raise_if_failed(report)

    # ---------------------------------------------------------------- helpers
    def _resolve_sleep_level(self) -> int:
        level = self.config.sleep_level
        if level == "auto":
            return 1 if self.engine.shares_trainer_weights else 2
        return int(level)

    def _check_step_allowed(self, optimizer, args, kwargs) -> None:
        if self._streamer is not None:
            if not self._streaming:
                raise PhaseError(
                    "optimizer.step() reached torch's own step, not swaprl's streamed one, while the optimizer "
                    "states are in host memory (SwapConfig(optimizer_states='host')): it was called through a "
                    "reference to the step method taken before swaprl.attach() (or something replaced the method "
                    "since). Call optimizer.step() itself, and build what keeps a reference to it (accelerate's "
                    "prepare() with a GradScaler) after attach()")
            if self._phase != "train":
                raise PhaseError(f"optimizer.step() was called in phase {self._phase!r}; call it inside "
                                 "`with phase('train')`")
            return
        if self._resources["optimizer"].location != "device":
            raise PhaseError("optimizer.step() was called while its states are in host memory (phase "
                             f"{self._phase!r}); call it inside `with phase('train')`")
        self.wait_reload()

    # ---------------------------------------------------------------- host-resident optimizer states
    def _install_streamed_methods(self) -> None:
        """Make `optimizer.step()` the streamed step, and `optimizer.load_state_dict()` load into host memory, for
        this optimizer object only, until `detach()`.

        Instance attributes take precedence over the class's methods, so every caller (user code, accelerate's
        AcceleratedOptimizer, an LR scheduler's wrapper made after attach) reaches them.
        """
        opt, runtime, streamer = self.optimizer, self, self._streamer
        algorithm = type(opt).step
        if getattr(algorithm, "hooked", False):  # torch wraps each optimizer class's step with its hooks once
            algorithm = algorithm.__wrapped__

        def streamed(opt, closure=None):
            return streamer.step(lambda: algorithm(opt), closure)

        # Torch's own hook wrapper, once around all chunks: step hooks see the whole step, every gradient in place.
        hooked = torch.optim.Optimizer.profile_hook_step(streamed)

        def step(plain, *args, **kwargs):
            if getattr(plain, "_wrapped_by_lr_sched", False):  # what the LR scheduler's wrapper, replaced, records
                opt._opt_called = True
            runtime._streaming = True
            try:
                return hooked(opt, *args, **kwargs)
            finally:
                runtime._streaming = False

        def load_state_dict(plain, state_dict):
            # torch casts each loaded state to its parameter's device, all at once: the very memory this mode saves.
            # For the length of the load each parameter's data is an empty host tensor of its dtype, so the states
            # land in host memory, and the load's post-hook moves them into the buffer from there.
            params = [p for p, _ in streamer.params()]
            data = [p.data for p in params]
            try:
                for p in params:
                    p.data = torch.empty(0, dtype=p.dtype)
                return plain(state_dict)
            finally:
                for p, d in zip(params, data):
                    p.data = d

        # An LR scheduler built before attach wrapped the step to record that it ran, and warns when a step method
        # without its mark replaces it (https://github.com/pytorch/pytorch/issues/20124): keep the mark.
        undo = [self._override("step", step, marks=("_wrapped_by_lr_sched",)),
                self._override("load_state_dict", load_state_dict)]

        def restore() -> None:
            for fn in undo:
                fn()

        self._restore_methods = restore

    def _override(self, name: str, body: Callable, marks: tuple[str, ...] = ()) -> Callable[[], None]:
        """Set `optimizer.<name>` on the instance to call `body(plain, *args, **kwargs)`, where `plain` is what was
        there before; returns what puts it back."""
        opt, runtime = self.optimizer, self
        previous = vars(opt).get(name)  # an instance-level wrapper made earlier, e.g. by an LR scheduler
        plain = previous if previous is not None else types.MethodType(getattr(type(opt), name), opt)

        def method(opt, *args, **kwargs):
            if runtime._closed:  # detached, but still reached through a wrapper made after attach
                return plain(*args, **kwargs)
            return body(plain, *args, **kwargs)

        for mark in marks:
            if getattr(previous, mark, False):
                setattr(method, mark, getattr(previous, mark))
        installed = types.MethodType(method, opt)
        setattr(opt, name, installed)

        def restore() -> None:
            if vars(opt).get(name) is installed:
                if previous is None:
                    delattr(opt, name)
                else:
                    setattr(opt, name, previous)
            # else a wrapper made after attach holds `installed`, which passes through to `plain` from now on

        return restore

    def _states_to_device(self) -> int:
        """Bring the host-resident optimizer states back to the device (detach, or undoing attach)."""
        moved = self._streamer.moved()
        total = sum(nbytes(m.tensor) for m in moved)
        try:
            self._mover.reload(moved, buffer=self._resources["optimizer"].buffer)
        except torch.OutOfMemoryError as exc:
            free = memory.device_free_bytes(self.device) if self.device.type == "cuda" else 0
            # Without the gradients (and the engine, asleep in "train") would they fit? Say which fix applies.
            grads = sum(nbytes(p.grad) for p in self.model.parameters() if p.grad is not None)
            fix = ("free device memory (drop the gradients: optimizer.zero_grad(set_to_none=True)) before "
                   "detach()" if total <= free + grads else
                   "they do not fit next to the parameters: keep the runtime attached to the end of training "
                   "(optimizer.state_dict() taken now is a complete checkpoint of host tensors)")
            raise torch.OutOfMemoryError(
                f"swaprl could not bring the host-resident optimizer states back to {self.device} for plain torch "
                f"to step them: {memory.gib(total):.2f} GiB needed, {memory.gib(free):.2f} GiB free. They stay in "
                f"host memory and the runtime stays attached; {fix}. ({exc})") from exc
        self._streamer.forget()
        self._resources["optimizer"].location = "device"
        return total

    def _on_streamed_step(self, info: dict) -> None:
        self._emit({"type": "step", "transition": "optimizer.step", "step": "stream optimizer states", **info})

    def _check_open(self) -> None:
        if self._closed:
            raise PhaseError("this runtime was detached; call swaprl.attach(model, optimizer) again")

    def _emit(self, event: dict) -> None:
        if not self._listeners:
            return
        event = {"t": time.time(), **event}
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:  # a broken listener must never break a transition
                logger.exception("swaprl listener failed on %s event", event.get("type"))


def _model_device(model: torch.nn.Module) -> torch.device:
    devices = {local_tensor(p).device for p in model.parameters()}
    if not devices:
        raise ValueError("the model has no parameters; attach the module you train")
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are spread over {sorted(map(str, devices))}; swaprl drives one "
                         "device per process: move the model to one device (or shard it with FSDP2)")
    return devices.pop()
