"""Where each phase switch's time goes, from a Chrome trace of one step (`examples/grpo.py --trace-step N`).

    python benchmarks/trace_steps.py OUT/trace.step3.rank0.json [--out steps.md]

For every switch step the runtime names (`swaprl <transition>: <step>`, the memory profile's names), it gives the
step's wall time on the CPU thread that ran it, the CUDA runtime and driver calls the profiler saw inside it (the
largest by time), and what is left: time the profiler does not see. CUPTI does not trace the virtual-memory calls
(`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`) through which torch's expandable
segments and vLLM's sleep mode hand device memory to and from the driver, nor Python, so a step that only remaps
memory shows almost all of its time as untraced. The GPU's own copies and kernels inside each step are summed too,
by kind, over their device time.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

PREFIX = "swaprl "
CALLS = ("cuda_runtime", "cuda_driver")
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def summarize(trace: dict) -> list[dict]:
    """One row per switch step of the trace, in the order they ran."""
    events = trace.get("traceEvents", [])
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"
                    and str(e.get("name", "")).startswith(PREFIX)), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("no swaprl switch steps in this trace: trace a step with `--trace-step N` (a step after "
                         "the first, whose switches ran under the profiler)")
    calls = [e for e in events if e.get("cat") in CALLS and e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in DEVICE and e.get("ph") == "X"]
    flows = {e.get("args", {}).get("correlation"): e for e in calls}
    rows = []
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        mine = [e for e in calls if e.get("tid") == step.get("tid") and e.get("pid") == step.get("pid")
                and start <= e["ts"] < end]
        by_call: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        for e in mine:
            by_call[e["name"]][0] += 1
            by_call[e["name"]][1] += e.get("dur", 0.0)
        # Device work launched from inside the step (its launching call lies in the step), wherever it ran.
        launched = {e.get("args", {}).get("correlation") for e in mine}
        by_kind: dict[str, float] = collections.defaultdict(float)
        for e in device:
            if e.get("args", {}).get("correlation") in launched and e.get("args", {}).get("correlation") in flows:
                by_kind[e["cat"]] += e.get("dur", 0.0)
        traced = sum(t for _, t in by_call.values())
        rows.append({"step": step["name"][len(PREFIX):], "ms": step["dur"] / 1e3, "traced_ms": traced / 1e3,
                     "untraced_ms": (step["dur"] - traced) / 1e3,
                     "calls": sorted(((name, n, t / 1e3) for name, (n, t) in by_call.items()), key=lambda c: -c[2]),
                     "device_ms": {kind: t / 1e3 for kind, t in sorted(by_kind.items())}})
    return rows


def markdown(rows: list[dict], source: str) -> str:
    out = [f"Switch steps of `{source}` (wall time on the thread that ran them; calls: what the profiler saw of the "
           "CUDA runtime and driver inside each; untraced: the rest, the virtual-memory calls and Python among it).",
           "", "| step | ms | traced calls ms | untraced ms | largest calls | device work launched, ms |",
           "|---|---:|---:|---:|---|---|"]
    for r in rows:
        calls = "; ".join(f"{name} x{n} {ms:.1f}" for name, n, ms in r["calls"][:3]) or "—"
        dev = "; ".join(f"{k} {v:.1f}" for k, v in r["device_ms"].items()) or "—"
        out.append(f"| {r['step']} | {r['ms']:.1f} | {r['traced_ms']:.1f} | {r['untraced_ms']:.1f} | {calls} | {dev} |")
    total = sum(r["ms"] for r in rows)
    untraced = sum(r["untraced_ms"] for r in rows)
    out += ["", f"{len(rows)} steps, {total:.1f} ms, of which {untraced:.1f} ms untraced "
            f"({100 * untraced / total:.0f}%)." if total else ""]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, help="a Chrome trace written by --trace-step")
    ap.add_argument("--out", type=Path, help="write the table here (markdown) as well as printing it")
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        ap.error(f"{args.trace} is not a file: pass the trace.stepN[.rankR].json that --trace-step wrote")
    try:
        rows = summarize(json.loads(args.trace.read_text()))
    except ValueError as exc:
        print(f"trace_steps: {exc}", file=sys.stderr)
        return 1
    text = markdown(rows, args.trace.name)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
