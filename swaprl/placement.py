"""Where the trainer's memory lives, and the moves that change it: one `Placement` per runtime.

The trainer's memory is three resources: "optimizer" (the optimizer's state tensors, and the fp32 masters),
"grads" and "params". Each is on the device, in its host buffer, or released (gradients only: dropped, re-made by
the next backward). The phase machine (`swaprl.runtime`) decides when to move what; this module moves it and says
where everything is. Each parameter's states have a home (`swaprl.state_homes`, the policy of `swaprl.homes`):
"device" (they never move), "swap" (the "optimizer" resource: moved to its host buffer for 'generate' and back for
'train') or "host" (kept by a `StateStreamer`, `swaprl.streaming`, in a host buffer of their own for good and
brought through the device inside `optimizer.step()`). The host memory every buffer takes is asked of the
runtime's `HostBudget` first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from . import distributed, homes, memory
from .compat.torch import local_tensor
from .config import STATE_HOMES, SwapConfig
from .errors import HostBufferError, PhaseError
from .host_budget import HostBudget
from .master import MasterWeights
from .partitions import FlatPartitions, PartitionCopies
from .residency import HostBuffer, Moved, Mover, PendingOffload, layout_bytes, nbytes
from .state_homes import StateHomes
from .streaming import StateStreamer
from .undo import Step

logger = logging.getLogger(__name__)

Resource = Literal["optimizer", "grads", "params"]
Location = Literal["device", "host", "released"]
EngineRoom = Literal["free now", "after release"]
"""Where the engine's weights fit while the optimizer is still on the device: in memory the driver has free now,
or once torch's cache is handed back (not the gradients grads="free" drops: held for the step's undo until the
switch commits)."""

RESOURCES: tuple[Resource, ...] = ("optimizer", "grads", "params")


@dataclass(slots=True)
class _Resource:
    name: Resource
    buffer: HostBuffer
    location: Location = "device"
    moved: list[Moved] = field(default_factory=list)
    dropped: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    pending: PendingOffload | None = None


class Placement:
    """The trainer's resources for one model and optimizer on one device, and their host buffers.

    `room`: the device's room measured at attach with the engine awake (`memory.measure_room`), None when it
    cannot be (`unmeasurable` says why); `peaks`: the runtime's `memory.TorchPeaks`, whose span from attach gives the
    first step's rule training's peak. `partitions`: the flat partitions `optimizer` steps in place of the model's
    parameters (`swaprl.partitions`); their copies move with their states."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 config: SwapConfig, *, masters: MasterWeights | None, room: homes.Room | None,
                 unmeasurable: str | None = None, peaks: memory.TorchPeaks | None = None,
                 on_streamed_step: Callable[[dict], None] | None = None,
                 partitions: FlatPartitions | None = None) -> None:
        self.model, self.optimizer, self.device, self.config = model, optimizer, device, config
        self.masters = masters
        self.homes = StateHomes(optimizer, device, config, masters=masters, room=room, unmeasurable=unmeasurable,
                                partitions=partitions)
        if self.homes.why:
            logger.info("optimizer_states='auto': %s", self.homes.why)
        self._peaks = peaks
        if peaks is not None and self.homes.may_stream and not self.homes.streams:
            peaks.start()  # the first step's rule reads training's peak since now
        self._mover = Mover(device)
        pin = config.pin_memory and device.type == "cuda"
        gpu = device.index if device.type == "cuda" else None
        self._res = {name: _Resource(name, HostBuffer(name, pin=pin, device=gpu)) for name in RESOURCES}
        self._pending_reload: torch.cuda.Event | None = None
        self.whole_segments = True
        """The reloaded states come back in one segment of their own (`Mover.reload`'s `one_segment`), which the
        release before the engine's wake-up hands back whole; False for an engine that wakes on torch's cached pages
        (`lend_pages`): in torch's pages, which that wake-up borrows when the states leave, and which the next
        reload finds still mapped."""
        self.budget = HostBudget(config, self._held)
        self.streamer: StateStreamer | None = None
        # Under "auto" the streamed step is there from the start, owning nothing until the first step finds that
        # the states it creates do not all fit on the device beside what training holds (`home_new_states`).
        if self.homes.may_stream:
            # Streamed flat partitions that are copies live with their states, as fp32 masters do.
            streamed = partitions is not None and partitions.streamable
            self.streamer = StateStreamer(optimizer, device, HostBuffer("streamed optimizer", pin=pin, device=gpu),
                                          owns=lambda p: self.homes.home(p) == "host",
                                          chunk_bytes=config.stream_chunk_bytes,
                                          check_budget=self.budget.for_states, on_step=on_streamed_step,
                                          masters=PartitionCopies(partitions) if streamed else masters,
                                          params=partitions.with_groups(optimizer) if streamed else None)
            if not self.homes.swaps and self.homes.streams:
                self._res["optimizer"].location = "host"

    @property
    def swaps_states(self) -> bool:
        """Some states move at each switch (the "optimizer" resource is not empty)."""
        return self.homes.swaps

    def home(self, p: torch.Tensor) -> homes.Home:
        return self.homes.home(p)

    # ---------------------------------------------------------------- the homes' later moments
    def make_room(self, short_bytes: int) -> int:
        """Under "auto", after an engine's wake-up lacked `short_bytes` (and was undone): swap the states of as many
        more parameters as that takes, on every rank or none. Returns the bytes swapped from now on (0: the switch
        cannot go again)."""
        freed = self.homes.after_short_wake(short_bytes, self._device_state_bytes)
        res = self._res["optimizer"]
        if freed and not res.moved:  # the swapped states are on the device (the switch was undone)
            res.location = "device"
        return freed

    def home_new_states(self) -> int:
        """Under "auto", at the first streamed `optimizer.step()` (before it creates the states): the states that
        would not fit on the device beside training's peak get the "host" home, and their host buffer is allocated
        and locked now. Returns the bytes of states homed in host memory (0 when all fit or already decided)."""
        before = self.homes.snapshot()
        streamed = self.homes.at_first_step(lambda: memory.measure_room(self.device, peaks=self._peaks))
        if not streamed:
            return 0
        try:
            self._host_buffers_for_new_homes()
        except BaseException:
            self.homes.undo_first_step(before)  # nothing was decided: the next step measures again
            raise
        if self.homes.partitions is not None and any(self.home(t) == "host" for t in self._moving_themselves()):
            # Flat partitions that are copies, on the device until now: at their home before the step plans, so
            # that it stages them a piece at a time with their states rather than whole where they are.
            self.streamer.layout.move_into_buffer("The step has not run; the homes stand.")
        return streamed

    def _host_buffers_for_new_homes(self) -> None:
        """After the first step gave states the host home, before it creates them (collective): the streamed states'
        buffer is allocated and page-locked now, at its full size, so that the step copies each state it creates
        straight into locked memory, not into new pageable memory first (faulting in every page) and into the buffer
        after (a second copy). The swapped states' buffer, which attach sized for the states it expected to swap,
        is refitted to those that still do (with `make_room`'s headroom), if it holds none now. Raises
        `HostBufferError` on every rank, the homes not yet changed for good, if host memory is short on one."""
        sizes, swapped, streamed = self._host_sizes(), self._res["optimizer"], self.streamer.buffer
        want = sizes.get("optimizer", 0)
        refit = not swapped.moved and swapped.buffer.capacity > want
        # Not where it holds states already (loaded before the first step): the step places the new ones itself.
        size = 0 if streamed.capacity else sizes.get("streamed optimizer", 0)
        self.budget.check(max(size - (swapped.buffer.capacity - want if refit else 0), 0), 0,
                          "keeping in host memory the optimizer states the first step creates "
                          "(optimizer_states='auto')",
                          "Nothing was moved and the step has not run; the next optimizer.step() decides again. "
                          "Free host memory or raise host_budget_bytes.")
        held = swapped.buffer.capacity
        if refit:
            logger.info("host buffer 'optimizer': %.2f GiB refitted to %.2f GiB for the states that still swap",
                        memory.gib(held), memory.gib(want))
            swapped.buffer.release()
        error = None
        try:
            if size:
                streamed.ensure(size)
        except Exception as exc:  # out of host memory, or locking it refused: every rank must hear of it
            error = exc
        if distributed.all_reduce([error is not None], "max")[0]:
            # As before the call: no streamed buffer (the next step sizes it again), the swap buffer as attach made it.
            if size:
                streamed.release()
            if refit:
                swapped.buffer.prepare(held)
            what = f"this rank's {memory.gib(size):.2f} GiB ({error})" if error else "it on another rank"
            raise HostBufferError(
                f"allocating page-locked host memory for the optimizer states the first step creates failed: {what}. "
                "Nothing was moved and the step has not run; the next optimizer.step() decides again. Free host "
                "memory or set SwapConfig(optimizer_states='host') with a host_budget_bytes that fits.") from error
        if refit and want:
            swapped.buffer.prepare(want)  # in the background: nothing needs it before the next switch

    # ---------------------------------------------------------------- where things are
    def location(self, name: Resource) -> Location:
        return self._res[name].location

    def tensors(self, name: Resource, of_homes: tuple[str, ...] = ("swap",)) -> list[torch.Tensor]:
        """The distinct tensors of a resource that live on the device now; for "optimizer", the states of the
        parameters with one of `of_homes` (by default those that move at a switch)."""
        if name == "optimizer":
            candidates = (v for p in self.homes.parameters() if self.home(p) in of_homes
                          for v in self._state_tensors(p))
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

    def status(self) -> dict:
        """Per resource: where it is, its device bytes and its host bytes ("optimizer": the states of every home;
        its location is that of the swapped ones); the states' bytes by home; and the host buffers' total."""
        out: dict = {}
        for name, res in self._res.items():
            moved = list(res.moved)
            if name == "optimizer" and self.streamer is not None:
                moved += self.streamer.layout.moved()
            on_host = {id(m.tensor) for m in moved}  # on a CPU-only machine host and device look alike
            on_device = sum(nbytes(t) for t in self.tensors(name, STATE_HOMES) if id(t) not in on_host)
            out[name] = {"location": res.location, "bytes": on_device,
                         "host_bytes": sum(nbytes(m.tensor) for m in moved)}
        out["optimizer_homes"] = self.home_bytes()
        out["optimizer_split"] = self.homes.fractions()
        buffers = self._buffers()
        out["host_buffers"] = {"bytes": self._held(), "pinned": any(b.pin for b in buffers),
                               "locked_bytes": sum(b.locked_bytes for b in buffers),
                               "lock_seconds": sum(b.lock_seconds or 0.0 for b in buffers),
                               "waited_seconds": sum(b.waited_seconds for b in buffers),
                               "attach_waited_seconds": sum(b.attach_waited_seconds for b in buffers),
                               "buffers": [{"name": b.name, "bytes": b.capacity, "locked_bytes": b.locked_bytes,
                                            "lock_seconds": b.lock_seconds, "lock_span": b.lock_span,
                                            "background": b.background, "waited_seconds": b.waited_seconds,
                                            "attach_waited_seconds": b.attach_waited_seconds,
                                            "numa_node": b.numa_node}
                                           for b in buffers if b.capacity]}
        return out

    def home_bytes(self) -> dict[str, int]:
        """The optimizer states' bytes by home, wherever they are now (not torch's CPU step counters of a device's
        parameters, which stay where torch keeps them)."""
        out = dict.fromkeys(STATE_HOMES, 0)
        for p, state in self.optimizer.state.items():
            if not self.homes.places(p):  # a flat partition's states its owner keeps in host memory itself
                continue
            out[self.home(p)] += sum(nbytes(local_tensor(v)) for key, v in state.items() if isinstance(v, torch.Tensor)
                                     and not (key == "step" and local_tensor(v).device != self.device
                                              and local_tensor(v).device.type == "cpu"))
        for m in self._moving_themselves():
            out[self.home(m)] += nbytes(local_tensor(m))
        return out

    def _moving_themselves(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps that live with their states: fp32 masters, flat partitions that are
        copies of the model's values."""
        return [p for p in self.homes.parameters() if self.homes.moves_itself(p)]

    def _state_tensors(self, p: torch.Tensor) -> list:
        """`p`'s optimizer states, and `p` itself when it lives with them (`StateHomes.moves_itself`)."""
        master = [p] if self.homes.moves_itself(p) else []
        return master + list(self.optimizer.state.get(p, {}).values())

    def _buffers(self) -> list[HostBuffer]:
        return [r.buffer for r in self._res.values()] + ([self.streamer.buffer] if self.streamer else [])

    def _device_state_bytes(self, p: torch.Tensor) -> int:
        """The device bytes of `p`'s states (and master) now."""
        return sum(nbytes(local_tensor(t)) for t in self._state_tensors(p)
                   if isinstance(t, torch.Tensor) and local_tensor(t).device == self.device)

    def _held(self) -> int:
        orphaned = self.streamer.layout.orphaned_bytes() if self.streamer is not None else 0
        return sum(b.capacity for b in self._buffers()) + orphaned

    # ---------------------------------------------------------------- host memory ahead of the first switch
    def prepare_host(self) -> dict[str, int]:
        """Check the host budget for the buffers the first switches and steps will need, then allocate and page-lock
        them in the background (`HostBuffer.prepare`), so that locking runs under the engine's start instead of inside
        the first switch; attach waits for it at its end (`finish_host`). Under "auto" the swapped states' buffer
        gets more room (the reserve's worth, up to the states kept on the device) for those `make_room` may swap
        later without a new buffer. Returns the bytes started per buffer."""
        sizes = self._host_sizes()
        parts = ", ".join(f"{k} {memory.gib(n):.2f} GiB" for k, n in sizes.items())
        self.budget.check(sum(sizes.values()), 0,
                          f"locking host buffers at attach for the first switch ({parts or 'none'})",
                          "Nothing was allocated. Free host memory or raise host_budget_bytes (the optimizer states "
                          "live in host memory while the engine generates), or keep the parameters on the device "
                          "(params='keep').")
        buffers = {b.name: b for b in self._buffers()}
        for name, n in sizes.items():
            buffers[name].prepare(n)
        return sizes

    def _host_sizes(self) -> dict[str, int]:
        """`expected_host_bytes`, and under "auto" the swapped states' room for those `make_room` may swap later."""
        headroom = memory.default_reserve_bytes(torch.cuda.mem_get_info(self.device)[1]) \
            if self.homes.auto and self.device.type == "cuda" else 0
        sizes = self.expected_host_bytes()
        kept = self.homes.expected_bytes("device") if headroom else 0
        if min(headroom, kept):
            sizes["optimizer"] = sizes.get("optimizer", 0) + min(headroom, kept)
        return sizes

    def masters_to_device(self, of_homes: tuple[homes.Home, ...]) -> int:
        """The fp32 masters of `of_homes` go to the device, filled from their model parameters (they are made in
        host memory); returns the bytes placed. Attach places the "device" home's before an engine is sized from
        the free memory (they stay there beside it), the "swap" home's once the engine sleeps (they leave for
        every 'generate': an engine sized beside them would lose their room to its KV cache for nothing)."""
        if self.masters is None:
            return 0
        return self.masters.place([m for m in self.masters if self.home(m) in of_homes], self.device)

    def finish_host(self) -> float:
        """Wait for what `prepare_host` started; returns the seconds waited."""
        return sum(b.settle() for b in self._buffers())

    def expected_host_bytes(self) -> dict[str, int]:
        """What each host buffer will hold, by its name: the swapped optimizer states ("optimizer") and the
        host-resident ones ("streamed optimizer"), those that exist, else what the optimizer will create, for the
        optimizers whose states are known; and the parameters with params='offload'. Gradients are left out: a loop
        that zeroes them with set_to_none before generating moves none.

        The first streamed step sends the states it creates straight into their buffer, laid out in the order it
        creates them, so a buffer locked ahead holds them without a second copy in other host memory."""
        out = {}
        for name, home in (("optimizer", "swap"), ("streamed optimizer", "host")):
            counted = self.tensors("optimizer", (home,)) if self.optimizer.state else []
            states = layout_bytes(counted) or self.homes.expected_bytes(home)
            # Masters made in host memory (not on the device, so not counted above) move into the buffer at attach;
            # flat partitions that are copies move with their states, which the first step makes.
            ids = {id(t) for t in counted}
            states += layout_bytes([local_tensor(m) for m in self._moving_themselves() if self.home(m) == home
                                    and id(local_tensor(m)) not in ids])
            if states:
                out[name] = states
        if self.config.params == "offload":
            out["params"] = layout_bytes(self.tensors("params"))
        return out

    # ---------------------------------------------------------------- the steps of a switch
    def offload_steps(self, room: EngineRoom | None) -> tuple[list[Step], list[Step]]:
        """The trainer's moves entering `generate`, in two parts: those that start it, before the engine wakes, and
        those that end it, once the engine's weights are woken and synced. With `room` (the engine's weights fit
        beside the states) the offloads' copies start in the first part and finish in the second, running under the
        wake-up and the sync. The runtime runs the first part's blocking steps, then torch's release, then its
        steps that only queue copies (`blocking=False`), which made the release as slow as themselves. Only what is on
        the device moves: a switch into the phase the runtime is in already completes what a failed rollback left,
        and moves nothing twice. Refuses before a byte moves if the host buffers would pass the budget."""
        self.check_host_budget()
        cfg = self.config
        offloads = [name for name in (["optimizer"] if self.swaps_states else [])
                    + (["grads"] if cfg.grads == "offload" else []) if self.location(name) == "device"]
        first: list[Step] = []
        then: list[Step] = []
        for name in offloads:
            if room:
                first.append(Step(f"start offload {name}", lambda n=name: self.start_offload(n),
                                  lambda n=name: self.cancel_offload(n), blocking=False))
                then.append(Step(f"finish offload {name}", lambda n=name: self.finish_offload(n),
                                 lambda n=name: self.reload(n), started_by=f"start offload {name}"))
            else:
                first.append(Step(f"offload {name}", lambda n=name: self.offload(n), lambda n=name: self.reload(n)))
        if cfg.grads == "free" and self.location("grads") == "device":
            first.append(Step("free grads", self.free_grads, self.restore_grads, self.keep_grads_freed, moves=False))
        if cfg.params == "offload" and self.location("params") == "device":  # an engine of its own weights only
            then.append(Step("offload params", lambda: self.offload("params"), lambda: self.reload("params")))
        return first, then

    def reload_steps(self) -> list[Step]:
        """The trainer's moves entering `train`: what is in host memory comes back (the swapped optimizer states
        under the forward with `overlap_optimizer_reload`); freed gradients are made afresh by the next backward.
        States with the "host" home stay: the streamed step brings them through."""
        steps = []
        for name in ("params", "grads", "optimizer"):
            location = self.location(name)
            if name == "optimizer" and not self.swaps_states:
                continue
            if location == "host":
                overlap = name == "optimizer" and self.config.overlap_optimizer_reload
                steps.append(Step(f"reload {name}", lambda n=name, o=overlap: self.reload(n, defer=o),
                                  lambda n=name: self.offload(n), blocking=not overlap))
            elif location == "released":
                steps.append(Step("grads to device", lambda: self.set_location("grads", "device"),
                                  lambda: self.set_location("grads", "released")))
        return steps

    # ---------------------------------------------------------------- moves
    def offload(self, name: Resource) -> int:
        self.start_offload(name)
        return self.finish_offload(name)

    def start_offload(self, name: Resource) -> int:
        """Queue the copies of `name` to its host buffer; the tensors stay on the device until `finish_offload`."""
        self.wait_reload()
        res = self._res[name]
        res.pending = self._mover.start_offload(self.tensors(name), res.buffer)
        return 0  # counted when it finishes

    def finish_offload(self, name: Resource) -> int:
        res = self._res[name]
        pending, res.pending = res.pending, None
        res.moved = self._mover.finish(pending)
        res.location = "host"
        return pending.bytes

    def cancel_offload(self, name: Resource) -> None:
        res = self._res[name]
        if res.pending is not None:
            self._mover.cancel(res.pending)
            res.pending = None

    def reload(self, name: Resource, *, defer: bool = False) -> int:
        """Bring `name` back to the device. `defer`: the compute stream waits for the copies only at
        `wait_reload()` (the optimizer's step and state_dict call it), so they run under the forward and backward."""
        res = self._res[name]
        moved = sum(nbytes(m.tensor) for m in res.moved)
        try:
            event = self._mover.reload(res.moved, wait=not defer, buffer=res.buffer,
                                       one_segment=self.whole_segments and name != "grads")
            if defer:
                self._pending_reload = event
        except torch.OutOfMemoryError as exc:
            raise torch.OutOfMemoryError(
                f"swaprl could not bring the {name} back to {self.device}: {memory.gib(moved):.2f} GiB needed, "
                f"{memory.gib(self._device_free()):.2f} GiB free. Something allocated during 'generate' is still "
                f"alive (rollout tensors, a cache): delete it before leaving the phase. ({exc})") from exc
        res.moved = []
        res.location = "device"
        return moved

    def check_step(self, phase: str) -> None:
        """Refuse an `optimizer.step()` that would not find the optimizer states where it needs them (a pre-hook);
        with a reload still in flight, make the step wait for it."""
        if self.streamer is not None and self.homes.streams:
            if not self.streamer.stepping:
                raise PhaseError(
                    "optimizer.step() reached torch's own step, not swaprl's streamed one, while optimizer states "
                    "are in host memory (the 'host' home of SwapConfig.optimizer_states): it was called through a "
                    "reference to the step method taken before swaprl.attach() (or something replaced the method "
                    "since). Call optimizer.step() itself, and build what keeps a reference to it (accelerate's "
                    "prepare() with a GradScaler) after attach()")
            if phase != "train":
                raise PhaseError(f"optimizer.step() was called in phase {phase!r}; call it inside "
                                 "`with phase('train')`")
        if self.swaps_states and self.location("optimizer") != "device":
            raise PhaseError("optimizer.step() was called while its states are in host memory (phase "
                             f"{phase!r}); call it inside `with phase('train')`")
        self.wait_reload()

    def wait_reload(self) -> None:
        """Make the compute stream wait for an optimizer reload still in flight."""
        if self._pending_reload is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending_reload)
            self._pending_reload = None

    def free_grads(self) -> int:
        """Drop the gradients (kept aside until `keep_grads_freed` or `restore_grads`); returns the bytes freed."""
        res = self._res["grads"]
        freed = 0
        for p in self.model.parameters():
            if p.grad is not None and local_tensor(p.grad).device == self.device:
                res.dropped.append((p, p.grad))
                freed += nbytes(local_tensor(p.grad))
                p.grad = None
        res.location = "released"
        return freed

    def restore_grads(self) -> None:
        res = self._res["grads"]
        for p, g in res.dropped:
            p.grad = g
        res.dropped = []
        res.location = "device"

    def keep_grads_freed(self) -> None:
        self._res["grads"].dropped = []  # the transition stands: let the gradients go

    def set_location(self, name: Resource, location: Location) -> None:
        self._res[name].location = location

    def release_cache(self) -> int:
        """Hand the blocks just freed back to the driver, so that an engine with its own memory pool (vLLM) can map
        them and NVML shows the drop (one call per transition, not per tensor); returns the bytes handed back."""
        if self.device.type != "cuda":
            return 0
        before = memory.torch_counters(self.device)[1]
        torch.cuda.empty_cache()
        return max(before - memory.torch_counters(self.device)[1], 0)

    def engine_room(self, engine_bytes: int) -> EngineRoom | None:
        """Whether `engine_bytes` (the engine's weights and the sync's largest bucket) fit while the optimizer is
        still on the device, and how (see `EngineRoom`); None if not at all.

        Gradients that grads="free" drops do not count as room: "free grads" holds them for its undo until the
        switch commits, so no release before the engine wakes can hand their memory back."""
        if self.device.type != "cuda":
            return "after release"
        need = engine_bytes + 512 * 2**20
        free = self._device_free()
        if free >= need:
            return "free now"
        cached = memory.default_pool_free_bytes(self.device)  # not a paused private pool's: no release maps it
        return "after release" if free + cached >= need else None

    def states_to_host(self) -> int:
        """Move the optimizer states into their host buffer for good (optimizer_states='host')."""
        return self.streamer.layout.move_into_buffer("Nothing was moved.")

    def states_to_device(self) -> int:
        """Bring the host-resident optimizer states back to the device for plain torch (detach, undoing attach)."""
        moved = self.streamer.layout.moved()
        total = sum(nbytes(m.tensor) for m in moved)
        try:
            self._mover.reload(moved, buffer=self.streamer.buffer)
        except torch.OutOfMemoryError as exc:
            free = self._device_free()
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
        self.streamer.layout.forget()
        if not self.swaps_states:
            self._res["optimizer"].location = "device"
        return total

    def release(self) -> None:
        """Drop the host buffers (detach: everything is back on the device)."""
        for buffer in self._buffers():
            buffer.release()

    def _device_free(self) -> int:
        return memory.device_free_bytes(self.device) if self.device.type == "cuda" else 0

    # ---------------------------------------------------------------- the host budget
    def check_host_budget(self) -> None:
        """Refuse before moving a byte if the offloads for 'generate' would grow the host buffers past the budget."""
        wanted = {}
        if self.swaps_states:  # host-resident states are in their buffer already
            wanted["optimizer"] = layout_bytes(self.tensors("optimizer"))
        if self.config.grads == "offload":
            wanted["grads"] = layout_bytes(self.tensors("grads"))
        if self.config.params == "offload":
            wanted["params"] = layout_bytes(self.tensors("params"))
        growth = sum(max(0, n - self._res[k].buffer.capacity) for k, n in wanted.items())
        parts = ", ".join(f"{k} {memory.gib(n):.2f} GiB" for k, n in wanted.items())
        self.budget.check(growth, 0, f"offloading for 'generate' ({parts})",
                          "Nothing was moved. Free host memory, raise host_budget_bytes, or move less: "
                          "grads='free' or 'keep', params='keep'.")
