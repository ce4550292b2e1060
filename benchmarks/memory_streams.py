"""Which stream's cached blocks stood free when torch's allocator held the most memory, from a memory-history
snapshot (`examples/grpo.py --memory-step N`) replayed stream by stream.

    python benchmarks/memory_streams.py OUT/memory.step2.rank0.pickle [--out streams.md]

torch's caching allocator keeps the blocks a stream frees for that stream: a block freed by FSDP2's all-gather
stream cannot serve the backward on the compute stream, so at training's peak one stream's free blocks can sit
beside another stream's new pages. The memory report gives the total of free cached blocks at a peak; this splits
it by stream, at the moment the default pool held the most (private pools, such as vLLM's, are left out).

The snapshot's trace holds the allocator's actions since recording began (the newest `max_entries` of them); its
segments, the state when it was taken. The state at the first recorded action is that state less every recorded
change, and the replay walks forward from there.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections import Counter, defaultdict
from pathlib import Path

_RESERVED = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_ALLOCATED = {"alloc": 1, "free_completed": -1}  # a block waiting for another stream's use stays allocated
_DEFAULT_POOL = (0, 0)
_PLUMBING = {"allocate", "decorate_context", "__call__", "_call_impl", "_wrapped_call_impl"}


def _default_pool(pool) -> bool:
    return pool is None or tuple(pool) == _DEFAULT_POOL  # traces of torch versions without pool ids: counted


def _origin(frames: list) -> str | None:
    """Where an allocation was asked for: its innermost Python frame past torch's plumbing (FSDP2's all-gather
    and reduce-scatter buffers name `foreach_all_gather` and `foreach_reduce`)."""
    for f in frames:
        name, where = f.get("name", ""), f.get("filename", "")
        if where.endswith(".py") and name not in _PLUMBING and "/torch/utils/" not in where:
            return name
    return None


def replay(snapshot: dict, device: int | None = None) -> dict:
    """Per stream, the default pool's reserved, allocated and free bytes at the moment its reserved total peaked
    within the recorded actions. `device`: the index into `device_traces` (default: the one with the most
    allocator actions; a rank's snapshot also lists the other GPUs, with a few `snapshot` marks at most)."""
    traces = snapshot.get("device_traces") or []
    counts = [sum(e["action"] in _RESERVED or e["action"] in _ALLOCATED for e in t) for t in traces]
    if device is None and any(counts):
        device = max(range(len(traces)), key=counts.__getitem__)
    if device is None or not 0 <= device < len(traces) or not counts[device]:
        raise ValueError("the snapshot records no allocator actions: take it with torch.cuda.memory."
                         "_record_memory_history() on while the step runs (examples/grpo.py --memory-step N)")
    events = [e for e in traces[device] if e["action"] in _RESERVED or e["action"] in _ALLOCATED]
    events = [e for e in events if _default_pool(e.get("pool_id"))]
    reserved: dict[int, int] = defaultdict(int)
    allocated: dict[int, int] = defaultdict(int)
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) == device and _default_pool(seg.get("segment_pool_id")):
            reserved[seg["stream"]] += seg["total_size"]
            # in the trace's terms: the sizes asked for (not the rounded blocks), blocks awaiting their free included
            allocated[seg["stream"]] += sum(b["requested_size"] for b in seg.get("blocks", [])
                                            if b["state"] != "inactive")
    for e in events:  # back to the state before the first recorded action
        reserved[e["stream"]] -= _RESERVED.get(e["action"], 0) * e["size"]
        allocated[e["stream"]] -= _ALLOCATED.get(e["action"], 0) * e["size"]
    # The peak's moment: the most reserved, and of the moments that held it the one with the most allocated (a
    # segment is mapped before its first block is handed out): what stood free even then was stranded.
    best, at, state = (sum(reserved.values()), sum(allocated.values())), -1, (dict(reserved), dict(allocated))
    grew = grew_on = None  # the stream whose new pages last raised the total, and that stream at the peak
    origins: dict[int, Counter] = defaultdict(Counter)
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            origins[e["stream"]][_origin(e.get("frames") or [])] += e["size"]
        reserved[e["stream"]] += _RESERVED.get(e["action"], 0) * e["size"]
        allocated[e["stream"]] += _ALLOCATED.get(e["action"], 0) * e["size"]
        if _RESERVED.get(e["action"], 0) > 0:
            grew = e["stream"]
        now = (sum(reserved.values()), sum(allocated.values()))
        if now > best:
            best, at, state, grew_on = now, i, (dict(reserved), dict(allocated)), grew
    peak = best[0]
    streams = {s: {"reserved": state[0].get(s, 0), "allocated": state[1].get(s, 0)}
               for s in sorted(set(state[0]) | set(state[1]))}
    for stream, row in streams.items():
        row["free"] = row["reserved"] - row["allocated"]
        # the place that asked this stream for the most bytes in the recorded actions; None: no Python frame
        # (autograd's backward allocates from C++), or no allocation recorded
        row["mostly"] = origins[stream].most_common(1)[0][0] if origins[stream] else None
    return {"device": device, "actions": len(events), "peak_reserved": peak, "at_action": at,
            "grew_on": grew_on, "streams": streams}


def markdown(path: Path, result: dict) -> str:
    gib = 2**30
    lines = [f"# Free cached blocks by stream at the default pool's peak: {path.name}", "",
             f"Device {result['device']}: {result['actions']} recorded actions of the default pool; it held "
             f"{result['peak_reserved'] / gib:.2f} GiB at its peak (action {result['at_action']}, on stream "
             f"{result['grew_on']}).", "",
             "| stream | mostly allocated by | reserved GiB | allocated GiB | free GiB |", "|---|---|---:|---:|---:|"]
    for stream, row in sorted(result["streams"].items(), key=lambda kv: -kv[1]["free"]):
        lines.append(f"| {stream}{' (the one that grew)' if stream == result['grew_on'] else ''} | "
                     f"{row['mostly'] or 'no Python frame'} | {row['reserved'] / gib:.2f} | "
                     f"{row['allocated'] / gib:.2f} | {row['free'] / gib:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot", type=Path, help="a pickle from torch.cuda.memory._dump_snapshot")
    ap.add_argument("--device", type=int, default=None, help="index into the snapshot's device traces")
    ap.add_argument("--out", type=Path, default=None, help="write the table here (markdown) as well")
    args = ap.parse_args(argv)
    if not args.snapshot.is_file():
        raise SystemExit(f"{args.snapshot}: no such file; give a snapshot from examples/grpo.py --memory-step N")
    with args.snapshot.open("rb") as f:
        result = replay(pickle.load(f), args.device)
    text = markdown(args.snapshot, result)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
