"""Where each parameter's optimizer states (and its fp32 master) live: the one policy. The runtime feeds it the room
it measures (`swaprl.memory.measure_room`), the planner the room it predicts (`swaprl.plan`); both get their homes
from `decide`, and an explicit split of `SwapConfig.optimizer_states` from `by_fractions`. No torch here.

A parameter's states have one home:

- "device": on the GPU in both phases; they never move.
- "swap": on the GPU in `train`, in host memory in `generate`: out at the switch into `generate`, back at the
  switch into `train`, under the engine's wake-up and the forward where they can overlap.
- "host": in host memory for good; `optimizer.step()` brings them through the GPU a chunk at a time, on the
  critical path of every step.

`decide` gives whole parameters their homes in the optimizer's order, so that each home is one run of parameters
and the streamed step starts with those it does not stream: "device" while the states fit the room that both phases
leave them, then "swap" while they fit the room `train` leaves, then "host". So a byte that fits on the device
never moves, and nothing is streamed that a switch could carry. The room is described by `Capacity` (bytes, per
phase); how a phase's room is found from a device's memory is `Room`'s one formula.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

Home = Literal["device", "swap", "host"]
HOMES: tuple[Home, ...] = get_args(Home)  # the order homes are given in


@dataclass(frozen=True, slots=True)
class Room:
    """One reading of a device's memory in the terms every home decision uses (bytes).

    `free`: what the driver has free. `cached`: what torch's default pool holds reserved and unused (its next
    allocations take it without the driver; not a private pool's). `reserve`: what is kept free for transient needs
    (`swaprl.config.default_reserve_bytes`). `regrow`: what training's peak takes back of `free` and `cached` beyond
    what is allocated now: torch's peak reserved bytes less its allocated bytes now, once a forward and backward have
    run; 0 before."""

    free: int
    cached: int = 0
    reserve: int = 0
    regrow: int = 0

    def for_new(self, *, temporaries: float = 1.0) -> int:
        """Bytes that tensors made now and kept for good can take (negative: that much is missing). Tensors that
        need `temporaries` times their size while they are made (torch's multi-tensor Adam makes a moment's size more
        inside its step) must also fit that, but only beside what is in use now: the step runs after the peak."""
        at_peak = self.free + self.cached - self.regrow - self.reserve
        if temporaries <= 1.0:
            return at_peak
        return min(at_peak, math.floor((self.free + self.cached - self.reserve) / temporaries))


@dataclass(frozen=True, slots=True)
class Capacity:
    """The bytes of states each kind of room holds: `device` on the GPU in both phases (what `generate` leaves
    beside the engine), `resident` on the GPU in `train` (the "device" and "swap" homes together). None: no bound is
    known (yet)."""

    device: int | None = None
    resident: int | None = None

    def within(self, *, device: int | None = None, resident: int | None = None) -> Capacity:
        """This capacity with each bound lowered to the one given, where one is: what a later moment of a run
        learns only ever takes room away."""
        return Capacity(device=_least(self.device, device), resident=_least(self.resident, resident))


def decide(sizes: Sequence[int], capacity: Capacity) -> list[Home]:
    """The home of each of `sizes` (the bytes of each parameter's states, masters included, in the optimizer's
    order): "device" for the first ones while their total fits both bounds, "swap" for the next while the total of
    both homes fits `resident`, "host" for the rest. A parameter that does not fit its home ends that home: the homes
    stay runs in order."""
    device = _least(capacity.device, capacity.resident)
    out: list[Home] = []
    total, home = 0, 0
    for size in sizes:
        while home < 2 and not _fits(total + size, device if home == 0 else capacity.resident):
            home += 1
        out.append(HOMES[home])
        if home < 2:
            total += size
    return out


def by_fractions(sizes: Sequence[int], split: Mapping[str, float]) -> list[Home]:
    """The homes of an explicit split (fractions of the states' bytes by home, summing to 1): whole parameters in
    order, each in the home whose share of the running total its middle byte falls in, so that each home ends
    within half a parameter of its fraction. A parameter's states are proportional to its own bytes for every torch
    optimizer, so `sizes` may be the parameters' bytes."""
    total = sum(sizes)
    bounds, edge = [], 0.0
    for home in HOMES:
        edge += split.get(home, 0.0) * total
        bounds.append((edge, home))
    out: list[Home] = []
    before = 0
    for size in sizes:
        middle = before + size / 2
        out.append(next((home for edge, home in bounds if middle < edge), bounds[-1][1] if total else "swap"))
        before += size
    return out


def totals(sizes: Sequence[int], homes: Sequence[Home]) -> dict[Home, int]:
    """The bytes each home holds."""
    out = dict.fromkeys(HOMES, 0)
    for size, home in zip(sizes, homes):
        out[home] += size
    return out


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _fits(total: int, bound: int | None) -> bool:
    return bound is None or total <= bound
