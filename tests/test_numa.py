"""Host buffers on the GPU's own NUMA node: the kernel is asked (mbind) before the pages are first touched.

    python -m pytest tests/test_numa.py -q
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from swaprl import memory, residency

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="NUMA placement is Linux's (mbind)")


def _policy_at(address: int) -> str:
    """The memory policy /proc/self/numa_maps gives the mapping that starts at `address`."""
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        start, policy, *_ = line.split()
        if int(start, 16) == address:
            return policy
    raise AssertionError(f"no mapping starts at {address:#x}")


@linux
def test_pages_are_asked_for_on_the_node_before_they_are_touched():
    buf = torch.empty(64 * 2**20, dtype=torch.uint8)  # large enough to be a mapping of its own
    assert residency._prefer_node(buf, 0)
    buf.zero_()
    page = os.sysconf("SC_PAGE_SIZE")
    assert _policy_at((buf.data_ptr() + page - 1) // page * page) == "prefer:0"
    assert int(buf.sum()) == 0  # the buffer is ordinary memory all the same

    assert not residency._prefer_node(buf, None)  # no node named: the kernel's choice
    assert not residency._prefer_node(torch.empty(16, dtype=torch.uint8), 0)  # no whole page inside


@linux
def test_a_node_that_does_not_exist_is_refused_with_a_warning_and_the_buffer_still_works(caplog):
    missing = max(memory.numa_nodes()) + 1
    buf = torch.empty(64 * 2**20, dtype=torch.uint8)
    assert not residency._prefer_node(buf, missing)
    assert f"NUMA node {missing}" in caplog.text and "link between sockets" in caplog.text
    buf.fill_(3)
    assert int(buf[-1]) == 3


def test_the_online_nodes_are_read_from_the_kernel():
    nodes = memory.numa_nodes()
    assert nodes and nodes == sorted(set(nodes)) and nodes[0] >= 0
    if Path("/sys/devices/system/node/node0").exists():
        assert 0 in nodes


@pytest.mark.gpu
def test_a_pinned_host_buffer_lives_on_the_gpus_node():
    device = torch.cuda.current_device()
    node = memory.gpu_numa_node(device)
    buf = residency.HostBuffer("numa", pin=True)
    buf.prepare(64 * 2**20)
    buf.settle()
    assert buf.numa_node == node and buf.locked_bytes == 64 * 2**20
    if len(memory.numa_nodes()) < 2:
        assert node is None  # one node: nothing to choose, the kernel's placement stands
        return
    assert node in memory.numa_nodes()
    page = os.sysconf("SC_PAGE_SIZE")
    assert _policy_at((buf.ensure(1).data_ptr() + page - 1) // page * page) == f"prefer:{node}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_buffer_for_another_gpu_lives_on_that_gpus_node_whatever_the_current_device():
    torch.cuda.set_device(0)
    buf = residency.HostBuffer("numa 1", pin=True, device=1)
    buf.prepare(64 * 2**20)
    buf.settle()
    assert buf.numa_node == memory.gpu_numa_node(1) and buf.locked_bytes == 64 * 2**20
    assert torch.cuda.current_device() == 0  # the background thread's device is its own
    data = torch.arange(1024, device="cuda:1", dtype=torch.uint8)
    host = buf.ensure(1024)[:1024]
    host.copy_(data)
    assert torch.equal(host, data.cpu())
