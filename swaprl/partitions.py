"""Flat partitions: what an optimizer steps in place of the model's parameters, declared by the library that made them.

swaprl binds a model and the torch optimizer that trains it, and takes the optimizer's parameters to be the model's
(or swaprl's own fp32 masters of them, `swaprl.master`). DeepSpeed's ZeRO breaks that on purpose: it flattens the
model's parameters, splits them over the ranks, and points its torch optimizer at one flat fp32 tensor per group
(ZeRO-1/2, `single_partition_of_fp32_groups`) or per sub-group (ZeRO-3, `fp32_partitioned_groups_flat`, listed in
the optimizer's groups only inside its step). Those tensors and their states are what moves for 'generate'; the
model's parameters are views of, or placeholders for, buffers ZeRO keeps. `FlatPartitions` says so explicitly, so
that `swaprl.checks` accepts an optimizer over them and the homes (`swaprl.state_homes`) place them, rather than
either check being bypassed. `swaprl.compat.deepspeed.partitions` builds one from a ZeRO optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class FlatPartitions:
    """The tensors an optimizer steps for a model whose parameters another library keeps in flat partitions."""

    owner: str
    """Who made them, named in errors: "DeepSpeed ZeRO-3"."""
    tensors: tuple[torch.Tensor, ...]
    """Every tensor the optimizer steps, in the owner's order (one per group or sub-group); its states are keyed by
    them."""
    copies: frozenset[int]
    """`id`s of the tensors that are copies of the model's values (fp32 masters of bf16 parameters): each moves with
    its states. The others are the model's own storage (ZeRO-3 training in fp32 keeps no second copy) and stay."""
    kept: frozenset[int] = frozenset()
    """`id`s of the tensors the owner keeps in host memory for good with their states (its own optimizer offload):
    swaprl neither homes nor moves them."""

    def __post_init__(self) -> None:
        ids = [id(t) for t in self.tensors]
        if not all(isinstance(t, torch.Tensor) for t in self.tensors) or len(set(ids)) != len(ids):
            raise ValueError(f"FlatPartitions of {self.owner}: tensors must be distinct tensors, each listed once")
        if not (self.copies | self.kept) <= set(ids):
            raise ValueError(f"FlatPartitions of {self.owner}: copies and kept must name listed tensors")

    def placed(self) -> list[torch.Tensor]:
        """The tensors whose states swaprl homes and moves: all but those the owner keeps."""
        return [t for t in self.tensors if id(t) not in self.kept]

    def is_copy(self, t: torch.Tensor) -> bool:
        return id(t) in self.copies
