"""Flat partitions: what an optimizer steps in place of the model's parameters, declared by the library that made them.

swaprl binds a model and the torch optimizer that trains it, and takes the optimizer's parameters to be the model's
(or swaprl's own fp32 masters of them, `swaprl.master`). DeepSpeed's ZeRO breaks that on purpose: it flattens the
model's parameters, splits them over the ranks, and points its torch optimizer at one flat fp32 tensor per group
(ZeRO-1/2, `single_partition_of_fp32_groups`) or per sub-group (ZeRO-3, `fp32_partitioned_groups_flat`, listed in
the optimizer's groups only inside its step). Those tensors and their states are what moves for 'generate'; the
model's parameters are views of, or placeholders for, buffers ZeRO keeps. `FlatPartitions` says so explicitly, so
that `swaprl.checks` accepts an optimizer over them and the homes (`swaprl.state_homes`) place them, rather than
either check being bypassed. `swaprl.compat.deepspeed.partitions` builds one from a ZeRO optimizer.

An owner whose step calls `optimizer.step()` with each partition's gradient in place and then copies the partition
into the model (ZeRO-3) can also have them streamed (the "host" home, `swaprl.streaming`): the owner declares which
model tensor each copy is cast into (`models`) and what its step needs changed to run over a partition whose data
is at its host home and to leave out its own copy into the model where the streamed step made it
(`prepare_streaming`). The streamed step then treats each copy as it treats an fp32 master (`PartitionCopies`):
staged with its states a piece at a time when at its host home, updated on the device, cast into the model there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .master import cast_into


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
    groups: tuple[int, ...] = ()
    """The index of each tensor's parameter group in the optimizer, for an owner that lists its tensors in the groups
    only inside its step (ZeRO-3); empty: each tensor is listed in its group."""
    models: tuple[torch.Tensor | None, ...] = ()
    """For an owner whose partitions may be streamed: the model tensor each copy's values are cast into after its
    update (None for the tensors that are not copies). Empty: the owner's step cannot be streamed."""
    prepare_streaming: Callable[[Callable[[torch.Tensor], bool], Callable[[torch.Tensor], bool]],
                                Callable[[], None]] | None = None
    """Given what tells whether a tensor's data is at its host home now, and whether the streamed step cast it into
    its model tensor since last asked (`PartitionCopies.take_written`), change what the owner's step needs changed
    to step such a tensor through the streamed step and not copy it into the model again; returns what undoes it."""

    def __post_init__(self) -> None:
        ids = [id(t) for t in self.tensors]
        if not all(isinstance(t, torch.Tensor) for t in self.tensors) or len(set(ids)) != len(ids):
            raise ValueError(f"FlatPartitions of {self.owner}: tensors must be distinct tensors, each listed once")
        if not (self.copies | self.kept) <= set(ids):
            raise ValueError(f"FlatPartitions of {self.owner}: copies and kept must name listed tensors")
        for name in ("groups", "models"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.tensors):
                raise ValueError(f"FlatPartitions of {self.owner}: {name} must give one entry per tensor, or none")
        if self.models and any((m is None) == self.is_copy(t) for t, m in zip(self.tensors, self.models)):
            raise ValueError(f"FlatPartitions of {self.owner}: models must name a model tensor for each copy, and "
                             "None for the others")

    def placed(self) -> list[torch.Tensor]:
        """The tensors whose states swaprl homes and moves: all but those the owner keeps."""
        return [t for t in self.tensors if id(t) not in self.kept]

    def is_copy(self, t: torch.Tensor) -> bool:
        return id(t) in self.copies

    @property
    def streamable(self) -> bool:
        """Whether the owner's step may be streamed: the "host" home is open to these partitions."""
        return bool(self.models)

    def with_groups(self, optimizer: torch.optim.Optimizer) -> Callable[[], list[tuple[torch.Tensor, dict]]] | None:
        """For an owner that lists its tensors in the optimizer's groups only inside its step (`groups`): what lists
        the placed tensors, each with its parameter group (the dict itself), in order. None where the groups list
        them: the optimizer's own listing serves."""
        if not self.groups:
            return None
        pairs = [(t, g) for t, g in zip(self.tensors, self.groups) if id(t) not in self.kept]
        return lambda: [(t, optimizer.param_groups[g]) for t, g in pairs]


class PartitionCopies:
    """The streamed step's view of streamable partitions that are copies (`FlatPartitions.models`): what it asks of
    an fp32 master (`swaprl.master.MasterWeights`), answered for a copy. A copy steps on its own gradient, which the
    owner's step gave it; once updated on the device it is cast into its model tensor there, so the owner's copy
    back (for a copy at its host home, from host memory, cast on the host) is skipped for it
    (`FlatPartitions.prepare_streaming`, told by `take_written`)."""

    def __init__(self, partitions: FlatPartitions) -> None:
        self._model = {id(t): m for t, m in zip(partitions.tensors, partitions.models) if m is not None}
        # Copies cast into their model tensors since their owner last asked. One left over by a step that failed
        # after the cast is harmless: the model tensor holds the copy's values until the copy is stepped again,
        # which casts it again.
        self._written: set[int] = set()

    def is_master(self, t: torch.Tensor) -> bool:
        return id(t) in self._model

    def check(self) -> None:
        """Nothing to refuse: the owner made a copy of every tensor it steps."""

    def model_param(self, copy: torch.Tensor) -> torch.Tensor:
        return self._model[id(copy)]

    def grad(self, copy: torch.Tensor) -> torch.Tensor | None:
        return copy.grad

    def load_grad(self, copy: torch.Tensor, grad: torch.Tensor) -> None:
        copy.grad = grad.to(dtype=copy.dtype)

    def initial(self, local: torch.Tensor) -> None:
        """A copy holds its values from the start: nothing fills it."""
        return None

    def filled(self, locals_: Iterable[torch.Tensor]) -> None:
        return None

    def write_back(self, copies: Iterable[torch.Tensor]) -> None:
        with torch.no_grad():
            for c in copies:
                cast_into(self._model[id(c)], c)
                self._written.add(id(c))

    def take_written(self, copy: torch.Tensor) -> bool:
        """Whether `copy` was cast into its model tensor since the last call for it (which forgets it)."""
        if id(copy) not in self._written:
            return False
        self._written.discard(id(copy))
        return True
