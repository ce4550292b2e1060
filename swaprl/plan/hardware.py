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
# Memory bandwidth of one GPU: NVIDIA's datasheet figures, not measured here (§Clusters). It prices the reads of a
# decode step in the step cost (§Cost), which ranks plans; it decides nothing about fitting.
_H100_SXM_BANDWIDTH = 3.35e12


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
    memory_bandwidth_bytes_per_s: float = _H100_SXM_BANDWIDTH
    """One GPU's memory bandwidth (the datasheet's; default the H100 SXM's): it prices the weights and KV cache each
    decode step reads in the step cost that ranks plans (§Cost), not whether a plan fits."""

    def __post_init__(self) -> None:
        check_positive_ints(self, ("gpus_per_node", "gpu_memory_bytes", "host_memory_bytes", "nodes"))
        rate = self.copy_bytes_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
            raise ValueError(f"Cluster.copy_bytes_per_s must be a positive number of bytes per second, e.g. 36e9, "
                             f"got {rate!r}")
        bandwidth = self.memory_bandwidth_bytes_per_s
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float) or not 0 < bandwidth < math.inf:
            raise ValueError(f"Cluster.memory_bandwidth_bytes_per_s must be a positive number of bytes per second, "
                             f"e.g. 4.8e12 (an H200's datasheet figure), got {bandwidth!r}")

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True, slots=True)
class GPU:
    """One kind of GPU: its memory as CUDA reports it, and the pinned copy rate of one such GPU alone."""

    memory_bytes: int
    copy_bytes_per_s: float
    measured: bool
    """Its memory figure was read off such a GPU (nvidia-smi); else the vendor's figure less the same driver share."""
    memory_bandwidth_bytes_per_s: float = _H100_SXM_BANDWIDTH
    """The datasheet's memory bandwidth (NVIDIA's figure for the SXM module where there are several)."""


# cudaMemGetInfo totals: nvidia-smi's total less the 480 MiB the driver keeps (measured on the H100, assumed for the
# others); one GPU's copy rate measured on the H100, the PCIe generation's for the others (§Clusters).
GPUS: dict[str, GPU] = {
    "H100": GPU((81559 - 480) * MiB, _ONE_GPU_COPY_RATE, measured=True, memory_bandwidth_bytes_per_s=3.35e12),
    "H200": GPU((143771 - 480) * MiB, _ONE_GPU_COPY_RATE, measured=True, memory_bandwidth_bytes_per_s=4.8e12),
    "A100": GPU((81920 - 480) * MiB, 25e9, measured=False,  # the 80 GB card; PCIe 4
                memory_bandwidth_bytes_per_s=2.039e12),
    "B200": GPU((183359 - 480) * MiB, _ONE_GPU_COPY_RATE, measured=False, memory_bandwidth_bytes_per_s=8e12),
    "L40S": GPU((46068 - 480) * MiB, 25e9, measured=False, memory_bandwidth_bytes_per_s=0.864e12),  # PCIe 4
}
HOST_BYTES_PER_GPU = 128 * GiB
"""Host memory a cluster named `NxGPU` is given per GPU of a node, unless it is one of `CLUSTERS` (which carry the
memory of the machines measured here) or `host_memory_bytes` / `--host-memory-gib` says otherwise."""


def _cluster(gpus_per_node: int, gpu: str, *, host_memory_bytes: int | None = None, nodes: int = 1) -> Cluster:
    kind = GPUS[gpu]
    rate = kind.copy_bytes_per_s if gpus_per_node == 1 else min(_NODE_COPY_RATE, kind.copy_bytes_per_s)
    host = HOST_BYTES_PER_GPU * gpus_per_node if host_memory_bytes is None else host_memory_bytes
    return Cluster(gpus_per_node=gpus_per_node, gpu_memory_bytes=kind.memory_bytes, host_memory_bytes=host,
                   nodes=nodes, copy_bytes_per_s=rate, memory_bandwidth_bytes_per_s=kind.memory_bandwidth_bytes_per_s)


# The machines measured here, with their host memory (a real node may have more or less: --host-memory-gib).
CLUSTERS: dict[str, Cluster] = {
    "8xH200": _cluster(8, "H200", host_memory_bytes=560 * GiB),
    "8xH100": _cluster(8, "H100", host_memory_bytes=1024 * GiB),
    "1xH200": _cluster(1, "H200"),
    "1xH100": _cluster(1, "H100"),
}


def get_cluster(name: str) -> Cluster:
    """A copy of a named cluster ("8xH200", "8xH100", "1xH200", "1xH100"), or any `NxGPU` with a GPU of `GPUS`
    (case-insensitive): N up to 8 is one node, more is nodes of 8 (N a multiple of 8), with `HOST_BYTES_PER_GPU`
    of host memory per GPU of a node."""
    for key, value in CLUSTERS.items():
        if key.lower() == name.lower():
            return dataclasses.replace(value)
    count, sep, gpu = name.lower().partition("x")
    gpu = next((g for g in GPUS if g.lower() == gpu.lower()), None)
    if not sep or not count.isdigit() or int(count) < 1 or gpu is None:
        raise ValueError(f"unknown cluster {name!r}; give NxGPU with a GPU among {', '.join(GPUS)} (e.g. 2xH100, "
                         f"16xH200) or one of {', '.join(CLUSTERS)}; another GPU: the nearest one with "
                         "--gpu-memory-gib (and --host-memory-gib, --gpus-per-node, --nodes), or a Cluster(...)")
    n = int(count)
    if n > 8 and n % 8:
        raise ValueError(f"cluster {name!r}: more than 8 GPUs are taken as nodes of 8, and {n} is not a multiple "
                         "of 8; give the nodes with --nodes and --gpus-per-node")
    return _cluster(min(n, 8), gpu, nodes=max(n // 8, 1))
