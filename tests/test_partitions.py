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


class SubGroups:
    """ZeRO-3's way with a Linear: one flat fp32 copy per sub-group (the weight, the bias), listed in its group only
    inside the owner's step, each stepped by an `optimizer.step()` of its own with its gradient given just before and
    copied back into the model after; declared streamable (each copy's model tensor, each tensor's group)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(512, 256)
        self.pairs = [(p.detach().reshape(-1).clone().requires_grad_(True), p) for p in self.model.parameters()]
        flats = tuple(t for t, _ in self.pairs)
        self.optimizer = torch.optim.AdamW([{"params": [t]} for t in flats], lr=0.1)
        for group in self.optimizer.param_groups:
            group["params"] = []
        self.partitions = FlatPartitions(owner="a test's sub-grouper", tensors=flats, copies=frozenset(map(id, flats)),
                                         groups=(0, 1), models=tuple(p.detach().view(-1) for p in self.model.parameters()))

    def step(self) -> None:
        self.model(torch.ones(2, 512)).square().sum().backward()
        for i, (flat, p) in enumerate(self.pairs):
            flat.grad = p.grad.reshape(-1).clone()
            self.optimizer.param_groups[i]["params"] = [flat]
            self.optimizer.step()
            self.optimizer.param_groups[i]["params"] = []
            flat.grad = None
            with torch.no_grad():
                p.copy_(flat.view_as(p))
        self.model.zero_grad(set_to_none=True)


def bind(f: Flattened | SubGroups, config: swaprl.SwapConfig | None = None) -> swaprl.Runtime:
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


def test_streamable_partitions_live_in_host_memory_and_train_like_without_the_runtime():
    """The "host" home over partitions whose owner declares its step streamable: each copy lives in the host buffer
    with its states in both phases, its owner's steps are streamed (in pieces: a chunk is smaller than the weight's
    states), and training is bit for bit the owner's own."""
    plain, f = SubGroups(), SubGroups()
    rt = bind(f, swaprl.SwapConfig(optimizer_states="host", stream_chunk_bytes=2**20))
    streamed = []
    rt.add_listener(lambda e: streamed.append(e) if e.get("transition") == "optimizer.step" else None)
    for _ in range(3):
        plain.step()
        with rt.phase("generate"):
            held = rt.status()
        f.step()
    states = sum(v.numel() * v.element_size() for s in f.optimizer.state.values() for v in s.values())
    copies = sum(t.numel() * 4 for t, _ in f.pairs)
    assert held["optimizer_homes"]["host"] == states + copies and held["optimizer"]["bytes"] == 0
    assert len(streamed) == 3 * 2 and max(e["chunks"] for e in streamed) > 1  # each sub-group's step, in pieces
    for (a, p), (b, q) in zip(plain.pairs, f.pairs):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    rt.detach()
    plain.step()
    f.step()  # plain torch again, the copies and states back where the owner keeps them
    for (a, _), (b, _) in zip(plain.pairs, f.pairs):
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
