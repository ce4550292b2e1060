"""The errors swaprl raises for what a user can fix; each message says what was wrong and what to do."""

from __future__ import annotations


class PhaseError(RuntimeError):
    """A phase request that cannot be honoured (unknown name, nothing attached, wrong nesting, a step out of phase)."""


class HostBufferError(MemoryError):
    """An offload would need more host memory than the budget allows."""
