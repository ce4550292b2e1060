"""Flat partitions (swaprl/partitions.py): an optimizer over flat tensors that stand for a model's parameters, as
DeepSpeed's ZeRO builds one, declared to the runtime rather than refused by its check or let through unseen.

    python -m pytest tests/test_partitions.py -q

The partitions here are made by hand (tests/test_trl_deepspeed.py runs DeepSpeed's own): one flat fp32 copy of a
module's parameters, which the optimizer steps and which the step copies back into the module, as ZeRO's does.
"""

from __future__ import annotations

import pytest
import torch

import swaprl
from swaprl.partitions import FlatPartitions


class Flattened:
    """A Linear whose parameters an AdamW steps through flat tensors: `flat` (a copy of every weight, what ZeRO's fp32
    partition is) and, when `alias`, `own` (the bias's own storage, what ZeRO-3's fp32 partition is in fp32)."""

    def __init__(self, *, alias: bool = False) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 4)
        self.flat = self.model.weight.detach().reshape(-1).clone().requires_grad_(True)
        self.own = torch.zeros(4, requires_grad=True)
        tensors = (self.flat, self.own) if alias else (self.flat,)
        self.optimizer = torch.optim.AdamW([{"params": [t]} for t in tensors], lr=0.1)
        self.partitions = FlatPartitions(owner="a test's flattener", tensors=tensors,
                                         copies=frozenset({id(self.flat)}))

    def step(self) -> None:
        """The owner's step: the gradient into the flat copy, the optimizer's update, the copy back into the model."""
        loss = self.model(torch.ones(2, 8)).square().sum()
        loss.backward()
        self.flat.grad = self.model.weight.grad.reshape(-1).clone()
        self.own.grad = torch.ones(4)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.weight.copy_(self.flat.view_as(self.model.weight))


def bind(f: Flattened, config: swaprl.SwapConfig | None = None) -> swaprl.Runtime:
    rt = swaprl.attach_later(config=config, until="the test binds it")
    return rt.bind(f.model, f.optimizer, "hf", partitions=f.partitions)


def test_an_optimizer_over_undeclared_flat_tensors_is_refused():
    f = Flattened()
    with pytest.raises(ValueError, match="not parameters of the model"):
        swaprl.attach(f.model, f.optimizer)


def test_declared_partitions_move_with_their_states_and_train_like_without_the_runtime():
    plain, f = Flattened(alias=True), Flattened(alias=True)
    rt = bind(f, swaprl.SwapConfig(optimizer_states="swap"))
    for _ in range(3):
        plain.step()
        with rt.phase("generate"):
            held = rt.status()["optimizer"]
        f.step()
    # The flat copy and every state moved; the partition that is not a copy stayed, its states moved.
    states = sum(v.numel() * v.element_size() for s in f.optimizer.state.values() for v in s.values())
    assert held["location"] == "host" and held["host_bytes"] == states + f.flat.numel() * 4
    assert rt.status()["optimizer_homes"]["swap"] == states + f.flat.numel() * 4
    for a, b in ((plain.model.weight, f.model.weight), (plain.own, f.own), (plain.flat, f.flat)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_partitions_their_owner_keeps_are_neither_homed_nor_moved():
    f = Flattened()
    kept = FlatPartitions(owner=f.partitions.owner, tensors=f.partitions.tensors, copies=f.partitions.copies,
                          kept=frozenset({id(f.flat)}))
    f.partitions = kept
    rt = bind(f, swaprl.SwapConfig(optimizer_states="swap"))
    f.step()
    with rt.phase("generate"):
        held = rt.status()
    assert held["optimizer"]["host_bytes"] == 0 and sum(held["optimizer_homes"].values()) == 0


@pytest.mark.parametrize(("config", "match"), [
    (swaprl.SwapConfig(master_weights=True), r"master_weights=True\) with a test's flattener"),
    (swaprl.SwapConfig(optimizer_states="host"), "'host' home .* inside a test's flattener's own step"),
    (swaprl.SwapConfig(params="offload"), "params='offload'.* flat buffers a test's flattener owns"),
])
def test_what_only_swaprl_could_hold_is_refused_with_partitions(config, match):
    f = Flattened()
    rt = swaprl.attach_later(config=config, until="the test binds it")
    with pytest.raises(ValueError, match=match):
        rt.bind(f.model, f.optimizer, "hf", partitions=f.partitions)
    with pytest.raises(swaprl.PhaseError, match="the test binds it"):
        rt.status()  # refused before anything was taken: the runtime holds nothing


def test_a_model_parameter_declared_as_a_partition_is_refused():
    f = Flattened()
    f.partitions = FlatPartitions(owner="x", tensors=(f.model.weight,), copies=frozenset())
    with pytest.raises(ValueError, match="include parameters of the model"):
        bind(f)
