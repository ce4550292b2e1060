"""The cost of a checkpoint of examples/grpo.py's state, against what the disk itself writes and reads in the same run.

    python benchmarks/bench_checkpoint.py --preset qwen2.5-7b --dtype bfloat16 --master-weights \
        --optimizer-states host --dir /local/nvme/bench-checkpoint --out benchmarks/results/checkpoint_7b_h200
    torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py --preset qwen2.5-7b --dtype bfloat16 \
        --master-weights --optimizer-states host --dir /local/nvme/bench-checkpoint \
        --out benchmarks/results/checkpoint_7b_h200x2                                     # FSDP2, one GPU per rank
    python benchmarks/bench_checkpoint.py --preset tiny --warmup 0 --repeats 1 --dir /tmp/bench-checkpoint  # CPU

The state is the one examples/grpo.py checkpoints: the model of `--preset` (a random checkpoint, FSDP2 under
torchrun as grpo.py shards it), AdamW with its states in the homes `--optimizer-states` gives them and, with
`--master-weights`, the fp32 masters, after one optimizer step has made the states. Each repeat writes a checkpoint
the way grpo.py's `--save-steps` does (run_files.Checkpoints.save over swaprl.saving.save: DCP's files, each fsynced,
then the manifest's CRC-32s and the rename), evicts the files from the page cache (posix_fadvise DONTNEED), and
loads it the way `--resume` does (the manifest's checks, then swaprl.saving.load into the attached model and
optimizer). The floor is the disk's own: in the same run each rank writes and fsyncs a file of its share's size in
64 MiB blocks (as dd bs=64M conv=fsync does), which is evicted and read back. Every figure is the median of
`--repeats` after `--warmup`, timed between barriers with the device synchronised; sizes and rates are over all ranks.
Prints a table and ends with one JSON line (also in OUT/checkpoint.json with `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import swaprl  # noqa: E402
from swaprl import saving  # noqa: E402
from swaprl.config import parse_optimizer_states  # noqa: E402
from swaprl.compat.transformers import enable_activation_checkpointing  # noqa: E402

import grpo  # noqa: E402  (the loop whose state this measures: its model loading and sharding)
import run_files  # noqa: E402  (its checkpoints: the manifest, the checks, the rename)

BLOCK = 64 * 2**20


def evict(files: list[Path]) -> None:
    """Drop `files`' pages from the page cache, so the next read comes from the disk (they were fsynced)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_rates(path: Path, size: int, barrier) -> tuple[float, float]:
    """Seconds to write and fsync `size` bytes into `path` in 64 MiB blocks, and to read them back from the disk."""
    block = torch.randint(0, 256, (min(BLOCK, max(size, 1)),), dtype=torch.uint8).numpy().tobytes()
    barrier()
    t = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            left -= f.write(block[:left])
        f.flush()
        os.fsync(f.fileno())
    barrier()
    write_s = time.perf_counter() - t
    evict([path])
    barrier()
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(BLOCK):
            pass
    barrier()
    read_s = time.perf_counter() - t
    path.unlink()
    return write_s, read_s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--master-weights", action="store_true")
    ap.add_argument("--optimizer-states", default="host")
    ap.add_argument("--dir", required=True, help="where the checkpoints are written: the disk being measured")
    ap.add_argument("--checkpoint-dir", default="/tmp/swaprl-checkpoints", help="where the random model is written")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    rank, world, device = grpo.init_distributed()
    cuda = device.startswith("cuda")

    def barrier() -> None:
        if cuda:
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    from transformers import AutoModelForCausalLM

    from swaprl.checkpoints import write_random_checkpoint

    name = args.preset + (f"-{args.layers}l" if args.layers else "")
    source = Path(args.checkpoint_dir) / name
    if rank == 0:
        write_random_checkpoint(args.preset, source, layers=args.layers)
    barrier()
    dtype = getattr(torch, args.dtype)
    model = (grpo.load_sharded(source, dtype, device) if world > 1
             else AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device))
    enable_activation_checkpointing(model)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    states = args.optimizer_states
    states = states if states in ("auto", "swap", "host") else parse_optimizer_states(states)
    rt = swaprl.attach(model, optimizer, config=swaprl.SwapConfig(master_weights=args.master_weights,
                                                                   optimizer_states=states, grads="free"))
    ids = torch.randint(0, min(model.config.vocab_size, 256), (2, 64), device=device)
    model(input_ids=ids).logits.float().mean().backward()  # one step: the states exist, where their homes are
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    homes = rt.status()["optimizer_homes"]

    root = Path(args.dir)
    runs = []
    for k in range(args.warmup + args.repeats):
        checkpoints = run_files.Checkpoints(root / f"run{k}", rank=rank, world=world, keep=1)
        timed = {}

        def write(d: Path, timed: dict = timed) -> list[Path]:
            t = time.perf_counter()
            files = saving.save(d, model, optimizer, extra={"step": 1})
            timed["dcp_save_s"] = time.perf_counter() - t  # (this rank's; the whole save is timed outside)
            return files

        barrier()
        t = time.perf_counter()
        path = checkpoints.save(1, write)
        barrier()
        save_s = time.perf_counter() - t
        manifest = json.loads((path / run_files.MANIFEST).read_text())
        files = [path / e["name"] for e in manifest["files"]] + [path / run_files.MANIFEST]
        total = sum(f.stat().st_size for f in files)
        mine = sum(e["bytes"] for e in manifest["files"] if e["rank"] == rank)
        evict([f for e in manifest["files"] if e["rank"] == rank for f in [path / e["name"]]])
        barrier()
        t = time.perf_counter()
        intact = checkpoints.newest_intact()
        barrier()
        check_s = time.perf_counter() - t
        evict(files)  # the checks read them: the load reads from the disk again
        barrier()
        t = time.perf_counter()
        saving.load(intact.path, model, optimizer)
        barrier()
        load_s = time.perf_counter() - t
        write_s, read_s = disk_rates(root / f"disk{k}.rank{rank}", mine, barrier)
        runs.append({"save_s": save_s, "dcp_save_s": timed["dcp_save_s"], "check_s": check_s, "load_s": load_s,
                     "disk_write_s": write_s, "disk_read_s": read_s, "bytes": total})
        barrier()
        if rank == 0:
            shutil.rmtree(root / f"run{k}")
    timed_runs = runs[args.warmup:]
    med = {key: statistics.median(r[key] for r in timed_runs) for key in timed_runs[0]}
    size = med["bytes"]
    result = {"benchmark": "checkpoint", "preset": args.preset, "layers": args.layers, "dtype": args.dtype,
              "master_weights": args.master_weights, "optimizer_states": args.optimizer_states,
              "optimizer_homes_bytes": homes, "world_size": world, "device": device,
              "gpu": torch.cuda.get_device_name() if cuda else None, "host": platform.node(),
              "torch": torch.__version__, "swaprl": swaprl.__version__, "dir": str(root),
              "repeats": args.repeats, "warmup": args.warmup, "median": med,
              "save_gb_s": size / med["save_s"] / 1e9, "load_gb_s": size / med["load_s"] / 1e9,
              "disk_write_gb_s": size / med["disk_write_s"] / 1e9, "disk_read_gb_s": size / med["disk_read_s"] / 1e9,
              "save_over_disk_write": med["save_s"] / med["disk_write_s"],
              "load_over_disk_read": med["load_s"] / med["disk_read_s"], "runs": runs}
    if rank == 0:
        print(f"checkpoint of {args.preset} ({size / 2**30:.2f} GiB on {world} rank(s), {device}) in {root}")
        print(f"{'':28}{'seconds':>10}{'GB/s':>10}{'x disk':>10}")
        rows = [("save (grpo.py --save-steps)", med["save_s"], result["save_over_disk_write"]),
                ("  of it swaprl.saving.save", med["dcp_save_s"], med["dcp_save_s"] / med["disk_write_s"]),
                ("check (the manifest's CRCs)", med["check_s"], None),
                ("load (swaprl.saving.load)", med["load_s"], result["load_over_disk_read"]),
                ("disk: write + fsync", med["disk_write_s"], 1.0), ("disk: read", med["disk_read_s"], 1.0)]
        for what, seconds, ratio in rows:
            times = "" if ratio is None else f"{ratio:.2f}"
            print(f"{what:28}{seconds:>10.3f}{size / seconds / 1e9:>10.2f}{times:>10}")
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "checkpoint.json").write_text(json.dumps(result, indent=1))
    swaprl.detach()
    if world > 1:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
