"""The torch internals swaprl reads, in one place, behind a version gate.

swaprl moves tensors by re-pointing their `.data`, which for a DTensor (FSDP2) must reach the local shard, and with
`SwapConfig(optimizer_states="host")` replaces `optimizer.step` on the instance, which must keep what torch's own
step wrapper and the LR scheduler's wrapper do. Each function below names the private attribute it reads and why;
all were checked against torch 2.11 (CUDA) and 2.13 (CPU), the `SUPPORTED` range.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import in_range

SUPPORTED = ">=2.11,<2.14"
"""torch versions swaprl was checked against (PEP 440 specifier; local builds such as 2.13.0+cpu count as their
base release)."""


def check_version(version: str | None = None) -> None:
    """Raise if `version` (default: the installed torch's) is outside `SUPPORTED`."""
    version = version if version is not None else torch.__version__
    if not in_range(version, SUPPORTED):
        raise RuntimeError(
            f"swaprl supports torch{SUPPORTED}, found torch {version}. It re-points tensors' storage (DTensor shards "
            "included) and wraps optimizer.step() through torch internals that change between releases, so other "
            f"versions are refused rather than silently mis-moved. Install a supported one: pip install "
            f"'torch{SUPPORTED}'.")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the memory: the local shard of a DTensor (FSDP2), else `t` itself.

    DTensor keeps its shard in the private `_local_tensor`; `to_local()` goes through autograd and may return a
    view, whose `.data` could not be swapped.
    """
    return getattr(t, "_local_tensor", t)


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable:
    """The optimizer class's own `step`, without the hook wrapper torch puts around it at the first construction
    (`Optimizer._patch_step_function` sets `hooked` on the wrapper, which keeps the original in `__wrapped__`)."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def with_step_hooks(step: Callable) -> Callable:
    """`step` wrapped the way torch wraps every optimizer's step: its pre- and post-hooks and profiler range run once
    around it (`Optimizer.profile_hook_step`)."""
    return torch.optim.Optimizer.profile_hook_step(step)


LR_SCHEDULER_MARK = "_wrapped_by_lr_sched"
"""What an LR scheduler sets on the `optimizer.step` wrapper it installs, to record that the optimizer stepped
(https://github.com/pytorch/pytorch/issues/20124). A step method that replaces that wrapper keeps the mark."""


def record_step_for_scheduler(optimizer: torch.optim.Optimizer, replaced: Callable) -> None:
    """Do what the LR scheduler's wrapper `replaced` would have done: note that the optimizer stepped, so the
    scheduler does not warn that `lr_scheduler.step()` ran before `optimizer.step()`."""
    if getattr(replaced, LR_SCHEDULER_MARK, False):
        optimizer._opt_called = True


def stop_routing(device: int, pool_id: tuple[int, int]) -> None:
    """Stop routing this thread's allocations to the pool `pool_id`, entered with `torch.cuda.use_mem_pool`, as
    leaving that context does (`_cuda_endAllocateToPool`, then `_cuda_releasePool` for the reference it took). torch
    has no public way to step out of a pool for a while; vLLM's and SGLang's symmetric-memory allocators step out of
    the graph pool with the same two calls. `start_routing` steps back in."""
    torch._C._cuda_endAllocateToPool(device, pool_id)
    torch._C._cuda_releasePool(device, pool_id)


def start_routing(device: int, pool_id: tuple[int, int]) -> None:
    """Route this thread's allocations to the pool `pool_id` again, as entering `torch.cuda.use_mem_pool` does."""
    torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool_id)
