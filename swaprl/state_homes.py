"""Each parameter's state home for one runtime: the policy of `swaprl.homes` applied to this optimizer, with the
room this run measures.

An explicit `SwapConfig.optimizer_states` fixes the homes at attach (`homes.by_fractions`). Under "auto" they are
decided at attach from the room the device has then, and decided again at the two later moments that show more:

- the first `optimizer.step()` of Adam or AdamW (`at_first_step`), before it creates the states: training has run
  its forward and backward beside all it holds, so the room of `train` is known; what does not fit it is streamed;
- a wake-up of the engine that lacked room (`after_short_wake`): the states of as many more parameters swap.

Each moment only lowers the capacities the earlier ones found (`homes.Capacity.within`), so a parameter's home only
moves away from the device. Every rank takes the same decision: the least room and each parameter's largest states
over the ranks (FSDP2's shards differ by a row), so that the switches' and streamed steps' collectives match.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from . import distributed, homes, memory
from .compat.torch import local_tensor
from .config import STATES_PER_PARAMETER, SwapConfig
from .homes import Capacity, Home
from .master import MasterWeights
from .partitions import FlatPartitions
from .residency import align, nbytes

logger = logging.getLogger(__name__)

WAKE_MARGIN_BYTES = 256 * 2**20
"""Beyond what a short wake-up lacked, what `after_short_wake` swaps more of: the engine's next try maps its
allocations in pages, and a shortfall measured to the byte would fail again on the last page."""

# The optimizers whose states are known before their first step: exp_avg, exp_avg_sq (and max_exp_avg_sq with
# amsgrad), each the parameter's size (the table the planner prices states with).
_STATES_PER_PARAM = {cls: STATES_PER_PARAMETER[cls.__name__.lower()] for cls in (torch.optim.Adam, torch.optim.AdamW)}
# Device bytes a step needs per byte of the states it updates, the states included: torch's multi-tensor (foreach)
# Adam and AdamW take the square roots of the second moments into new tensors, one moment's size more.
_STEP_TEMPORARIES = {torch.optim.Adam: 1.5, torch.optim.AdamW: 1.5}


class StateHomes:
    """The home of each parameter of `optimizer` under `config`. `room`: the device's room at attach, with the
    engine awake and holding all it holds while it generates (`memory.measure_room`), or None when it cannot be
    measured (`unmeasurable` says why): then "auto" swaps every state. `partitions`: the flat partitions the
    optimizer steps in place of the model's parameters (`swaprl.partitions`), which are then what gets homes."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, config: SwapConfig, *,
                 masters: MasterWeights | None, room: homes.Room | None, unmeasurable: str | None = None,
                 partitions: FlatPartitions | None = None) -> None:
        self.optimizer, self.device, self.masters, self.partitions = optimizer, device, masters, partitions
        self.auto = config.optimizer_states == "auto"
        """`optimizer_states="auto"`: the homes may change as the run shows what fits."""
        self._capacity = Capacity()
        self._first_step_pending = False
        self.why = ""
        """What "auto" decided at attach and why, for the log."""
        params = self.parameters()
        if not self.auto:
            # each parameter's largest shard over the ranks, so that every rank homes alike (FSDP2's shards differ
            # by a row where the rows do not divide)
            sizes = [nbytes(local_tensor(p)) for p in params]
            sizes = [int(n) for n in distributed.all_reduce(sizes, "max")] if sizes else []
            self._homes = dict(zip(map(id, params), homes.by_fractions(sizes, config.state_split())))
            return
        sizes, existing, why = self._sizes(params)
        unmeasurable = unmeasurable or why or (None if device.type == "cuda" else
                                               "without CUDA there is no device memory to keep them in")
        if unmeasurable is not None or room is None:
            self._capacity = Capacity(device=0)  # what it holds while generating is unknown: nothing stays there
            self._homes = dict.fromkeys(map(id, params), "swap")
            self.why = f"all swapped: {unmeasurable or 'the device room was not measured'}"
        else:
            grads = sum(nbytes(local_tensor(p)) for p in params if p.requires_grad and p.grad is None) \
                if config.grads == "keep" else 0
            (device_room,) = distributed.all_reduce([room.for_new() + existing - grads], "min")
            self._capacity = Capacity(device=int(device_room))
            self._homes = self._decide(params, sizes)
            kept = self.bytes_by_home(sizes)["device"]
            self.why = (f"{memory.gib(kept):.2f} of {memory.gib(sum(sizes)):.2f} GiB of states stay on the device: "
                        f"{memory.gib(room.free + room.cached):.2f} GiB free beside the awake engine, less "
                        f"{memory.gib(room.reserve):.2f} GiB of reserve"
                        + (f" and {memory.gib(grads):.2f} GiB of gradients" if grads else ""))
        # The first step's rule needs training's peak, which torch counts only as a peak since a reset: from now.
        # Not for flat partitions whose owner's step cannot be streamed: the "host" home it may give streams it.
        self._first_step_pending = (device.type == "cuda" and (partitions is None or partitions.streamable)
                                    and _expected_per_parameter(optimizer) is not None)

    # ---------------------------------------------------------------- what is where
    def parameters(self) -> list[torch.Tensor]:
        """What has a home, in the order homes are given in: the optimizer's parameters, or the flat partitions
        their owner does not keep itself."""
        return self.partitions.placed() if self.partitions is not None else parameters(self.optimizer)

    def places(self, p: torch.Tensor) -> bool:
        """Whether `p`'s states are the homes' to place (not those of a partition its owner keeps)."""
        return self.partitions is None or id(p) not in self.partitions.kept

    def moves_itself(self, p: torch.Tensor) -> bool:
        """Whether `p` lives with its states, in their home: an fp32 master, or a flat partition that is a copy."""
        return (self.masters is not None and self.masters.is_master(p)) or \
            (self.partitions is not None and self.partitions.is_copy(p))

    def home(self, p: torch.Tensor) -> Home:
        """Where `p`'s states live; a parameter added to the optimizer after attach takes the last parameter's home
        (so "swap" and "host" stay whole)."""
        return self._homes.get(id(p)) or next(reversed(self._homes.values()), "swap")

    @property
    def swaps(self) -> bool:
        """Some states move at each switch."""
        return "swap" in self._homes.values()

    @property
    def streams(self) -> bool:
        """Some states live in host memory and are streamed through each step."""
        return "host" in self._homes.values()

    @property
    def may_stream(self) -> bool:
        """The first step may still give states the host home: the streamed step must be there from the start."""
        return self.streams or self._first_step_pending

    def fractions(self) -> dict[str, float]:
        """The share of the parameters' bytes each home holds: the split "auto" stands for now."""
        held = self.bytes_by_home([nbytes(local_tensor(p)) for p in self.parameters()])
        total = sum(held.values()) or 1
        return {home: n / total for home, n in held.items()}

    def bytes_by_home(self, sizes: list[int]) -> dict[Home, int]:
        return homes.totals(sizes, [self.home(p) for p in self.parameters()])

    def expected_bytes(self, home: Home) -> int:
        """Device bytes of the states the optimizer will create at its first step for the parameters of `home`
        (0 when not known), laid out as the host buffer lays them."""
        per = _expected_per_parameter(self.optimizer, self.parameters())
        return sum(n for p, n in per.items() if self.places(p) and self.home(p) == home) if per is not None else 0

    # ---------------------------------------------------------------- the later moments
    def at_first_step(self, measure: Callable[[], homes.Room]) -> int:
        """Under "auto", at the first `optimizer.step()` before it creates the states: the room `train` leaves,
        measured now (`measure()`, training's peak since attach included), decides which parameters stream.
        Returns the bytes of states newly homed in host memory (0 when all fit, or already decided). Collective."""
        if not self._first_step_pending:
            return 0
        self._first_step_pending = False
        params = self.parameters()
        sizes, existing, _ = self._sizes(params)
        room = measure()
        factor = _STEP_TEMPORARIES.get(type(self.optimizer), 1.0)
        (resident,) = distributed.all_reduce([room.for_new(temporaries=factor) + existing], "min")
        before = dict(self._homes)
        self._capacity = self._capacity.within(resident=int(resident))
        self._homes = self._decide(params, sizes)
        streamed = sum(n for p, n in zip(params, sizes) if self._homes[id(p)] == "host" and before.get(id(p)) != "host")
        if streamed:
            need = sum(n for p, n in zip(params, sizes) if before.get(id(p)) != "host")
            logger.warning("optimizer_states='auto': the first optimizer step creates %.2f GiB of states and %.2f GiB "
                           "fit on %s beside training (%.2f GiB free, of which training's peak takes %.2f GiB back; "
                           "%.2f GiB cached; %.2f GiB reserve): %.2f GiB of them stay in host memory from now on, "
                           "streamed through the device by each step", memory.gib(need),
                           memory.gib(max(resident, 0)), self.device, memory.gib(room.free), memory.gib(room.regrow),
                           memory.gib(room.cached), memory.gib(room.reserve), memory.gib(streamed))
        return streamed

    def undo_first_step(self, homes_before: dict[int, Home]) -> None:
        """The first step's decision could not be carried out (host memory short): the next step decides again."""
        self._homes = homes_before
        self._first_step_pending = True

    def snapshot(self) -> dict[int, Home]:
        return dict(self._homes)

    def after_short_wake(self, short_bytes: int, on_device: Callable[[torch.Tensor], int]) -> int:
        """Under "auto", after an engine's wake-up lacked `short_bytes` (and was undone): the last parameters kept on
        the device swap from now on, as many as free that and `WAKE_MARGIN_BYTES` more, on every rank or none.
        `on_device(p)`: the device bytes of `p`'s states now. Returns the bytes swapped from now on (0: nothing
        more can swap, and the switch cannot go again)."""
        if not self.auto or not short_bytes:
            return 0
        kept = [p for p in self.parameters() if self.home(p) == "device"]
        sizes = [on_device(p) for p in kept]
        (short,) = distributed.all_reduce([short_bytes], "max")
        capacity = Capacity(device=max(sum(sizes) - int(short) - WAKE_MARGIN_BYTES, 0))
        decided = dict(zip(map(id, kept), self._agreed(sizes, capacity)))
        freed = sum(n for p, n in zip(kept, sizes) if decided[id(p)] == "swap")
        if not distributed.all_reduce([freed], "min")[0]:
            return 0
        self._homes.update(decided)
        self._capacity = self._capacity.within(device=capacity.device)
        logger.warning("optimizer_states='auto': the engine's wake-up lacked %.2f GiB; %.2f GiB more of the "
                       "optimizer states are swapped from now on", memory.gib(short_bytes), memory.gib(freed))
        return freed

    # ---------------------------------------------------------------- the engine attach builds
    def device_growth(self) -> int:
        """Device bytes the states with the "device" home will take beyond what they take now: an engine sized now
        from the free memory (vLLM's KV cache) must leave them room. Known ahead for Adam and AdamW before their
        first step, masters included; 0 once the states exist, or for other optimizers."""
        if self.optimizer.state:
            return 0
        masters = sum(align(nbytes(local_tensor(m))) for m in self.masters or ()
                      if self.home(m) == "device" and local_tensor(m).device != self.device)
        return self.expected_bytes("device") + masters

    # ---------------------------------------------------------------- helpers
    def _decide(self, params: list[torch.Tensor], sizes: list[int]) -> dict[int, Home]:
        return dict(zip(map(id, params), self._agreed(sizes, self._capacity)))

    @staticmethod
    def _agreed(sizes: list[int], capacity: Capacity) -> list[Home]:
        """`homes.decide` on each parameter's largest states over the ranks, so that every rank homes alike."""
        largest = distributed.all_reduce(sizes, "max") if sizes else []
        return homes.decide([int(n) for n in largest], capacity)

    def _sizes(self, params: list[torch.Tensor]) -> tuple[list[int], int, str | None]:
        """Each parameter's bytes of states (its fp32 master included) wherever they are now or will be made, the
        bytes of them on the device now, and why they cannot be known (states of an optimizer whose first step has
        not made them, and whose states are not known ahead)."""
        expected = _expected_per_parameter(self.optimizer, params)
        sizes, existing, why = [], 0, None
        for p in params:
            state = self.optimizer.state.get(p)
            master = local_tensor(p) if self.moves_itself(p) else None
            here = align(nbytes(master)) if master is not None else 0
            if master is not None and master.device == self.device:
                existing += here
            if state:
                on_device = sum(nbytes(local_tensor(v)) for v in state.values()
                                if isinstance(v, torch.Tensor) and local_tensor(v).device == self.device)
                existing += on_device
                here += on_device
            elif expected is not None:
                here += expected[p]
            else:
                why = why or (f"the states {type(self.optimizer).__name__} will create are not known before its "
                              "first step")
            sizes.append(here)
        return sizes, existing, why


def parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in its order, each once: the order homes are given in."""
    return list(dict.fromkeys(p for group in optimizer.param_groups for p in group["params"]))


def _expected_per_parameter(optimizer: torch.optim.Optimizer,
                            also: list[torch.Tensor] = ()) -> dict[torch.Tensor, int] | None:
    """Each parameter's bytes of the states `optimizer` will create at its first step (0 for one without a
    gradient), for Adam and AdamW; None for optimizers whose states are not known ahead. `also`: tensors it steps
    that no group lists now (ZeRO-3 puts its partitions in the groups only inside its step), expected with the
    optimizer's defaults."""
    per = _STATES_PER_PARAM.get(type(optimizer), 0)
    if not per:
        return None
    out = {}
    listed = [(group, group["params"]) for group in optimizer.param_groups]
    grouped = {id(p) for _, params in listed for p in params}
    listed.append((optimizer.defaults, [p for p in also if id(p) not in grouped]))
    for group, params in listed:
        on_device = group.get("fused") or group.get("capturable")  # the step counter is a device tensor too
        tensors = per + bool(group.get("amsgrad"))
        for p in params:
            # torch keeps the step counter on the CPU, which is the device of a CPU parameter
            step = on_device or local_tensor(p).device.type == "cpu"
            out[p] = tensors * align(nbytes(local_tensor(p))) + (align(4) if step else 0) if p.requires_grad else 0
    return out
