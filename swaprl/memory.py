"""Readings of device and host memory: NVML where present (it sees every allocator, vLLM's pool included),
`torch.cuda.mem_get_info` otherwise, psutil for the host, and which host NUMA node is the GPU's own."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import psutil
import torch

from .config import default_reserve_bytes as default_reserve_bytes  # where the planner, which has no torch, reads it
from .homes import Room

logger = logging.getLogger(__name__)


@functools.cache
def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception as exc:  # no driver, no library, or no GPU: callers fall back
        logger.debug("NVML unavailable: %s", exc)
        return None


def nvml_available() -> bool:
    return torch.cuda.is_available() and _nvml() is not None


def _nvml_handle(device: torch.device):
    nvml = _nvml()
    props = torch.cuda.get_device_properties(device)
    # CUDA and NVML may number devices differently (CUDA_VISIBLE_DEVICES); the PCI bus id names the same card.
    bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    by_bus = getattr(nvml, "nvmlDeviceGetHandleByPciBusId_v2", None) or nvml.nvmlDeviceGetHandleByPciBusId
    return by_bus(bus)


def device_used_bytes(device: torch.device) -> int:
    """Bytes in use on the whole device (every process and allocator), as NVML or the CUDA driver report."""
    if nvml_available():
        try:
            return int(_nvml().nvmlDeviceGetMemoryInfo(_nvml_handle(device)).used)
        except Exception as exc:
            logger.debug("NVML reading failed (%s); using cudaMemGetInfo", exc)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def device_reserved_bytes(device: torch.device) -> int:
    """Memory the driver keeps for itself on the device (NVML's v2 `reserved`), counted in NVML's v1 `used`
    but by no process; 0 when NVML or its v2 query is unavailable."""
    if not nvml_available():
        return 0
    nvml = _nvml()
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(_nvml_handle(device), version=nvml.nvmlMemory_v2)
        return int(getattr(info, "reserved", 0))
    except Exception as exc:
        logger.debug("NVML v2 memory query failed: %s", exc)
        return 0


def device_free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]


def device_total_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[1]


def torch_counters(device: torch.device, *, lent: int = 0) -> tuple[int, int]:
    """torch's allocated and reserved bytes on `device`, from one reading of its statistics: `memory_allocated` and
    `memory_reserved` each build all of them (a dict of some 150 counters) and take the allocator's lock, which a
    phase switch, and the profiler's sampler beside it, would otherwise pay for twice per figure. `lent`: bytes of
    torch's blocks an engine holds (`swaprl.lending.PageLender.lent_bytes`), counted as neither: they are the
    engine's."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:  # CUDA not initialised yet: nothing allocated
        return 0, 0
    return (int(stats["allocated_bytes"]["all"]["current"]) - lent,
            int(stats["reserved_bytes"]["all"]["current"]) - lent)


def device_figures(device: torch.device, *, lent: int = 0) -> dict[str, int]:
    """The device's used and total bytes (NVML where it reads) and torch's allocated and reserved counters (`lent`:
    see `torch_counters`)."""
    allocated, reserved = torch_counters(device, lent=lent)
    return {"used": device_used_bytes(device), "total": device_total_bytes(device),
            "torch_allocated": allocated, "torch_reserved": reserved}


def private_pool_bytes(device: torch.device) -> tuple[int, int]:
    """Bytes torch reserves on `device` in private pools (MemPool, CUDA graphs) rather than its default pool, and how
    many of them no block holds (a graph's freed intermediates, a paused pool's cached blocks): free in torch's
    counters, but not for the default pool to hand out."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        try:
            segments = torch.cuda.memory_snapshot(include_traces=False)
        except TypeError:  # torch < 2.10 has no include_traces
            segments = torch.cuda.memory_snapshot()
    except Exception as exc:  # e.g. a pluggable allocator replacing torch's
        logger.debug("torch.cuda.memory_snapshot failed (%s); counting no private pools", exc)
        return 0, 0
    private = [s for s in segments if s.get("device") == index and tuple(s.get("segment_pool_id") or (0, 0)) != (0, 0)]
    reserved = sum(int(s["total_size"]) for s in private)
    return reserved, reserved - sum(int(s.get("allocated_size", s["total_size"])) for s in private)


class TorchPeaks:
    """torch's peak memory counters of one device, per reader and span, and since a start: one per runtime
    (`Runtime.peaks`), which its profile and its first step's rule share.

    torch keeps one peak per counter, since its last reset. A memory profile wants each phase's own peaks (reserved
    less allocated at a phase's peak is what its allocator held but could not hand out: a sample taken between two
    of the backward's allocations would see a passing low of allocated under reserved's high mark instead), and the
    first step's rule of `optimizer_states="auto"` the peak reserved since attach. Every reset folds torch's peaks
    into what each reader and the start have not taken yet, so that two profiles of one device, or a profile and the
    rule, do not cut each other's spans short."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._since_start = 0  # reserved
        self._pending: dict[object, tuple[int, int]] = {}  # per reader: (allocated, reserved) not yet taken

    def _fold(self) -> tuple[int, int]:
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)  # both peaks of one moment, in one reading
        allocated = stats["allocated_bytes"]["all"]["peak"] if stats else 0
        reserved = stats["reserved_bytes"]["all"]["peak"] if stats else 0
        self._since_start = max(self._since_start, reserved)
        for reader, (a, r) in self._pending.items():
            self._pending[reader] = (max(a, allocated), max(r, reserved))
        torch.cuda.reset_peak_memory_stats(self.device)
        return allocated, reserved

    def start(self) -> None:
        """The peak reserved since now, for `reserved_since_start`; the readers' spans go on."""
        self._fold()
        self._since_start = 0

    def span(self, reader: object) -> tuple[int, int]:
        """torch's peak allocated and reserved bytes since `reader`'s last span (or, at its first, since torch's last
        reset); its next span starts now."""
        self._pending.setdefault(reader, (0, 0))
        self._fold()
        out, self._pending[reader] = self._pending[reader], (0, 0)
        return out

    def forget(self, reader: object) -> None:
        self._pending.pop(reader, None)

    def reserved_since_start(self) -> int:
        return max(self._since_start, torch.cuda.max_memory_reserved(self.device))


def measure_room(device: torch.device, *, peaks: TorchPeaks | None = None, reserve: int | None = None) -> Room:
    """The device's room now, as every home decision and the engine's sizing read it (`swaprl.homes.Room`): the
    driver's free bytes, torch's default pool's free blocks, the reserve (`default_reserve_bytes` unless given) and,
    with `peaks`, what training's peak since their start takes back beyond what is allocated now."""
    free, total = torch.cuda.mem_get_info(device)
    regrow = 0
    if peaks is not None:
        regrow = max(peaks.reserved_since_start() - torch_counters(device)[0], 0)
    return Room(free=free, cached=default_pool_free_bytes(device),
                reserve=default_reserve_bytes(total) if reserve is None else reserve, regrow=regrow)


def default_pool_free_bytes(device: torch.device) -> int:
    """What torch's default pool holds cached and free on `device`: reserved less allocated, less the private pools'
    free bytes. Memory the trainer's next allocations can take without asking the driver."""
    allocated, reserved = torch_counters(device)
    return max(reserved - allocated - private_pool_bytes(device)[1], 0)


def host_available_bytes() -> int:
    return int(psutil.virtual_memory().available)


def numa_nodes() -> list[int]:
    """The host's online NUMA nodes ([0] where the kernel says nothing)."""
    try:
        text = Path("/sys/devices/system/node/online").read_text().strip()
    except OSError:
        return [0]
    nodes: list[int] = []
    for part in filter(None, text.split(",")):  # "0", "0-1", "0,2-3"
        first, _, last = part.partition("-")
        nodes += range(int(first), int(last or first) + 1)
    return nodes or [0]


@functools.cache
def gpu_numa_node(device_index: int) -> int | None:
    """The host NUMA node nearest to CUDA device `device_index` (NVML's memory affinity, node scope): where its
    page-locked buffers belong, since copies to memory on another socket's node cross the link between sockets.
    None on a host with one node (nothing to choose) or when NVML cannot tell."""
    nodes = numa_nodes()
    if len(nodes) < 2 or not nvml_available():
        return None
    nvml = _nvml()
    try:
        mask = nvml.nvmlDeviceGetMemoryAffinity(_nvml_handle(torch.device("cuda", device_index)),
                                                max(nodes) // 64 + 1, nvml.NVML_AFFINITY_SCOPE_NODE)
    except Exception as exc:  # an old driver or NVML without the call
        logger.debug("NVML memory affinity unavailable: %s", exc)
        return None
    near = [n for n in nodes if mask[n // 64] >> (n % 64) & 1]
    return near[0] if near else None


def gib(n: float) -> float:
    return n / 2**30
