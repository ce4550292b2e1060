"""The host memory a runtime may hold in its buffers, asked before any buffer grows.

The budget is `SwapConfig.host_budget_bytes`, or what the OS reports available less `host_margin_bytes`, shared by
the ranks of a node (they size their buffers at the same moments). Under torchrun the check is collective: the ranks
reach it at the same switch or step, and every rank refuses or none does (`swaprl.distributed`), so that no rank goes
on into a collective the others have left.
"""

from __future__ import annotations

from collections.abc import Callable

from . import distributed, memory
from .config import SwapConfig
from .errors import HostBufferError


class HostBudget:
    """`check` refuses growth past the budget; `held()` says what the runtime's buffers hold now."""

    def __init__(self, config: SwapConfig, held: Callable[[], int]) -> None:
        self.config = config
        self.held = held

    def check(self, growth: int, releasing: int, what: str, fix: str) -> None:
        """Raise `HostBufferError` if growing the host buffers by `growth` bytes overshoots the budget on this rank
        or another; `releasing` bytes of ordinary host memory are freed as the buffers fill. `what` and `fix` make the
        message: what needed the memory, and what to do (and what state things are left in)."""
        if growth == 0 and not distributed.is_distributed():
            return
        if self.config.host_budget_bytes is not None:
            available = self.config.host_budget_bytes - self.held()
            source = f"SwapConfig.host_budget_bytes={self.config.host_budget_bytes}"
        else:
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

    def for_states(self, growth: int, releasing: int, context: str) -> None:
        """`check` for the host-resident optimizer states' buffer (`swaprl.host_states` asks it)."""
        self.check(max(growth, 0), releasing,
                   "keeping optimizer states in host memory (their 'host' home in SwapConfig.optimizer_states)",
                   f"{context} Free host memory or raise host_budget_bytes.")
