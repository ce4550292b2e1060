"""Each phase-switch step of a recorded run next to its physical floor, measured on the run's GPU after it.

    python benchmarks/switch_floors.py OUT/profile.rank0.jsonl [--repeats 3] [--out floors.md]

Run it on the GPU the profile was recorded on (under torchrun, `CUDA_VISIBLE_DEVICES` set to that rank's), once the
run has ended: the floors need the memory the engine held. The profile says what each step did; this measures what
that work costs at the least, here:

- the copies (offload, reload, the weight sync, the streamed optimizer step): their bytes at the pinned and
  device-to-device rates the run itself measured (the memory report's copy ceiling);
- the engine's wake-ups: creating and mapping physical memory in the sizes of the engine's own pool allocations,
  per tag (the profile header's `engine_pool`, `bench_vmm.map_sizes`); its sleep: unmapping and releasing them (at
  sleep level 1 also copying the weights out, and the weights' wake-up copying them back);
- `release cached memory`: torch's `empty_cache` over as many bytes as the step handed back, with the allocator
  settings the run had (`bench_vmm.torch_hand_over`, per byte).

Steps with no floor here (the weight check's kernels, bookkeeping) show none. Time is the median over the cycles
after the first (a step that ran only in the first: that one); for a step that waits for copies it started earlier,
the span from that start. A floor above its step's time is a measuring error, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import Counter
from pathlib import Path

from swaprl.profile.report import Run, copy_ceiling, load_run

_COPY = {"offload": "d2h_GBps", "reload": "h2d_GBps", "sync weights": "d2d_GBps"}


def occurrences(run: Run) -> dict[tuple[str, str], list[dict]]:
    """The step records per (transition, step name), in time order, those of the first switch of each transition
    (and the first train phase's optimizer steps) left out where later ones exist. A name one switch runs twice is
    told apart by the engine step that follows it ("release cached memory (before engine wake kv_cache)"), which
    holds whatever runs in between (the offload's copies start after the first release when they overlap the
    wake-up, before it when they do not) and in a switch that skips one of them (the release before the wake-up,
    when the engine's weights fit in what is free); the steps outside switches (each optimizer step's) are one row
    however many run in a phase."""
    # A switch's steps come before its phase record: those between two phase records, by transition.
    switches: list[tuple[str, list[dict]]] = []
    window: dict[str, list[dict]] = {}
    for r in sorted([*run.steps, *({"boundary": True, **p} for p in run.phases)], key=lambda r: r["t"]):
        if r.get("boundary"):
            switches += window.items()
            window = {}
        else:
            window.setdefault(r["transition"], []).append(r)
    switches += window.items()
    repeated = {(transition, name) for transition, recs in switches if "->" in transition
                for name, n in Counter(r["step"] for r in recs).items() if n > 1}
    out: dict[tuple[str, str], list[tuple[bool, dict]]] = {}
    seen: set[str] = set()
    for transition, recs in switches:
        first = transition not in seen
        seen.add(transition)
        for i, r in enumerate(recs):
            name = r["step"]
            if (transition, name) in repeated:
                after = [s["step"] for s in recs[i + 1:]]
                label = next((s for s in after if s.startswith("engine ")), after[0] if after else None)
                name += f" (before {label})" if label else " (last)"
            out.setdefault((transition, name), []).append((first, r))
    return {key: [r for first, r in recs if not first] or [r for _, r in recs] for key, recs in out.items()}


def sleep_level(run: Run) -> int | None:
    levels = [p["status"].get("engine", {}).get("sleep_level") for p in run.phases if p.get("status")]
    return next((lv for lv in reversed(levels) if lv is not None), None)


def floor_of(step: str, rec: dict, measured: dict, ceiling: dict, level: int | None) -> tuple[float | None, str]:
    """The floor of one step record, in seconds, and what it is; (None, why) where there is none."""
    base = step.split(" (")[0]
    maps, unmaps = measured.get("create_map", {}), measured.get("unmap_release", {})
    if rec.get("h2d_bytes") is not None and rec.get("d2h_bytes") is not None and ceiling.get("h2d_GBps"):
        return (max(rec["h2d_bytes"] / ceiling["h2d_GBps"], rec["d2h_bytes"] / ceiling["d2h_GBps"]) / 1e9,
                "both ways at once, each at its pinned rate")
    gather, world = measured.get("gather_GBps"), measured.get("world_size", 1)
    if base == "sync weights" and gather and world > 1 and rec["bytes"] and ceiling.get("d2d_GBps"):
        # FSDP2: each full tensor is gathered, (world - 1) / world of it from the other ranks, then loaded; at best
        # the two overlap, so the slower of them bounds the step
        return max(rec["bytes"] * (world - 1) / world / gather, rec["bytes"] / ceiling["d2d_GBps"]) / 1e9, \
            "gather from the other ranks (bench_allgather), or the device copy if slower"
    for words, key in _COPY.items():
        if f" {words} " in f" {base} ":
            if not rec["bytes"]:
                return None, "nothing moved"
            if not ceiling.get(key):
                return None, "no copy rate in the profile"
            return rec["bytes"] / ceiling[key] / 1e9, f"{key.split('_')[0]} copy at the run's rate"
    if base.startswith("engine wake"):
        tags = [t for t in ("weights", "kv_cache") if t in base] or ["weights", "kv_cache"]
        if not all(t in maps for t in tags):
            return None, "the engine's pool was not measured"
        copy = 0.0  # at level 1 vLLM copies each weight allocation back from host memory as it maps it
        if level == 1 and "weights" in tags and ceiling.get("h2d_GBps"):
            copy = measured.get("weights_bytes", 0) / ceiling["h2d_GBps"] / 1e9
        return sum(maps[t] for t in tags) + copy, "create + map the engine's allocations" + (
            ", weights copied back" if copy else "")
    if base == "engine sleep":
        if not unmaps:
            return None, "the engine's pool was not measured"
        copy = 0.0
        if level == 1 and ceiling.get("d2h_GBps"):
            copy = measured.get("weights_bytes", 0) / ceiling["d2h_GBps"] / 1e9
        return sum(unmaps.values()) + copy, "unmap + release the engine's allocations" + (
            ", weights copied out" if copy else "")
    if base == "release cached memory":
        rate = measured.get("empty_cache_s_per_byte")
        if rate is None:
            return None, "torch's release was not measured"
        return rec["bytes"] * rate, "torch's empty_cache over the bytes handed back"
    return None, ""


def rows(run: Run, measured: dict) -> list[dict]:
    ceiling, level = copy_ceiling(run), sleep_level(run)
    out = []
    for (transition, step), recs in occurrences(run).items():
        spans = [r.get("span_seconds") for r in recs]
        timed = [s for s in spans if s] if all(spans) else [r["seconds"] for r in recs]
        floors = [floor_of(step, r, measured, ceiling, level) for r in recs]
        values = [f for f, _ in floors if f is not None]
        row = {"transition": transition, "step": step, "count": len(recs),
               "bytes": statistics.median(r["bytes"] for r in recs), "time_s": statistics.median(timed),
               "span": all(spans), "issued": any(r.get("issued") for r in recs),
               "floor_s": statistics.median(values) if values else None, "floor_is": floors[-1][1]}
        row["ratio"] = row["floor_s"] / row["time_s"] if row["floor_s"] and row["time_s"] else None
        out.append(row)
    return out


def measure(pool: dict[str, list[int]], release_bytes: int, weights_bytes: int, repeats: int) -> dict:
    """On this process's GPU: the engine's pool created, mapped, unmapped and released per tag, and torch's release
    of `release_bytes` (or as many as fit now)."""
    import torch
    from bench_vmm import Driver, map_sizes, torch_hand_over

    drv = Driver(torch.cuda.current_device())
    out: dict = {"create_map": {}, "unmap_release": {}, "weights_bytes": weights_bytes, "notes": []}
    for tag, sizes in pool.items():
        free = torch.cuda.mem_get_info()[0]
        if sum(sizes) > free - (1 << 30):
            out["notes"].append(f"the engine's {tag!r} ({sum(sizes) / 2**30:.2f} GiB) does not fit in the "
                                f"{free / 2**30:.2f} GiB free: not measured")
            continue
        m = map_sizes(drv, sizes, repeats)
        out["create_map"][tag], out["unmap_release"][tag] = m["create_map"], m["unmap_release"]
    if release_bytes:
        size = min(release_bytes, torch.cuda.mem_get_info()[0] - (1 << 30))
        if size <= 0:
            out["notes"].append("no room on the GPU to measure torch's release: not measured")
            return out
        if size < release_bytes:
            # per byte, a smaller release pays its fixed costs over fewer bytes: scaled up, it can pass the floor
            out["notes"].append(f"torch's release was measured over {size / 2**30:.2f} GiB, less than the "
                                f"{release_bytes / 2**30:.2f} GiB a step handed back: larger steps' floors may be "
                                "too high")
        out["empty_cache_s_per_byte"] = torch_hand_over(size, repeats)["torch_empty_cache"] / size
        out["release_measured_bytes"] = size
    return out


def markdown(run: Run, table: list[dict], measured: dict) -> str:
    lines = [f"# Switch steps against their floors: {run.path.name}", "",
             f"Device: {run.header.get('device_name')}; allocator settings: "
             f"`{run.header.get('alloc_conf') or 'torch defaults'}`; floors measured after the run on the same "
             "GPU. Time: median over the cycles after the first (for a step that waited for copies started "
             "earlier, the span from their start).", "",
             "| transition | step | n | GiB | time s | floor s | floor / time | floor of |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in table:
        time = "issued" if r["issued"] else f"{r['time_s']:.4f}" + (" (span)" if r["span"] else "")
        floor = f"{r['floor_s']:.4f}" if r["floor_s"] is not None else "-"
        ratio = f"{r['ratio']:.2f}" + (" (over: a measuring error)" if r["ratio"] > 1 else "") \
            if r["ratio"] is not None and not r["issued"] else "-"
        lines.append(f"| {r['transition']} | {r['step']} | {r['count']} | {r['bytes'] / 2**30:.2f} | {time} | "
                     f"{floor} | {ratio} | {r['floor_is']} |")
    switches = [r for r in table if "->" in r["transition"] and not r["issued"]]
    total = sum(r["time_s"] for r in switches if not r["span"])
    floor = sum(r["floor_s"] or 0 for r in switches if not r["span"])
    lines += ["", f"Switch steps in sequence (waits for earlier copies left out): {total:.3f} s, their floors "
              f"{floor:.3f} s."] + [f"- {n}" for n in measured.get("notes", [])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="a rank's memory profile (SwapConfig(profile=...), .jsonl or .jsonl.gz)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="markdown file (a .json beside it gets the figures)")
    ap.add_argument("--gather-GBps", type=float, default=None, dest="gather_GBps",
                    help="an FSDP2 trainer's sync gathers each parameter from its shards: the rate a rank receives "
                         "the others' bytes at (benchmarks/bench_allgather.py's gathered_GBps on the same GPUs); "
                         "without it the sync's floor is its device copy only")
    args = ap.parse_args(argv)
    run = load_run(args.profile)
    if not run.header.get("device_total"):
        raise SystemExit(f"{args.profile} was recorded without a CUDA device: no floors to measure")
    notes = []
    # torch's release costs what the run's allocator settings make it cost: the same, before CUDA starts here
    # (torch reads them once, when it initialises CUDA)
    conf = run.header.get("alloc_conf")
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        notes.append("CUDA was initialised before the run's allocator settings could be set: torch's release is "
                     "measured with this process's")
    elif conf is None:
        notes.append("the profile does not record the run's allocator settings: torch's release is measured with "
                     "this process's")
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    pool = run.header.get("engine_pool")
    if pool is None:
        notes.append("the profile has no `engine_pool` (recorded before swaprl wrote it): the engine's wake-ups and "
                     "sleep get no floor")
    releases = [r["bytes"] for r in run.steps if r["step"] == "release cached memory"]
    # what a level-1 sleep copies out and its wake-up back: vLLM backs up each weight allocation whole
    weights = sum((pool or {}).get("weights", [])) or max(
        (p["status"].get("engine", {}).get("weights_bytes", 0) for p in run.phases if p.get("status")), default=0)
    measured = measure(pool or {}, max(releases, default=0), weights, args.repeats)
    measured["notes"][:0] = notes
    measured.update(gather_GBps=args.gather_GBps, world_size=run.header.get("world_size") or 1)
    table = rows(run, measured)
    text = markdown(run, table, measured)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"measured": measured, "rows": table}, indent=1))
    return {"measured": measured, "rows": table}


if __name__ == "__main__":
    main()
