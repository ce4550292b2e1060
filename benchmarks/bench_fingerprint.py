"""The weight check's two costs on one GPU: the fingerprint kernel against reading memory, and reading its result
back while a transition's device-to-host copies are queued.

    python benchmarks/bench_fingerprint.py --out benchmarks/results/verify_cost_h100/fingerprint.json

1. Kernel: `swaprl.fingerprint.fold_into` over a `--gib` GiB tensor of each dtype, against the floor of reading
   those bytes once at the device's copy rate in bytes moved (read + write), measured in the same run.
2. Readback: `--queued-gib` GiB of device-to-host copies are queued on a side stream (as `start_offload` queues the
   optimizer's states), then a 1 GiB bf16 tensor is fingerprinted on the compute stream and its result read with
   `tolist()` (a device-to-host copy, behind the queued ones) and with `swaprl.readback.to_list` (stores into
   page-locked memory). Floor: the fingerprint kernel alone. The queued copies' own time is reported next to it.
3. Cold (`--cold`): the first check of a fresh process with an empty Triton cache, over Qwen2.5-1.5B's tensors
   (bf16; two layers fp32 cast to bf16 as with master weights; a few views at odd offsets), with and without
   `fingerprint.warm_up` run to completion first (at attach it runs under the engine's start). Each in a child
   process; reported: the warm-up's time, the first check, the steady check (median of `--repeats`), and the
   kernel variants Triton compiled (its cache's `*.cubin` files) after the warm-up and after the first check.

Medians of `--repeats` after one warm-up.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
        fingerprint.fold_into([x[:64]])  # compile for this width
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


def _qwen_1_5b_tensors(device: torch.device) -> tuple[list[torch.Tensor], list[torch.dtype | None]]:
    """Qwen2.5-1.5B's weights as a check sees them (hidden 1536, MLP 8960, 2 KV heads of 128, vocabulary 151936, 28
    layers), random bits; the first two layers fp32 with a cast to bf16; a few views that start off 16 bytes."""
    h, m, kv, vocab = 1536, 8960, 256, 151936
    layer = [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h), (m, h), (m, h), (h, m), (h,), (h,)]
    tensors, casts = [torch.empty(vocab, h, dtype=torch.bfloat16, device=device)], [None]
    for i in range(28):
        dtype = torch.float32 if i < 2 else torch.bfloat16
        for shape in layer:
            tensors.append(torch.empty(shape, dtype=dtype, device=device))
            casts.append(torch.bfloat16 if dtype == torch.float32 else None)
    for t in tensors:
        t.view(torch.uint8).random_()
    for t in tensors[1:4]:
        tensors.append(t.reshape(-1)[3:])
        casts.append(None)
    return tensors, casts


def _compiled(cache: Path) -> dict[str, int]:
    return dict(collections.Counter(p.stem for p in cache.rglob("*.cubin")))


def cold_child(warm: bool, repeats: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    tensors, casts = _qwen_1_5b_tensors(device)
    torch.cuda.synchronize()
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    warm_s = 0.0
    if warm:
        t0 = time.perf_counter()
        fingerprint.warm_up(device)
        fingerprint._warm_ups[device].join()
        warm_s = time.perf_counter() - t0
    after_warm = _compiled(cache)
    t0 = time.perf_counter()
    fingerprint.fold_into(tensors, cast=casts)
    first = time.perf_counter() - t0
    after_first = _compiled(cache)
    steady = statistics.median(_timed(lambda: fingerprint.fold_into(tensors, cast=casts)) for _ in range(repeats))
    return {"warm_up": warm, "warm_up_s": warm_s, "first_s": first, "steady_s": steady, "first_over_steady":
            first / steady, "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "compiled_after_warm_up": after_warm, "compiled_after_first": after_first}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cold_rows(repeats: int) -> list[dict]:
    rows = []
    for warm in (False, True):
        with tempfile.TemporaryDirectory() as cache:
            proc = subprocess.run([sys.executable, __file__, "--cold-child", str(int(warm)), "--repeats",
                                   str(repeats)], env=dict(os.environ, TRITON_CACHE_DIR=cache),
                                  capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"cold child failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"cold, warm-up {'run first' if warm else 'not run'}: warm-up {row['warm_up_s']:.2f} s, first check "
              f"{row['first_s']:.3f} s, steady {row['steady_s'] * 1e3:.1f} ms ({row['first_over_steady']:.1f}x); "
              f"compiled after the warm-up {row['compiled_after_warm_up']}, after the first check "
              f"{row['compiled_after_first']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--queued-gib", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cold", action="store_true", help="only the cold first check (part 3)")
    ap.add_argument("--cold-child", type=int, choices=(0, 1), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import triton

    if args.cold_child is not None:
        print(json.dumps(cold_child(bool(args.cold_child), args.repeats)))
        return {}
    if args.cold:
        result = {"benchmark": "fingerprint_cold", "cold": cold_rows(args.repeats),
                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
        return _save(args.out, result)

    rate = device_copy_GBps()
    result = {"benchmark": "fingerprint", "d2d_read_write_GBps": rate,
              "kernel": kernel_rows(args.gib, args.repeats, rate),
              "readback": readback_rows(args.queued_gib, args.repeats),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    return _save(args.out, result)


def _save(out: str | None, result: dict) -> dict:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
