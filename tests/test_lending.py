"""swaprl.lending: the pages under torch's free cached blocks mapped at an engine's addresses, for real on the GPU.

An address range reserved with the driver stands for one of vLLM's sleep-mode allocations (vLLM reserves its
ranges the same way); the engine itself wakes on lent pages in tests/test_vllm.py. Here:
a lent range reads and writes torch's own pages, creates physical memory only past its last whole page, and gives
everything back; a page that is not one physical allocation is refused with nothing mapped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from swaprl import vmm, memory
from swaprl.lending import PageLender

MiB = 2**20
gpu = pytest.mark.gpu


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class _Reserved:
    """An address range reserved with the driver and nothing mapped: what vLLM's allocator holds for an allocation
    while the engine sleeps (reserved through benchmarks/bench_vmm.py's driver calls)."""

    def __init__(self, size: int) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
        from bench_vmm import Driver

        self.driver = Driver(torch.cuda.current_device())
        self.size, self.ptr = size, self.driver.reserve(size)

    def view(self) -> torch.Tensor:
        """The range as a uint8 tensor (valid while it is mapped)."""
        holder = type("Range", (), {"__cuda_array_interface__": {"shape": (self.size,), "typestr": "|u1",
                                                                  "data": (self.ptr, False), "version": 3}})()
        return torch.as_tensor(holder, device="cuda")

    def close(self) -> None:
        self.driver.free_address(self.ptr, self.size)


@pytest.fixture
def lender():
    if not vmm.available():
        pytest.fail(f"the native library must load on the GPU machine: {vmm.unavailable()}")
    torch.cuda.empty_cache()
    block = torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")  # pages torch maps, then holds free
    del block
    out = PageLender(torch.cuda.current_device())
    if not out.lendable():
        pytest.skip("torch holds no lendable pages: run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    yield out
    assert not out.lent
    out.give_back()
    torch.cuda.empty_cache()


@gpu
def test_a_lent_range_is_torchs_own_pages_and_creates_memory_only_past_the_last_whole_page(lender):
    device = torch.cuda.current_device()
    size = 2**30 + 6 * MiB  # not a whole number of pages
    warm = torch.zeros(1, dtype=torch.uint8, device="cuda")
    assert not bool((warm.fill_(7) == 7).logical_not().any())  # kernels loaded before the driver is read
    reserved_before = torch.cuda.memory_reserved()
    allocated_before = memory.torch_counters(torch.device("cuda", device))[0]
    ready = lender.take([size])
    first_page, page, _ = lender._pages[0]
    assert page % (2 * MiB) == 0 and ready >= size // page * page, (page, ready)
    taken = sum(lender._blocks.values())
    assert taken - ready < page, f"took {taken} bytes of torch's for {ready} lent: a page or more taken for nothing"
    assert lender.lent_bytes >= ready
    # the engine's, not torch's
    assert memory.torch_counters(torch.device("cuda", device), lent=lender.lent_bytes)[0] == allocated_before
    dst = _Reserved(size)
    free0 = _free()
    try:
        lent = lender.map(dst.ptr, size)
        assert lent == size // page * page
        assert free0 - _free() == size - lent  # new physical memory only for what fills no whole page
        dst.view().fill_(7)
        torch.cuda.synchronize()
        # The bytes are in torch's pages: read the first one lent where torch maps it.
        held = _Reserved.__new__(_Reserved)
        held.size, held.ptr = page, first_page
        assert not bool((held.view() == 7).logical_not().any()), "torch's page does not hold what was written there"
        assert lender.unmap(dst.ptr) and not lender.unmap(dst.ptr)
        assert _free() == free0
    finally:
        if lender.lent:
            lender.unmap(dst.ptr)
        dst.close()
    lender.give_back()
    assert lender.lent_bytes == 0
    assert torch.cuda.memory_reserved() == reserved_before  # no page released or created on torch's side


@gpu
def test_a_free_block_starting_inside_a_page_still_gives_every_page_wanted(lender):
    """The fixture's free 3 GiB block with its first 6 MiB taken again: what is free starts 6 MiB into a page, and
    `take` still gets the pages wanted, holding less than a page of torch's beyond them."""
    front = torch.empty(6 * MiB, dtype=torch.uint8, device="cuda")
    size = 2**30
    ready = lender.take([size])
    page = lender._pages[0][1]
    taken = sum(lender._blocks.values())
    assert ready == size // page * page and taken - ready < page, (ready, taken, page)
    lender.give_back_unused()
    del front


@gpu
def test_a_block_freed_after_another_streams_use_is_lendable_once_that_stream_is_done(lender):
    """The states' reload allocates them on the compute stream and copies on its own (`record_stream`): freed, their
    block is pending until torch sees that stream's event done. The lender counts it as soon as it is."""
    side = torch.cuda.Stream()
    states = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    before = lender.lendable()
    with torch.cuda.stream(side):
        states.fill_(1)
    states.record_stream(side)
    side.synchronize()
    del states  # pending in torch's allocator until an allocation finds the side stream's event done
    torch.cuda.synchronize()  # that event done too (synchronizing checks no event: the block stays pending)
    assert lender.lendable() >= before + 2 * 2**30 - 2 * 20 * MiB


@gpu
def test_a_page_that_is_not_one_physical_allocation_is_refused_with_nothing_mapped(lender):
    lender.take([2**30])
    page = lender._pages[0][1]
    dst = _Reserved(4 * page)
    try:
        with pytest.raises(RuntimeError, match="not one physical allocation"):
            vmm.lend(dst.ptr, 4 * page, [lender._pages[0][0]], 2 * page, torch.cuda.current_device())
        assert vmm.lent_mapped_bytes() == (0, 0)
        assert not vmm.unlend(dst.ptr, torch.cuda.current_device())
    finally:
        dst.close()
    lender.give_back_unused()


@pytest.mark.vllm
def test_lend_pages_without_a_gpu_names_the_fix(tiny_checkpoint, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the machine without a GPU")
    from swaprl.engines.vllm import VLLMEngine

    with pytest.raises(RuntimeError, match="lend_pages=True needs a CUDA GPU.*lend_pages=False"):
        VLLMEngine(tiny_checkpoint, lend_pages=True)


def test_what_a_block_is_asked_for_holds_the_pages_wanted_wherever_torch_cuts_it():
    """`take` asks a free block for the pages still wanted and less than a page more: torch's best fit may cut the
    allocation from another free block, starting anywhere in a page, and the pages must be there all the same."""
    from swaprl.lending import _ask

    for page in (20 * MiB, 64 * MiB):
        for need in (page, 3 * page, 40 * page):
            size = need + 5 * page  # a block with more whole pages than wanted: it is cut, not taken whole
            ask = _ask(size, need + 4 * page, need, page)
            assert need <= ask < need + page, (page, need, ask)
            for head in (0, 512, 2 * MiB, page // 2, page - 512):  # where in a page the cut starts
                assert PageLender._whole(head, ask, 0, page) == need, (page, need, head)
        # a block with no more whole pages than wanted is taken whole
        assert _ask(3 * page + MiB, 3 * page, 4 * page, page) == 3 * page + MiB
        assert _ask(3 * page + MiB, 3 * page, 3 * page, page) == 3 * page + MiB
