"""Run a script on a GPU made to offer a smaller card's memory, so that a larger card runs the smaller one's plan.

    torchrun --nproc-per-node 2 benchmarks/as_gpu.py H100 examples/qwen72b.py --layers 20 --tp 1 --steps 5

A driver allocation that neither torch nor vLLM sees takes the rest of this rank's GPU (`child.hold_beyond`), and
the two readers of the card's total that the planner, swaprl's checks and vLLM's start use
(`torch.cuda.mem_get_info`, `torch.accelerator.get_memory_info`) report the smaller card's total: the plan, the
engine's share and the KV cache are then the smaller card's. Speeds (compute, memory, copies, the driver's page
tables) stay the card's own, so the result is the smaller card's memory plan at the larger card's speeds. NVML's
device figures include the held bytes (logged at the start).

Allocator settings are read when torch first allocates, which here is before the script runs: PYTORCH_CUDA_ALLOC_CONF
must be set in the environment of this command (the script's own default would come too late), and is refused
otherwise.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch

from child import hold_beyond


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: as_gpu.py GPU SCRIPT [ARGS...]  (GPU: a name from swaprl.plan.hardware.GPUS)")
    from swaprl.compat import torch as torch_compat
    from swaprl.plan.hardware import GPUS

    name, script = sys.argv[1], sys.argv[2]
    if name not in GPUS:
        raise SystemExit(f"as_gpu.py {name}: unknown GPU; choose among {', '.join(GPUS)}")
    if not torch_compat.alloc_conf():
        # torch reads its settings at the first allocation, here, before the script can set its own; the script
        # would then believe settings torch never took (swaprl reads the page size from the environment too)
        raise SystemExit("as_gpu.py: set PYTORCH_CUDA_ALLOC_CONF in this command's environment (e.g. "
                         "expandable_segments:True,large_segment_size_mb:64): torch takes its settings before the "
                         "script runs")
    total = GPUS[name].memory_bytes
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # this rank's GPU, before anything allocates
    held = hold_beyond(total)
    cuda_info, accelerator_info = torch.cuda.mem_get_info, torch.accelerator.get_memory_info

    def mem_get_info(device=None):
        return cuda_info(device)[0], total

    def get_memory_info(device=None):
        return accelerator_info(device)[0], total

    torch.cuda.mem_get_info = torch.cuda.memory.mem_get_info = mem_get_info
    torch.accelerator.get_memory_info = get_memory_info
    print(f"as an {name}: {held / 2**30:.2f} GiB held, {total / 2**30:.2f} GiB reported as the total; "
          f"allocator settings {torch_compat.alloc_conf()}", flush=True)
    sys.argv = sys.argv[2:]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python SCRIPT` would
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
