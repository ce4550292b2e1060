"""How fast host memory can be page-locked for the swaps, by method, against the host's own write floor.

    python benchmarks/bench_host_lock.py --gib 16 --out benchmarks/results/cold_start_h100/host_lock_h100.json

Locking fresh host memory costs two things: faulting every page in (the kernel zeroes each one) and pinning it for
the GPU (`cudaHostRegister`). Methods, each on fresh memory (`torch.empty`: an untouched anonymous mapping):

  pin_memory           torch.empty(pin_memory=True): torch's caching host allocator
  register             cudaHostRegister on untouched memory (the driver faults the pages in, one thread)
  touchN+register      the pages written by N threads first (torch's parallel zero_), then cudaHostRegister
  thp+touchN+register  the same with transparent huge pages asked for (madvise MADV_HUGEPAGE) before the touch
  touchN+registerK     touched by N threads, then registered as K chunks by K threads at once (one registration
                       per chunk; the copy below straddles a chunk boundary: the driver refuses it, so one
                       registration per buffer is what a buffer copied as one range must use)

The floor is the host's write bandwidth measured in the same run: zero_ over memory whose pages are already in,
with every thread (faulting a page in must at least write it). Each method runs once on 1 GiB as a warm-up, then
`--repeats` times on `--gib`; the table shows medians (GB/s of the whole lock, and of its touch and register
parts), the ratio floor/method, and the pinned copy speed out of each buffer (it must match: a buffer that is not
really locked copies at pageable speed). It ends with one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import platform
import statistics
import time

import torch

from bench_offload import emit

MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(None, use_errno=True)


def _register(buf: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def _unregister(buf: torch.Tensor, method: str) -> None:
    chunks = int(method.split("register")[1] or 1)
    step = (buf.numel() // chunks + 4095) // 4096 * 4096
    for i in range(0, buf.numel(), step):
        torch.cuda.cudart().cudaHostUnregister(buf[i:].data_ptr())


def _huge_pages(buf: torch.Tensor) -> None:
    """Ask for transparent huge pages over the 2 MiB-aligned inside of `buf`."""
    page = 2 << 20
    start = (buf.data_ptr() + page - 1) // page * page
    end = (buf.data_ptr() + buf.numel()) // page * page
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")


def _touch(buf: torch.Tensor, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf.zero_()
    finally:
        torch.set_num_threads(before)


def lock(method: str, nbytes: int) -> tuple[torch.Tensor, bool, dict[str, float]]:
    """A locked buffer of `nbytes` made by `method`, whether it must be unregistered, and its parts' seconds."""
    parts: dict[str, float] = {}
    t0 = time.perf_counter()
    if method == "pin_memory":
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        parts["total"] = time.perf_counter() - t0
        return buf, False, parts
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if method.startswith("thp+"):
        _huge_pages(buf)
    if "touch" in method:
        threads = int(method.split("touch")[1].split("+")[0])
        _touch(buf, threads)
        parts["touch"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    chunks = int(method.split("register")[1] or 1)
    if chunks == 1:
        _register(buf)
    else:
        from concurrent.futures import ThreadPoolExecutor

        step = (nbytes // chunks + 4095) // 4096 * 4096
        with ThreadPoolExecutor(chunks) as pool:  # cudaHostRegister releases the GIL
            list(pool.map(_register, [buf[i: i + step] for i in range(0, nbytes, step)]))
    parts["register"] = time.perf_counter() - t1
    parts["total"] = time.perf_counter() - t0
    return buf, True, parts


def copy_GBps(host: torch.Tensor, dev: torch.Tensor) -> float:
    """H2D GB/s of a copy from the middle of `host` (across chunk boundaries where it was registered in chunks)."""
    mid = (host.numel() - dev.numel()) // 2
    src = host[mid: mid + dev.numel()]
    dev.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    dev.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return dev.numel() / (time.perf_counter() - t) / 1e9


def write_floor_GBps(nbytes: int, repeats: int) -> float:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.zero_()  # pages in
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.zero_()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,4,8,16", help="touch thread counts to try")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the methods (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_lock needs a CUDA GPU: page-locking is for the GPU's copies")
    torch.zeros(1, device="cuda")  # a live context: registration is per context
    nbytes = int(args.gib * 2**30)
    threads = [int(t) for t in args.threads.split(",")]
    methods = (["pin_memory", "register"] + [f"touch{t}+register" for t in threads]
               + [f"thp+touch{t}+register" for t in threads[-2:]] + [f"touch{threads[-1]}+register{k}" for k in (4, 8)])
    if args.methods:
        methods = [m for m in methods if m in args.methods.split(",")]
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    floor = write_floor_GBps(nbytes, args.repeats)
    rows = {}
    for method in methods:
        runs, errors = [], None
        for size in [1 << 30] + [nbytes] * args.repeats:  # the first: warm-up
            buf, registered, parts = lock(method, size)
            speed = None
            if size == nbytes:
                try:
                    speed = copy_GBps(buf, dev)
                except RuntimeError as exc:  # torch.AcceleratorError: a copy across two registrations
                    errors = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            if registered:
                _unregister(buf, method)
            del buf
            if method == "pin_memory":  # its caching allocator would hand the same block back: measure a new one
                empty = getattr(torch._C, "_host_emptyCache", None) or torch._C._accelerator_emptyHostCache
                empty()
            if size == nbytes:
                runs.append((parts, speed))
        total = statistics.median(p["total"] for p, _ in runs)
        speeds = [s for _, s in runs if s is not None]
        row = {"seconds": total, "GBps": nbytes / total / 1e9, "floor_ratio": (nbytes / floor / 1e9) / total,
               "h2d_GBps": statistics.median(speeds) if speeds else None, "copy_error": errors}
        for part in ("touch", "register"):
            if part in runs[0][0]:
                row[f"{part}_GBps"] = nbytes / statistics.median(p[part] for p, _ in runs) / 1e9
        rows[method] = row
        print(f"{method:24s} {row['seconds']:7.2f} s  {row['GBps']:6.2f} GB/s  floor/method {row['floor_ratio']:.2f}"
              f"  touch {row.get('touch_GBps', float('nan')):6.2f}"
              f"  register {row.get('register_GBps', float('nan')):6.2f}"
              f"  H2D from it {row['h2d_GBps'] or float('nan'):5.1f} GB/s {errors or ''}", flush=True)
    result = {"bench": "host_lock", "gib": args.gib, "repeats": args.repeats, "write_floor_GBps": floor,
              "methods": rows, "cpu_threads": torch.get_num_threads(), "page_size": mmap.PAGESIZE,
              "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version()}
    print(f"write floor {floor:.2f} GB/s")
    return emit(result, args.out)


if __name__ == "__main__":
    main()
