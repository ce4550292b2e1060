"""Time of every phase-switch step with a colocated vLLM engine, next to its floor measured in the same run.

    python benchmarks/bench_transitions.py --preset qwen2.5-1.5b \
        --out benchmarks/results/transitions_qwen2.5-1.5b_h100/transitions_qwen2.5-1.5b_h100.json
    python benchmarks/bench_transitions.py --preset qwen2.5-7b --param-dtype bfloat16 --out ...

One process per model (vLLM's sleep-mode allocator is one per process). Writes a random checkpoint, loads the
trainer, builds the engine, takes one optimizer step so the states exist, then runs `--cycles` train -> generate ->
train cycles (a small generation in each) and reports the median of each step after `--warmup` cycles.

Floors: host copies (optimizer offload/reload, level-1 sleep and wake of weights) are bytes over the pinned copy
bandwidth; the weight sync is (bytes read from the trainer + bytes written into the engine) over the device copy
bandwidth (read + write); the engine's wake-ups and sleep are the CUDA driver's page-table work for its pool's own
allocations (creating and mapping each, unmapping and releasing each: `bench_vmm.map_sizes`, measured on the same GPU
once the engine is closed), plus the weights' copies at sleep level 1.
With the optimizer offload overlapped with the engine's wake-up and sync (the default), "finish offload optimizer" is
only the wait left at its end; the row "offload optimizer: copies (overlapped)" is the copies' whole span against the
floor.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import swaprl
from swaprl.checkpoints import write_random_checkpoint
from swaprl.compat import vllm as vllm_compat

from bench_offload import copy_floor, make_states


def device_copy_GBps(nbytes: int = 2 << 30, repeats: int = 5) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * nbytes / statistics.median(times) / 1e9  # read + write


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--sleep-level", type=int, default=2, choices=[1, 2])
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "swaprl-checkpoints"),
                    help="where the random checkpoint is written (and reused)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from swaprl.engines.vllm import VLLMEngine

    floors = copy_floor(1 << 30)  # before the engine takes the GPU's free memory for its KV cache
    d2d = device_copy_GBps()
    torch.cuda.empty_cache()
    path = write_random_checkpoint(args.preset, Path(args.workdir) / args.preset)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.param_dtype)).cuda()
    torch.cuda.empty_cache()
    engine = VLLMEngine(path, max_model_len=1024, enforce_eager=args.enforce_eager)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(sleep_level=args.sleep_level, grads="free"))
    with swaprl.phase("train"):
        make_states(model, opt)

    times: dict[str, list[float]] = collections.defaultdict(list)
    moved: dict[str, int] = {}
    switch = []

    def on_event(e):
        if e["type"] == "step":
            times[e["step"]].append(e["seconds"])
            moved[e["step"]] = e["bytes"]
            if "span_seconds" in e:  # an overlapped offload: its copies ran from its start step to this one
                times[COPIES].append(e["span_seconds"])
                moved[COPIES] = e["bytes"]
        elif e["type"] == "phase":
            switch.append(e["seconds"])

    rt.add_listener(on_event)
    for cycle in range(args.warmup + args.cycles):
        if cycle == args.warmup:
            times.clear()
            switch.clear()
        with swaprl.phase("generate"):
            rt.engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 4, swaprl.Sampling(max_tokens=16, seed=cycle))
    st = rt.status()
    swaprl.detach()
    pool = vllm_compat.sleep_pool_allocations()  # the engine's allocations, each mapped whole at a wake-up
    weights = engine.weights_bytes
    trainer_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine.close()
    del rt, opt, model
    gc.collect()
    torch.cuda.empty_cache()
    maps = page_table_floor(pool, max(args.cycles, 1))

    opt_bytes = moved.get("offload optimizer") or moved.get(COPIES, 0)
    floor_s = {
        "offload optimizer": opt_bytes / (floors["d2h"] * 1e9),
        COPIES: opt_bytes / (floors["d2h"] * 1e9),
        "reload optimizer": opt_bytes / (floors["h2d"] * 1e9),
        "sync weights": (trainer_param_bytes + weights) / (d2d * 1e9),
    }
    # The engine's wake-ups and its sleep: at level 1 the copies of its weights' pool (vLLM backs up and restores
    # each allocation whole), plus the page-table work of the pool's own allocations, measured on this GPU once the
    # engine is gone (left out where that measure failed or did not fit).
    copied = sum(pool.get("weights", [])) or weights if args.sleep_level == 1 else 0
    table = {tag: m for tag, m in maps.items() if "error" not in m}
    wake_weights = copied / (floors["h2d"] * 1e9) + table.get("weights", {}).get("create_map", 0)
    sleep = copied / (floors["d2h"] * 1e9) + sum(m["unmap_release"] for m in table.values())
    if wake_weights:
        floor_s["engine wake weights"] = wake_weights
    if "kv_cache" in table:
        floor_s["engine wake kv_cache"] = table["kv_cache"]["create_map"]
    if sleep:
        floor_s["engine sleep"] = sleep
    rows = []
    print(f"{'step':<40}{'GiB':>8}{'median s':>10}{'floor s':>10}{'floor/time':>11}")
    for step, ts in times.items():
        med = statistics.median(ts)
        floor = floor_s.get(step)
        nbytes = {"sync weights": weights, "engine wake weights": weights,
                  "engine wake kv_cache": engine.kv_cache_bytes}.get(step, moved.get(step, 0))
        rows.append({"step": step, "bytes": nbytes, "median_s": med, "floor_s": floor,
                     "ratio": floor / med if floor else None})
        print(f"{step:<40}{nbytes / 2**30:>8.2f}{med:>10.4f}{floor if floor else float('nan'):>10.4f}"
              f"{floor / med if floor else float('nan'):>11.2f}")
    import vllm

    result = {"benchmark": "transitions", "preset": args.preset, "param_dtype": args.param_dtype,
              "sleep_level": args.sleep_level, "engine_dtype": str(engine.dtype), "engine_weights_bytes": weights,
              "kv_cache_bytes": engine.kv_cache_bytes, "engine_start_s": engine.stats.get("start_s"),
              "floor_GBps": {**floors, "d2d_read_write": d2d}, "page_table_floor": maps, "steps": rows,
              "switch_median_s": {"both directions": statistics.median(switch) * 2 if switch else None},
              "status_in_train": st, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "vllm": vllm.__version__, "swaprl": swaprl.__version__, "date": time.strftime("%Y-%m-%d"),
              "cycles": args.cycles, "warmup": args.warmup, "enforce_eager": args.enforce_eager}
    print(json.dumps(result, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return result


def page_table_floor(pool: dict[str, list[int]], repeats: int) -> dict[str, dict]:
    """Per tag of the engine's pool: `bench_vmm.map_sizes` over its allocations' sizes, on this process's GPU (the
    engine closed, its memory back with the driver). A tag that does not fit in the free memory now is left out,
    with a note on stderr."""
    from bench_vmm import Driver, map_sizes

    drv = Driver(torch.cuda.current_device())
    out = {}
    for tag, sizes in pool.items():
        free = torch.cuda.mem_get_info()[0]
        if sum(sizes) > free - (1 << 30):
            print(f"page-table floor of the engine's {tag!r}: {sum(sizes) / 2**30:.2f} GiB do not fit in the "
                  f"{free / 2**30:.2f} GiB free now; left out", file=sys.stderr)
            continue
        try:
            out[tag] = map_sizes(drv, sizes, repeats)
        except Exception as exc:  # noqa: BLE001 - the transitions are measured already: keep them, say what failed
            print(f"page-table floor of the engine's {tag!r} failed: {exc}", file=sys.stderr)
            out[tag] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


COPIES = "offload optimizer: copies (overlapped)"

if __name__ == "__main__":
    main()
