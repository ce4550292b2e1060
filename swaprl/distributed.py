"""Several ranks under torchrun: who this rank is, the engine's tensor-parallel groups, and ranks agreeing.

swaprl never starts a process group: launch with `torchrun` (several nodes through its rendezvous, `--nnodes N
--rdzv-backend c10d --rdzv-endpoint HOST:PORT`) and call `torch.distributed.init_process_group` yourself, as
FSDP2 needs anyway. The layout follows vLLM's external launcher: ranks `[k*tp, (k+1)*tp)` form tensor-parallel
group `k` (one engine, sharded over them), and the groups are data-parallel replicas of each other.

Every rank runs the same phase transitions, so a decision one rank takes alone (raise, skip) would leave the others
blocked in the next collective; the checks that can differ between ranks (free memory, the on-policy check) are
reduced over all ranks first, so every rank raises the same error or none does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from .readback import to_list


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_distributed() -> bool:
    """True with an initialised process group of more than one rank (an in-process vLLM starts one of its own)."""
    return world()[1] > 1


def local_world_size() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE); they share the node's host memory."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1) if is_distributed() else 1


def is_fsdp2(model: torch.nn.Module) -> bool:
    """True when `model` or one of its submodules was sharded with `torch.distributed.fsdp.fully_shard`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard_causal_lm(model: torch.nn.Module, **fsdp_kwargs) -> torch.nn.Module:
    """Shard a transformers causal LM with FSDP2 over the default process group: each decoder layer a unit, an
    untied embedding and lm_head each a unit of its own, the rest (final norm; a tied embedding) the root.
    `fsdp_kwargs` go to every `fully_shard` call (e.g. `mp_policy`). Returns `model`, sharded in place.

    The root stays gathered from its forward to the end of backward, gradients included, and FSDP2 all-gathers each
    unit into one buffer that its side stream keeps cached once freed: with the embedding and lm_head in the root,
    both are held whole through every layer's backward, and a buffer the size of both stands free beside the
    compute stream's peak. As units of their own they are gathered only while used. The lm_head keeps its
    parameters gathered from its forward to its backward, which follows at once (as the root did); the memory plan
    counts these units with `fsdp_units="split"`.
    """
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model, "get_input_embeddings"):
        raise ValueError(f"{type(model).__name__} has no `model.layers` or input embedding: shard_causal_lm takes a "
                         "transformers causal LM (Qwen2, Llama, ...); shard other models with fully_shard yourself")
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    for layer in layers:
        fully_shard(layer, **fsdp_kwargs)
    if head is not None and head.weight is not embedding.weight:  # tied: one tensor, so one unit (the root)
        fully_shard(embedding, **fsdp_kwargs)
        fully_shard(head, **{"reshard_after_forward": False, **fsdp_kwargs})
    fully_shard(model, **fsdp_kwargs)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Leave the model as it was before a forward pass without backward (scoring, generation).

    FSDP2 keeps the root module's parameters gathered after its forward (and the lm_head's, as `shard_causal_lm`
    shards it), expecting a backward to follow; none does, and they would stay gathered while the engine needs the
    memory: they are freed. DeepSpeed ZeRO-3 would prefetch the next training forward's parameters in this
    forward's order: its trace is dropped (`swaprl.compat.deepspeed.forget_trace`).
    """
    from .compat import deepspeed as deepspeed_compat

    deepspeed_compat.forget_trace(model)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _reduce_device() -> torch.device:
    # NCCL reduces CUDA tensors only, gloo reduces CPU tensors: pick what the default group's backend takes.
    backend = str(dist.get_backend())
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(values: Sequence[float], op: Literal["max", "min", "sum"]) -> list[float]:
    """`values` reduced element-wise over all ranks (float64); `values` itself on a single rank."""
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_reduce_device())
    dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}[op])
    return to_list(t)  # not behind a transition's queued device-to-host copies


class TPGroup:
    """This rank's tensor-parallel group: ranks `[index*size, (index+1)*size)`, which together run one engine.

    Building one is collective (every rank must build one, with the same size, at the same point). Its gloo
    subgroup carries Python objects (prompts), away from the trainer's NCCL streams.
    """

    def __init__(self, size: int) -> None:
        rank, world_size = world()
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size={size!r}; use a positive integer")
        if world_size % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the {world_size} ranks; each "
                             "tensor-parallel group needs the same number of ranks: use a divisor of the world size")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if size > 1 and local % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the {local} ranks of a node: a "
                             "tensor-parallel group must stay inside one node")
        self.size, self.index, self.rank = size, rank // size, rank % size
        self.group = None
        if size > 1:
            self.group, _ = dist.new_subgroups_by_enumeration(
                [list(range(k * size, (k + 1) * size)) for k in range(world_size // size)], backend="gloo")

    def gather(self, items: Sequence) -> tuple[list, slice]:
        """Every rank's `items` of this group, concatenated in rank order, and where this rank's own lie.

        The engine's ranks must be handed identical requests (vLLM's external launcher runs one scheduler per rank
        and relies on all of them deciding alike), while each trainer rank has prompts of its own: gathering
        keeps the caller's code the same for any tensor-parallel size, at the price of one small object gather.
        """
        items = list(items)
        if self.size == 1:
            return items, slice(0, len(items))
        parts: list = [None] * self.size
        dist.all_gather_object(parts, items, group=self.group)
        start = sum(len(p) for p in parts[: self.rank])
        return [x for p in parts for x in p], slice(start, start + len(items))
