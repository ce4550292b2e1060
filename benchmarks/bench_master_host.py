"""Host memory of `swaprl.attach` with fp32 master weights, against its floor: the masters' own bytes.

    python benchmarks/bench_master_host.py --out benchmarks/results/master_host_cpu

Loads a random model of `--preset` in bf16 on the CPU, then attaches it with `SwapConfig(master_weights=True)` and
samples the process's resident memory (RSS) every 5 ms while attach runs. The masters (4 bytes per parameter) must
be in host memory once attach returns, so their bytes are the floor of the growth; a growth near twice that would
mean they were held twice on the way into the pinned buffer. The AdamW states' part of the buffer is laid out at
attach but written only by the first step, so its untouched pages are not resident yet. On the CPU the "device"
is host memory too: the model's bf16 parameters are in the baseline, before attach.
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from pathlib import Path

import psutil
import torch

import swaprl
from swaprl.checkpoints import random_model

GiB = 2**30


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    model = random_model(args.preset, dtype=torch.bfloat16, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    n = sum(p.numel() for p in model.parameters())
    proc = psutil.Process()
    before = proc.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    rt = swaprl.attach(model, optimizer, config=swaprl.SwapConfig(master_weights=True))
    seconds = time.perf_counter() - t
    done.set()
    sampler.join()
    after = proc.memory_info().rss
    floor = 4 * n
    result = {
        "benchmark": "master_host", "preset": args.preset, "parameters": n, "attach_seconds": seconds,
        "rss_before_bytes": before, "rss_after_bytes": after, "rss_peak_bytes": peak[0],
        "growth_after_bytes": after - before, "growth_peak_bytes": peak[0] - before, "floor_bytes": floor,
        "peak_ratio_to_floor": (peak[0] - before) / floor, "host_buffers_bytes": rt.status()["host_buffers"]["bytes"],
        "hardware": {"cpu": platform.processor() or platform.machine(), "cores": psutil.cpu_count(),
                     "memory_bytes": psutil.virtual_memory().total},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "swaprl": swaprl.__version__},
    }
    swaprl.detach()
    print(json.dumps(result))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "master_host.json").write_text(json.dumps(result, indent=1))
        (out / "README.md").write_text(
            f"# Host memory of attach with fp32 master weights ({args.preset}, CPU)\n\n"
            f"Command: `python benchmarks/bench_master_host.py --preset {args.preset} --out {args.out}`\n\n"
            f"Hardware: {result['hardware']['cores']} cores, {result['hardware']['memory_bytes'] / GiB:.1f} GiB. "
            f"Software: Python {result['versions']['python']}, torch {result['versions']['torch']}. "
            "One run (attach happens once per process; no warm-up applies).\n\n"
            f"| parameters | masters (floor) | RSS growth at peak | ratio to floor | growth after attach | "
            f"host buffers laid out | attach s |\n|---|---|---|---|---|---|---|\n"
            f"| {n / 1e9:.2f} B | {floor / GiB:.2f} GiB | {result['growth_peak_bytes'] / GiB:.2f} GiB | "
            f"{result['peak_ratio_to_floor']:.2f} | {result['growth_after_bytes'] / GiB:.2f} GiB | "
            f"{result['host_buffers_bytes'] / GiB:.2f} GiB | {seconds:.2f} |\n\n"
            "The masters are filled straight into the pinned buffer from the model's parameters, so the growth "
            "stays near the floor; the AdamW states' part of the buffer is written by the first step.\n")
    return result


if __name__ == "__main__":
    main()
