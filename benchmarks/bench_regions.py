"""A training step captured in a CUDA graph, with and without its memory paused in generate (`Runtime.pausable`).

    python benchmarks/bench_regions.py --preset qwen2.5-1.5b --batch 4 --seq 512 --steps 8 --out OUT

Three ways, each in a process of its own, on a random-weight bf16 checkpoint of the preset's shape with swaprl
attached (the HF engine, `grads="keep"`, AdamW states swapped as usual):
- "eager": forward and backward run eagerly; their activations go back to torch's cache, which the switch to
  generate hands to the driver;
- "graph": forward and backward replay one CUDA graph (`torch.cuda.graph`, its own private pool), the AdamW step
  eagerly; the graph's pool stays reserved in generate;
- "region": the same graph captured into a pausable region (`keep="nothing"`), released at each switch to generate
  and mapped again at the same addresses for training.

Reported per way: the step's median time after `--warmup` steps (forward, backward and the optimizer step, to the
device's completion) and the first step apart; the device memory in use in generate and in train (NVML) at each
cycle; the region's pause and resume times (medians; no bytes are copied with keep="nothing", so the floor is the
driver's unmapping and mapping, for which no copy rate stands); the losses of each way, equal for "graph" and
"region" bit for bit only where the backward is deterministic (bf16 at 1.5B on the H100 is not: compare two runs
of one way for the spread).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import swaprl  # noqa: E402
from swaprl.checkpoints import write_random_checkpoint  # noqa: E402

from child import result_or_say_why, start_runs  # noqa: E402

WAYS = ("eager", "graph", "region")


def run_one(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from transformers import AutoModelForCausalLM

    from swaprl import memory

    way = spec["way"]
    path = write_random_checkpoint(spec["preset"], Path(spec["workdir"]) / spec["preset"], dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randint(1, 1000, (spec["batch"], spec["seq"]), device="cuda",
                      generator=torch.Generator("cuda").manual_seed(1))
    profile = Path(spec["result"]).with_suffix(".profile.jsonl")
    rt = swaprl.attach(model, opt, engine="hf", config=swaprl.SwapConfig(grads="keep", profile=profile))
    steps: dict[str, list[float]] = collections.defaultdict(list)
    rt.add_listener(lambda e: steps[e["step"]].append(e["seconds"]) if e["type"] == "step" else None)
    device = torch.device("cuda", torch.cuda.current_device())

    region = rt.pausable("train graph", keep="nothing") if way == "region" else None
    graph = loss = None
    capture_s = None
    if way != "eager":
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up before capture; it also allocates the grads the graph accumulates in
            for _ in range(2):
                model(input_ids=x, labels=x).loss.backward()
        torch.cuda.current_stream().wait_stream(side)
        opt.zero_grad(set_to_none=False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=region.id if region is not None else None):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t0

    losses, step_s, used_generate, used_train, region_bytes = [], [], [], [], []
    for _ in range(spec["steps"]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        if graph is not None:
            graph.replay()
        else:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
        opt.step()
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
        used_train.append(memory.device_used_bytes(device))
        if region is not None:
            region_bytes.append(region.mapped_bytes)
        with swaprl.phase("generate"):
            torch.cuda.synchronize()
            used_generate.append(memory.device_used_bytes(device))
            rt.engine.generate([[1, 2, 3, 4]], swaprl.Sampling(max_tokens=8, temperature=0.0))
    swaprl.detach()
    if region is not None:
        del graph
        region.close()

    warm = spec["warmup"]

    def med(v):
        return statistics.median(v[warm:]) if len(v) > warm else None

    result = {
        "way": way, "preset": spec["preset"], "batch": spec["batch"], "seq": spec["seq"], "steps": spec["steps"],
        "capture_s": capture_s,
        "step_s": {"first": step_s[0], "median": med(step_s), "all": step_s},
        "losses": losses,
        "device_used_generate_bytes": used_generate, "device_used_train_bytes": used_train,
        "region_mapped_bytes_in_train": region_bytes,
        "switch_steps": {k: {"first_s": v[0], "median_s": med(v), "n": len(v)} for k, v in steps.items()},
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "swaprl": swaprl.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(spec["result"]).write_text(json.dumps(result, indent=1, default=str))


def summarize(runs: dict) -> dict:
    out: dict = {}
    for way, r in runs.items():
        if r is None:
            out[way] = None
            continue
        out[way] = {"step_median_s": r["step_s"]["median"], "step_first_s": r["step_s"]["first"],
                    "generate_used_GiB": statistics.median(r["device_used_generate_bytes"]) / 2**30,
                    "train_used_GiB": statistics.median(r["device_used_train_bytes"]) / 2**30,
                    "switch_steps": {k: v["median_s"] for k, v in r["switch_steps"].items()
                                     if k in ("pause regions", "resume regions")}}
    g, reg, e = runs.get("graph"), runs.get("region"), runs.get("eager")
    if g and reg:
        out["graph_and_region_losses_equal"] = g["losses"] == reg["losses"]
        out["graph_and_region_first_differing_step"] = next(
            (i for i, (a, b) in enumerate(zip(g["losses"], reg["losses"])) if a != b), None)
        out["generate_GiB_released_by_region"] = out["graph"]["generate_used_GiB"] - out["region"]["generate_used_GiB"]
    if g and e:
        out["graph_step_speedup_over_eager"] = e["step_s"]["median"] / g["step_s"]["median"]
        out["eager_and_graph_losses_equal"] = g["losses"] == e["losses"]
    return out


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ways", default=",".join(WAYS))
    started = start_runs(ap, argv, run_one, timeout=600)
    if started is None:
        return None
    args, out = started
    runs = {}
    for way in args.ways.split(","):
        if way not in WAYS:
            raise SystemExit(f"--ways: unknown way {way!r}; use some of {', '.join(WAYS)}")
        name = f"{args.preset}_{way}"
        runs[way] = result_or_say_why(__file__, {"way": way, "preset": args.preset, "batch": args.batch,
                                                 "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
                                                 "workdir": args.workdir}, name, out, args.timeout)
    summary = summarize(runs)
    (out / f"{args.preset}_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
