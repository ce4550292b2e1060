"""The weight check's costs on one GPU: the fingerprint kernel against reading memory, one side of a check over a
whole model's tensors, and reading its result back while a transition's device-to-host copies are queued.

    python benchmarks/bench_fingerprint.py --out benchmarks/results/verify_cost_h100/fingerprint.json
    python benchmarks/bench_fingerprint.py --models qwen2.5-1.5b,qwen2.5-7b,qwen2.5-72b:20 --out models.json

1. Kernel: `swaprl.fingerprint.fold_into` over a `--gib` GiB tensor of each dtype, against the floor of reading
   those bytes once at the device's copy rate in bytes moved (read + write), measured in the same run.
2. Models (`--models`, then only this part): `fold_into` over every tensor of a model as the trainer holds them
   (q, k and v apart; random bits), bf16, and fp32 cast to bf16 (master weights) where they fit, against the floor
   of the bytes it moves (reads, and the cast's write and read back) at the device's copy rate. `NAME:LAYERS` cuts
   the depth. What a check costs beyond reading memory is here: one launch per tensor cost ~35 us each.
3. Readback: `--queued-gib` GiB of device-to-host copies are queued on a side stream (as `start_offload` queues the
   optimizer's states), then a 1 GiB bf16 tensor is fingerprinted on the compute stream and its result read with
   `tolist()` (a device-to-host copy, behind the queued ones) and with `swaprl.readback.to_list` (stores into
   page-locked memory). Floor: the fingerprint kernel alone. The queued copies' own time is reported next to it.
4. Cold (`--cold`): the first check of a fresh process with an empty Triton cache, over Qwen2.5-1.5B's tensors
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
from swaprl.presets import get_preset
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
        x = None  # freed before the next dtype's tensor
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
        folder = fingerprint._Folder(out, use_kernel=True)
        folder.add(x, 0)
        folder.flush()
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


def _model_tensors(name: str, device: torch.device, *, layers: int | None = None, dtype=torch.bfloat16,
                   fp32_layers: int = 0) -> list[torch.Tensor]:
    """A Qwen2.5 preset's weights as the trainer holds them (q, k and v apart), random bits; the first
    `fp32_layers` layers in fp32 whatever `dtype`."""
    p = get_preset(name)
    h, m, kv = p.hidden_size, p.intermediate_size, p.num_key_value_heads * p.head_dim
    layer = [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h), (m, h), (m, h), (h, m), (h,), (h,)]
    shapes = [(p.vocab_size, h)] + [(p.vocab_size, h)] * (not p.tie_word_embeddings)
    tensors = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
    for i in range(p.num_hidden_layers if layers is None else layers):
        tensors += [torch.empty(s, dtype=torch.float32 if i < fp32_layers else dtype, device=device) for s in layer]
    tensors.append(torch.empty(h, dtype=dtype, device=device))
    for t in tensors:
        t.view(torch.uint8).random_()
    return tensors


def model_rows(models: list[str], repeats: int, rate_GBps: float) -> list[dict]:
    rows = []
    free = torch.cuda.mem_get_info()[0]
    for spec in models:
        name, _, layers = spec.partition(":")
        for dtype in (torch.bfloat16, torch.float32):
            p = get_preset(name)
            n = p.num_parameters(int(layers) if layers else None)
            if n * dtype.itemsize > 0.8 * free:
                print(f"models {spec} {dtype}: {n * dtype.itemsize / 2**30:.1f} GiB does not fit, skipped", flush=True)
                continue
            tensors = _model_tensors(name, torch.device("cuda"), layers=int(layers) if layers else None, dtype=dtype)
            casts = [torch.bfloat16 if t.dtype != torch.bfloat16 else None for t in tensors]
            fingerprint.fold_into(tensors[:2], cast=casts[:2])  # compile
            seconds = median_s(lambda: fingerprint.fold_into(tensors, cast=casts), repeats)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            moved = nbytes + (4 * n if dtype != torch.bfloat16 else 0)  # a cast writes bf16 and reads it back
            floor = moved / (rate_GBps * 1e9)
            rows.append({"model": spec, "dtype": str(dtype), "cast_to": "torch.bfloat16" if dtype != torch.bfloat16
                         else None, "tensors": len(tensors), "bytes": nbytes, "bytes_moved": moved,
                         "seconds": seconds, "floor_s": floor, "ratio": floor / seconds})
            print(f"models {spec:<16} {str(dtype):<15} {len(tensors):4d} tensors {nbytes / 1e9:6.2f} GB "
                  f"{seconds * 1e3:8.2f} ms  floor {floor * 1e3:7.2f} ms  floor/time {floor / seconds:.2f}", flush=True)
            tensors = None  # freed before the next
            torch.cuda.empty_cache()
    return rows


def _compiled(cache: Path) -> dict[str, int]:
    return dict(collections.Counter(p.stem for p in cache.rglob("*.cubin")))


def cold_child(warm: bool, repeats: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    # Qwen2.5-1.5B, the first two layers fp32 cast to bf16 (master weights), and a few views that start off 16 bytes.
    tensors = _model_tensors("qwen2.5-1.5b", device, fp32_layers=2)
    casts = [torch.bfloat16 if t.dtype == torch.float32 else None for t in tensors]
    for t in tensors[1:4]:
        tensors.append(t.reshape(-1)[3:])
        casts.append(None)
    torch.cuda.synchronize()
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    warm_s = 0.0
    if warm:
        t0 = time.perf_counter()
        fingerprint.warm_up(device).join()
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
    ap.add_argument("--models", default=None, help="only the whole-model part (2): comma-separated presets, "
                    "NAME:LAYERS to cut the depth")
    ap.add_argument("--cold", action="store_true", help="only the cold first check (part 4)")
    ap.add_argument("--cold-child", type=int, choices=(0, 1), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import triton

    if args.cold_child is not None:
        print(json.dumps(cold_child(bool(args.cold_child), args.repeats)))
        return {}
    if args.models:
        result = {"benchmark": "fingerprint_models", "d2d_read_write_GBps": (rate := device_copy_GBps()),
                  "models": model_rows(args.models.split(","), args.repeats, rate),
                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
        return _save(args.out, result)
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
