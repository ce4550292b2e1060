"""The weight check's two costs on one GPU: the fingerprint kernel against reading memory, and reading its result
back while a transition's device-to-host copies are queued.

    python benchmarks/bench_fingerprint.py --out benchmarks/results/verify_cost_h100/fingerprint.json

1. Kernel: `swaprl.fingerprint.fold_into` over a `--gib` GiB tensor of each dtype, against the floor of reading
   those bytes once at the device's copy rate in bytes moved (read + write), measured in the same run.
2. Readback: `--queued-gib` GiB of device-to-host copies are queued on a side stream (as `start_offload` queues the
   optimizer's states), then a 1 GiB bf16 tensor is fingerprinted on the compute stream and its result read with
   `tolist()` (a device-to-host copy, behind the queued ones) and with `swaprl.readback.to_list` (stores into
   page-locked memory). Floor: the fingerprint kernel alone. The queued copies' own time is reported next to it.

Medians of `--repeats` after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from swaprl import fingerprint
from swaprl.readback import to_list

from bench_transitions import device_copy_GBps


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def kernel_rows(gib: float, repeats: int, rate_GBps: float) -> list[dict]:
    rows = []
    n = int(gib * 2**30)
    for dtype in (torch.bfloat16, torch.float32, torch.uint8):
        size = torch.empty(0, dtype=dtype).element_size()
        x = torch.empty(n // size, dtype=dtype, device="cuda")
        x.view(torch.uint8).random_()
        fingerprint.fold_into([x[:8]])  # compile for this width
        seconds = median_s(lambda: fingerprint.fold_into([x]), repeats)
        floor = n / (rate_GBps * 1e9)  # one read of the bytes, at the copy's rate in bytes moved (read + write)
        rows.append({"dtype": str(dtype), "bytes": n, "seconds": seconds, "floor_s": floor, "ratio": floor / seconds,
                     "GBps": n / seconds / 1e9})
        print(f"fingerprint {str(dtype):<16} {n / 2**30:.1f} GiB  {seconds * 1e3:8.3f} ms  floor {floor * 1e3:.3f} ms "
              f" floor/time {floor / seconds:.2f}", flush=True)
        del x
    return rows


def readback_rows(queued_gib: float, repeats: int) -> list[dict]:
    nbytes = int(queued_gib * 2**30)
    chunk = 128 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    x.view(torch.int16).random_()

    def check(read) -> None:
        out = torch.zeros(1, dtype=torch.int64, device="cuda")
        fingerprint._fold_triton(x, out)
        read(out)

    def under_queued_copies(read) -> tuple[float, float]:
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            for lo in range(0, nbytes, chunk):
                host[lo: lo + chunk].copy_(src[lo: lo + chunk], non_blocking=True)
        t1 = time.perf_counter()
        check(read)
        t2 = time.perf_counter()
        side.synchronize()
        return t2 - t1, time.perf_counter() - t0

    rows = []
    alone = median_s(lambda: check(to_list), repeats)
    for name, read in (("tolist", lambda t: t.tolist()), ("readback.to_list", to_list)):
        under_queued_copies(read)  # warm-up
        runs = [under_queued_copies(read) for _ in range(repeats)]
        seconds = statistics.median(r[0] for r in runs)
        copies = statistics.median(r[1] for r in runs)
        rows.append({"read": name, "seconds": seconds, "alone_s": alone, "ratio": alone / seconds,
                     "queued_bytes": nbytes, "queued_copies_s": copies})
        print(f"fingerprint 1 GiB + read with {name:<17} under {queued_gib:.0f} GiB of queued copies: "
              f"{seconds * 1e3:8.3f} ms (alone {alone * 1e3:.3f} ms, alone/time {alone / seconds:.2f}); the copies "
              f"took {copies:.3f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--queued-gib", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import triton

    rate = device_copy_GBps()
    result = {"benchmark": "fingerprint", "d2d_read_write_GBps": rate,
              "kernel": kernel_rows(args.gib, args.repeats, rate),
              "readback": readback_rows(args.queued_gib, args.repeats),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
