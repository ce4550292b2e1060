"""Where the trainer's memory lives, and the moves that change it: one `Placement` per runtime.

The trainer's memory is three resources: "optimizer" (the optimizer's state tensors), "grads" and "params". Each is
on the device, in its host buffer, or released (gradients only: dropped, re-made by the next backward). The
phase machine (`swaprl.runtime`) decides when to move what; this module moves it, keeps the host memory it uses
within the budget, and says where everything is.

Each parameter's optimizer states have a home (`SwapConfig.optimizer_states`, `assign_homes`): "device" (they never
move), "swap" (the "optimizer" resource: moved to its host buffer for 'generate' and back for 'train') or "host" (a
`StateStreamer`, `swaprl.streaming`, keeps them in a host buffer of their own for good and brings them through the
device inside `optimizer.step()`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from . import distributed, master, memory
from .compat.torch import local_tensor
from .config import STATE_HOMES, STATES_PER_PARAMETER, StateHome, SwapConfig
from .errors import HostBufferError, PhaseError
from .residency import HostBuffer, Moved, Mover, PendingOffload, align, layout_bytes, nbytes
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
    """The trainer's resources for one model and optimizer on one device, and their host buffers."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 config: SwapConfig, *, unmeasurable: str | None = None,
                 on_streamed_step: Callable[[dict], None] | None = None) -> None:
        self.masters = master.of(optimizer)
        """The optimizer's fp32 master weights (`swaprl.master`), if it keeps them: each is one more state of its
        parameter, in host memory with the others."""
        if self.masters is not None:
            config = _masters_config(config)
        self.auto = config.optimizer_states == "auto"
        """`optimizer_states="auto"`: the homes may change as the run shows what fits (`make_room`,
        `home_new_states`)."""
        config, why = resolve_auto(config, optimizer, device, unmeasurable=unmeasurable)
        if why:
            logger.info("optimizer_states='auto': %s", why)
        self.model, self.optimizer, self.device, self.config = model, optimizer, device, config
        """`config`: the caller's, with "auto" resolved to the split it measured."""
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
        self._homes = assign_homes(optimizer, config.state_split())
        self._first_states_homed = not (self.auto and device.type == "cuda")
        if not self._first_states_homed:
            # The first step's rule needs the peak that training's forward and backward reach, which torch counts
            # only as a peak since a reset: from here. (The peak statistics of this device start again at attach.)
            memory.torch_peaks(device).start()
        self.swaps_states = "swap" in self._homes.values()
        """Some states move at each switch (the "optimizer" resource is not empty)."""
        self.streamer: StateStreamer | None = None
        # Under "auto" the streamed step is there from the start, owning nothing until the first step finds that
        # the states it creates do not all fit on the device beside what training holds (`home_new_states`).
        if "host" in self._homes.values() or not self._first_states_homed:
            self.streamer = StateStreamer(optimizer, device, HostBuffer("streamed optimizer", pin=pin, device=gpu),
                                          owns=lambda p: self.home(p) == "host",
                                          chunk_bytes=config.stream_chunk_bytes,
                                          check_budget=self.check_budget_for_states, on_step=on_streamed_step,
                                          masters=self.masters)
            if not self.swaps_states and "host" in self._homes.values():
                self._res["optimizer"].location = "host"

    def make_room(self, short_bytes: int) -> int:
        """Under "auto", after an engine's wake-up lacked `short_bytes` (and was undone): swap the states of as many
        more parameters as that takes, on every rank or none. Returns the bytes swapped from now on (0: the switch
        cannot go again)."""
        if not self.auto or not short_bytes:
            return 0
        freed = self.demote(short_bytes + 2**28)
        if not distributed.all_reduce([freed], "min")[0]:
            return 0
        logger.warning("optimizer_states='auto': the engine's wake-up lacked %.2f GiB; %.2f GiB more of the "
                       "optimizer states are swapped from now on", memory.gib(short_bytes), memory.gib(freed))
        return freed

    def demote(self, nbytes_needed: int) -> int:
        """Give the "swap" home to the last parameters with the "device" home whose states, on the device now, add
        up to `nbytes_needed` or more (fewer if fewer are kept); returns their bytes. For `optimizer_states="auto"`,
        whose measure at attach could not see what the first steps would add."""
        freed = 0
        for p in reversed(_parameters(self.optimizer)):
            if freed >= nbytes_needed:
                break
            if self._homes.get(id(p)) != "device":
                continue
            self._homes[id(p)] = "swap"
            freed += sum(nbytes(local_tensor(v)) for v in self.optimizer.state.get(p, {}).values()
                         if isinstance(v, torch.Tensor) and local_tensor(v).device == self.device)
        self.swaps_states = "swap" in self._homes.values()
        res = self._res["optimizer"]
        if self.swaps_states and not res.moved:  # the swapped states are on the device (a switch was undone)
            res.location = "device"
        return freed

    def home_new_states(self) -> int:
        """Under "auto", at the first `optimizer.step()` (before it creates the states): give the "host" home to the
        last parameters whose states would not fit on the device, measured now that training has run its forward
        and backward beside everything it really holds (DDP's buckets, FSDP2's buffers, a trainer's chunks, the
        engine asleep). Returns the bytes of states homed in host memory (0 when all fit or already decided).

        The states created must fit in what the driver has free, less the reserve and less what the next forward and
        backward will take back from it: torch's cache may hold less now than at training's peak (the allocator
        hands cached blocks back when a request fails, then retries; anything may call `empty_cache`), and the peak
        of reserved memory since attach says how much less. The step also needs temporaries while it runs, which
        the cached blocks can serve: torch's multi-tensor Adam and AdamW take one moment's size more
        (`_STEP_TEMPORARIES`)."""
        if self._first_states_homed:
            return 0
        self._first_states_homed = True
        expected = _expected_per_parameter(self.optimizer)
        params = [p for p in _parameters(self.optimizer) if p not in self.optimizer.state and self.home(p) != "host"]
        if expected is None or not params:
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        cached = memory.default_pool_free_bytes(self.device)
        regrow = max(memory.torch_peaks(self.device).reserved_since_start() - memory.torch_counters(self.device)[1], 0)
        reserve = memory.default_reserve_bytes(total)
        factor = _STEP_TEMPORARIES.get(type(self.optimizer), 1.0)
        room = min(free - regrow - reserve, (free + cached - reserve) / factor)
        # Every rank homes the same parameters: the least room, and each parameter's largest states (FSDP2's shards
        # differ by a row between ranks), so that the streamed steps and their collectives are the same everywhere.
        (room,) = distributed.all_reduce([room], "min")
        sizes = [int(n) for n in distributed.all_reduce([expected[p] for p in params], "max")]
        need = sum(sizes)
        homes, homed = dict(self._homes), 0
        for p, n in zip(reversed(params), reversed(sizes)):
            if need - homed <= room:
                break
            homes[id(p)] = "host"
            homed += n
        if not homed:
            return 0
        previous = self._homes, self.swaps_states
        self._homes, self.swaps_states = homes, "swap" in homes.values()
        try:
            self._host_buffers_for_new_homes()
        except BaseException:
            self._homes, self.swaps_states = previous
            self._first_states_homed = False  # nothing was decided: the next step measures again
            raise
        logger.warning("optimizer_states='auto': the first optimizer step creates %.2f GiB of states and %.2f GiB "
                       "fit on %s beside training (%.2f GiB free, of which training's peak takes %.2f GiB back; "
                       "%.2f GiB cached; %.2f GiB reserve): %.2f GiB of them stay in host memory from now on, "
                       "streamed through the device by each step", memory.gib(need), memory.gib(max(room, 0)),
                       self.device, memory.gib(free), memory.gib(regrow), memory.gib(cached), memory.gib(reserve),
                       memory.gib(homed))
        return homed

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
        self._check_budget(max(size - (swapped.buffer.capacity - want if refit else 0), 0), 0,
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

    def home(self, p: torch.Tensor) -> StateHome:
        """Where `p`'s optimizer states live; a parameter added to the optimizer after attach takes the last
        parameter's home (so "swap" and "host" stay whole)."""
        return self._homes.get(id(p)) or next(reversed(self._homes.values()), "swap")

    # ---------------------------------------------------------------- where things are
    def location(self, name: Resource) -> Location:
        return self._res[name].location

    def tensors(self, name: Resource, homes: tuple[str, ...] = ("swap",)) -> list[torch.Tensor]:
        """The distinct tensors of a resource that live on the device now; for "optimizer", the states of the
        parameters with one of `homes` (by default those that move at a switch)."""
        if name == "optimizer":
            candidates = (v for p in _parameters(self.optimizer) if self.home(p) in homes
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
                moved += self.streamer.moved()
            on_host = {id(m.tensor) for m in moved}  # on a CPU-only machine host and device look alike
            on_device = sum(nbytes(t) for t in self.tensors(name, STATE_HOMES) if id(t) not in on_host)
            out[name] = {"location": res.location, "bytes": on_device,
                         "host_bytes": sum(nbytes(m.tensor) for m in moved)}
        out["optimizer_homes"] = self.home_bytes()
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
            out[self.home(p)] += sum(nbytes(local_tensor(v)) for key, v in state.items() if isinstance(v, torch.Tensor)
                                     and not (key == "step" and local_tensor(v).device != self.device
                                              and local_tensor(v).device.type == "cpu"))
        for m in self.masters or ():
            out[self.home(m)] += nbytes(local_tensor(m))
        return out

    def _state_tensors(self, p: torch.Tensor) -> list:
        """`p`'s optimizer states, and `p` itself when it is an fp32 master."""
        master = [p] if self.masters is not None and self.masters.is_master(p) else []
        return master + list(self.optimizer.state.get(p, {}).values())

    def _buffers(self) -> list[HostBuffer]:
        return [r.buffer for r in self._res.values()] + ([self.streamer.buffer] if self.streamer else [])

    def _held(self) -> int:
        orphaned = self.streamer.orphaned_bytes() if self.streamer is not None else 0
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
        self._check_budget(sum(sizes.values()), 0,
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
            if self.auto and self.device.type == "cuda" else 0
        sizes = self.expected_host_bytes()
        kept = _expected_state_bytes(self.optimizer, lambda p: self.home(p) == "device") if headroom else 0
        if min(headroom, kept):
            sizes["optimizer"] = sizes.get("optimizer", 0) + min(headroom, kept)
        return sizes

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
            states = layout_bytes(counted) or _expected_state_bytes(self.optimizer, lambda p, h=home: self.home(p) == h)
            # Masters made in host memory (not on the device, so not counted above) move into the buffer at attach.
            ids = {id(t) for t in counted}
            states += layout_bytes([local_tensor(m) for m in self.masters or () if self.home(m) == home
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
        if self.streamer is not None and self.streamer.stepping:
            self.home_new_states()
        if self.streamer is not None and "host" in self._homes.values():
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
        return self.streamer.move_into_buffer("Nothing was moved.")

    def states_to_device(self) -> int:
        """Bring the host-resident optimizer states back to the device for plain torch (detach, undoing attach)."""
        moved = self.streamer.moved()
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
        self.streamer.forget()
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
        self._check_budget(growth, 0, f"offloading for 'generate' ({parts})",
                           "Nothing was moved. Free host memory, raise host_budget_bytes, or move less: "
                           "grads='free' or 'keep', params='keep'.")

    def check_budget_for_states(self, growth: int, releasing: int, context: str) -> None:
        """Refuse to grow the host-resident optimizer states' buffer by `growth` bytes past the budget; `releasing`
        bytes of ordinary host memory (states waiting to move into the buffer) are freed as it fills."""
        self._check_budget(max(growth, 0), releasing,
                           "keeping optimizer states in host memory (their 'host' home in SwapConfig.optimizer_states)",
                           f"{context} Free host memory or raise host_budget_bytes.")

    def _check_budget(self, growth: int, releasing: int, what: str, fix: str) -> None:
        """Raise `HostBufferError` if growing the host buffers by `growth` bytes overshoots the budget on this rank
        or another. Collective under torchrun: the ranks reach it at the same switch or step, and every rank
        refuses or none does (see `swaprl.distributed`)."""
        if growth == 0 and not distributed.is_distributed():
            return
        if self.config.host_budget_bytes is not None:
            available = self.config.host_budget_bytes - self._held()
            source = f"SwapConfig.host_budget_bytes={self.config.host_budget_bytes}"
        else:
            # The ranks of a node share its host memory and size their buffers at the same moment.
            ranks = distributed.local_world_size()
            available = (memory.host_available_bytes() - self.config.host_margin_bytes) // ranks + releasing
            source = (f"available host memory less SwapConfig.host_margin_bytes "
                      f"({memory.gib(self.config.host_margin_bytes):.1f} GiB)"
                      + (f", shared by the {ranks} ranks of this node" if ranks > 1 else ""))
        over = growth - available if growth else 0
        (worst,) = distributed.all_reduce([over], "max")
        if worst <= 0:
            return
        elsewhere = "" if over > 0 else f" (this rank fits; another is {memory.gib(worst):.2f} GiB over)"
        raise HostBufferError(
            f"{what} needs {growth} more bytes ({memory.gib(growth):.2f} GiB) of host memory but only "
            f"{max(available, 0)} bytes ({memory.gib(max(available, 0)):.2f} GiB) are allowed ({source}){elsewhere}. "
            f"{fix}")


def _masters_config(config: SwapConfig) -> SwapConfig:
    """`config` for an optimizer with fp32 master weights, which says so whatever was asked: they and their states
    live in host memory ("auto" is "host"); SwapConfig's own check refuses a split that keeps some elsewhere."""
    if config.optimizer_states == "auto":
        logger.info("optimizer_states='auto' with fp32 master weights: the masters and their states live in host "
                    "memory ('host')")
        config = dataclasses.replace(config, optimizer_states="host", overlap_optimizer_reload=False)
    return dataclasses.replace(config, master_weights=True)


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in its order, each once: the order homes are given in."""
    return list(dict.fromkeys(p for group in optimizer.param_groups for p in group["params"]))


def assign_homes(optimizer: torch.optim.Optimizer, split: dict[str, float]) -> dict[int, StateHome]:
    """id(parameter) -> the home of its optimizer states under `split` (fractions of the states' bytes by home).

    Whole parameters, in the optimizer's order, weighted by their (local) bytes, which the states of every torch
    optimizer are proportional to: a parameter goes to the home whose share of the running total its middle byte
    falls in, so each home ends within half a parameter of its fraction. "device" takes the first parameters: the
    streamed step then starts with them, and their update runs under the first host chunk's copy in."""
    params = _parameters(optimizer)
    sizes = [nbytes(local_tensor(p)) for p in params]
    total = sum(sizes)
    bounds, edge = [], 0.0
    for home in STATE_HOMES:
        edge += split[home] * total
        bounds.append((edge, home))
    homes, before = {}, 0
    for p, size in zip(params, sizes):
        middle = before + size / 2
        homes[id(p)] = next((home for edge, home in bounds if middle < edge), bounds[-1][1] if total else "swap")
        before += size
    return homes


def resolve_auto(config: SwapConfig, optimizer: torch.optim.Optimizer, device: torch.device, *,
                 unmeasurable: str | None = None) -> tuple[SwapConfig, str]:
    """`config` with `optimizer_states="auto"` made a split: the states that fit in the device memory free now stay
    there ("device"), from the optimizer's first parameter on, and the rest are swapped; with why, for the log.

    Called at attach with the engine awake, so what is free now is what is free while it generates, less what comes
    by then: the states not created yet (Adam and AdamW: known ahead), the gradients with grads="keep", and
    `memory.default_reserve_bytes` for the trainer's transient needs (the probe's forward, the sync's buckets).
    `unmeasurable`: why the engine's footprint cannot be measured now; then every state is swapped. Other configs
    come back as they are."""
    if config.optimizer_states != "auto":
        return config, ""
    swapped = dataclasses.replace(config, optimizer_states="swap")
    if unmeasurable is None and device.type != "cuda":
        unmeasurable = "without CUDA there is no device memory to keep them in"
    params = _parameters(optimizer)
    expected = _expected_per_parameter(optimizer)
    needs = []
    for p in params:
        state = optimizer.state.get(p)
        if state is not None:
            needs.append(sum(nbytes(local_tensor(v)) for v in state.values()
                             if isinstance(v, torch.Tensor) and local_tensor(v).device == device))
        elif expected is not None:
            needs.append(expected[p])
        else:
            unmeasurable = unmeasurable or (f"the states {type(optimizer).__name__} will create are not known "
                                            "before its first step")
    if unmeasurable is not None:
        return swapped, f"all swapped: {unmeasurable}"
    free, total = torch.cuda.mem_get_info(device)
    cached = memory.default_pool_free_bytes(device)  # not the private pools' (the awake engine's graphs')
    existing = sum(n for p, n in zip(params, needs) if p in optimizer.state)  # on the device now, counted in use
    grads = sum(nbytes(local_tensor(p)) for p in params if p.requires_grad and p.grad is None) \
        if config.grads == "keep" else 0
    reserve = memory.default_reserve_bytes(total)
    room = free + cached + existing - grads - reserve
    sizes = [nbytes(local_tensor(p)) for p in params]
    kept = taken = 0
    for size, need in zip(sizes, needs):
        if kept + need > room:
            break
        kept, taken = kept + need, taken + size
    fraction = taken / sum(sizes) if sum(sizes) else 0.0
    why = (f"{memory.gib(kept):.2f} of {memory.gib(sum(needs)):.2f} GiB of states stay on the device: "
           f"{memory.gib(free + cached):.2f} GiB free beside the awake engine, less {memory.gib(reserve):.2f} GiB "
           "of reserve" + (f" and {memory.gib(grads):.2f} GiB of gradients" if grads else ""))
    if fraction >= 1.0:
        return dataclasses.replace(config, optimizer_states={"device": 1.0}, overlap_optimizer_reload=False), why
    if fraction <= 0.0:
        return swapped, why
    return dataclasses.replace(config, optimizer_states={"device": fraction, "swap": 1.0 - fraction}), why


def engine_reserve_bytes(optimizer: torch.optim.Optimizer, config: SwapConfig) -> int | None:
    """What an engine sized now from the free memory (`VLLMEngine(reserve_bytes=...)`) must leave free: the default
    reserve plus the optimizer states that will stay on the device while it generates (the "device" home, created by
    the first optimizer step: `device_state_growth`). None: nothing to add to the default."""
    growth = device_state_growth(optimizer, config)
    if not growth or not torch.cuda.is_available():
        return None
    return memory.default_reserve_bytes(torch.cuda.mem_get_info()[1]) + growth


def device_state_growth(optimizer: torch.optim.Optimizer, config: SwapConfig) -> int:
    """Device bytes the optimizer states with the "device" home will take beyond what they take now. They stay on
    the device while the engine generates, so an engine sized now from the free memory (vLLM's KV cache) must leave
    them room: `make_engine` adds them to the engine's reserve. Known ahead for Adam and AdamW before their first
    step; 0 once the states exist (they are then in use already) or for other optimizers."""
    split = config.state_split()
    if not split["device"] or optimizer.state:
        return 0
    homes = assign_homes(optimizer, split)
    return _expected_state_bytes(optimizer, lambda p: homes.get(id(p)) == "device")


# The optimizers whose states are known before their first step: exp_avg, exp_avg_sq (and max_exp_avg_sq with
# amsgrad), each the parameter's size (the table the planner prices states with)
_STATES_PER_PARAM = {cls: STATES_PER_PARAMETER[cls.__name__.lower()] for cls in (torch.optim.Adam, torch.optim.AdamW)}
# Device bytes a step needs per byte of the states it updates, the states included: torch's multi-tensor (foreach)
# Adam and AdamW take the square roots of the second moments into new tensors, one moment's size more.
_STEP_TEMPORARIES = {torch.optim.Adam: 1.5, torch.optim.AdamW: 1.5}


def _expected_state_bytes(optimizer: torch.optim.Optimizer, counted: Callable[[torch.Tensor], bool]) -> int:
    """Device bytes of the states `optimizer` will create at its first step for the parameters `counted` (0 when not
    known), laid out as the host buffer lays them. SGD's momentum and the other optimizers' states are sized when
    they appear."""
    per = _expected_per_parameter(optimizer)
    return sum(n for p, n in per.items() if counted(p)) if per is not None else 0


def _expected_per_parameter(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, int] | None:
    """Each parameter's bytes of the states `optimizer` will create at its first step (0 for one without a
    gradient), for Adam and AdamW; None for optimizers whose states are not known ahead."""
    per = _STATES_PER_PARAM.get(type(optimizer), 0)
    if not per:
        return None
    out = {}
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")  # the step counter is a device tensor too
        tensors = per + bool(group.get("amsgrad"))
        for p in group["params"]:
            # torch keeps the step counter on the CPU, which is the device of a CPU parameter
            step = on_device or local_tensor(p).device.type == "cpu"
            out[p] = tensors * align(nbytes(local_tensor(p))) + (align(4) if step else 0) if p.requires_grad else 0
    return out
