"""A split of the optimizer states over their homes (`SwapConfig(optimizer_states={"device": .., "swap": ..,
"host": ..})`): every split trains bit for bit as plain torch does, each state lives where its home says in each
phase, and the homes take the fractions asked for. FSDP2's side is in tests/test_fsdp.py."""

from __future__ import annotations

import pytest
import torch

import swaprl
from swaprl.config import STATE_HOMES
from swaprl.engines import HFEngine
from swaprl.placement import assign_homes, device_state_growth
from swaprl.residency import nbytes

from . import grpo
from .test_runtime import DEVICES, load
from .test_streamed_step import OPTIMIZERS, assert_same_training, snapshot

MiB = 2**20
SPLITS = {
    "all device": {"device": 1.0},
    "all swap": "swap",
    "all host": "host",
    "mixed": {"device": 0.3, "swap": 0.3, "host": 0.4},
    "device and host": {"device": 0.5, "host": 0.5},
    "swap and host": {"swap": 0.5, "host": 0.5},
    "device and swap": {"device": 0.5, "swap": 0.5},
}


def train(checkpoint, device: str, split, opt_name: str = "adamw", steps: int = 3):
    """`steps` GRPO steps of the tiny model: plain torch (`split` None) or attached with `split`. Returns the losses,
    the trained state, and (attached) where each home's states were in each phase of the last step."""
    model = load(checkpoint, device)
    opt = OPTIMIZERS[opt_name](model.parameters())
    engine = HFEngine(model)
    if split is None:
        return grpo.run(model, opt, engine, steps=steps), snapshot(model, opt), None
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(optimizer_states=split, stream_chunk_bytes=MiB))
    losses = grpo.run(model, opt, engine, steps=steps, runtime=rt)
    homes = {id(p): rt._placement.home(p) for p in model.parameters()}
    seen = {}
    for phase in ("generate", "train"):
        with rt.phase(phase):
            seen[phase] = {"status": rt.status(), "devices": {
                home: {v.device.type for p, st in opt.state.items() if homes[id(p)] == home
                       for k, v in st.items() if k != "step"} for home in STATE_HOMES}}
    swaprl.detach()
    return losses, snapshot(model, opt), seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", SPLITS)
def test_every_split_trains_bit_for_bit_as_plain_torch(tiny_checkpoint, device, split):
    if device == "cuda":
        torch.use_deterministic_algorithms(True)
    try:
        l0, a, _ = train(tiny_checkpoint, device, None)
        l1, b, seen = train(tiny_checkpoint, device, SPLITS[split])
    finally:
        torch.use_deterministic_algorithms(False)
    assert l0 == l1
    assert_same_training(a, b)

    # Where the states are, by home: "device" never leaves, "swap" leaves for generate, "host" never comes.
    homes = seen["train"]["status"]["optimizer_homes"]
    asked = swaprl.SwapConfig(optimizer_states=SPLITS[split]).state_split()
    assert sum(homes.values()) > 0 and {h for h, f in asked.items() if f > 0} == {h for h, n in homes.items() if n}
    for phase, off in (("generate", ("swap", "host")), ("train", ("host",))):
        st = seen[phase]["status"]["optimizer"]
        assert st["host_bytes"] == sum(homes[h] for h in off), (phase, st, homes)
        assert st["bytes"] == sum(homes.values()) - st["host_bytes"], (phase, st, homes)
        if device == "cuda":
            for home in STATE_HOMES:
                where = {"cpu"} if home in off else {"cuda"}
                assert seen[phase]["devices"][home] in (set(), where), (phase, home, seen[phase]["devices"])


@pytest.mark.parametrize("opt_name", ["adamw_fused", "sgd_momentum", "adam_amsgrad"])
def test_a_mixed_split_is_exact_for_other_optimizers(tiny_checkpoint, opt_name):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    l0, a, _ = train(tiny_checkpoint, device, None, opt_name)
    l1, b, _ = train(tiny_checkpoint, device, SPLITS["mixed"], opt_name)
    assert l0 == l1
    assert_same_training(a, b)


@pytest.mark.parametrize("split", [SPLITS["mixed"], {"device": 0.05, "swap": 0.9, "host": 0.05},
                                   {"device": 0.999, "host": 0.001}])
def test_homes_take_whole_parameters_in_order_within_half_a_parameter(tiny_checkpoint, split):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    homes = assign_homes(opt, swaprl.SwapConfig(optimizer_states=split).state_split())
    params = list(model.parameters())
    order = [homes[id(p)] for p in params]
    assert order == sorted(order, key=STATE_HOMES.index)  # device first, then swap, then host
    total = sum(nbytes(p) for p in params)
    largest = max(nbytes(p) for p in params)
    edge = 0.0
    for home in STATE_HOMES:
        got = sum(nbytes(p) for p in params if homes[id(p)] == home)
        # Each boundary falls inside the parameter it cuts: within half the largest parameter of the asked one.
        edge_got = sum(nbytes(p) for p in params if STATE_HOMES.index(homes[id(p)]) <= STATE_HOMES.index(home))
        edge += split.get(home, 0.0) * total
        assert abs(edge_got - edge) <= largest / 2 + 1, (home, got, edge_got, edge)


def test_a_split_with_host_states_is_refused_for_lbfgs(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(TypeError, match=r"LBFGS.*Use optimizer_states='swap'"):
        swaprl.attach(model, opt, config=swaprl.SwapConfig(optimizer_states={"device": 0.5, "host": 0.5}))
    swaprl.detach()


def test_device_state_growth_predicts_what_the_device_home_will_hold(tiny_checkpoint):
    """What an engine sized before the first step must leave free: the "device" home's states, known ahead for
    AdamW (within the host layout's 512-byte alignment per tensor), and nothing once they exist."""
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = swaprl.SwapConfig(optimizer_states=SPLITS["mixed"])
    predicted = device_state_growth(opt, config)
    assert device_state_growth(opt, swaprl.SwapConfig(optimizer_states="swap")) == 0
    rt = swaprl.attach(model, opt, config=config)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    homes = rt.status()["optimizer_homes"]
    in_device_home = sum(1 for p in model.parameters() if rt._placement.home(p) == "device")
    assert homes["device"] - 4 * in_device_home <= predicted <= homes["device"] + 2 * 512 * in_device_home
    assert device_state_growth(opt, config) == 0
    swaprl.detach()


class NoRoomEngine(grpo.ReplicaEngine):
    """A replica whose KV cache no longer fits when it wakes, as a vLLM engine's sized before the states existed."""

    def wake(self, tags=None) -> None:
        if tags is None or "kv_cache" in tags:
            raise torch.OutOfMemoryError("waking the engine's kv_cache needs 2.00 GiB but only 1.00 GiB are free.")


def test_a_kv_cache_without_room_for_device_states_names_the_fix_and_loses_nothing(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, NoRoomEngine(load(tiny_checkpoint)),
                       config=swaprl.SwapConfig(optimizer_states={"device": 0.5, "swap": 0.5}))
    grpo.policy_loss(model, [[1, 2, 3]], [[4, 6], [5, 7]], n=2).backward()
    opt.step()
    before = snapshot(model, opt)
    with pytest.raises(torch.OutOfMemoryError, match=r"needs 2.00 GiB.*GiB are optimizer states kept on the device "
                                                     r".*'device' home.*engine_reserve_bytes\(optimizer, config\)"):
        with rt.phase("generate"):
            pytest.fail("the block must not run when entering the phase failed")
    assert rt.current_phase == "train" and rt.status()["optimizer"]["location"] == "device"
    assert_same_training(before, snapshot(model, opt))
    swaprl.detach()
