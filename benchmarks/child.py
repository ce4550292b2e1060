"""Run one measurement of a benchmark in a process of its own.

vLLM's sleep-mode allocator allows one engine per process, and an out-of-memory error can leave CUDA unusable in
the process that hit it, so each attempt (a way, a utilization, a depth) gets a fresh interpreter: the benchmark
script itself with `--child SPEC`, where SPEC is a JSON file naming the `result` file the child writes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Child:
    rc: int | str  # the exit status, or "timeout"
    seconds: float
    log: Path  # the child's stdout and stderr
    result: dict | None  # what it wrote, when it exited 0 and wrote it
    ranks: tuple[dict, ...] = ()  # under torchrun: what ranks 1.. wrote, in rank order

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()


_HELD: list = []  # the driver allocations that hold_beyond made: kept for the life of the process


def hold_beyond(total_bytes: int) -> int:
    """Leave this process's GPU only the memory of a card of `total_bytes` (as CUDA counts a card's total), so that a
    larger card runs what a smaller one would hold: a driver allocation that torch and vLLM do not see (`cuMemAlloc`)
    takes the rest for the life of the process. `cudaMemGetInfo` still reports the larger card's total: a reader of
    the total is told apart (bench_grpo's `engine_share`, as_gpu.py). Returns the held size; NVML's device figure
    includes it, so a caller subtracts it from what it reads there."""
    import ctypes

    import torch

    torch.zeros(1, device="cuda")  # the primary context, current on this thread, as the driver call needs
    real = torch.cuda.mem_get_info()[1]
    held = real - total_bytes
    if held < 0:
        raise SystemExit(f"this GPU has {real / 2**30:.2f} GiB, less than the {total_bytes / 2**30:.2f} GiB asked for: "
                         "emulate a card no larger than the one here")
    if held:
        ptr = ctypes.c_uint64()
        rc = ctypes.CDLL("libcuda.so.1").cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(held))
        if rc:
            raise RuntimeError(f"cuMemAlloc of {held / 2**30:.2f} GiB to emulate a smaller GPU failed (CUDA error "
                               f"{rc}): free the GPU first")
        _HELD.append(ptr)
    return held


def rank_result_path(result: str | Path) -> Path:
    """Where this process writes its result: `result` on rank 0 (or without torchrun), `result.rank{r}` on rank r."""
    rank = int(os.environ.get("RANK", "0"))
    return Path(result) if rank == 0 else Path(f"{result}.rank{rank}")


def run_child(script: str, spec: dict, name: str, run_dir: Path, timeout: float, *, nproc: int | None = None,
              nnodes: int = 1) -> Child:
    """Run `script --child` on `spec` (plus `result`, a path in `run_dir`); spec, result and log are `name.*`.
    `nproc`: run it as that many ranks under torchrun on this node (1 included: a process group of one); the
    result is rank 0's, the others' are in `ranks`. `nnodes` > 1: as that many nodes of `nproc` ranks on this
    machine, each its own torchrun with its own GPUs (CUDA_VISIBLE_DEVICES), meeting through torchrun's c10d
    rendezvous as the nodes of a cluster do."""
    spec = {**spec, "result": str(run_dir / f"{name}.json")}
    spec_path, log_path = run_dir / f"{name}.spec.json", run_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    if nproc is None:
        launches = [([sys.executable], None)]
    elif nnodes == 1:
        launches = [([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)],
                     None)]
    else:
        endpoint = f"localhost:{_free_port()}"
        # Each node takes the next `nproc` of the GPUs this process may use.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(nproc * nnodes)]
        if len(gpus) < nproc * nnodes:
            raise ValueError(f"{nnodes} nodes of {nproc} ranks need {nproc * nnodes} GPUs; CUDA_VISIBLE_DEVICES "
                             f"names {len(gpus)}: name more, or run fewer nodes")
        launches = [([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node",
                      str(nproc), "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id", name,
                      "--rdzv-endpoint", endpoint],
                     {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus[node * nproc:(node + 1) * nproc])})
                    for node in range(nnodes)]
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        procs = [subprocess.Popen([*cmd, script, "--child", str(spec_path)], stdout=logf, stderr=subprocess.STDOUT,
                                  env=env) for cmd, env in launches]
        rc: int | str = 0
        # One node that fails leaves the others waiting for it in a collective: stop them at once.
        while any(p.poll() is None for p in procs) and not rc:
            if time.perf_counter() - t0 > timeout:
                rc = "timeout"
            else:
                rc = next((p.returncode for p in procs if p.returncode), 0)
                time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        rc = rc or next((p.returncode for p in procs if p.returncode), 0)
    seconds = time.perf_counter() - t0
    world = (nproc or 1) * nnodes
    paths = [Path(spec["result"])] + [Path(f"{spec['result']}.rank{r}") for r in range(1, world)]
    if rc != 0 or not all(p.exists() for p in paths):
        return Child(rc, seconds, log_path, None)
    result, *ranks = (json.loads(p.read_text()) for p in paths)
    return Child(rc, seconds, log_path, result, tuple(ranks))


def _free_port() -> int:
    """A TCP port free on this machine now, for a rendezvous of local nodes."""
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def result_or_say_why(script: str, spec: dict, name: str, run_dir: Path, timeout: float, *,
                      nproc: int | None = None) -> dict | None:
    """`run_child`'s result, or None after printing why there is none (the exit status, the log's last lines); under
    torchrun (`nproc`) rank 0's, with the other ranks' under "other_ranks"."""
    child = run_child(script, spec, name, run_dir, timeout, nproc=nproc)
    if child.result is None:
        print(f"{name}: failed ({child.rc}); last lines of {child.log}:\n" + "\n".join(child.log_lines()[-30:]))
        return None
    return {**child.result, "other_ranks": list(child.ranks)} if child.ranks else child.result


def start_runs(parser: argparse.ArgumentParser, argv: list[str] | None, run_one: Callable[[str], None], *,
               timeout: float) -> tuple[argparse.Namespace, Path] | None:
    """`start` for a benchmark that runs its measurements in children, with the arguments all of those take: where
    checkpoints are written (--workdir), where results go (--out, default a new temporary directory, created here),
    each child's time limit. Returns (args, the results directory), or None in a child."""
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "swaprl-checkpoints"))
    parser.add_argument("--out", default=None, help="directory for the results")
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = start(parser, argv, run_one)
    if args is None:
        return None
    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    return args, out


def start(parser: argparse.ArgumentParser, argv: list[str] | None,
          run_one: Callable[[str], None]) -> argparse.Namespace | None:
    """Parse the benchmark's command line. In a child (`--child SPEC`) run its one measurement and return None."""
    args = parser.parse_args(argv)
    if args.child:
        run_one(args.child)
        return None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return args
