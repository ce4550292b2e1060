"""The machines a plan is for: nodes of identical GPUs, their memory and copy rates, the named clusters (§Clusters)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GiB = 2**30
MiB = 2**20


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def check_positive_ints(obj, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}")


# Pinned copy rates per GPU and direction (§Clusters). Several GPUs: 36 GB/s measured with both GPUs of a 2 x H200
# host copying both ways at once, standing in for 8-GPU nodes of H200s and H100s (not measured with 8). One GPU:
# 55 GB/s each way, measured on one H100 (benchmarks/results/transitions_qwen2.5-7b_h100.md: 55.4 device-to-host,
# 55.1 host-to-device), assumed for one H200 too (the same PCIe generation).
_NODE_COPY_RATE = 36e9
_ONE_GPU_COPY_RATE = 55e9


@dataclass(kw_only=True, slots=True)
class Cluster:
    """The machines: identical nodes of identical GPUs."""

    gpus_per_node: int
    """GPUs in one node; the engine's tensor parallelism stays inside a node."""
    gpu_memory_bytes: int
    """Memory of one GPU as CUDA reports it (`torch.cuda.mem_get_info()[1]`), the base of the utilisation cap."""
    host_memory_bytes: int
    """Host memory of one node (`free -b` total); pinned buffers for swapped tensors come out of it."""
    nodes: int = 1
    """Number of nodes."""
    copy_bytes_per_s: float = _NODE_COPY_RATE
    """Pinned host <-> GPU copy rate of one GPU, per direction, while every GPU of the node copies both ways at once
    (the default is the slowest measured, §Clusters); it prices the bytes a step moves, not whether it fits."""

    def __post_init__(self) -> None:
        check_positive_ints(self, ("gpus_per_node", "gpu_memory_bytes", "host_memory_bytes", "nodes"))
        rate = self.copy_bytes_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
            raise ValueError(f"Cluster.copy_bytes_per_s must be a positive number of bytes per second, e.g. 36e9, "
                             f"got {rate!r}")

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


# cudaMemGetInfo totals (nvidia-smi's total less the 480 MiB the driver keeps) and host memory (§Clusters).
_H100_BYTES = 85_017_493_504  # measured: 81559 MiB - 480 MiB
_H200_BYTES = 150_251_503_616  # 143771 MiB - 480 MiB (the H100's driver reserve, assumed)
CLUSTERS: dict[str, Cluster] = {
    "8xH200": Cluster(gpus_per_node=8, gpu_memory_bytes=_H200_BYTES, host_memory_bytes=560 * GiB,
                      copy_bytes_per_s=_NODE_COPY_RATE),
    "8xH100": Cluster(gpus_per_node=8, gpu_memory_bytes=_H100_BYTES, host_memory_bytes=1024 * GiB,
                      copy_bytes_per_s=_NODE_COPY_RATE),
    "1xH200": Cluster(gpus_per_node=1, gpu_memory_bytes=_H200_BYTES, host_memory_bytes=128 * GiB,
                      copy_bytes_per_s=_ONE_GPU_COPY_RATE),
    "1xH100": Cluster(gpus_per_node=1, gpu_memory_bytes=_H100_BYTES, host_memory_bytes=128 * GiB,
                      copy_bytes_per_s=_ONE_GPU_COPY_RATE),
}


def get_cluster(name: str) -> Cluster:
    """A copy of a named cluster ("8xH200", "8xH100", "1xH200", "1xH100"; case-insensitive)."""
    for key, value in CLUSTERS.items():
        if key.lower() == name.lower():
            return dataclasses.replace(value)
    raise ValueError(f"unknown cluster {name!r}; choose one of {', '.join(CLUSTERS)} or build a "
                     "Cluster(gpus_per_node=..., gpu_memory_bytes=..., host_memory_bytes=..., nodes=...)")

