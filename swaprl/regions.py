"""Trainer memory paused in place while the engine generates: `Runtime.pausable(name, keep=...)`.

    region = rt.pausable("train graph", keep="nothing")      # a swaprl.vmm.PausablePool
    with torch.cuda.graph(graph, pool=region.id):             # the captured step's memory lives in the region
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
    with swaprl.phase("generate"):    # the region's device memory is released: the engine can use it
        ...
    graph.replay()                    # back in train: mapped again at the same addresses

Why: swaprl moves the trainer's state by pointing its tensors at new memory (`swaprl.placement`), and the caching
allocator hands freed memory to the driver before the engine wakes. A captured CUDA graph (a training step replayed
with `torch.cuda.graph`, or compiled with CUDA graphs) follows neither: it replays on the addresses it recorded,
and its private pool (activations, workspaces, its outputs) stays reserved in every phase, taking memory from the
engine's KV cache. A region is a pausable pool (`swaprl.vmm`) that the runtime pauses at the start of each
switch to generate, before the engine wakes, and resumes once the engine sleeps again, at the same addresses. What
survives a pause is what `keep` says: "nothing" for a graph's private pool (a replay writes every intermediate
before reading it), "allocated" for live tensors allocated inside `region.use()` (copied to the host and back).

A graph captured over memory swaprl moves replays on stale addresses: capture no optimizer step whose states the
runtime swaps (`optimizer_states="swap"`) and keep the gradients in place (`SwapConfig(grads="keep")`) when the
backward is captured; the eager optimizer step after `graph.replay()` is swapped as usual.

The runtime owns no region's lifetime: `detach()` leaves them mapped, and `region.close()` gives one back once no
graph captured in it will replay.
"""

from __future__ import annotations

import torch

from .undo import Undo


def new(name: str, *, keep: str, device: torch.device, taken: set[str]):
    """A new `swaprl.vmm.PausablePool` on `device` named `name` (not one of `taken`)."""
    from . import vmm

    if device.type != "cuda" or not vmm.available():
        why = vmm.unavailable() if device.type == "cuda" else f"the trainer is on {device}"
        raise RuntimeError(f"Runtime.pausable() needs swaprl's pausable pool on a CUDA device ({why}); without "
                           "it, leave the memory where it is (a graph's pool then stays reserved in generate)")
    if name in taken:
        raise ValueError(f"a pausable region named {name!r} exists already; give each region its own name")
    with torch.cuda.device(device):
        return vmm.PausablePool(name, keep=keep)


def pause(regions: list) -> int:
    """Pause every region (those already paused stay so); returns the bytes copied to the host. On failure the
    regions paused here are resumed."""
    copied = 0
    done = Undo("pause regions")
    with done.on_error():
        for region in regions:
            if not region.paused:
                region.pause()
                done.push(region.resume, f"resume {region.name}")
                copied += region.kept_bytes
    return copied


def resume(regions: list) -> int:
    """Resume every paused region; returns the bytes copied back. On failure those resumed here are paused again
    and the error (`torch.OutOfMemoryError` when the device is full) is raised."""
    copied = 0
    done = Undo("resume regions")
    with done.on_error():
        for region in regions:
            if region.paused:
                region.resume()
                done.push(region.pause, f"pause {region.name}")
                copied += region.kept_bytes
    return copied


def status(regions: list) -> dict:
    """{name: {"bytes": device bytes held now, "reserved_bytes": address space, "paused": bool}}."""
    return {r.name: {"bytes": r.mapped_bytes, "reserved_bytes": r.reserved_bytes, "paused": r.paused}
            for r in regions}
