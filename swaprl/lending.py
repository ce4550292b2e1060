"""torch's free cached pages lent to an engine's sleep-mode allocations while the engine is awake.

A switch into `generate` used to hand torch's cached free blocks back to the driver (`empty_cache`: unmap and
release every page) so that vLLM's wake-up could create physical memory and map it at its fixed addresses, and the
engine's sleep released that memory again for torch to create anew in training. The driver's cost is in creating
and releasing physical memory, not in mapping it (benchmarks/bench_vmm.py). Lending skips both: the free blocks
stay allocated in torch's cache for the lender (`torch.cuda.caching_allocator_alloc`, on the stream that owns
them), the physical pages under them are mapped a second time at the engine's addresses (`vmm.lend`), and
when the engine sleeps they are unmapped there and the blocks freed: torch finds them still mapped.

It needs torch's expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, swaprl's default): each
of their pages is one physical allocation the driver can name. Without them, or without swaprl's native library,
nothing is lendable and the engine wakes as before.

While lent, the blocks count as allocated in torch's statistics; `PageLender.lent_bytes` says how many of them are
the engine's, and `memory.torch_counters` leaves them out when told.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import vmm


_ALIGN = 512  # torch's blocks start and end on multiples of this


def _ask(size: int, whole: int, need: int, page: int) -> int:
    """The bytes to allocate from a free block of `size` bytes, `whole` of them in whole pages, for `need` bytes of
    pages (a multiple of `page`): the whole block where its pages do not exceed the need, else the need and less than
    a page more. torch's best fit may cut the allocation from another free block than this one, starting anywhere in
    a page (on a 512-byte boundary), and `need + page - 512` bytes hold `need` bytes of whole pages wherever they
    start."""
    return size if whole <= need else min(size, need + page - _ALIGN)


@dataclass
class _Free:
    """A free block of torch's default pool that holds at least one whole page."""
    address: int
    size: int
    stream: int
    base: int  # its segment's first byte: pages start there, every `page` bytes
    page: int


class PageLender:
    """Lends the pages under torch's free cached blocks on `device` to an engine's allocations.

    `lendable()` says how many bytes could be lent now; `take(sizes)` allocates free blocks holding the whole pages
    those allocations can use; `map(dst, size)` backs an engine allocation with taken pages (and memory of its own
    past the last whole page, or where the pages ran out); `unmap(dst)` undoes that; `give_back()` frees every block
    taken (after every range is unmapped), `give_back_unused()` those none of whose pages were mapped."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._blocks: dict[int, int] = {}  # block address -> size, allocated from torch's cache
        self._pages: list[tuple[int, int, int]] = []  # (page address, page bytes, block address), not yet mapped
        self._used: dict[int, int] = {}  # block address -> its pages mapped now
        self._ranges: dict[int, list[int]] = {}  # lent range -> the blocks its pages came from

    @property
    def lent_bytes(self) -> int:
        """Bytes of torch's blocks held for the engine now: allocated in torch's counters, the engine's memory in
        fact (`memory.torch_counters(..., lent=)` leaves them out)."""
        return sum(self._blocks.values())

    # ---------------------------------------------------------------- what torch holds free
    def _segments(self):
        """Each segment of torch's pools on the device as (segment, first byte, page bytes), the page bytes 0 but
        for the default pool's large segments made of pages the driver can name (expandable segments, whose pages
        start at the segment's first byte; `cudaMalloc`'s memory has none)."""
        if not vmm.available():
            return
        # A block freed while another stream used it (`record_stream`: the states' reload) stays pending until torch
        # sees that stream's event done, which it checks only when it allocates: allocate, so the snapshot shows
        # such blocks free (and merged with their free neighbours) once their streams are done with them. (Not
        # while a graph is captured, when torch checks no event; and never at the price of an error.)
        if not torch.cuda.is_current_stream_capturing():
            try:
                torch.cuda.caching_allocator_delete(torch.cuda.caching_allocator_alloc(1, self.device))
            except torch.OutOfMemoryError:
                pass
        for seg in torch.cuda.memory_snapshot(include_traces=False):
            if seg.get("device") != self.device:
                continue
            base = int(seg["address"])
            default = tuple(seg.get("segment_pool_id") or (0, 0)) == (0, 0)
            large = default and seg.get("segment_type") == "large"
            yield seg, base, vmm.page_bytes(base, int(seg["total_size"]), self.device) if large else 0

    def _scan(self) -> tuple[list[_Free], dict[int, tuple[int, int]]]:
        """The default pool's free blocks holding whole pages, largest first, and its paged segments (first byte ->
        end, page bytes)."""
        out, segments = [], {}
        for seg, base, page in self._segments():
            if not page:
                continue
            segments[base] = (base + int(seg["total_size"]), page)
            addr = base
            for block in seg["blocks"]:
                size = int(block["size"])
                if block["state"] == "inactive" and self._whole(addr, size, base, page):
                    out.append(_Free(addr, size, int(seg["stream"]), base, page))
                addr += size
        return sorted(out, key=lambda b: -b.size), segments

    @staticmethod
    def _whole(addr: int, size: int, base: int, page: int) -> int:
        """Bytes of whole pages inside [addr, addr + size)."""
        first = base + -(-(addr - base) // page) * page
        end = base + (addr + size - base) // page * page
        return max(end - first, 0)

    def lendable(self) -> int:
        """Bytes of whole pages under torch's free cached blocks now (none without expandable segments)."""
        return sum(self._whole(b.address, b.size, b.base, b.page) for b in self._scan()[0])

    def census(self) -> dict:
        """Where torch's default pool on the device stands, in bytes, for a message: its blocks by state, the free
        ones' whole pages, its segments (those without pages to lend, `cudaMalloc`'s, apart), its three largest
        allocated blocks, and what this lender holds: its blocks, their count, and their edges (the bytes outside
        whole pages, which pin the pages they share with their neighbours)."""
        unmapped, (lent, own) = sum(n for _, n, _ in self._pages), vmm.lent_mapped_bytes()
        out = {"segments": 0, "allocated": 0, "pending_free": 0, "free": 0, "free_whole_pages": 0, "free_blocks": 0,
               "unpaged": 0, "unpaged_free": 0, "largest_allocated": [],
               "lender_blocks": sum(self._blocks.values()), "lender_block_count": len(self._blocks),
               "lender_edges": sum(self._blocks.values()) - lent - unmapped, "lender_pages_unmapped": unmapped,
               "lent_pages": lent, "lent_own": own}
        free, total = torch.cuda.mem_get_info(self.device)
        out.update(device_used=total - free, default_pool=0, private_pools=0)
        for seg, base, page in self._segments():
            if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0):
                out["private_pools"] += int(seg["total_size"])
                continue
            out["segments"] += 1
            out["default_pool"] += int(seg["total_size"])
            out["unpaged"] += 0 if page else int(seg["total_size"])
            addr = base
            for block in seg["blocks"]:
                size, state = int(block["size"]), block["state"]
                key = {"active_allocated": "allocated", "active_pending_free": "pending_free"}.get(state, "free")
                out[key] += size
                if key == "free":
                    out["free_blocks"] += 1
                    out["free_whole_pages"] += self._whole(addr, size, base, page) if page else 0
                    out["unpaged_free"] += 0 if page else size
                elif key == "allocated":
                    out["largest_allocated"] = sorted(out["largest_allocated"] + [size], reverse=True)[:3]
                addr += size
        return out

    # ---------------------------------------------------------------- taking and giving back
    def take(self, sizes: list[int]) -> int:
        """Allocate free cached blocks until they hold whole pages enough for allocations of these `sizes` (what of
        each fills whole pages), or none is left; returns the page bytes ready to map (those left from an earlier
        call included). The last block is taken only as far as it is needed; a block whose edges (the pages it
        shares with its neighbours) outweigh its whole pages is left to be handed back to the driver instead."""
        blocks, segments = self._scan()
        ready = sum(n for _, n, _ in self._pages)
        if not blocks:
            return ready
        page = blocks[0].page
        want = sum(n // page * page for n in sizes)
        streams, free = set(), list(blocks)
        while free and ready < want:
            block = free.pop(0)
            whole = self._whole(block.address, block.size, block.base, page)
            if block.page != page or 2 * whole < block.size:
                continue
            ask = _ask(block.size, whole, want - ready, page)
            ptr = torch.cuda.caching_allocator_alloc(ask, self.device, stream=block.stream)
            # Best fit may have cut it from another free block the scan describes (`_ask` covers where it starts), or
            # from one it no longer describes, or torch may have mapped new memory: then stop, and read again at the
            # next wake-up.
            if not any(b.address <= ptr and ptr + ask <= b.address + b.size for b in (block, *free)):
                torch.cuda.caching_allocator_delete(ptr)
                break
            self._blocks[ptr] = ask
            streams.add(block.stream)
            base = next(b for b, (end, _) in segments.items() if b <= ptr < end)
            first = base + -(-(ptr - base) // page) * page
            for at in range(first, base + (ptr + ask - base) // page * page, page):
                self._pages.append((at, page, ptr))
                ready += page
            free = [b for b in (block, *free) if not (b.address <= ptr < b.address + b.size)]  # what is still free
        # torch hands a block to the stream it was freed on, ordered after that stream's work; the engine writes
        # it from its own streams: wait for the owners' queued work first.
        for stream in streams:
            (torch.cuda.ExternalStream(stream, device=self.device) if stream
             else torch.cuda.default_stream(self.device)).synchronize()
        return ready

    def release(self, nbytes: int) -> int:
        """Hand back to the driver about `nbytes` of torch's free cached pages, the smallest free blocks first, and
        keep the rest cached (for a later wake-up to lend): `empty_cache` would hand back all of them. The blocks
        to keep are allocated around the call and freed after it. Returns the bytes torch handed back. (A vLLM
        whose wake-up empties torch's cache itself, as 0.31's does, hands back the rest there.)"""
        blocks, _ = self._scan()
        keep, going = [], 0
        for block in reversed(blocks):  # smallest first
            if going < nbytes:
                going += self._whole(block.address, block.size, block.base, block.page)
            else:
                try:
                    keep.append(torch.cuda.caching_allocator_alloc(block.size, self.device, stream=block.stream))
                except torch.OutOfMemoryError:  # the block went meanwhile: torch emptied its cache to retry
                    break
        before = torch.cuda.memory_reserved(self.device)
        try:
            torch.cuda.empty_cache()
        finally:
            for ptr in keep:
                torch.cuda.caching_allocator_delete(ptr)
        return before - torch.cuda.memory_reserved(self.device)

    def map(self, dst: int, size: int, *, zero: bool = False) -> int:
        """Back the engine's reserved range [dst, dst + size) with taken pages, in the order taken, and past them
        with memory of its own (`zero`: written with zeros, as new memory reads, not with what torch left there);
        returns the page bytes mapped."""
        page = self._pages[0][1] if self._pages else 0
        count = min(size // page, len(self._pages)) if page else 0
        fits, self._pages = self._pages[:count], self._pages[count:]
        try:
            vmm.lend(dst, size, [p[0] for p in fits], page or 1, self.device, fill=0 if zero else None)
        except BaseException:
            self._pages = fits + self._pages
            raise
        blocks = [p[2] for p in fits]
        for b in blocks:
            self._used[b] = self._used.get(b, 0) + 1
        self._ranges[dst] = blocks
        return count * page

    def unmap(self, dst: int) -> bool:
        """Unmap a range `map` backed; False if it is not one of this lender's."""
        if dst not in self._ranges:
            return False
        try:
            vmm.unlend(dst, self.device)  # lets go of every piece even when it raises
        finally:
            for b in self._ranges.pop(dst):
                self._used[b] -= 1
        return True

    @property
    def lent(self) -> bool:
        return bool(self._ranges)

    def unmap_all(self) -> None:
        """Unmap every range still lent (before vLLM's own teardown frees them as memory of its own)."""
        for dst in list(self._ranges):
            self.unmap(dst)

    def give_back_unused(self) -> int:
        """Free the taken blocks none of whose pages are mapped; returns their bytes."""
        unused = [b for b in self._blocks if not self._used.get(b)]
        self._pages = [p for p in self._pages if p[2] not in unused]
        return self._free(unused)

    def give_back(self) -> int:
        """Free every taken block; every range must be unmapped first. Returns their bytes."""
        if self._ranges:
            raise RuntimeError(f"{len(self._ranges)} lent ranges are still mapped: unmap them before giving the "
                               "blocks back")
        self._pages = []
        return self._free(list(self._blocks))

    def _free(self, blocks: list[int]) -> int:
        total = 0
        for b in blocks:
            torch.cuda.caching_allocator_delete(b)
            total += self._blocks.pop(b)
            self._used.pop(b, None)
        return total
