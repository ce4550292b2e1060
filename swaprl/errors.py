"""The errors swaprl raises for what a user can fix; each message says what was wrong and what to do."""

from __future__ import annotations


class PhaseError(RuntimeError):
    """A phase request that cannot be honoured (unknown name, nothing attached, wrong nesting, a step out of phase)."""


class HostBufferError(MemoryError):
    """An offload would need more host memory than the budget allows."""


def switch_out_of_memory(transition: str, step: str) -> str:
    """The note on an out-of-memory error that stopped a phase switch which was then undone whole."""
    return (f"swaprl: {transition} ran out of device memory at step {step!r} and was undone; nothing was lost and "
            "the runtime stays in the phase it was in. To give the switch room: SwapConfig(overlap_offload=False) "
            "moves the optimizer states off the device before the engine wakes, optimizer_states='auto' swaps those "
            "that do not fit, a smaller gpu_memory_utilization or KV cache for the engine leaves more to the "
            "trainer; or free the device memory held outside swaprl")
