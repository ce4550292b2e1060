"""Offload/reload round trip of AdamW states through the phase controller, against the pinned copy floor.

    python benchmarks/bench_offload.py --preset qwen2.5-1.5b \
        --out benchmarks/results/offload_qwen2.5-1.5b_h100/offload_qwen2.5-1.5b_h100.json

Builds the model on the GPU (random weights, fp32 parameters so AdamW keeps fp32 states: 12.3 GB for 1.5B), takes
one optimizer step so the states exist, then times `train -> generate -> train` cycles and reads the optimizer's
offload and reload steps from the runtime's events. The floor is measured in the same run: one large copy between
a device tensor and a host buffer pinned the way swaprl pins its buffers, in each direction. Warm-up cycles (the
first one allocates and pins the host buffer) are excluded; the table shows medians and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import swaprl
from swaprl.checkpoints import random_model
from swaprl.engines import HFEngine
from swaprl.presets import get_preset
from swaprl.residency import HostBuffer


def emit(result: dict, out: str | None) -> dict:
    """End a benchmark: its result as one JSON line on stdout, and in `out` (indented) when given."""
    print(json.dumps(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def copy_floor(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Median GB/s of one `nbytes` copy each way between the GPU and a pinned host buffer."""
    torch.zeros(1, device="cuda")  # a live context first: the copies below must not pay for creating it
    buffer = HostBuffer("floor", pin=True)
    host = buffer.ensure(nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.random_()
    out = {}
    for name, (dst, src) in {"d2h": (host, dev), "h2d": (dev, host)}.items():
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


def make_states(model: torch.nn.Module, opt: torch.optim.Optimizer, grad=torch.randn_like) -> None:
    """One optimizer step on gradients `grad(p)`, so that the optimizer's states exist (and can be moved)."""
    for p in model.parameters():
        p.grad = grad(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark measures PCIe copies: run it on a machine with a CUDA GPU")

    spec = get_preset(args.preset)
    model = random_model(spec.name, layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    make_states(model, opt)
    state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor) and v.is_cuda)
    floor = copy_floor(1 << 30)

    rt = swaprl.attach(model, opt, HFEngine(model))
    steps: dict[str, list[float]] = {"offload optimizer": [], "reload optimizer": []}
    cycle_times = []
    rt.add_listener(lambda e: steps[e["step"]].append(e["seconds"]) if e.get("step") in steps else None)
    first_cycle = None
    for i in range(args.warmup + args.cycles):
        t0 = time.perf_counter()
        with swaprl.phase("generate"):
            pass
        dt = time.perf_counter() - t0
        if i == 0:
            first_cycle = dt
        if i < args.warmup:
            for v in steps.values():
                v.clear()
        else:
            cycle_times.append(dt)
    swaprl.detach()

    off, on = statistics.median(steps["offload optimizer"]), statistics.median(steps["reload optimizer"])
    gbps_off, gbps_on = state_bytes / off / 1e9, state_bytes / on / 1e9
    floor_round = state_bytes / (floor["d2h"] * 1e9) + state_bytes / (floor["h2d"] * 1e9)
    result = {
        "benchmark": "offload", "preset": spec.name, "layers": args.layers or spec.num_hidden_layers,
        "parameters": sum(p.numel() for p in model.parameters()), "optimizer_state_bytes": state_bytes,
        "tensors": sum(1 for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
                       and v.is_cuda),
        "floor_GBps": floor, "offload_s": off, "reload_s": on, "offload_GBps": gbps_off, "reload_GBps": gbps_on,
        "offload_ratio": gbps_off / floor["d2h"], "reload_ratio": gbps_on / floor["h2d"],
        "round_trip_s": off + on, "round_trip_floor_s": floor_round, "round_trip_ratio": floor_round / (off + on),
        "cycle_median_s": statistics.median(cycle_times), "first_cycle_s": first_cycle,
        "cycles": args.cycles, "warmup": args.warmup,
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "swaprl": swaprl.__version__, "date": time.strftime("%Y-%m-%d"),
    }
    print(f"{'step':<20}{'GiB':>8}{'median s':>10}{'GB/s':>8}{'floor GB/s':>12}{'ratio':>7}")
    print(f"{'offload (D2H)':<20}{state_bytes / 2**30:>8.2f}{off:>10.3f}{gbps_off:>8.1f}{floor['d2h']:>12.1f}"
          f"{result['offload_ratio']:>7.2f}")
    print(f"{'reload (H2D)':<20}{state_bytes / 2**30:>8.2f}{on:>10.3f}{gbps_on:>8.1f}{floor['h2d']:>12.1f}"
          f"{result['reload_ratio']:>7.2f}")
    print(f"{'round trip':<20}{2 * state_bytes / 2**30:>8.2f}{off + on:>10.3f}{'':>8}{'':>12}"
          f"{result['round_trip_ratio']:>7.2f}")
    print(f"first cycle (allocates and pins the host buffer): {first_cycle:.2f} s; "
          f"full cycle median {result['cycle_median_s']:.3f} s")
    return emit(result, args.out)


if __name__ == "__main__":
    main()
