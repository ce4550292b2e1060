"""What one reading of torch's allocator statistics costs on a GPU: idle, with device work queued, with many blocks
cached, and beside a sampler thread reading them every 20 ms (as the memory profiler does). A phase switch reads them
a few times; the figure tells a reading's own cost from a wait for something else.

    python benchmarks/bench_memory_stats.py OUT.json     # on one GPU (CUDA_VISIBLE_DEVICES=0)

Medians (and maxima) of repeated calls, in ms; the floor to compare with is `idle_raw_C`, the C call alone.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch


def timed(fn, n: int = 50) -> dict[str, float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"median_ms": times[len(times) // 2] * 1e3, "max_ms": times[-1] * 1e3}


def behind_queued_work(fn, n: int = 5) -> dict[str, float]:
    """`fn` timed right after a kernel of about 100 ms is queued: whether it waits for the device."""
    times = []
    for _ in range(n):
        torch.cuda._sleep(int(2e8))
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    times.sort()
    return {"median_ms": times[n // 2] * 1e3}


def main(out: str) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench_memory_stats measures torch's CUDA allocator: run it on a machine with a CUDA GPU")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    res = {"torch": torch.__version__, "name": torch.cuda.get_device_name(0),
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    torch.cuda.synchronize()
    res["idle_memory_stats"] = timed(lambda: torch.cuda.memory_stats(dev))
    res["idle_memory_reserved"] = timed(lambda: torch.cuda.memory_reserved(dev))
    res["idle_raw_C"] = timed(lambda: torch._C._cuda_memoryStats(0))
    res["idle_mem_get_info"] = timed(lambda: torch.cuda.mem_get_info(dev))
    res["queued_memory_stats"] = behind_queued_work(lambda: torch.cuda.memory_stats(dev))
    res["queued_mem_get_info"] = behind_queued_work(lambda: torch.cuda.mem_get_info(dev))
    start = time.perf_counter()
    torch.cuda._sleep(int(2e8))
    torch.cuda.synchronize()
    res["sleep_kernel_ms"] = (time.perf_counter() - start) * 1e3
    # Many blocks cached: 20,000 small ones (every other one freed) and 40 of 256 MiB.
    small = [torch.empty(int(1e5) + (i % 64) * 512, device=dev, dtype=torch.uint8) for i in range(20000)]
    big = [torch.empty(2**28, device=dev, dtype=torch.uint8) for _ in range(40)]
    del small[::2]
    res["blocks_memory_stats"] = timed(lambda: torch.cuda.memory_stats(dev))
    res["blocks_memory_snapshot"] = timed(lambda: torch.cuda.memory_snapshot(), n=5)
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            torch.cuda.memory_allocated(dev)
            torch.cuda.memory_reserved(dev)
            time.sleep(0.02)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    res["beside_sampler_memory_stats"] = timed(lambda: torch.cuda.memory_stats(dev), n=200)

    def churn() -> None:  # the main thread allocating and freeing, beside the sampler and alone
        for _ in range(2000):
            a = torch.empty(4096, device=dev)
            del a

    res["churn_with_sampler_ms"] = timed(churn, n=5)["median_ms"]
    stop.set()
    thread.join()
    res["churn_alone_ms"] = timed(churn, n=5)["median_ms"]
    del big, small
    torch.cuda.empty_cache()
    print(json.dumps(res, indent=1))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "memory_stats.json")
