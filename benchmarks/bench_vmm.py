"""The page-table floor of a phase switch: what handing device memory between owners costs the CUDA driver.

    python benchmarks/bench_vmm.py [--gib 16] [--repeats 5] [--out OUT.json]

Each cycle, the trainer's freed memory goes back to the driver (torch's `empty_cache`), the driver gives it to vLLM
(the sleep-mode wake-ups create physical memory and map it at the engine's fixed addresses), vLLM gives it back
(sleep) and torch takes it again. A traced 72B step spends most of its switches there
(benchmarks/results/switch_trace_h200x2_72b20l/). This measures, on one GPU, the ways that memory can change hands:

- create + map: `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` per piece (what vLLM's wake-up and torch's
  expandable segments do), for pieces of 2 MiB and 20 MiB (torch's small and large segment pages) and one piece per
  GiB (vLLM maps each allocation whole);
- unmap + release: `cuMemUnmap` + `cuMemRelease` (sleep, `empty_cache`);
- unmap only, then map + access again with the same handles: the cost if the pages stayed with the process and
  only changed addresses, which is what an owner-to-owner hand-over would pay;
- torch with this process's allocator settings: a fresh `torch.empty` of the size after `empty_cache`, and
  `empty_cache` after freeing it;
- the floor of writing the same bytes (`cuMemsetD8` at the device's memory bandwidth), beside the rates above;
- releasing one range while another is created and mapped on a second thread, against the two one after the other
  (`--overlap`, 20 MiB pieces): whether torch's `empty_cache` and an engine's wake-up could run at the same time.

Every mapping is checked: a byte pattern is written through the mapped range and read back, so a measure of a
mapping that does not hold memory fails instead of reading fast. Medians over --repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

MIB = 2**20
GIB = 2**30


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3


class Driver:
    """The CUDA driver's virtual-memory calls on one device, through ctypes (no build step)."""

    def __init__(self, device: int):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.prop = _Prop(type=_PINNED, location=_Location(type=_ON_DEVICE, id=device))
        self.access = _Access(location=_Location(type=_ON_DEVICE, id=device), flags=_READ_WRITE)
        granularity = ctypes.c_size_t()
        self.check(self.cu.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self.prop), 0),
                   "cuMemGetAllocationGranularity")
        self.granularity = granularity.value

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else rc}")

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self.check(self.cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                               ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        return ptr.value

    def free_address(self, base: int, size: int) -> None:
        self.check(self.cu.cuMemAddressFree(ctypes.c_uint64(base), ctypes.c_size_t(size)), "cuMemAddressFree")

    def create(self, size: int) -> int:
        handle = ctypes.c_ulonglong()
        self.check(self.cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop),
                                       ctypes.c_ulonglong(0)), "cuMemCreate")
        return handle.value

    def map(self, ptr: int, size: int, handle: int) -> None:
        self.check(self.cu.cuMemMap(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                    ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0)), "cuMemMap")
        self.check(self.cu.cuMemSetAccess(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(self.access),
                                          ctypes.c_size_t(1)), "cuMemSetAccess")

    def unmap(self, ptr: int, size: int) -> None:
        self.check(self.cu.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size)), "cuMemUnmap")

    def retain(self, ptr: int) -> int:
        handle = ctypes.c_ulonglong()
        self.check(self.cu.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)),
                   "cuMemRetainAllocationHandle")
        return handle.value

    def map_only(self, ptr: int, size: int, handle: int) -> int:
        """cuMemMap without setting access: the driver's result code, not raised (a refusal is a finding)."""
        return self.cu.cuMemMap(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0))

    def set_access(self, ptr: int, size: int) -> None:
        self.check(self.cu.cuMemSetAccess(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(self.access),
                                          ctypes.c_size_t(1)), "cuMemSetAccess")

    def release(self, handle: int) -> None:
        self.check(self.cu.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")

    def fill(self, ptr: int, value: int, size: int) -> None:
        self.check(self.cu.cuMemsetD8_v2(ctypes.c_uint64(ptr), ctypes.c_ubyte(value), ctypes.c_size_t(size)),
                   "cuMemsetD8")
        self.check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def read(self, ptr: int, size: int) -> bytes:
        out = (ctypes.c_ubyte * size)()
        self.check(self.cu.cuMemcpyDtoH_v2(out, ctypes.c_uint64(ptr), ctypes.c_size_t(size)), "cuMemcpyDtoH")
        return bytes(out)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prove_mapped(drv: Driver, base: int, size: int, piece: int, value: int) -> None:
    """Write `value` through the whole range, read a few bytes of each piece back: the mapping holds memory."""
    drv.fill(base, value, size)
    for offset in range(0, size, max(piece, size // 64)):
        got = drv.read(base + offset, 8)
        if got != bytes([value]) * 8:
            raise RuntimeError(f"the mapped range read {got!r} at offset {offset}, not the byte {value} written: the "
                               "measure mapped no memory there")


def hand_over(drv: Driver, size: int, piece: int, repeats: int) -> dict:
    """The driver's ways of giving `size` bytes to an address range in pieces of `piece` and taking them back."""
    base = drv.reserve(size)
    offsets = range(0, size, piece)
    times: dict[str, list[float]] = {"create_map": [], "unmap_release": [], "unmap_only": [], "map_only": []}
    try:
        for rep in range(repeats + 1):
            handles: list[int] = []

            def create_map():
                for off in offsets:
                    handles.append(drv.create(piece))
                    drv.map(base + off, piece, handles[-1])

            t_create = _timed(create_map)
            _prove_mapped(drv, base, size, piece, 0x5A + rep)
            t_unmap = _timed(lambda: [drv.unmap(base + off, piece) for off in offsets])
            t_map = _timed(lambda: [drv.map(base + off, piece, h) for off, h in zip(offsets, handles)])
            _prove_mapped(drv, base, size, piece, 0xA5 - rep)

            def unmap_release():
                for off, h in zip(offsets, handles):
                    drv.unmap(base + off, piece)
                    drv.release(h)

            t_release = _timed(unmap_release)
            if rep:  # the first round warms the driver up
                for key, t in zip(("create_map", "unmap_only", "map_only", "unmap_release"),
                                  (t_create, t_unmap, t_map, t_release)):
                    times[key].append(t)
    finally:
        drv.free_address(base, size)
    return {key: statistics.median(ts) for key, ts in times.items()}


def overlapped(drv: Driver, size: int, piece: int, repeats: int) -> dict:
    """Unmap + release one range of `size` bytes while a second thread creates + maps another ("together"), against
    the same two one after the other ("serial"). Medians of `repeats` after a warm-up, each mapping proved."""
    import threading

    ctx = ctypes.c_void_p()
    drv.check(drv.cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    ranges = [drv.reserve(size), drv.reserve(size)]
    offsets = range(0, size, piece)
    held: list[list[int]] = [[], []]  # each range's handles, mapped in order

    def create_map(k: int) -> None:
        for off in offsets:
            held[k].append(drv.create(piece))
            drv.map(ranges[k] + off, piece, held[k][-1])

    def unmap_release(k: int) -> None:
        while held[k]:
            drv.unmap(ranges[k] + offsets[len(held[k]) - 1], piece)
            drv.release(held[k].pop())

    def on_second_thread(fn, k: int, errors: list) -> threading.Thread:
        def run():
            try:
                drv.check(drv.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
                fn(k)
            except BaseException as exc:  # noqa: BLE001  (raised again on the first thread)
                errors.append(exc)
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    times: dict[str, list[float]] = {"serial": [], "together": []}
    try:
        for rep in range(repeats + 1):
            for way in ("serial", "together"):
                create_map(0)  # what the first owner hands back
                start = time.perf_counter()
                if way == "serial":
                    unmap_release(0)
                    create_map(1)
                else:
                    errors: list = []
                    thread = on_second_thread(create_map, 1, errors)
                    try:
                        unmap_release(0)
                    finally:  # the second thread's mappings are settled before anything gives them back
                        thread.join()
                    if errors:
                        raise errors[0]
                elapsed = time.perf_counter() - start
                _prove_mapped(drv, ranges[1], size, piece, 0x21 + rep)
                unmap_release(1)
                if rep:  # the first round warms the driver up
                    times[way].append(elapsed)
    finally:
        for k in (0, 1):  # what is still mapped goes back, or the range could not be freed
            try:
                unmap_release(k)
                drv.free_address(ranges[k], size)
            except Exception as exc:  # noqa: BLE001  (reported, not raised over the first failure)
                print(f"overlapped: giving range {k} back failed: {exc}", file=sys.stderr)
    return {way: statistics.median(ts) for way, ts in times.items()}


def map_sizes(drv: Driver, sizes: list[int], repeats: int) -> dict:
    """The page-table floor of waking and putting to sleep a sleep-mode pool made of allocations of these `sizes`
    (vLLM's: `swaprl.compat.vllm.sleep_pool_allocations`): one physical allocation per size, rounded up to the
    granularity, created and mapped at consecutive addresses ("create_map": a wake-up's), then unmapped and
    released ("unmap_release": a sleep's). Medians of `repeats` after a warm-up, every mapping proved to hold
    memory."""
    if not sizes:
        raise ValueError("map_sizes: no allocation sizes given")
    if repeats < 1:
        raise ValueError(f"map_sizes: repeats {repeats}; give 1 or more")
    pieces = [-(-n // drv.granularity) * drv.granularity for n in sizes]
    offsets = [0, *itertools.accumulate(pieces)][:-1]
    total = sum(pieces)
    base = drv.reserve(total)
    times: dict[str, list[float]] = {"create_map": [], "unmap_release": []}
    handles: list[int] = []  # created this round, in order
    mapped = 0  # how many of them are mapped

    def create_map():
        nonlocal mapped
        for off, n in zip(offsets, pieces):
            handles.append(drv.create(n))
            drv.map(base + off, n, handles[-1])
            mapped += 1

    def unmap_release():
        nonlocal mapped
        while handles:
            k = len(handles) - 1
            if mapped > k:
                drv.unmap(base + offsets[k], pieces[k])
                mapped -= 1
            drv.release(handles.pop())

    try:
        for rep in range(repeats + 1):
            t_create = _timed(create_map)
            _prove_mapped(drv, base, total, min(pieces), 0x3C + rep)
            t_release = _timed(unmap_release)
            if rep:  # the first round warms the driver up
                times["create_map"].append(t_create)
                times["unmap_release"].append(t_release)
    except BaseException:
        # What is still mapped and created goes back first, or the range could not be freed and the physical memory
        # would stay with the process; a failure of that is reported, not raised over the first.
        try:
            unmap_release()
        except Exception as exc:  # noqa: BLE001
            print(f"map_sizes: giving the memory back after a failure failed too: {exc}", file=sys.stderr)
        raise
    finally:
        if not handles:
            drv.free_address(base, total)
    return {"bytes": total, "allocations": len(pieces), **{k: statistics.median(v) for k, v in times.items()}}


def torch_pages(drv: Driver, base: int, size: int) -> tuple[list[tuple[int, int, int]], bool]:
    """The physical pages under torch memory [base, base + size), as (offset, size, handle) for each page wholly
    inside, one reference retained on each; and whether retaining twice inside one page gave the same handle."""
    g = drv.granularity
    per_granule = [drv.retain(base + off) for off in range(0, size, g)]
    same_twice = drv.retain(base) == per_granule[0]
    drv.release(per_granule[0])
    pages: list[list[int]] = []
    for k, h in enumerate(per_granule):
        if pages and pages[-1][2] == h:
            pages[-1][1] += g
            drv.release(h)  # one reference kept per page
        else:
            pages.append([k * g, g, h])
    return [tuple(p) for p in pages], same_twice


def lend(drv: Driver, size: int, repeats: int) -> dict:
    """torch's own pages mapped at a second address range and unmapped again, the handles retained from torch's
    mappings (`cuMemRetainAllocationHandle`): what a hand-over costs when no physical memory is released or created.
    Each round proves both ways that the two ranges share memory: bytes torch writes read back through the second
    range, and bytes written there read back through torch's tensor."""
    import torch

    held = torch.empty(size, dtype=torch.uint8, device="cuda")
    base = held.data_ptr()
    pages, same_twice = torch_pages(drv, base, size)
    result: dict = {"pages": len(pages), "page_bytes": sorted({p[1] for p in pages}), "same_handle_twice": same_twice,
                    "first_page_offset": pages[0][0]}
    # Can part of a page be mapped (its first granule)? A remainder of an allocation would need it.
    probe = drv.reserve(drv.granularity)
    rc = drv.map_only(probe, drv.granularity, pages[0][2])
    result["prefix_map_rc"] = rc
    if rc == 0:
        drv.unmap(probe, drv.granularity)
    drv.free_address(probe, drv.granularity)
    for _, _, h in pages:
        drv.release(h)
    lent = drv.reserve(size)
    times: dict[str, list[float]] = {k: [] for k in ("retain", "map", "access", "unmap_whole", "unmap_pages",
                                                     "release")}
    try:
        for rep in range(repeats + 1):
            held.fill_(0x30 + rep)
            torch.cuda.synchronize()
            start = time.perf_counter()
            handles = [drv.retain(base + off) for off, _, _ in pages]
            t_retain = time.perf_counter() - start
            t_map = _timed(lambda: [drv.check(drv.map_only(lent + off, n, h), "cuMemMap")
                                    for (off, n, _), h in zip(pages, handles)])
            t_access = _timed(lambda: drv.set_access(lent, size))
            for off in range(0, size, max(size // 64, drv.granularity)):
                got = drv.read(lent + off, 8)
                if got != bytes([0x30 + rep]) * 8:
                    raise RuntimeError(f"the lent range read {got!r} at {off}, not what torch wrote: no shared memory")
            drv.fill(lent, 0x60 + rep, size)
            if not bool((held[:: size // 64] == 0x60 + rep).all()):
                raise RuntimeError("torch's tensor does not see the bytes written through the lent range")
            whole = rep % 2 == 0  # one unmap over every page, or one per page, in turn
            if whole:
                t_unmap = _timed(lambda: drv.unmap(lent, size))
            else:
                t_unmap = _timed(lambda: [drv.unmap(lent + off, n) for off, n, _ in pages])
            t_release = _timed(lambda: [drv.release(h) for h in handles])
            if rep:
                times["retain"].append(t_retain)
                times["map"].append(t_map)
                times["access"].append(t_access)
                times["unmap_whole" if whole else "unmap_pages"].append(t_unmap)
                times["release"].append(t_release)
    finally:
        drv.free_address(lent, size)
    del held
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    torch.cuda.empty_cache()
    result["freed_by_empty_cache"] = torch.cuda.mem_get_info()[0] - free_before
    result.update({k: statistics.median(v) for k, v in times.items() if v})
    return result


def retake(size: int) -> dict:
    """Whether `caching_allocator_alloc` of a free cached block's exact size, on its stream, hands back that block."""
    import torch

    a = torch.empty(size, dtype=torch.uint8, device="cuda")
    b = torch.empty(size + 6 * MIB, dtype=torch.uint8, device="cuda")
    c = torch.empty(size, dtype=torch.uint8, device="cuda")
    where = b.data_ptr()
    del b
    stream = torch.cuda.current_stream()
    start = time.perf_counter()
    ptr = torch.cuda.caching_allocator_alloc(size + 6 * MIB, stream=stream)
    took = time.perf_counter() - start
    torch.cuda.caching_allocator_delete(ptr)
    del a, c
    torch.cuda.empty_cache()
    return {"same_block": ptr == where, "alloc_s": took}


def torch_hand_over(size: int, repeats: int) -> dict:
    """torch's allocator with this process's settings: new pages for a fresh tensor, and `empty_cache` after it."""
    import torch

    fresh, empty = [], []
    for rep in range(repeats + 1):
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t_fresh = time.perf_counter() - start
        t.fill_(rep)  # touched, as a real buffer is
        del t
        torch.cuda.synchronize()
        t_empty = _timed(torch.cuda.empty_cache)
        if rep:
            fresh.append(t_fresh)
            empty.append(t_empty)
    return {"torch_empty_fresh": statistics.median(fresh), "torch_empty_cache": statistics.median(empty)}


def write_floor(drv: Driver, size: int, piece: int, repeats: int) -> float:
    """Seconds to write `size` bytes on the device (one memset over mapped memory): memory bandwidth, no driver."""
    base = drv.reserve(size)
    handles = [drv.create(piece) for _ in range(0, size, piece)]
    try:
        for off, h in zip(range(0, size, piece), handles):
            drv.map(base + off, piece, h)
        drv.fill(base, 1, size)  # warm-up
        ts = [_timed(lambda: drv.fill(base, 2, size)) for _ in range(repeats)]
        for off in range(0, size, piece):
            drv.unmap(base + off, piece)
    finally:
        for h in handles:
            drv.release(h)
        drv.free_address(base, size)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=16.0, help="bytes handed over per measure, in GiB (default 16)")
    ap.add_argument("--pieces-mib", default="2,20,1024", help="piece sizes in MiB (default: torch's 2 and 20, "
                    "and 1024 for vLLM's whole allocations)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--overlap", action="store_true", help="also release one range while a second thread maps "
                    "another (20 MiB pieces, twice --gib free)")
    ap.add_argument("--lend", action="store_true", help="also map torch's own pages at a second address range "
                    "with handles retained from torch's mappings, and unmap them again")
    ap.add_argument("--out", type=Path, help="JSON result; a markdown table with the same stem beside it")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: give 1 or more")
    if args.gib <= 0:
        raise SystemExit(f"--gib {args.gib}: give a positive size")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_vmm measures the CUDA driver's virtual-memory calls: run it on a machine with a "
                         "CUDA GPU")
    torch.cuda.set_device(args.device)
    torch.zeros(1, device="cuda")  # the primary context, current on this thread, as the driver calls need
    drv = Driver(args.device)
    pieces = [int(p) * MIB for p in args.pieces_mib.split(",")]
    bad = [p // MIB for p in pieces if p <= 0 or p % drv.granularity]
    if bad:
        raise SystemExit(f"--pieces-mib: {bad} are not multiples of the device's granularity "
                         f"({drv.granularity // MIB} MiB)")
    step = math.lcm(*pieces)  # every piece size tiles the range exactly
    size = int(args.gib * GIB) // step * step
    if not size:
        raise SystemExit(f"--gib {args.gib}: give at least {step / GIB:.2f} GiB (a whole number of every piece size)")
    free = torch.cuda.mem_get_info()[0]
    ranges = 2 if args.overlap else 1
    if ranges * size > free - 2 * GIB:
        raise SystemExit(f"--gib {args.gib}: {free / GIB:.1f} GiB are free on the GPU; give at most "
                         f"{max(free / GIB - 2, 0) / ranges:.1f}{' with --overlap' if args.overlap else ''}")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bytes": size,
              "granularity": drv.granularity, "repeats": args.repeats,
              "write_floor_s": write_floor(drv, size, max(pieces), args.repeats),
              "pieces": {str(p // MIB): hand_over(drv, size, p, args.repeats) for p in pieces}}
    if args.overlap:
        piece = 20 * MIB if size % (20 * MIB) == 0 else max(pieces)
        result["overlap"] = {"piece": piece, **overlapped(drv, size, piece, args.repeats)}
    result.update(torch_hand_over(size, args.repeats))
    if args.lend:
        result["lend"] = lend(drv, size, args.repeats)
        result["retake"] = retake(GIB)
    text = markdown(result)
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text)
    return result


def markdown(r: dict) -> str:
    gib = r["bytes"] / GIB

    def row(what, s):
        return f"| {what} | {1e3 * s:.1f} | {1e3 * s / gib:.2f} | {s / r['write_floor_s']:.1f}x |"

    out = [f"{r['gpu']}, torch {r['torch']}: {gib:.0f} GiB handed over, median of {r['repeats']} after a warm-up; "
           f"floor: writing the same bytes once ({1e3 * r['write_floor_s']:.1f} ms).", "",
           "| way | ms | ms per GiB | against the write floor |", "|---|---:|---:|---:|"]
    for piece, t in r["pieces"].items():
        out += [row(f"create + map + access, {piece} MiB pieces", t["create_map"]),
                row(f"unmap + release, {piece} MiB pieces", t["unmap_release"]),
                row(f"unmap only (handles kept), {piece} MiB pieces", t["unmap_only"]),
                row(f"map + access with kept handles, {piece} MiB pieces", t["map_only"])]
    out += [row("torch.empty, fresh pages", r["torch_empty_fresh"]),
            row("torch.cuda.empty_cache", r["torch_empty_cache"])]
    if "overlap" in r:
        o, mib = r["overlap"], r["overlap"]["piece"] // MIB
        out += [row(f"release one range, then create + map another, {mib} MiB pieces", o["serial"]),
                row(f"the same on two threads at once, {mib} MiB pieces", o["together"])]
    if "lend" in r:
        ln = r["lend"]
        out += [row(f"retain torch's page handles ({ln['pages']} pages)", ln["retain"]),
                row("map them at a second range (no access yet)", ln["map"]),
                row("set access over the whole second range, one call", ln["access"])]
        out += [row(f"unmap {what}", ln[key]) for what, key in (("every page in one call", "unmap_whole"),
                                                                ("page by page", "unmap_pages")) if key in ln]
        out += [row("release the retained handles", ln["release"]), "",
                f"torch's pages: {[b // MIB for b in ln['page_bytes']]} MiB, the first at offset "
                f"{ln['first_page_offset']}; "
                f"the same handle retained twice: {ln['same_handle_twice']}; mapping one granule of a page: "
                f"rc {ln['prefix_map_rc']}; freed by empty_cache after: {ln['freed_by_empty_cache'] / GIB:.2f} GiB; "
                f"caching_allocator_alloc gave the freed block back: {r['retake']['same_block']}."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
