"""A fault after every step of train->generate (torch's release, then the offload's copies starting under the
wake-up where there is room): the runtime stays in train with every optimizer state and gradient intact, bit for
bit, and the next switch works. Every config the order depends on: grads free/offload/keep, optimizer_states
swap/auto, the vLLM engine (its weights need room: the offload overlaps the wake-up) and the HF engine (the
trainer's own weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import swaprl

from . import grpo

CONFIGS = [(g, s) for g in ("free", "offload", "keep") for s in ("swap", "auto")]


class Fault(BaseException):
    pass


def setup(checkpoint, engine, grads, states):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if torch.cuda.is_available():
        model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = swaprl.SwapConfig(grads=grads, optimizer_states=states, verify_sync=True)
    # None: the trainer's own module generates ("hf"; the default would build a vLLM engine where vLLM is installed)
    rt = swaprl.attach(model, opt, engine if engine is not None else "hf", config=config)
    return model, opt, rt


def backward(model, opt, *, step: bool):
    loss = grpo.policy_loss(model, [[1, 2, 3, 4]], [[10, 12, 14], [11, 13, 15], [20, 22, 24], [21, 23, 25]], n=4)
    loss.backward()
    if step:
        opt.step()


def snapshot(model, opt):
    states = [(id(p), k, v.clone()) for p, st in opt.state.items() for k, v in st.items()
              if isinstance(v, torch.Tensor)]
    grads = [(n, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()]
    params = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    return states, grads, params


def assert_same(model, opt, snap):
    states, grads, params = snap
    now = {(id(p), k): v for p, st in opt.state.items() for k, v in st.items() if isinstance(v, torch.Tensor)}
    assert len(now) == len(states)
    for key0, key1, v in states:
        t = now[(key0, key1)]
        assert t.device == v.device, (key1, t.device, v.device)
        assert torch.equal(t, v), key1
    named = dict(model.named_parameters())
    for n, g in grads:
        if g is None:
            assert named[n].grad is None, n
        else:
            assert named[n].grad is not None, f"grad of {n} lost"
            assert named[n].grad.device == g.device and torch.equal(named[n].grad, g), n
    for n, p in params:
        assert torch.equal(named[n].detach(), p), n


def switch_steps(rt) -> list[str]:
    events = []
    remove = rt.add_listener(events.append)
    with rt.phase("generate"):
        pass
    remove()
    return [e["step"] for e in events if e["type"] == "step" and e["transition"] == "train->generate"]


def run_matrix(checkpoint, engine, grads, states):
    model, opt, rt = setup(checkpoint, engine, grads, states)
    backward(model, opt, step=True)  # the states exist
    names = switch_steps(rt)  # a full cycle: the order, with this config
    backward(model, opt, step=False)  # gradients present at the switch
    seen = {}
    faults = []
    for i, name in enumerate(names):
        n = seen[name] = seen.get(name, 0) + 1
        snap = snapshot(model, opt)

        count = [0]

        def raise_after(event, name=name, n=n, count=count):
            if event["type"] == "step" and event["transition"] == "train->generate" and event["step"] == name:
                count[0] += 1
                if count[0] == n:
                    raise Fault(f"{name} #{n}")

        remove = rt.add_listener(raise_after)
        try:
            with pytest.raises(Fault), rt.phase("generate"):
                pytest.fail("the block ran")
        finally:
            remove()
        st = rt.status()
        where = f"fault after {name!r} #{n} (step {i} of {names})"
        assert rt.current_phase == "train", where
        assert "unsettled" not in st, (where, st.get("unsettled"))
        assert st["optimizer"]["location"] == "device", where
        assert st["grads"]["location"] == "device", where
        try:
            assert_same(model, opt, snap)
        except AssertionError as exc:
            faults.append(f"{where}: {exc}")
        # the next switch works and checks out
        with rt.phase("generate"):
            assert rt.last_sync is None or rt.last_sync.ok, where
        assert rt.current_phase == "train"
        backward(model, opt, step=False)  # grads='free' dropped them: make them again for the next fault
    swaprl.detach()
    return names, faults


@pytest.mark.vllm
@pytest.mark.parametrize("grads, states", CONFIGS)
def test_a_fault_after_any_step_with_the_vllm_engine(tiny_checkpoint, vllm_engine, grads, states):
    names, faults = run_matrix(tiny_checkpoint, vllm_engine, grads, states)
    print(grads, states, names)
    assert not faults, faults


@pytest.mark.parametrize("grads, states", CONFIGS)
def test_a_fault_after_any_step_with_the_hf_engine(tiny_checkpoint, grads, states):
    names, faults = run_matrix(tiny_checkpoint, None, grads, states)
    print(grads, states, names)
    assert not faults, faults


# ---------------------------------------------------------------- what the release can hand back
@pytest.mark.vllm
def test_free_grads_holds_the_gradients_through_the_release_for_its_undo(tiny_checkpoint, vllm_engine):
    """Why Placement.engine_room counts no gradient as room: until the switch commits, 'free grads' keeps each one
    for its undo, so neither release before the engine's wake-up can hand their memory back."""
    import gc
    import weakref

    model, opt, rt = setup(tiny_checkpoint, vllm_engine, "free", "swap")
    backward(model, opt, step=True)
    refs = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
    assert refs
    alive = {}

    def at(event):
        if event["type"] == "step" and event["step"] in ("release cached memory", "engine wake weights") \
                and event["step"] not in alive:
            gc.collect()
            alive[event["step"]] = sum(r() is not None for r in refs)

    rt.add_listener(at)
    with rt.phase("generate"):
        pass
    swaprl.detach()
    # (an engine that wakes on torch's cached pages releases nothing before it: the step is not there)
    released = {} if vllm_engine.lender is not None else {"release cached memory": len(refs)}
    assert alive == released | {"engine wake weights": len(refs)}, (alive, len(refs))
    gc.collect()
    assert not any(r() is not None for r in refs)  # gone once the switch stands

