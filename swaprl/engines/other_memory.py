"""The memory a colocated vLLM engine allocates outside its sleep-mode pool, in pools that pause while it sleeps.

vLLM's sleep mode releases the weights and the KV cache (its own CuMemAllocator pool, tags "weights" and
"kv_cache"). Everything else the engine allocated stays on the device while it sleeps: the CUDA graphs' private
pool, the model runner's persistent buffers, workspaces, the blocks its forward passes left cached: memory the trainer
needs every step (benchmarks/results/engine_pool_h100 measures it per model).

`OtherMemory` routes those allocations into three `swaprl.vmm.PausablePool`s and pauses them when the engine
sleeps:
- "graphs": vLLM's global CUDA-graph pool (`compat.vllm.global_graph_pool`); nothing is kept across a pause,
  since a replay writes every intermediate before reading it.
- "buffers": every other allocation this thread makes while vLLM starts and during its first generation (where
  it makes lazily what it keeps); the bytes of allocated blocks are kept (copied to a page-locked host buffer and
  back), free cached blocks are not. vLLM's profile run is left out (`compat.vllm.startup_runs_in_own_pool`): its
  activations go back to the driver when it ends, as without the pool, instead of staying cached in it and mapped
  at every wake-up.
- "warm-up": vLLM's kernel warm-up, sealed when it ends (`PausablePool.seal`): the buffers it made and kept stay
  there, backed only under themselves while the engine is awake, and not at all while it sleeps; its
  activations' memory goes back to the driver.

Later generations allocate outside the pools: while any pool routes allocations, torch's caching allocator
recycles no block freed with uses on another stream (`free()` defers their events "until no captures are
underway", and `malloc()` skips `process_events()`), and vLLM's model runner frees such blocks every step, so each
step of a routed generation takes fresh segments. What a generation allocates and frees goes back to torch's cache
as without the pools.

What must stay outside: memory the trainer shares with the engine. vLLM makes its model stream this thread's
current stream, so the trainer runs on it too, and torch creates a cuBLAS workspace per (handle, stream) the first
time a matmul runs there: were that first matmul vLLM's, inside the pool, the trainer's matmuls would use memory
that is released during training. `capturing()` therefore creates vLLM's stream and runs matmuls on it before
entering the pool. Communication buffers (NCCL) are allocated by NCCL itself and stay on the device.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from .. import vmm
from ..compat import vllm as vllm_compat

logger = logging.getLogger(__name__)


def _warm_shared_workspaces() -> None:
    """Create, on the current stream and in torch's default pool, what torch allocates once per stream and keeps."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.ones(64, 64, device="cuda", dtype=dtype)
        torch.addmm(a[0], a, a)  # cuBLASLt (bias epilogue)
        a @ a  # cuBLAS
    torch.cuda.current_stream().synchronize()


class OtherMemory:
    """The engine's memory outside vLLM's sleep-mode pool, in three pausable pools (see the module docstring)."""

    def __init__(self) -> None:
        self.graphs = vmm.PausablePool("engine graphs", keep="nothing")
        self.buffers = vmm.PausablePool("engine buffers", keep="allocated")
        self.warmup = vmm.PausablePool("engine warm-up", keep="allocated")
        self.stats: dict[str, float] = {}
        self._generated = False  # the first generation ran (routed into the buffer pool)

    @property
    def pools(self) -> tuple[vmm.PausablePool, ...]:
        return self.graphs, self.buffers, self.warmup

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """While vLLM starts: its graphs into the graph pool, its other allocations on this thread into the buffer
        pool, after the shared per-stream workspaces were made outside both."""
        vllm_compat.engine_stream()
        _warm_shared_workspaces()
        with vllm_compat.global_graph_pool(self.graphs.id), \
                vllm_compat.startup_runs_in_own_pool(self.buffers.stepped_out, self.warmup) as startup, \
                self.buffers.use():
            yield
        # Made once during the profile run and kept, outside the pools: on the device while the engine sleeps.
        self.stats["start_unpooled_bytes"] = startup.get("left_bytes", 0)
        self.stats["warmup_kept_bytes"] = startup.get("warmup_kept_bytes", 0)
        logger.info("the engine's start-up runs left %.1f MiB allocated outside the pausable pools",
                    self.stats["start_unpooled_bytes"] / 2**20)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While the engine generates for the first time: its new allocations into the buffer pool, where they
        pause with the rest. Later generations run unrouted (see the module docstring)."""
        if self._generated:
            yield
            return
        with self.buffers.use():
            yield
        self._generated = True

    @property
    def mapped_bytes(self) -> int:
        return sum(p.mapped_bytes for p in self.pools)

    @property
    def reserved_bytes(self) -> int:
        return sum(p.reserved_bytes for p in self.pools)

    @property
    def resume_bytes(self) -> int:
        """Device memory the next `resume()` maps (0 while running)."""
        return sum(p.resume_bytes for p in self.pools)

    @property
    def paused(self) -> bool:
        return self.buffers.paused

    def pause(self) -> int:
        """Release the pools' device memory; returns the bytes released. On failure the pools are as they were."""
        start = time.perf_counter()
        released, done = 0, []
        try:
            for pool in self.pools:
                released += pool.pause()
                done.append(pool)
        except BaseException:
            for pool in done:
                pool.resume()  # as it was: all mapped
            raise
        self.stats.update(pause_s=time.perf_counter() - start, released_bytes=released,
                          kept_bytes=sum(p.kept_bytes for p in self.pools))
        return released

    def resume(self) -> None:
        """Map the pools again (with their kept bytes). On `torch.OutOfMemoryError` all stay paused."""
        start = time.perf_counter()
        done = []
        try:
            for pool in self.pools:
                pool.resume()
                done.append(pool)
        except BaseException:
            for pool in done:
                pool.pause()
            raise
        self.stats["resume_s"] = time.perf_counter() - start

    def close(self) -> None:
        for p in self.pools:
            p.close()
