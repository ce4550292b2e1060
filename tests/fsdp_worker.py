"""One rank of the multi-rank tests, launched by torchrun from tests/test_fsdp.py:

    torchrun --nproc-per-node 2 tests/fsdp_worker.py cpu --out DIR

Each rank writes DIR/rank{N}.json with what it measured (and the traceback if it failed), so the test that launched
it can assert on every rank and a failure reads as numbers rather than as a hung or dead process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the swaprl under test, wherever torchrun runs

import swaprl  # noqa: E402
from swaprl.engines.base import Engine, Sampling, sequence_logprobs  # noqa: E402
from swaprl.residency import local_tensor, nbytes  # noqa: E402

N = 4  # completions per prompt


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def reward(completion: list[int]) -> float:
    return sum(t % 2 == 0 for t in completion) / max(len(completion), 1)


def policy_loss(model, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """The GRPO loss of tests/grpo.py, on this rank's rollouts (FSDP2 averages the gradients over ranks)."""
    rewards = torch.tensor([reward(c) for c in completions])
    groups = rewards.view(len(prompts), N)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    rows = [list(prompts[i // N]) + list(c) for i, c in enumerate(completions)]
    width = max(map(len, rows))
    device = local_tensor(next(model.parameters())).device
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, len(prompts[i // N]): len(r)] = 1.0
    ids, mask, adv = ids.to(device), mask.to(device), adv.to(device)
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:]
    return -((logp * m).sum(1) / m.sum(1).clamp(min=1) * adv).mean()


def rank_prompts(rank: int, step: int, count: int = 2) -> list[list[int]]:
    """Prompts of their own on each rank (data parallelism), of lengths that differ between ranks."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 256, (count, 5 + rank), generator=gen).tolist()


def shards(tensors) -> list[torch.Tensor]:
    return [local_tensor(t).detach().cpu().clone() for t in tensors]


def optimizer_states(opt) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def bitwise_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                    for x, y in zip(a, b))


class ReplicaEngine(Engine):
    """A CPU stand-in for a data-parallel vLLM engine: an unsharded replica of the model, loaded only through
    `load_weights` (what the weight sync sends), its weights discarded by a level-2 sleep as vLLM's are."""

    def __init__(self, replica: torch.nn.Module) -> None:
        self.replica = replica
        self.loaded: dict[str, torch.Tensor] = {}

    def generate(self, prompts, sampling):
        from swaprl.engines import HFEngine

        return HFEngine(self.replica).generate(prompts, sampling)

    def logprobs(self, sequences):
        return sequence_logprobs(self.replica, sequences)

    def sleep(self, level: int) -> None:
        if level == 2:
            with torch.no_grad():
                for p in self.replica.parameters():
                    p.zero_()

    def load_weights(self, weights) -> None:
        params = dict(self.replica.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t)
                self.loaded[name] = t.clone()

    def expected_weights(self):
        return {n: (tuple(p.shape), p.dtype) for n, p in self.replica.named_parameters(remove_duplicate=False)}


# ---------------------------------------------------------------- CPU: FSDP2 on gloo
def cpu(args) -> dict:
    from swaprl.checkpoints import random_model
    from swaprl.engines import HFEngine

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank, "world": world}

    def build():
        torch.manual_seed(0)
        model = random_model("tiny", device="cpu")
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        return shard(model), full

    def train(swap: bool, grads: str, steps: int = 3) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor]]:
        model, _ = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = HFEngine(model)
        rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(grads=grads)) if swap else None
        phase = rt.phase if rt else (lambda name: __import__("contextlib").nullcontext())
        losses = []
        for step in range(steps):
            prompts = rank_prompts(rank, step)
            with phase("generate"):
                completions = engine.generate(prompts, Sampling(max_tokens=6, n=N, seed=step))
                if rt and step == steps - 1:
                    out[f"status_generate_{grads}"] = rt.status()
            with phase("train"):
                loss = policy_loss(model, prompts, completions)
                loss.backward()
                opt.step()
                # Zeroed, not dropped: the gradients are real DTensors while 'generate' moves them.
                opt.zero_grad(set_to_none=False)
                losses.append(loss.item())
        if rt:
            out[f"status_train_{grads}"] = rt.status()
            out[f"verify_{grads}"] = rt.verify_sync().ok
        swaprl.detach()
        return losses, shards(model.parameters()), shards(optimizer_states(opt))

    l0, p0, s0 = train(swap=False, grads="keep")
    for grads in ("offload", "free"):
        l1, p1, s1 = train(swap=True, grads=grads)
        out[f"bitwise_{grads}"] = {"losses": l0 == l1, "params": bitwise_equal(p0, p1),
                                   "optimizer": bitwise_equal(s0, s1), "losses_seen": [l0, l1]}
    out["local_state_bytes"] = sum(nbytes(t) for t in s0)
    out["full_state_bytes"] = 2 * sum(p.numel() * 4 for p in build()[1].values())

    # Refused: an FSDP2 parameter's shard is a view into FSDP2's own buffer.
    model, full = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        swaprl.attach(model, opt, "hf", config=swaprl.SwapConfig(params="offload"))
        out["params_offload_error"] = None
    except ValueError as exc:
        out["params_offload_error"] = str(exc)
    swaprl.detach()

    # The weight sync gathers each parameter's shards into full tensors; the on-policy check spans the ranks.
    from swaprl.checkpoints import random_model

    torch.manual_seed(123)  # a replica with other weights: only the sync can make it agree
    engine = ReplicaEngine(random_model("tiny", device="cpu"))
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(sleep_level=2, verify_sync=True))
    with rt.phase("generate"):
        out["sync_full_tensors"] = all(torch.equal(engine.loaded[n], full[n]) for n in full)
        before = rt.last_sync
        probe_before = torch.cat(engine.logprobs(rank_prompts(rank, 99)))
    with rt.phase("train"):
        prompts = rank_prompts(rank, 0)
        completions = [[(i + 2 * j) % 256 for j in range(4)] for i in range(len(prompts) * N)]  # rewards 1, 0, ..
        policy_loss(model, prompts, completions).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with rt.phase("generate"):
        after = rt.last_sync
        probe_after = torch.cat(engine.logprobs(rank_prompts(rank, 99)))
    out["sync"] = {"before": [before.max_abs_diff, before.ok], "after": [after.max_abs_diff, after.ok],
                   "engine_moved": float((probe_after - probe_before).abs().max())}
    try:  # a different number of probe sequences per rank would hang the trainer's collective forward
        rt.verify_sync([[1, 2, 3]] * (1 + rank))
        out["uneven_verify_error"] = None
    except ValueError as exc:
        out["uneven_verify_error"] = str(exc)
    swaprl.detach()

    # The engine's tensor-parallel group gathers its ranks' prompts; each rank keeps its own share.
    from swaprl.distributed import TPGroup

    everyone, mine = TPGroup(world).gather([[rank, i] for i in range(rank + 1)])
    out["tp_gather"] = {"everyone": everyone, "mine": everyone[mine]}
    try:
        TPGroup(world + 1)
        out["tp_size_error"] = None
    except ValueError as exc:
        out["tp_size_error"] = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["cpu"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--checkpoint-dir", default=None)
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = cpu(args)
    except BaseException:
        result = {"rank": rank, "error": traceback.format_exc()}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
        raise
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
