"""The machines a plan is for: nodes of identical GPUs, their memory and copy rates, the named clusters (§Clusters)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..presets import SIZE_LIMIT, shown_value

GiB = 2**30
MiB = 2**20


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


# What a cluster can be said to hold, far past any machine built: only a typo or junk crosses these bounds, and
# below them the planner's sums of bytes stay finite and its searches over divisors of the GPU count stay short.
MAX_GPUS_PER_NODE = 1024
MAX_GPUS = 2**20
"""GPUs of the whole cluster (nodes times GPUs a node), past the largest training clusters built."""
MAX_GPU_MEMORY_BYTES = 4096 * GiB
MAX_HOST_MEMORY_BYTES = 65536 * GiB
MAX_COPY_BYTES_PER_S = 10_000e9
MAX_MEMORY_BANDWIDTH_BYTES_PER_S = 1e15
COUNT_LIMIT = SIZE_LIMIT - 1
"""The most of anything counted (nodes, prompts, tokens, sequences): the bound a config.json's sizes keep."""


def check_number(value: object, name: str, what: str, high: float, *, integer: bool = False,
                 zero: bool = False) -> None:
    """Refuse `value` unless it is a number (an int if `integer`; never a bool) above 0 (or 0 itself if `zero`) and
    at most `high`: a ValueError naming it `name` (a field, or the flag it came from) and saying it must be `what`.
    The comparisons refuse NaN and infinity too, and compare a huge int exactly, without overflowing to a float."""
    kinds = int if integer else int | float
    low_ok = (lambda v: v >= 0) if zero else (lambda v: v > 0)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (low_ok(value) and value <= high):
        bound = int(high) if float(high).is_integer() else high
        if name.startswith("--"):  # a flag, shown as it was typed
            raise ValueError(f"{name} {shown_value(value)}: give {what}, at most {bound}")
        raise ValueError(f"{name} must be {what}, at most {bound}; got {shown_value(value)}")


def check_gpus(nodes: int, gpus_per_node: int, *, names: tuple[str, str]) -> None:
    """Refuse more GPUs than `MAX_GPUS` in all; `names`: what the two counts are called where they were given."""
    if nodes * gpus_per_node > MAX_GPUS:
        raise ValueError(f"{nodes} nodes ({names[0]}) of {gpus_per_node} GPUs ({names[1]}) make "
                         f"{nodes * gpus_per_node} GPUs, more than the planner plans for (at most {MAX_GPUS}); give "
                         "fewer nodes or GPUs a node")


# Pinned copy rates per GPU and direction (§Clusters). Several GPUs: 36 GB/s measured with both GPUs of a 2 x H200
# host copying both ways at once, standing in for 8-GPU nodes of H200s and H100s (not measured with 8). One GPU:
# 55 GB/s each way, measured on one H100 (benchmarks/results/transitions_qwen2.5-7b_h100/README.md: 55.4 device-to-host,
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
        # No bound on the GPUs in all here, only in Spec (check_gpus): when nothing fits, the planner builds a
        # cluster of twice the nodes to try, and only a Spec's ValueError tells it that that cluster is no answer.
        check_number(self.gpus_per_node, "Cluster.gpus_per_node", "a positive integer", MAX_GPUS_PER_NODE,
                     integer=True)
        check_number(self.nodes, "Cluster.nodes", "a positive integer", COUNT_LIMIT, integer=True)
        check_number(self.gpu_memory_bytes, "Cluster.gpu_memory_bytes", "a positive integer of bytes",
                     MAX_GPU_MEMORY_BYTES, integer=True)
        check_number(self.host_memory_bytes, "Cluster.host_memory_bytes", "a positive integer of bytes",
                     MAX_HOST_MEMORY_BYTES, integer=True)
        check_number(self.copy_bytes_per_s, "Cluster.copy_bytes_per_s",
                     "a positive number of bytes per second, e.g. 36e9", MAX_COPY_BYTES_PER_S)
        check_number(self.memory_bandwidth_bytes_per_s, "Cluster.memory_bandwidth_bytes_per_s",
                     "a positive number of bytes per second, e.g. 4.8e12 (an H200's datasheet figure)",
                     MAX_MEMORY_BANDWIDTH_BYTES_PER_S)

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
    digits = count.isascii() and count.isdigit()  # isdigit() alone passes digits int() refuses ("²")
    n = 0 if not digits else int(count) if len(count) < 10 else MAX_GPUS + 1  # int() of a long one can refuse too
    if not sep or n < 1 or gpu is None:
        raise ValueError(f"unknown cluster {name!r}; give NxGPU with a GPU among {', '.join(GPUS)} (e.g. 2xH100, "
                         f"16xH200) or one of {', '.join(CLUSTERS)}; another GPU: the nearest one with "
                         "--gpu-memory-gib (and --host-memory-gib, --gpus-per-node, --nodes), or a Cluster(...)")
    if n > MAX_GPUS:
        raise ValueError(f"cluster {name!r} has more GPUs than the planner plans for (at most {MAX_GPUS}); give a "
                         "smaller cluster")
    if n > 8 and n % 8:
        raise ValueError(f"cluster {name!r}: more than 8 GPUs are taken as nodes of 8, and {n} is not a multiple "
                         "of 8; give the nodes with --nodes and --gpus-per-node")
    return _cluster(min(n, 8), gpu, nodes=max(n // 8, 1))
