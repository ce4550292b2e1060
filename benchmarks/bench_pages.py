"""What the page size of torch's expandable segments (`large_segment_size_mb`) costs an engine that wakes on them.

    python benchmarks/bench_pages.py [--mib 20,64,256,512] [--gib 15] [--out OUT.json]     # one GPU

A lending engine's wake-up maps torch's pages at its own addresses and its sleep unmaps them, one driver call per
page (swaprl.lending). For each page size, in a process of its own started with
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,large_segment_size_mb:N`, this measures:

- the page torch maps (`vmm.page_bytes` at the segment's start), which says torch took the setting;
- bench_vmm's `lend`: the driver's calls alone, per kind (retain, map, access, unmap, release) over torch's pages;
- swaprl's own path: `PageLender.take`, `map` (and `map` with the zero fill a KV cache gets), `unmap`, `give_back`
  of torch's free cached pages to a reserved range of the same size;
- what the page size costs torch itself: a fresh `torch.empty` of the size, its `empty_cache`, and the memory
  reserved for three 3 MiB tensors (one page at least).

Medians of 5 after a warm-up. The floor of a hand-over is writing the bytes once (bench_vmm's write floor); the
figures here are for choosing the page size, whose cost is per mapping, not per byte.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GIB, MIB = 2**30, 2**20
HERE = Path(__file__).resolve().parent


def measure(mib: int, size: int) -> dict:
    """One page size, in this process (started with that allocator setting)."""
    import torch

    sys.path.insert(0, str(HERE))
    import bench_vmm

    from swaprl import vmm
    from swaprl.lending import PageLender

    torch.cuda.set_device(0)
    held = torch.empty(size, dtype=torch.uint8, device="cuda")
    segment = next(s for s in torch.cuda.memory_snapshot()
                   if s["address"] <= held.data_ptr() < s["address"] + s["total_size"])
    out = {"mib": mib, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "bytes": size,
           "page_bytes": vmm.page_bytes(segment["address"], 2**31, 0)}
    del held
    drv = bench_vmm.Driver(0)
    out["driver"] = bench_vmm.lend(drv, size, 5)
    torch.empty(size, dtype=torch.uint8, device="cuda")  # freed at once: torch's cached pages to lend
    lender, dst = PageLender(0), drv.reserve(size)
    times: dict[str, list[float]] = {"take": [], "map": [], "map_zero": [], "unmap": [], "give_back": []}
    try:
        for rep in range(6):
            for zero in (False, True):
                t0 = time.perf_counter()
                ready = lender.take([size])
                t1 = time.perf_counter()
                lender.map(dst, size, zero=zero)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                lender.unmap(dst)
                t3 = time.perf_counter()
                lender.give_back()
                t4 = time.perf_counter()
                if rep:
                    times["take"].append(t1 - t0)
                    times["map_zero" if zero else "map"].append(t2 - t1)
                    times["unmap"].append(t3 - t2)
                    times["give_back"].append(t4 - t3)
    finally:
        drv.free_address(dst, size)
    out["lent_bytes"] = ready
    out["swaprl"] = {k: statistics.median(v) for k, v in times.items()}
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fresh = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    out["torch_empty_fresh_s"] = time.perf_counter() - t0
    del fresh
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    out["torch_empty_cache_s"] = time.perf_counter() - t0
    small = [torch.empty(3 * MIB, dtype=torch.uint8, device="cuda") for _ in range(3)]
    out["reserved_for_three_3mib"] = torch.cuda.memory_reserved()
    del small
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", default="20,64,256,512", help="page sizes in MiB (default 20,64,256,512)")
    ap.add_argument("--gib", type=float, default=15.0, help="bytes lent per measure, in GiB, rounded down to a "
                    "whole number of every page size (default 15)")
    ap.add_argument("--out", type=Path, help="JSON result")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(m) for m in args.mib.split(",")]
    if any(m < 2 or m % 2 for m in sizes):
        raise SystemExit(f"--mib {args.mib}: give even sizes of 2 MiB or more (the device's granularity is 2 MiB)")
    step = math.lcm(*sizes)
    size = int(args.gib * GIB) // (step * MIB) * step * MIB
    if not size:
        raise SystemExit(f"--gib {args.gib}: give at least {step / 1024:.2f} GiB (a whole number of every page size)")
    if args.child is not None:
        print("RESULT " + json.dumps(measure(args.child, size)), flush=True)
        return []
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_pages measures torch's pages on a CUDA GPU: run it on a machine with one")
    results = []
    for mib in sizes:
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:True,large_segment_size_mb:{mib}"}
        proc = subprocess.run([sys.executable, __file__, "--child", str(mib), "--gib", str(args.gib),
                               "--mib", args.mib], env=env, capture_output=True, text=True, timeout=600, check=False)
        got = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(got[0]) if got else {"mib": mib, "rc": proc.returncode,
                                                          "error": proc.stderr[-2000:]})
        print(json.dumps(results[-1])[:400], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
