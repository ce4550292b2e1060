"""One rank of tests/test_saving.py: train the tiny model with swaprl, save through swaprl.saving, or load and go on.

    python tests/saving_worker.py save --model DIR --checkpoint CK --dump F [--states host]     # one process
    torchrun --standalone --nproc-per-node 2 tests/saving_worker.py load --model DIR --checkpoint CK --dump F

bf16 parameters with fp32 master weights (SwapConfig(master_weights=True)), sharded with FSDP2 over gloo under
torchrun (or on one rank with `--fsdp`; NCCL with `--device cuda`), the optimizer states in the homes `--states`
gives them. `save` trains `--steps` steps and saves; `load`
attaches afresh, loads, and trains one step more. Both write to `--dump` (rank 0) the whole tensors, gathered from
every rank, of what the checkpoint holds (the model, the masters and the states, by the model parameter's name) as
they are right after the save or the load, and what `load` returned; `load` also the loss of its step after.
`save --export DIR` also writes the trained model there with `saving.export_hf`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the swaprl under test, wherever torchrun runs

import swaprl
from swaprl import saving
from swaprl.compat.torch import local_tensor
from swaprl.config import parse_optimizer_states
from swaprl.optimizer_hooks import masters_of
from tests.fsdp_worker import N, policy_loss, rank_prompts


def whole(t: torch.Tensor) -> torch.Tensor:
    """`t` whole on the host: a DTensor's rows gathered from every rank, through its mesh's device (a host-resident
    state's or master's rows are in host memory)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach().cpu().clone()
    rows = local_tensor(t).detach().to(t.device_mesh.device_type)
    return DTensor.from_local(rows, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(),
                              run_check=False).full_tensor().cpu()


def snapshot(model, optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    masters = masters_of(optimizer)
    of = {id(m): names[id(masters.model_param(m))] for m in masters}
    with torch.no_grad():
        return {"model": {n: whole(p) for n, p in model.named_parameters()},
                "masters": {of[id(m)]: whole(m) for m in masters},
                "states": {of[id(p)]: {k: whole(v) for k, v in s.items() if isinstance(v, torch.Tensor)}
                           for p, s in optimizer.state.items()},
                "lr": [g["lr"] for g in optimizer.param_groups]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "load"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--states", default="host")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--export", default=None, help="save: also export_hf into this directory")
    ap.add_argument("--device", default="cpu", help="cpu (gloo), or cuda (NCCL, one GPU per rank)")
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 on one rank too")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sharded = world > 1 or args.fsdp
    if sharded:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank = dist.get_rank() if sharded else 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device)
    if sharded:
        from swaprl.distributed import shard_causal_lm

        shard_causal_lm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    states = args.states if args.states in ("host", "swap", "auto") else parse_optimizer_states(args.states)
    engine = swaprl.engines.HFEngine(model)
    rt = swaprl.attach(model, optimizer, engine, config=swaprl.SwapConfig(
        master_weights=True, optimizer_states=states, stream_chunk_bytes=2**20, grads="free"))

    def step(k: int) -> float:
        prompts = rank_prompts(rank, k)
        with rt.phase("generate"):
            completions = engine.generate(prompts, swaprl.Sampling(max_tokens=4, n=N, seed=k))
        loss = policy_loss(model, prompts, completions)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    out: dict = {"world": world}
    if args.mode == "save":
        out["losses"] = [step(k) for k in range(args.steps)]
        out["files"] = sorted(str(f.relative_to(args.checkpoint)) for f in saving.save(
            args.checkpoint, model, optimizer, extra={"step": args.steps}, rank_extra={"rank": rank}))
        out["snapshot"] = snapshot(model, optimizer)
        if args.export:
            saving.export_hf(args.export if rank == 0 else None, model, optimizer, tokenizer_from=args.model)
    else:
        if cuda:  # what the load holds on the device beyond what was there
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        loaded = saving.load(args.checkpoint, model, optimizer)
        if cuda:
            out["load_device_peak_growth"] = torch.cuda.max_memory_allocated() - base
        out["loaded"] = {"extra": loaded.extra, "rank_extra": loaded.rank_extra, "world": loaded.world}
        out["snapshot"] = snapshot(model, optimizer)
        out["homes"] = rt.status()["optimizer_homes"]
        out["after"] = step(loaded.extra["step"])
    if sharded:  # every rank's files and what it loaded
        gathered = [None] * world
        dist.all_gather_object(gathered, {k: out.get(k) for k in ("files", "loaded")})
        out["ranks"] = gathered
    if rank == 0:
        torch.save(out, args.dump)
    swaprl.detach()
    if sharded:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    print(json.dumps({"ok": True}))
