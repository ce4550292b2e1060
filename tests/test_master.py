"""`SwapConfig(master_weights=True)`: a bf16 model trained through fp32 master weights kept in host memory with
their optimizer states. Against the same recipe written by hand without swaprl, bit for bit."""

from __future__ import annotations

import copy
import importlib
import io

import pytest
import torch
from transformers import AutoModelForCausalLM

import swaprl
from swaprl import master
from swaprl.engines import HFEngine
from swaprl.optimizer_hooks import masters_of

from . import grpo
from .test_runtime import DEVICES, assert_bitwise_equal

MiB = 2**20
LR = 1e-3


def load_bf16(path, device="cpu"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)


class HandMasters:
    """fp32 master weights written out by hand, as mixed-precision training keeps them without swaprl: AdamW over
    fp32 copies, the bf16 gradients cast in, the masters cast back into the model after each step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=LR)

    def step(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.params + self.masters:
            t.grad = None


def by_hand(checkpoint, steps: int, device: str = "cpu") -> tuple[torch.nn.Module, HandMasters, list[float]]:
    model = load_bf16(checkpoint, device)
    ref = HandMasters(model)
    losses = grpo.run(model, ref, HFEngine(model), steps=steps)
    return model, ref, losses


def host_tensors(ts) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in ts]


def states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.detach().cpu().clone() for p in (p for g in opt.param_groups for p in g["params"])
            for k, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]


def model_state(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


MASTER_SPLITS = {"host": "host", "swap": "swap", "device": {"device": 1.0}, "auto": "auto",
                 "device, swap and host": {"device": 0.3, "swap": 0.3, "host": 0.4}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", MASTER_SPLITS)
def test_master_weights_train_bit_for_bit_like_the_recipe_by_hand(tiny_checkpoint, device, split):
    """Three GRPO steps: the bf16 model, the fp32 masters and the AdamW states equal the hand-written recipe's, bit
    for bit, wherever the masters live with their states: streamed through in chunks of 1 MiB from host memory,
    swapped, kept on the device, or split over the three homes."""
    model, ref, ref_losses = by_hand(tiny_checkpoint, steps=3, device=device)

    ours = load_bf16(tiny_checkpoint, device)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    rt = swaprl.attach(ours, opt, "hf", config=swaprl.SwapConfig(master_weights=True, stream_chunk_bytes=MiB,
                                                                 optimizer_states=MASTER_SPLITS[split]))
    events = []
    rt.add_listener(lambda e: events.append(e) if e.get("transition") == "optimizer.step" else None)
    seen = {}

    def look(phase: str) -> None:
        seen[phase] = {m: local.device.type for m in rt.optimizer.param_groups[0]["params"]
                       for local in [getattr(m, "_local_tensor", m)]}

    losses = grpo.run(ours, opt, rt.engine, steps=3, runtime=rt, inside=look)

    assert losses == ref_losses
    assert_bitwise_equal(model_state(ours), model_state(model))
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters) and len(masters) == len(ref.masters)
    for a, b in zip(host_tensors(masters), host_tensors(ref.masters)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(states(opt)) == len(states(ref.opt)) > 0
    for a, b in zip(states(opt), states(ref.opt)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Where everything is: the masters with their states, by home; the streamed ones in several chunks per step.
    homes = rt.status()["optimizer_homes"]
    total = 12 * sum(p.numel() for p in ours.parameters())
    assert total <= sum(homes.values()) < total + 4 * MiB, homes
    streams = homes["host"] > 0
    assert len(events) == (3 if streams else 0) and all(e["chunks"] >= 2 for e in events), events
    if split == "host":
        assert homes["device"] == homes["swap"] == 0
    if device == "cuda":
        for m in masters:
            home = rt._placement.home(m)
            assert seen["generate"][m] == ("cuda" if home == "device" else "cpu"), (split, home)
            assert seen["train"][m] == ("cpu" if home == "host" else "cuda"), (split, home)
    swaprl.detach()


def test_updates_below_bf16_resolution_add_up_in_the_masters(tiny_checkpoint):
    """What master weights are for: at a learning rate whose updates bf16 parameters mostly cannot hold, plain bf16
    training changes few of its weights (measured: 1.9% after three steps at 1e-6) while every master moves (99.97%),
    and the model follows wherever the masters cross bf16's rounding (2.7%)."""
    def changed(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return sum((x != y).sum().item() for x, y in zip(a, b)) / sum(x.numel() for x in a)

    plain = load_bf16(tiny_checkpoint)
    before = host_tensors(plain.parameters())
    grpo.run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-6), HFEngine(plain), steps=3)

    ours = load_bf16(tiny_checkpoint)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-6)
    rt = swaprl.attach(ours, opt, config=swaprl.SwapConfig(master_weights=True))
    first = host_tensors(m for g in opt.param_groups for m in g["params"])
    grpo.run(ours, opt, rt.engine, steps=3, runtime=rt)
    masters = host_tensors(m for g in opt.param_groups for m in g["params"])
    swaprl.detach()
    plain_changed = changed(before, host_tensors(plain.parameters()))
    assert plain_changed < 0.05, "bf16 kept most updates: the test's learning rate is not small enough"
    assert changed(first, masters) > 0.99
    assert changed(before, host_tensors(ours.parameters())) > plain_changed


def test_a_checkpoint_carries_the_masters_and_resumes_bit_for_bit(tiny_checkpoint):
    model, ref, _ = by_hand(tiny_checkpoint, steps=3)

    a = load_bf16(tiny_checkpoint)
    opt = torch.optim.AdamW(a.parameters(), lr=LR)
    rt = swaprl.attach(a, opt, config=swaprl.SwapConfig(master_weights=True))
    grpo.run(a, opt, rt.engine, steps=2, runtime=rt)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optimizer": opt.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert set(saved["optimizer"][master.KEY]) == set(range(len(list(a.parameters()))))
    assert all(t.dtype == torch.float32 for t in saved["optimizer"][master.KEY].values())
    swaprl.detach()

    b = load_bf16(tiny_checkpoint)  # a fresh process's view: the model as it was first, then the checkpoint
    opt_b = torch.optim.AdamW(b.parameters(), lr=LR)
    rt = swaprl.attach(b, opt_b, config=swaprl.SwapConfig(master_weights=True))
    b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["optimizer"])
    grpo.run(b, opt_b, rt.engine, steps=1, runtime=rt, first=2)  # the reference's third step
    assert_bitwise_equal(model_state(b), model_state(model))
    for x, y in zip(host_tensors(m for g in opt_b.param_groups for m in g["params"]), host_tensors(ref.masters)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    swaprl.detach()


def test_a_state_dict_held_across_a_load_keeps_its_masters(tiny_checkpoint):
    """The masters of a `state_dict()` kept across `load_state_dict()` keep their values, as its states do, and
    training goes on from the loaded masters as it would with the dict dropped."""
    runs = []
    for hold in (False, True):
        model = load_bf16(tiny_checkpoint)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(master_weights=True, stream_chunk_bytes=MiB))
        grpo.run(model, opt, rt.engine, steps=2, runtime=rt)
        sd = opt.state_dict()
        kept = {k: v.clone() for k, v in sd[master.KEY].items()}
        other = copy.deepcopy(sd)
        for v in other[master.KEY].values():
            v.add_(0.25)
        if not hold:
            del sd
        opt.load_state_dict(other)
        del other
        grpo.run(model, opt, rt.engine, steps=1, runtime=rt, first=2)
        if hold:
            assert_bitwise_equal(sd[master.KEY], kept)
        runs.append((model_state(model), host_tensors(m for g in opt.param_groups for m in g["params"])))
        swaprl.detach()
    (a, ma), (b, mb) = runs
    assert_bitwise_equal(a, b)
    for x, y in zip(ma, mb):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_refused_load_leaves_the_masters_a_held_state_dict_views_where_they_are(tiny_checkpoint):
    """A load that torch or the masters' hook refuses moves nothing: the masters a held `state_dict()` views stay
    in the buffer under it, and the dict goes on following them as before."""
    model = load_bf16(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(master_weights=True, stream_chunk_bytes=MiB,
                                                            optimizer_states="host"))
    grpo.run(model, opt, rt.engine, steps=2, runtime=rt)
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    first = next(iter(bad[master.KEY]))
    bad[master.KEY][first] = bad[master.KEY][first][:1]
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    masters = [m for g in opt.param_groups for m in g["params"]]
    assert all(sd[master.KEY][i].data_ptr() == masters[i].data_ptr() for i in sd[master.KEY])
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt, first=2)
    assert all(torch.equal(sd[master.KEY][i], masters[i]) for i in sd[master.KEY])
    swaprl.detach()


def test_after_detach_plain_torch_steps_the_masters(tiny_checkpoint):
    """The masters stay installed after detach, back where the model is: the optimizer keeps training the bf16
    model through them, as the recipe by hand does."""
    model, _, ref_losses = by_hand(tiny_checkpoint, steps=3)

    ours = load_bf16(tiny_checkpoint)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    rt = swaprl.attach(ours, opt, config=swaprl.SwapConfig(master_weights=True))
    losses = grpo.run(ours, opt, rt.engine, steps=1, runtime=rt)
    swaprl.detach()
    losses += grpo.run(ours, opt, HFEngine(ours), steps=2, first=1)
    assert masters_of(opt) is not None
    assert losses == ref_losses
    assert_bitwise_equal(model_state(ours), model_state(model))


def test_attach_again_keeps_the_masters_it_finds(tiny_checkpoint):
    model, _, ref_losses = by_hand(tiny_checkpoint, steps=2)
    ours = load_bf16(tiny_checkpoint)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    losses = []
    for first in range(2):  # the second attach asks for nothing and still steps through the masters
        rt = swaprl.attach(ours, opt, config=swaprl.SwapConfig(master_weights=not losses))
        losses += grpo.run(ours, opt, rt.engine, steps=1, runtime=rt, first=first)
        swaprl.detach()
    assert losses == ref_losses
    assert_bitwise_equal(model_state(ours), model_state(model))


def test_a_failed_attach_gives_the_optimizer_back_as_it_was(tiny_checkpoint):
    model = load_bf16(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    params = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(swaprl.HostBufferError):
        swaprl.attach(model, opt, config=swaprl.SwapConfig(master_weights=True, host_budget_bytes=2**20))
    assert [list(g["params"]) for g in opt.param_groups] == params
    assert masters_of(opt) is None and "step" not in vars(opt) and not opt.state


def test_master_weights_config_is_checked_naming_the_fix():
    with pytest.raises(ValueError, match="master_weights='yes'; give True or False"):
        swaprl.SwapConfig(master_weights="yes")
    for states in MASTER_SPLITS.values():  # the masters live wherever their states do
        assert swaprl.SwapConfig(master_weights=True, optimizer_states=states).master_weights


def test_a_model_in_fp32_is_its_own_master_and_is_told_so(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match="load the model in bfloat16"):
        swaprl.attach(model, opt, config=swaprl.SwapConfig(master_weights=True))
    assert masters_of(opt) is None and "step" not in vars(opt)


def test_a_refused_load_changes_no_master(tiny_checkpoint):
    """A state dict saved with the parameters in another order: refused naming why, before any master is written."""
    a = load_bf16(tiny_checkpoint)
    opt_a = torch.optim.AdamW(reversed(list(a.parameters())), lr=LR)
    rt = swaprl.attach(a, opt_a, config=swaprl.SwapConfig(master_weights=True))
    grpo.run(a, opt_a, rt.engine, steps=1, runtime=rt)
    saved = opt_a.state_dict()
    swaprl.detach()

    b = load_bf16(tiny_checkpoint)
    opt_b = torch.optim.AdamW(b.parameters(), lr=LR)
    swaprl.attach(b, opt_b, config=swaprl.SwapConfig(master_weights=True))
    before = host_tensors(m for g in opt_b.param_groups for m in g["params"])
    with pytest.raises(ValueError, match="saved with other parameters"):
        opt_b.load_state_dict(saved)
    after = host_tensors(m for g in opt_b.param_groups for m in g["params"])
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    swaprl.detach()


def test_a_step_that_fails_mid_way_leaves_the_model_equal_to_its_masters(tiny_checkpoint, monkeypatch):
    """The streamed step is not atomic (the chunks before the failure are stepped); whatever it left done, the bf16
    model is its masters' cast, and the states are home."""
    algorithm = importlib.import_module(torch.optim.AdamW.step.__module__)  # where step finds its update
    real, calls = algorithm.adam, []

    def second_chunk_fails_after_its_update(*args, **kwargs):  # AdamW's functional update, chunk by chunk
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise FloatingPointError("a check after the update")

    model = load_bf16(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(master_weights=True, stream_chunk_bytes=MiB,
                                                            optimizer_states="host"))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    monkeypatch.setattr(algorithm, "adam", second_chunk_fails_after_its_update)
    with pytest.raises(FloatingPointError):
        grpo.run(model, opt, rt.engine, steps=1, runtime=rt, first=1)
    assert len(calls) == 2
    masters = [m for g in opt.param_groups for m in g["params"]]
    for m in masters:
        assert torch.equal(masters_of(opt).model_param(m).detach(), m.detach().to(torch.bfloat16))
    assert rt.status()["optimizer"]["bytes"] == 0  # every state home (the device is the host here: nothing left out)
    swaprl.detach()


def test_a_group_added_after_attach_is_refused_at_the_step(tiny_checkpoint):
    model = load_bf16(tiny_checkpoint)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params[:-2], lr=LR)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(master_weights=True))
    opt.add_param_group({"params": params[-2:]})
    with pytest.raises(ValueError, match="add every group before attach"):
        grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    swaprl.detach()


def test_attach_with_masters_inside_inference_mode_is_refused_and_changes_nothing(tiny_checkpoint):
    """Masters made inside `torch.inference_mode()` would be inference tensors, which torch lets no step outside it
    update: refused naming the fix, before the optimizer is touched; outside it the same attach trains."""
    model = load_bf16(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"inside torch.inference_mode\(\).*attach "
                                                                   r"outside the inference_mode\(\) block"):
        swaprl.attach(model, opt, config=swaprl.SwapConfig(master_weights=True))
    assert masters_of(opt) is None and "step" not in vars(opt)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(master_weights=True))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    swaprl.detach()

def test_fp16_is_refused_naming_bf16(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match="GradScaler.*load the model in bfloat16"):
        swaprl.attach(model, opt, config=swaprl.SwapConfig(master_weights=True))
    assert masters_of(opt) is None


def test_attaching_masters_again_with_another_home_trains_them_there(tiny_checkpoint):
    model, _, ref_losses = by_hand(tiny_checkpoint, steps=2)
    ours = load_bf16(tiny_checkpoint)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    rt = swaprl.attach(ours, opt, config=swaprl.SwapConfig(master_weights=True, optimizer_states="host"))
    losses = grpo.run(ours, opt, rt.engine, steps=1, runtime=rt)
    installed = masters_of(opt)
    swaprl.detach()
    rt = swaprl.attach(ours, opt, config=swaprl.SwapConfig(optimizer_states="swap"))
    losses += grpo.run(ours, opt, rt.engine, steps=1, runtime=rt, first=1)
    assert masters_of(opt) is installed and losses == ref_losses
    assert_bitwise_equal(model_state(ours), model_state(model))
    swaprl.detach()



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the GPU machine")
def test_a_cast_from_host_memory_holds_the_device_to_one_piece_and_equals_the_whole_cast():
    """A master in host memory cast into its bf16 parameter (a load, a failed step's repair): torch's own
    non-blocking copy would cast on the device through an fp32 temporary of the whole tensor."""
    src = torch.randn(3 * master.CAST_PIECE_BYTES // 4 + 5, dtype=torch.float32).pin_memory()
    dst = torch.empty(src.shape, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    master.cast_into(dst, src)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= master.CAST_PIECE_BYTES
    assert torch.equal(dst.cpu(), src.to(torch.bfloat16))
