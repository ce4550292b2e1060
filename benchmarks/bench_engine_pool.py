"""What a sleeping vLLM engine keeps on the GPU, with and without the pausable pools (swaprl.vmm), and what the
pools cost at wake-up.

    python benchmarks/bench_engine_pool.py --preset qwen2.5-1.5b --cycles 200 --baseline-cycles 12 \
        --out benchmarks/results/engine_pool_h100
    python benchmarks/bench_engine_pool.py --preset qwen2.5-7b --cycles 12 --out ...

Two runs per model, each in a process of its own (vLLM's sleep-mode allocator is one per process): the engine with
`release_other=True` and with `release_other=False`, both with the same CUDA-graph mode (`--cudagraph-mode`,
default FULL_DECODE_ONLY, what VLLMEngine picks when the pools are on), level-2 sleep, the trainer
in bf16 beside it (a random checkpoint of the preset's shape, cut to `--layers`). Each run takes one optimizer step
with lr=0 (AdamW's states exist, the weights do not move; `--optimizer sgd` has no states), then `--cycles`
train -> generate cycles through swaprl's phases, the on-policy check on at every sync, and one generation per cycle
with the same prompts and seed (16 prompts of 64 tokens, 4 completions of up to 64 tokens each).

Reported, per run:
- the engine's memory while asleep as the memory profile attributes it (`engine_other` at each train phase) and
  the device memory used in train (NVML) at every cycle: its growth after the first two cycles;
- the wake-up steps' median after `--warmup` cycles and the first separately, next to the floor of the pool's
  part (the bytes it copies back over the pinned host->device bandwidth measured in the same run);
- the generation's median time (the cost of the graph mode, when comparing runs of different modes);
- the tokens of every cycle's generation: equal across cycles within a run (graphs replayed after every pause)
  and equal between the two runs (same tokens for the same seed, with and without the pool);
- whether every sync's check passed.

vLLM's own tokens can differ from one process to the next (at 72B's size, 20 layers: three token sets in nine
processes without the pools, benchmarks/results/engine_pool_h200_72b20l). `--repeats N` runs each kind N times and
the summary then says whether every pooled run's tokens are those of some unpooled run (`pool_tokens_among_unpooled`,
with `token_sets` numbering the distinct ones).

`--nproc N` runs each as N ranks under torchrun, one engine per GPU (TP 1), with the default process group started
as examples/grpo.py starts it, its device bound (`init_process_group(device_id=...)`): then torch creates each new
process group's NCCL communicator at once, and vLLM makes several while it starts (`compat.torch.lazy_new_groups`
is what keeps them from holding memory). The figures are the largest over the ranks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import swaprl  # noqa: E402
from swaprl.checkpoints import write_random_checkpoint  # noqa: E402

from child import rank_result_path, result_or_say_why, start_runs  # noqa: E402

# A small rollout: 16 prompts of 64 tokens, 4 completions of up to 64 tokens each.
PROMPTS = [[(31 * i + 7 * j) % 500 + 1 for j in range(64)] for i in range(16)]
SAMPLING = dict(max_tokens=64, n=4, temperature=1.0, seed=7)


def label(preset: str, layers: int | None) -> str:
    """The model's name in file names: the preset, and its depth when cut ("qwen2.5-72b-20l")."""
    return preset + (f"-{layers}l" if layers else "")


def run_one(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from transformers import AutoModelForCausalLM

    from bench_offload import copy_floor, make_states
    from swaprl import memory
    from swaprl.engines.vllm import VLLMEngine

    ranks = "LOCAL_RANK" in os.environ  # under torchrun: a process group as a training script starts it
    if ranks:
        import torch.distributed as dist

        local = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=local)
    floors = copy_floor(256 << 20)
    torch.cuda.empty_cache()
    layers = spec.get("layers")
    path = Path(spec["workdir"]) / label(spec["preset"], layers)
    if not ranks or dist.get_rank() == 0:
        write_random_checkpoint(spec["preset"], path, layers=layers, dtype=torch.bfloat16)
    if ranks:
        dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    torch.cuda.empty_cache()
    engine = VLLMEngine(path, max_model_len=1024, release_other=spec["release_other"],
                        compilation_config={"cudagraph_mode": spec["cudagraph_mode"]})
    # Plain SGD keeps no states: what a sleeping engine keeps does not depend on them, and at 72B-20L AdamW's
    # would not fit one GPU beside the engine.
    opt = torch.optim.AdamW(model.parameters(), lr=0.0) if spec.get("optimizer", "adamw") == "adamw" \
        else torch.optim.SGD(model.parameters(), lr=0.0)
    profile = Path(spec["result"]).with_suffix(".profile.jsonl")
    written = profile.with_name(f"{profile.stem}.rank{dist.get_rank()}{profile.suffix}") \
        if ranks and dist.get_world_size() > 1 else profile  # the profiler's file per rank
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(sleep_level=2, grads="free", profile=profile))
    with swaprl.phase("train"):
        make_states(model, opt, grad=torch.zeros_like)

    steps: dict[str, list[float]] = collections.defaultdict(list)
    rt.add_listener(lambda e: steps[e["step"]].append(e["seconds"]) if e["type"] == "step" else None)
    tokens, used_in_train, checks, generate_s = [], [], [], []
    device = torch.device("cuda", torch.cuda.current_device())
    for cycle in range(spec["cycles"]):
        with swaprl.phase("generate"):
            checks.append(bool(rt.last_sync.ok) if rt.last_sync is not None else None)
            start = time.perf_counter()
            tokens.append(engine.generate(PROMPTS, swaprl.Sampling(**SAMPLING)))
            generate_s.append(time.perf_counter() - start)
        with swaprl.phase("train"):
            torch.cuda.synchronize()
            used_in_train.append(memory.device_used_bytes(device))
    st = rt.status()
    swaprl.detach()

    train_attr = [r["attribution"] for r in map(json.loads, written.read_text().splitlines())
                  if r.get("type") == "phase" and r.get("phase") == "train"]
    warm = spec["warmup"]
    import vllm

    result = {
        "preset": spec["preset"], "layers": layers, "optimizer": spec.get("optimizer", "adamw"),
        "release_other": spec["release_other"], "cycles": spec["cycles"],
        "engine": {"start_s": engine.stats.get("start_s"), "footprint_bytes": engine.stats.get("footprint_bytes"),
                   "weights_bytes": engine.weights_bytes, "kv_cache_bytes": engine.kv_cache_bytes,
                   "pool_at_start_bytes": engine._other_at_start,
                   "other_stats": {k: v for k, v in engine.stats.items() if k.startswith("other_")}},
        "asleep_engine_other_bytes": [a["categories"]["engine_other"] for a in train_attr],
        "asleep_unattributed_bytes": [a["categories"]["unattributed"] for a in train_attr],
        "train_device_used_bytes": used_in_train,
        "train_growth_bytes": max(used_in_train[2:]) - used_in_train[1] if len(used_in_train) > 2 else None,
        "steps": {k: {"first_s": v[0], "median_s": statistics.median(v[warm:]) if len(v) > warm else None,
                      "n": len(v)} for k, v in steps.items()},
        "generate": {"first_s": generate_s[0], "median_s": statistics.median(generate_s[warm:] or generate_s),
                     "tokens": sum(map(len, tokens[0]))},
        "cudagraph_mode": spec["cudagraph_mode"], "floor_GBps": floors, "tokens_first": tokens[0],
        "tokens_same_every_cycle": all(t == tokens[0] for t in tokens),
        "checks_passed": all(c for c in checks if c is not None), "checks": sum(c is not None for c in checks),
        "status_in_train": st, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "vllm": vllm.__version__, "swaprl": swaprl.__version__, "date": time.strftime("%Y-%m-%d"),
    }
    engine.close()
    rank_result_path(spec["result"]).write_text(json.dumps(result, indent=1, default=str))
    if ranks:
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=None, help="cut the preset to this many of its layers")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                    help="adamw (lr 0, its states exist) or sgd (no states: for models whose states do not fit)")
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--baseline-cycles", type=int, default=None,
                    help="cycles of the run without the pool (default: --cycles)")
    ap.add_argument("--pools", choices=("both", "on", "off"), default="both",
                    help="which runs: with the pools, without them, or both (a large model's run each in a call)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each this many times, each in a process of its own: at 72B's size vLLM's tokens differ "
                         "between processes, so the pooled runs' tokens are compared with every unpooled run's")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cudagraph-mode", default="FULL_DECODE_ONLY",
                    help="vLLM's cudagraph_mode for both runs (VLLMEngine's default with the pools: FULL_DECODE_ONLY)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="each run as this many ranks under torchrun, the process group's device bound (module doc)")
    started = start_runs(ap, argv, run_one, timeout=900)
    if started is None:
        return None
    args, out = started
    runs = {}
    wanted = {"both": (True, False), "on": (True,), "off": (False,)}[args.pools]
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: give 1 or more")
    model = label(args.preset, args.layers)
    for release in wanted if args.baseline_cycles != 0 else (True,):
        cycles = args.cycles if release or args.baseline_cycles is None else args.baseline_cycles
        for repeat in range(args.repeats):
            name = f"{model}_{'pool' if release else 'nopool'}{f'_{repeat + 1}' if repeat else ''}"
            runs[name] = result_or_say_why(__file__, {"preset": args.preset, "layers": args.layers,
                                                      "optimizer": args.optimizer, "release_other": release,
                                                      "cycles": cycles, "warmup": args.warmup,
                                                      "workdir": args.workdir, "cudagraph_mode": args.cudagraph_mode},
                                           name, out, args.timeout, nproc=args.nproc)
    summary = summarize(model, runs)
    (out / f"{model}_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


def summarize(preset: str, runs: dict) -> dict:
    pool, plain = runs.get(f"{preset}_pool"), runs.get(f"{preset}_nopool")
    out: dict = {"preset": preset}
    for name, r in (("pool", pool), ("nopool", plain)):
        if r is None:
            out[name] = None
            continue
        asleep = [b for rank in (r, *r.get("other_ranks", ())) for b in rank["asleep_engine_other_bytes"]]
        out[name] = {"asleep_engine_other_MiB_max": max(asleep) / 2**20 if asleep else None,
                     "asleep_engine_other_MiB_median": statistics.median(asleep) / 2**20 if asleep else None,
                     "train_growth_MiB": (r["train_growth_bytes"] or 0) / 2**20, "cycles": r["cycles"],
                     "tokens_same_every_cycle": r["tokens_same_every_cycle"], "checks_passed": r["checks_passed"],
                     "checks": r["checks"], "steps": r["steps"], "generate": r["generate"],
                     "other_stats": r["engine"]["other_stats"], "cudagraph_mode": r["cudagraph_mode"]}
    if pool and plain:
        out["tokens_equal_with_and_without_pool"] = pool["tokens_first"] == plain["tokens_first"]
        # With --repeats: the distinct token lists of all runs, and whether each pooled run's is an unpooled run's.
        pooled = [r["tokens_first"] for n, r in runs.items() if r and n.startswith(f"{preset}_pool")]
        unpooled = [r["tokens_first"] for n, r in runs.items() if r and n.startswith(f"{preset}_nopool")]
        sets: list = []
        for tokens in pooled + unpooled:
            if tokens not in sets:
                sets.append(tokens)
        out["token_sets"] = {"pool": [sets.index(t) for t in pooled], "nopool": [sets.index(t) for t in unpooled]}
        out["pool_tokens_among_unpooled"] = all(t in unpooled for t in pooled)
        h2d = pool["floor_GBps"]["h2d"]
        kept = pool["engine"]["other_stats"].get("other_kept_bytes", 0)
        out["pool_resume_floor_s"] = kept / (h2d * 1e9)
    return out


if __name__ == "__main__":
    main()
