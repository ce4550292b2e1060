"""The memory a colocated vLLM engine allocates outside its sleep-mode pool, in pools that pause while it sleeps.

vLLM's sleep mode releases the weights and the KV cache (its own CuMemAllocator pool, tags "weights" and
"kv_cache"). Everything else the engine allocated stays on the device while it sleeps: the CUDA graphs' private
pool, the model runner's persistent buffers, workspaces, the blocks its forward passes left cached. Measured on the
H100 that was 0.8-1.8 GiB for Qwen2.5-1.5B to 7B, memory the trainer needs every step.

`OtherMemory` routes those allocations into two `swaprl.kernels.PausablePool`s and pauses them when the engine
sleeps:
- "graphs": vLLM's global CUDA-graph pool (`compat.vllm.global_graph_pool`); nothing is kept across a pause,
  since a replay writes every intermediate before reading it.
- "engine": every other allocation this thread makes while vLLM starts and while it generates; the bytes of
  allocated blocks are kept (copied to a page-locked host buffer and back), free cached blocks are not. vLLM's
  profile run and its kernel warm-up are left out (`compat.vllm.startup_runs_in_own_pool`): their activations go
  back to the driver when each ends, as without the pool, instead of staying cached in it and mapped at every
  wake-up.

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

from .. import kernels
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
    """The engine's memory outside vLLM's sleep-mode pool, in two pausable pools (see the module docstring)."""

    def __init__(self) -> None:
        self.graphs = kernels.PausablePool("engine graphs", keep="nothing")
        self.buffers = kernels.PausablePool("engine buffers", keep="allocated")
        self.stats: dict[str, float] = {}

    @property
    def pools(self) -> tuple[kernels.PausablePool, kernels.PausablePool]:
        return self.graphs, self.buffers

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """While vLLM starts: its graphs into the graph pool, its other allocations on this thread into the buffer
        pool, after the shared per-stream workspaces were made outside both."""
        vllm_compat.engine_stream()
        _warm_shared_workspaces()
        with vllm_compat.global_graph_pool(self.graphs.id), \
                vllm_compat.startup_runs_in_own_pool(self.buffers.stepped_out) as startup, self.buffers.use():
            yield
        # Made once during the start-up runs and kept, outside both pools: on the device while the engine sleeps.
        self.stats["start_unpooled_bytes"] = startup.get("left_bytes", 0)
        logger.info("the engine's start-up runs left %.1f MiB allocated outside the pausable pools",
                    self.stats["start_unpooled_bytes"] / 2**20)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While the engine generates: its new allocations into the buffer pool, where they pause with the rest."""
        with self.buffers.use():
            yield

    @property
    def mapped_bytes(self) -> int:
        return sum(p.mapped_bytes for p in self.pools)

    @property
    def reserved_bytes(self) -> int:
        return sum(p.reserved_bytes for p in self.pools)

    @property
    def paused(self) -> bool:
        return self.buffers.paused

    def pause(self) -> int:
        """Release both pools' device memory; returns the bytes released."""
        start = time.perf_counter()
        released = self.graphs.pause()
        try:
            released += self.buffers.pause()
        except BaseException:
            self.graphs.resume()  # as it was: both mapped
            raise
        self.stats.update(pause_s=time.perf_counter() - start, released_bytes=released,
                          kept_bytes=self.buffers.kept_bytes)
        return released

    def resume(self) -> None:
        """Map both pools again (the buffers with their kept bytes). On `torch.OutOfMemoryError` both stay paused."""
        start = time.perf_counter()
        self.buffers.resume()
        try:
            self.graphs.resume()
        except BaseException:
            self.buffers.pause()
            raise
        self.stats["resume_s"] = time.perf_counter() - start

    def close(self) -> None:
        for p in self.pools:
            p.close()
