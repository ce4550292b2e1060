"""The torch internals swaprl reads, in one place, behind a version gate.

swaprl moves tensors by re-pointing their `.data`, which for a DTensor (FSDP2) must reach the local shard, and with
`SwapConfig(optimizer_states="host")` replaces `optimizer.step` on the instance, which must keep what torch's own
step wrapper and the LR scheduler's wrapper do. Each function below names the private attribute it reads and why;
all were checked against torch 2.11 (CUDA) and 2.13 (CPU), and read in 2.14's and 2.15's source and run
on the CPU under 2.15: the `SUPPORTED` range, of which `CHECKED_ON_A_GPU` has run on a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from . import in_range

SUPPORTED = ">=2.11,<2.16"
"""torch versions swaprl was checked against (PEP 440 specifier; local builds such as 2.13.0+cpu count as their
base release)."""

CHECKED_ON_A_GPU = ">=2.11,<2.14"
"""The part of `SUPPORTED` a GPU run has checked. The CUDA paths (routing to memory pools, lending pages, the
allocator's settings under vLLM) read internals a CPU run never reaches; 2.14 and 2.15 were read in their source
and run on the CPU only, so a process that sees a GPU is held to this range."""


def check_version(version: str | None = None, *, cuda: bool | None = None) -> None:
    """Raise if `version` (default: the installed torch's) is outside `SUPPORTED`, or, where `cuda` (default: a GPU
    is visible), outside `CHECKED_ON_A_GPU`."""
    version = version if version is not None else torch.__version__
    if not in_range(version, SUPPORTED):
        raise RuntimeError(
            f"swaprl supports torch{SUPPORTED}, found torch {version}. It re-points tensors' storage (DTensor shards "
            "included) and wraps optimizer.step() through torch internals that change between releases, so other "
            f"versions are refused rather than silently mis-moved. Install a supported one: pip install "
            f"'torch{SUPPORTED}'.")
    if (torch.cuda.is_available() if cuda is None else cuda) and not in_range(version, CHECKED_ON_A_GPU):
        raise RuntimeError(
            f"torch {version} with a GPU: swaprl's CUDA paths (memory pools, lent pages, allocator settings) were "
            f"checked on a GPU with torch{CHECKED_ON_A_GPU} only; {version} was checked on the CPU. Install one the "
            f"GPU runs used: pip install 'torch{CHECKED_ON_A_GPU}', or train on the CPU (CUDA_VISIBLE_DEVICES=).")


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


def first_state(optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor] | None:
    """The state torch's Adam or AdamW gives a parameter at its first step, made by its own lazy initialisation
    (`_init_group`) for a stand-in of no elements: the keys, dtypes and devices of each state, with the parameter-sized
    ones empty (their values are zeros). None where that private method is not what it was (a newer torch)."""
    q = torch.empty(0, dtype=dtype, device=device)
    q.grad = torch.empty(0, dtype=dtype, device=device)
    try:
        optimizer._init_group({**group, "params": [q]}, [], [], [], [], [], [])
    except (AttributeError, TypeError):
        return None
    finally:
        made = optimizer.state.pop(q, None)
    return dict(made) if made else None


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


@contextlib.contextmanager
def lazy_new_groups() -> Iterator[bool]:
    """While it runs, a new process group creates its NCCL communicator at its first collective, as it does when the
    default group was started without `init_process_group(device_id=...)`; yields whether that changed anything.

    With a device bound to the default group, `new_group` creates every new group's communicator at once
    (`ncclCommSplit`, `distributed_c10d._get_split_source`), on every rank of the default group. vLLM makes six
    groups while it starts (world, TP, PP, DP and two context-parallel ones, most of a single rank), and each of
    those communicators held 388-390 MiB on the H100 (NCCL 2.28 maps each of its small per-channel buffers in a
    2 MiB granule): 2.3 GiB that no sleep releases. Started lazily, a group that never communicates holds nothing.
    This clears the default group's `bound_device_id` (what `init_process_group(device_id=)` sets) and puts it back.
    Left alone where vLLM splits its groups from the default one (VLLM_DISTRIBUTED_USE_SPLIT_GROUP=1), which
    needs the bound device."""
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    bound = getattr(group, "bound_device_id", None)
    if bound is None or os.environ.get("VLLM_DISTRIBUTED_USE_SPLIT_GROUP", "0") not in ("", "0"):
        yield False
        return
    group.bound_device_id = None
    try:
        yield True
    finally:
        group.bound_device_id = bound


def alloc_conf() -> str:
    """The allocator settings torch was started with (read where torch reads them: the environment), "" if none."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""


def expandable_segments() -> bool:
    """Whether torch's CUDA allocator was told to use expandable segments."""
    return "expandable_segments:true" in alloc_conf().replace(" ", "").lower()


def _setting(conf: str, key: str) -> str | None:
    """`key`'s value in an allocator settings string, or None; the last entry for a key counts, as in torch's
    parser."""
    value = None
    for part in conf.split(","):
        name, _, setting = part.strip().partition(":")
        if name.strip() == key:
            value = setting.strip()
    return value


def allocator_setting(key: str) -> str | None:
    """The value torch's allocator settings give `key` now, or None where they leave it out. Read from torch itself
    where it says (what it parsed from PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF, and any change made since, as
    vLLM reads them), else from the environment."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return _setting(get() if get is not None else alloc_conf(), key)


def large_segment_mib() -> int | None:
    """The page size torch's expandable segments map large blocks in (`large_segment_size_mb`), or None where the
    settings leave torch's own (20 MiB). torch keeps a setting until another string names it, but the string it
    reports is only the last one set, and vLLM sets partial ones while it starts (`expandable_segments:False`
    around its pool, `max_split_size_mb:N` around its model's loading): the environment torch started from is read
    too, and the larger value counts."""
    found = []
    for value in (_setting(alloc_conf(), "large_segment_size_mb"), allocator_setting("large_segment_size_mb")):
        try:
            found += [int(value)] if value is not None else []
        except ValueError:  # torch refused it when it parsed the settings
            pass
    return max(found) if found else None


@contextlib.contextmanager
def whole_segments(device: torch.device) -> Iterator[None]:
    """New device memory the block asks for comes in one segment of the size asked (one `cudaMalloc`), where
    expandable segments are on: they map every request in pages (2 MiB, and 20 MiB or `large_segment_size_mb` for
    large blocks), each its own driver allocation, which
    for a buffer of tens of GiB made and given back at every phase switch is the switch's largest cost after the
    engine's own. Meant for buffers used whole and freed whole, which leave no free pieces behind.

    The setting is the process's: torch reads it whenever it makes a segment (vLLM's sleep-mode pool turns it off the
    same way). Setting it parses the whole settings string again, resetting what the string leaves out, so the
    block sets the string torch started with, expandable segments off, and puts that string back after."""
    conf = alloc_conf()
    if device.type != "cuda" or not expandable_segments():
        yield
        return
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        torch.cuda.memory._set_allocator_settings
    parts = [p.strip() for p in conf.split(",") if p.strip()]
    off = ",".join("expandable_segments:False" if p.replace(" ", "").lower().startswith("expandable_segments:")
                   else p for p in parts)
    set_settings(off)
    try:
        yield
    finally:
        set_settings(",".join(parts))


CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS's workspace setting that torch's deterministic algorithms require of it (a fixed workspace per stream, so
that its products sum in one order)."""


def deterministic_cublas() -> None:
    """Give cuBLAS the workspace setting `deterministic_algorithms` needs, unless the environment sets one of the
    two torch accepts (another is refused now, not at the first product inside the block). cuBLAS reads it when it
    starts, at the process's first product on the GPU: call this before that."""
    given = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    if given not in (CUBLAS_WORKSPACE_CONFIG, ":16:8"):
        raise ValueError(f"CUBLAS_WORKSPACE_CONFIG={given!r}: torch's deterministic algorithms need "
                         f"{CUBLAS_WORKSPACE_CONFIG!r} or ':16:8'; set one of them, or unset it")


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """torch's deterministic algorithms inside the block, the previous setting after it. A GPU backward sums in an
    order that varies from run to run without them (kernels that accumulate with atomics, as attention's backward
    does its query gradients), so two runs of the same steps drift apart in their low bits from the first update. An
    operation torch has no deterministic version of raises inside the block, naming itself. The setting also has
    `torch.empty` fill what it allocates; that fill stays off here, since it changes no result, only the time."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
