"""The first optimizer step's split when torch's cache holds less than training's peak, in a process of its own
(tests/test_split.py launches it):

    python tests/first_step_worker.py

Between the backward and the first `optimizer.step()` torch's cache goes back to the driver, as the allocator does
itself when a request fails under pressure (it hands back its cached blocks and retries; TRL's 14B step did). Memory
is blocked so that beside training there is room for about a quarter of the states: the rest must go to host
memory, or the next backward finds the memory it needs taken by states. Prints, as the last line, JSON with the
states' homes, the bytes of states on the device in each step's backward and `oom`: the step that ran out of
memory, or null.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the swaprl under test

import swaprl
from swaprl.checkpoints import random_model
from swaprl.config import default_reserve_bytes
from swaprl.state_homes import _expected_per_parameter
from swaprl.residency import nbytes
from tests.grpo import ReplicaEngine

MiB = 2**20


def state_bytes_on_device(opt: torch.optim.Optimizer) -> int:
    return sum(nbytes(t) for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.dim() > 0)


def main() -> None:
    logging.basicConfig(level=logging.INFO)  # swaprl's log on stderr: the test reads where the states went
    torch.manual_seed(0)
    model = random_model("qwen2.5-1.5b", device="cuda")  # fp32: 6.2 GB of parameters, AdamW states 12.4 GB
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 1000, (4, 512), generator=torch.Generator().manual_seed(1)).cuda()
    grads = sum(nbytes(p) for p in model.parameters())
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model(input_ids=ids, labels=ids).loss.backward()
    transients = torch.cuda.max_memory_reserved() - before - grads  # the backward's peak beyond its gradients
    model.zero_grad(set_to_none=True)
    rt = swaprl.attach(model, opt, ReplicaEngine(random_model("qwen2.5-1.5b", device="cuda")))
    with rt.phase("generate"):  # the first sync: what the engine keeps of it stays on the device from now on
        pass
    torch.cuda.empty_cache()
    need = sum(_expected_per_parameter(opt).values())
    free, total = torch.cuda.mem_get_info()
    left = grads + transients + default_reserve_bytes(total) + need // 4 + 256 * MiB
    blocker = torch.empty(free - left, dtype=torch.uint8, device="cuda")
    steps, oom = [], None
    for i in range(3):
        try:
            with rt.phase("generate"):
                pass
            model(input_ids=ids, labels=ids).loss.backward()
            steps.append(state_bytes_on_device(opt))
            torch.cuda.empty_cache()  # the allocator's own move when a request fails under pressure
            opt.step()
            opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            oom = i
            break
    print(json.dumps({"homes": rt.status()["optimizer_homes"], "states_on_device": steps, "oom": oom,
                      "transients": transients, "need": need}), flush=True)
    del blocker
    opt.zero_grad(set_to_none=True)
    swaprl.detach()


if __name__ == "__main__":
    main()
