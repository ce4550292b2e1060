"""A split of the optimizer states over their homes (`SwapConfig(optimizer_states={"device": .., "swap": ..,
"host": ..})`): every split trains bit for bit as plain torch does, each state lives where its home says in each
phase, and the homes take the fractions asked for. FSDP2's side is in tests/test_fsdp.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import swaprl
from swaprl.config import STATE_HOMES
from swaprl.engines import HFEngine
from swaprl import homes as policy
from swaprl import memory
from swaprl.residency import nbytes
from swaprl.state_homes import StateHomes, _expected_per_parameter

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
    params = list(model.parameters())
    order = policy.by_fractions([nbytes(p) for p in params], swaprl.SwapConfig(optimizer_states=split).state_split())
    homes = dict(zip(map(id, params), order))
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


@pytest.mark.parametrize("states", ["swap", "host", "auto"])
def test_sparse_gradients_are_refused_at_attach_naming_the_parameter(states):
    """SGD with momentum over an embedding of sparse gradients trains in plain torch; swaprl cannot move those
    gradients or the sparse momentum made of them, so it says so before anything moves (it used to fail at every
    switch, or every step, or at state_dict())."""
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8, sparse=True), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()  # plain torch trains it
    with pytest.raises(ValueError, match=r"0\.weight get sparse gradients.*sparse=False"):
        swaprl.attach(model, opt, HFEngine(model), config=swaprl.SwapConfig(optimizer_states=states))
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()
    assert "step" not in vars(opt) and "_swaprl_hooks" not in vars(opt)


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

    def device_growth(config):
        return StateHomes(opt, torch.device("cpu"), config, masters=None, room=None).device_growth()

    predicted = device_growth(config)
    assert device_growth(swaprl.SwapConfig(optimizer_states="swap")) == 0
    rt = swaprl.attach(model, opt, config=config)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    homes = rt.status()["optimizer_homes"]
    in_device_home = sum(1 for p in model.parameters() if rt._placement.home(p) == "device")
    assert homes["device"] - 4 * in_device_home <= predicted <= homes["device"] + 2 * 512 * in_device_home
    assert device_growth(config) == 0
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
                                                     r".*'device' home.*VLLMEngine\(reserve_bytes=\.\.\.\) of at least"):
        with rt.phase("generate"):
            pytest.fail("the block must not run when entering the phase failed")
    assert rt.current_phase == "train" and rt.status()["optimizer"]["location"] == "device"
    assert_same_training(before, snapshot(model, opt))
    swaprl.detach()


# ---------------------------------------------------------------- optimizer_states="auto"
def test_auto_is_the_default_and_swaps_what_it_cannot_measure(tiny_checkpoint):
    assert swaprl.SwapConfig().optimizer_states == "auto"
    with pytest.raises(ValueError, match=r"'auto'\) has no fixed split.*status\(\)\['optimizer_homes'\]"):
        swaprl.SwapConfig().state_split()
    swaprl.SwapConfig(optimizer_states="auto", overlap_optimizer_reload=True)  # whether a reload remains is decided
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = swaprl.SwapConfig()
    cpu = StateHomes(opt, torch.device("cpu"), config, masters=None, room=policy.Room(free=2**40))
    assert cpu.fractions()["swap"] == 1.0 and "without CUDA" in cpu.why
    asleep = StateHomes(opt, torch.device("cpu"), config, masters=None, room=None, unmeasurable="the engine is asleep")
    assert asleep.fractions()["swap"] == 1.0 and asleep.why == "all swapped: the engine is asleep"
    explicit = StateHomes(opt, torch.device("cpu"), swaprl.SwapConfig(optimizer_states={"device": 0.5, "swap": 0.5}),
                          masters=None, room=None)
    assert explicit.fractions()["device"] == pytest.approx(0.5, abs=0.2) and not explicit.auto
    # An engine that shares the trainer's weights takes memory as it generates: nothing to measure, all swapped.
    rt = swaprl.attach(model, opt, HFEngine(model))
    assert rt.status()["optimizer_split"]["swap"] == 1.0
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    with rt.phase("generate"):
        assert rt.status()["optimizer"]["location"] == "host"
    swaprl.detach()


class ReplicaOnDevice(grpo.ReplicaEngine):
    """A replica on the GPU, awake: what it holds while generating is held already when attach measures."""


@pytest.mark.gpu
def test_auto_keeps_on_the_device_the_states_that_fit_beside_the_engine(tiny_checkpoint):
    model = load(tiny_checkpoint, "cuda")
    opt = OPTIMIZERS["adamw"](model.parameters())
    rt = swaprl.attach(model, opt, ReplicaOnDevice(load(tiny_checkpoint, "cuda")))
    assert rt.status()["optimizer_split"] == {"device": 1.0, "swap": 0.0, "host": 0.0}
    steps = []
    rt.add_listener(lambda e: steps.append(e["step"]) if e["type"] == "step" else None)
    grpo.run(model, opt, rt.engine, steps=3, runtime=rt)
    with rt.phase("generate"):
        st = rt.status()["optimizer"]
        assert st["location"] == "device" and st["bytes"] > 0 and st["host_bytes"] == 0
    assert "sync weights" in steps and not any("optimizer" in s for s in steps)  # synced; the states never moved
    # What is locked for states that stay is only the room to swap them should the engine lack it later
    locked = sum(b["bytes"] for b in rt.status()["host_buffers"]["buffers"] if b["name"] == "optimizer")
    assert locked <= rt.status()["optimizer_homes"]["device"] + MiB  # (slots are 512-byte aligned)
    swaprl.detach()
    _release_cuda()


class ShrinkingRoomEngine(ReplicaOnDevice):
    """A replica whose KV cache, as a vLLM engine's does after the first steps add to the device, fits only beside
    `room` bytes of optimizer states kept on the device."""

    def __init__(self, replica, room: int, placement=lambda: None) -> None:
        super().__init__(replica)
        self.room, self.placement, self.refused = room, placement, 0

    def wake(self, tags=None) -> None:
        from swaprl.engines.vllm import EngineWakeError

        kept = self.placement().home_bytes()["device"] if self.placement() is not None else 0
        if (tags is None or "kv_cache" in tags) and kept > self.room:
            self.refused += 1
            raise EngineWakeError(f"waking the kv_cache lacks {kept - self.room} bytes", short_bytes=kept - self.room)


@pytest.mark.gpu
def test_auto_swaps_more_when_the_engine_lacks_room_later_and_loses_nothing(tiny_checkpoint):
    model = load(tiny_checkpoint, "cuda")
    opt = OPTIMIZERS["adamw"](model.parameters())
    engine = ShrinkingRoomEngine(load(tiny_checkpoint, "cuda"), room=MiB)
    rt = swaprl.attach(model, opt, engine)
    engine.placement = lambda: rt._placement
    assert rt.status()["optimizer_split"]["device"] == 1.0  # all fits at attach
    demoted = []
    rt.add_listener(lambda e: demoted.append(e) if e["type"] == "demote" else None)
    grpo.run(model, opt, rt.engine, steps=3, runtime=rt)  # the second switch creates no room: demoted, retried
    assert engine.refused == 1 and len(demoted) == 1
    homes = rt.status()["optimizer_homes"]
    assert homes["device"] <= MiB and homes["swap"] >= demoted[0]["short_bytes"]
    with rt.phase("generate"):
        st = rt.status()["optimizer"]
        assert st["location"] == "host" and st["host_bytes"] == homes["swap"] and st["bytes"] == homes["device"]
    swaprl.detach()
    _release_cuda()


def _release_cuda() -> None:
    """Hand what a test allocated back to the driver: a vLLM engine built later in the session sizes itself from
    the free memory."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_auto_keeps_what_the_free_memory_holds_and_swaps_the_rest():
    from swaprl.checkpoints import random_model
    from swaprl.memory import default_pool_free_bytes, default_reserve_bytes

    model = random_model("qwen2.5-0.5b", device="cuda")  # fp32: AdamW's states 3.7 GiB, the embedding's 1.1 GiB
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    needs = list(_expected_per_parameter(opt).values())
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    aim = needs[0] + (sum(needs) - needs[0]) // 2  # the embedding's states and about half of the layers'
    blocker = torch.empty(free - default_reserve_bytes(total) - aim, dtype=torch.uint8, device="cuda")
    try:
        # torch's cached free blocks count, but not those of private pools earlier tests left (graphs, pools)
        free = torch.cuda.mem_get_info()[0] + default_pool_free_bytes(torch.device("cuda"))
        room = free - default_reserve_bytes(total)
        device = torch.device("cuda", torch.cuda.current_device())
        decided = StateHomes(opt, device, swaprl.SwapConfig(), masters=None, room=memory.measure_room(device))
    finally:
        del blocker
    split = decided.fractions()
    assert 0 < split["device"] < 1 and split["swap"] == pytest.approx(1 - split["device"]) and split["host"] == 0
    kept = [n for p, n in zip(opt.param_groups[0]["params"], needs) if decided.home(p) == "device"]
    # The first parameters' states, as many as the room holds: one more would not fit.
    assert sum(kept) <= room < sum(needs[:len(kept) + 1]), (kept, room, decided.why)
    assert "GiB of states stay on the device" in decided.why
    del model, opt
    _release_cuda()


@pytest.mark.gpu
def test_auto_swaps_the_states_of_an_optimizer_it_cannot_size_ahead(tiny_checkpoint):
    model = load(tiny_checkpoint, "cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)  # momentum buffers appear at the first step
    device = torch.device("cuda", torch.cuda.current_device())
    decided = StateHomes(opt, device, swaprl.SwapConfig(), masters=None, room=memory.measure_room(device))
    assert decided.fractions()["swap"] == 1.0
    assert "SGD will create are not known before its first step" in decided.why


@pytest.mark.gpu
def test_auto_keeps_in_host_memory_the_new_states_the_first_step_has_no_room_for():
    """Training shows what attach could not measure (gradients, buffers, activations): at the first step, "auto"
    gives the "host" home to the states that would not fit on the device beside it, and trains bit for bit."""
    from swaprl.checkpoints import random_model
    from swaprl.memory import default_reserve_bytes

    def run(blocked: bool):
        torch.manual_seed(0)
        model = random_model("qwen2.5-0.5b", device="cuda")  # fp32: 1.98 GB of parameters, AdamW states 3.95 GB
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        rt = swaprl.attach(model, opt, HFEngine(model)) if blocked else None
        blocker = None
        if blocked:
            need = sum(_expected_per_parameter(opt).values())
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            grads = sum(nbytes(p) for p in model.parameters())
            # Room for about half of the states (and the step's temporaries) once the gradients exist.
            blocker = torch.empty(free - grads - 256 * MiB - default_reserve_bytes(total) - int(0.75 * need),
                                  dtype=torch.uint8, device="cuda")
        ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1)).cuda()
        losses = []
        for _ in range(3):
            if rt is not None:
                with rt.phase("generate"):
                    pass
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        homes = rt.status()["optimizer_homes"] if rt is not None else None
        out = losses, snapshot(model, opt), homes
        del blocker  # detach() brings the host-resident states back to the device
        swaprl.detach()
        del model, opt
        _release_cuda()
        return out

    torch.use_deterministic_algorithms(True)
    try:
        l0, a, _ = run(blocked=False)
        l1, b, homes = run(blocked=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert 0 < homes["host"] < sum(homes.values()) and homes["device"] + homes["swap"] > 0, homes
    assert l0 == l1
    assert_same_training(a, b)


@pytest.mark.gpu
def test_a_trainer_that_cannot_take_one_step_is_refused_before_anything_moves():
    total = torch.cuda.mem_get_info()[1]
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.empty((total // 2 - 2**30) // 4, device="cuda"))  # fp32
    opt = torch.optim.AdamW(model.parameters())
    try:
        with pytest.raises(ValueError, match=r"cannot train on cuda:\d at all.*gradients.*FSDP2"):
            swaprl.attach(model, opt, HFEngine(model))
        with pytest.raises(swaprl.PhaseError, match="no swaprl runtime is attached"):
            swaprl.current()
    finally:
        del model, opt
        _release_cuda()


@pytest.mark.gpu
def test_the_first_step_leaves_the_next_backward_what_training_took_at_its_peak():
    """The first step under "auto" keeps on the device only the states that fit beside training's peak, not beside
    what torch happens to cache when the step runs: the allocator hands its cache back when a request fails under
    pressure, and the next backward takes it again. Before this rule, 14B under TRL at TP 2 ran out of memory in
    its second backward."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("first_step_worker.py"))],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    homes, (first, *later) = out["homes"], out["states_on_device"]
    assert out["oom"] is None, (out, proc.stderr[-3000:])
    assert out["transients"] > out["need"] // 2, out  # a cache that, handed back, would have held most states
    assert 0 < homes["device"] + homes["swap"] and 0 < homes["host"], out  # the first step split the states
    kept = homes["device"] + homes["swap"]
    assert first == 0 and len(later) == 2 and all(abs(s - kept) <= 2**20 for s in later), out
    # The states the first step made went straight into their buffer, locked before the step: none waited in other
    # host memory to be moved there.
    assert "moved into host buffer 'streamed optimizer'" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"host buffer 'streamed optimizer': allocated [0-9.]+ GiB pinned", proc.stderr), \
        proc.stderr[-3000:]
