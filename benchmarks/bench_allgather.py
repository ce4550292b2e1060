"""The weight sync's floor between GPUs: NCCL's all-gather rate on this machine's ranks.

    torchrun --nproc-per-node 2 benchmarks/bench_allgather.py [--mib 256] [--repeats 10] [--out OUT.json]

Under FSDP2 the weight sync gathers every parameter from its shards (`DTensor.full_tensor`) before the engine loads
it: of each full tensor a rank receives (world - 1) / world from the others. This times `all_gather_into_tensor` of
`--mib` MiB per rank, medians after a warm-up, and gives the rate at which a rank receives the others' bytes
("gathered GB/s"). `benchmarks/switch_floors.py --gather-GBps` takes it for the sync's floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes per rank of one all-gather, in MiB")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if "RANK" not in os.environ or not torch.cuda.is_available():
        raise SystemExit("run it under torchrun with one CUDA GPU per rank: "
                         "torchrun --nproc-per-node 2 benchmarks/bench_allgather.py")
    if args.mib < 1 or args.repeats < 1:
        raise SystemExit(f"--mib {args.mib} --repeats {args.repeats}: give 1 or more of each")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    n = args.mib * 2**20
    shard = torch.full((n,), rank, dtype=torch.uint8, device="cuda")
    full = torch.empty(n * world, dtype=torch.uint8, device="cuda")
    times = []
    for rep in range(args.repeats + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_gather_into_tensor(full, shard)
        torch.cuda.synchronize()
        if rep:  # the first one sets NCCL's channels up
            times.append(time.perf_counter() - start)
    # every rank's shard landed where it belongs: a rate of a gather that moved nothing would be no floor
    assert all(int(full[r * n]) == r and int(full[(r + 1) * n - 1]) == r for r in range(world))
    seconds = statistics.median(times)
    result = {"world_size": world, "bytes_per_rank": n, "median_s": seconds,
              "gathered_GBps": n * (world - 1) / seconds / 1e9, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    if rank == 0:
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
