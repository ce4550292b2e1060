"""The phase controller on real transformers models and real optimizers: equivalence, identities, faults."""

from __future__ import annotations

import copy
import io
import sys
import threading

import pytest

import torch
from transformers import AutoModelForCausalLM

import swaprl
from swaprl.engines import HFEngine

from . import grpo

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_single_tensor": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def load(path, device="cpu"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def optimizer_tensors(opt):
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("grads, overlap", [("offload", False), ("free", False), ("keep", False),
                                            ("offload", True)])
def test_swapping_is_bitwise_invisible(tiny_checkpoint, device, opt_name, grads, overlap):
    """N GRPO steps with swapping give the same parameters and optimizer states, bit for bit, as without."""
    if device == "cuda":  # the same kernels twice must give the same bits: no atomics-based reductions
        torch.use_deterministic_algorithms(True)
    results = []
    for swap in (False, True):
        model = load(tiny_checkpoint, device)
        opt = OPTIMIZERS[opt_name](model.parameters())
        engine = HFEngine(model)
        cfg = swaprl.SwapConfig(grads=grads, overlap_optimizer_reload=overlap)
        rt = swaprl.attach(model, opt, engine, config=cfg) if swap else None
        losses = grpo.run(model, opt, engine, steps=3, runtime=rt)
        swaprl.detach()
        results.append((losses, {k: v.cpu() for k, v in model.state_dict().items()},
                        [t.cpu() for t in optimizer_tensors(opt)]))
    torch.use_deterministic_algorithms(False)
    (l0, p0, s0), (l1, p1, s1) = results
    assert l0 == l1
    assert_bitwise_equal(p0, p1)
    assert len(s0) == len(s1) > 0
    for a, b in zip(s0, s1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_generate_moves_storage_and_keeps_identities(tiny_checkpoint, device):
    model = load(tiny_checkpoint, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, "hf")
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)  # creates the optimizer state lazily
    states = optimizer_tensors(opt)
    ids_before = [id(t) for t in states]
    devices = [t.device for t in states]  # AdamW keeps its step counters on the CPU: those stay where they are
    values = [t.detach().clone() for t in states]
    dev_bytes = rt.status()["optimizer"]["bytes"]
    assert dev_bytes > 0
    with swaprl.phase("generate"):
        st = rt.status()
        assert st["phase"] == "generate"
        assert st["optimizer"]["location"] == "host"
        assert st["optimizer"]["bytes"] == 0
        assert st["optimizer"]["host_bytes"] == dev_bytes
        assert [id(t) for t in optimizer_tensors(opt)] == ids_before
        assert all(t.device.type == "cpu" for t in optimizer_tensors(opt))
        for t, v in zip(optimizer_tensors(opt), values):
            torch.testing.assert_close(t, v.cpu(), rtol=0, atol=0)
    st = rt.status()
    assert st["optimizer"] == {"location": "device", "bytes": dev_bytes, "host_bytes": 0}
    assert [id(t) for t in optimizer_tensors(opt)] == ids_before
    assert [t.device for t in states] == devices
    for t, v in zip(states, values):
        torch.testing.assert_close(t, v, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_switch_counts_as_moved_what_it_copied_not_what_it_freed(tiny_checkpoint, device):
    """Freed gradients and the cache handed back to the driver are listed per step, left out of the switch's
    total."""
    model = load(tiny_checkpoint, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, "hf", config=swaprl.SwapConfig(grads="free"))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    x = torch.tensor([[1, 2, 3, 4]], device=device)
    model(input_ids=x, labels=x).loss.backward()  # gradients to free
    events = []
    rt.add_listener(events.append)
    with swaprl.phase("generate"):
        pass
    steps = {e["step"]: e["bytes"] for e in events if e["type"] == "step" and e["transition"] == "train->generate"}
    switch = next(e for e in events if e["type"] == "phase" and e["phase"] == "generate")
    assert steps["free grads"] > 0 and steps["offload optimizer"] > 0
    assert switch["bytes"] == sum(n for name, n in steps.items() if name not in ("free grads",
                                                                                "release cached memory"))
    assert "release cached memory" in steps  # listed with what torch handed back (0 on the CPU)
    swaprl.detach()


def test_checkpoint_saved_in_generate_is_complete(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(grads="offload"))
    grpo.run(model, opt, rt.engine, steps=2, runtime=rt)
    reference = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    buf = io.BytesIO()
    with swaprl.phase("generate"):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert_bitwise_equal(saved["model"], reference[0])
    for pid, st in reference[1]["state"].items():
        assert_bitwise_equal(saved["optimizer"]["state"][pid], st)
    # And the checkpoint restores into a fresh trainer that continues identically.
    fresh = load(tiny_checkpoint)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["optimizer"])
    swaprl.detach()
    a = grpo.run(model, opt, HFEngine(model), steps=1)
    b = grpo.run(fresh, fresh_opt, HFEngine(fresh), steps=1)
    assert a == b


def test_nested_phases_restore_the_previous_one(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    assert rt.current_phase == "train"
    with swaprl.phase("generate"):
        with swaprl.phase("train"):
            assert rt.status()["optimizer"]["location"] == "device"
            with swaprl.phase("generate"):
                assert rt.status()["optimizer"]["location"] == "host"
            assert rt.current_phase == "train"
        assert rt.current_phase == "generate"
        assert rt.status()["optimizer"]["location"] == "host"
    assert rt.current_phase == "train"


def test_the_embedded_engine_outside_a_generate_block_gives_the_tokens_it_gives_inside(tiny_checkpoint):
    """Allowed, as docs/usage.md says: the embedded engine generates with the trainer's own module, so outside
    `generate` it samples what it samples inside, beside the optimizer states still on the device. (A vLLM engine is
    asleep there and refuses, naming the fix: tests/test_vllm.py.)"""
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, "hf")
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    sampling = swaprl.Sampling(max_tokens=6, n=2, seed=3)
    outside = rt.engine.generate([[1, 2, 3]], sampling)
    assert rt.current_phase == "train" and rt.status()["optimizer"]["location"] == "device"
    with swaprl.phase("generate"):
        assert rt.engine.generate([[1, 2, 3]], sampling) == outside


# ---------------------------------------------------------------- bad input


def test_unknown_phase_name_is_refused_before_anything_moves(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters())
    rt = swaprl.attach(model, opt)
    with pytest.raises(swaprl.PhaseError, match=r"unknown phase 'rollout'.*'train', 'generate'"):
        with swaprl.phase("rollout"):
            pass
    assert rt.current_phase == "train"


def test_phase_without_attach_names_the_fix():
    with pytest.raises(swaprl.PhaseError, match=r"call swaprl.attach\(model, optimizer\) first"):
        with swaprl.phase("generate"):
            pass


def test_second_attach_names_the_fix(tiny_checkpoint):
    model = load(tiny_checkpoint)
    swaprl.attach(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(swaprl.PhaseError, match=r"call swaprl.detach\(\) first"):
        swaprl.attach(model, torch.optim.AdamW(model.parameters()))
    swaprl.detach()
    swaprl.attach(model, torch.optim.AdamW(model.parameters()))  # and after detach() it works


def test_optimizer_of_another_model_is_refused(tiny_checkpoint):
    model, other = load(tiny_checkpoint), load(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"not parameters of the model.*AdamW\(model.parameters\(\)\)"):
        swaprl.attach(model, torch.optim.AdamW(other.parameters()))
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()  # nothing was registered


def test_params_offload_with_the_embedded_engine_is_refused(tiny_checkpoint):
    model = load(tiny_checkpoint)
    with pytest.raises(ValueError, match="params='keep'"):
        swaprl.attach(model, torch.optim.AdamW(model.parameters()), config=swaprl.SwapConfig(params="offload"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(grads="drop"), "grads='drop'"),
    (dict(params="host"), "params='host'"),
    (dict(sleep_level=3), "sleep_level=3"),
    (dict(host_budget_bytes=-1), "negative"),
    (dict(sync_bucket_bytes=10), "64 MiB or more"),
    (dict(gpu_memory_utilization=1.5), "outside"),
])
def test_config_validation_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        swaprl.SwapConfig(**kwargs)


def test_host_budget_refuses_at_attach_before_allocating(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # AdamW's states are known before they exist: two of each parameter's size, each slice 512-byte aligned, and the
    # step counter, which torch keeps on the CPU, the parameters' device here.
    expected = sum(2 * ((p.numel() * p.element_size() + 511) // 512 * 512) + 512 for p in model.parameters())
    with pytest.raises(swaprl.HostBufferError, match=rf"locking host buffers at attach .* needs {expected} more bytes "
                                                     r".* only 4096 bytes .*Nothing was allocated"):
        swaprl.attach(model, opt, config=swaprl.SwapConfig(host_budget_bytes=4096))
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()  # nothing attached
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(host_budget_bytes=expected + 2**20))
    host = rt.status()["host_buffers"]
    assert host["bytes"] == expected  # prepared in the background at attach
    # ... and finished before attach returned: no preparation runs on under the first steps, and none waited later
    assert not [t for t in threading.enumerate() if t.name.startswith("swaprl-host")]
    assert host["waited_seconds"] == 0 and host["attach_waited_seconds"] >= 0
    grpo.run(model, opt, rt.engine, steps=2, runtime=rt)
    with swaprl.phase("generate"):  # the states went into the buffer prepared for them, not a new one
        assert rt.status()["optimizer"]["host_bytes"] > 0
        assert rt.status()["host_buffers"]["bytes"] - expected < 2**20  # only the gradients' buffer came on top


def test_host_budget_refuses_a_switch_before_moving_a_byte(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)  # states not known ahead: sized at the first switch
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(host_budget_bytes=4096))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)  # first generate: no state yet, nothing to offload
    before = [t.clone() for t in optimizer_tensors(opt)]
    needed = sum((t.numel() * t.element_size() + 511) // 512 * 512 for t in optimizer_tensors(opt))
    with pytest.raises(swaprl.HostBufferError, match=rf"needs {needed} more bytes .* only 4096 bytes .*"
                                                     r"Nothing was moved"):
        with swaprl.phase("generate"):
            pass
    assert rt.current_phase == "train"
    assert rt.status()["optimizer"]["location"] == "device"
    for t, b in zip(optimizer_tensors(opt), before):
        torch.testing.assert_close(t, b, rtol=0, atol=0)


@pytest.mark.parametrize("states", ["swap", "host"])
def test_step_inside_generate_is_refused(tiny_checkpoint, states):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(optimizer_states=states))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    with swaprl.phase("generate"):
        with pytest.raises(swaprl.PhaseError, match=r"inside `with phase\('train'\)`"):
            opt.step()


def test_detach_inside_a_phase_is_refused(tiny_checkpoint):
    model = load(tiny_checkpoint)
    rt = swaprl.attach(model, torch.optim.AdamW(model.parameters()))
    with swaprl.phase("generate"):
        with pytest.raises(swaprl.PhaseError, match="leave the block first"):
            rt.detach()


def test_runtime_built_directly_is_checked_and_registered_when_bound(tiny_checkpoint):
    model, other = load(tiny_checkpoint), load(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"not parameters of the model"):
        swaprl.Runtime(swaprl.SwapConfig()).bind(model, torch.optim.AdamW(other.parameters()), HFEngine())
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()  # a refused bind registers nothing
    rt = swaprl.Runtime(swaprl.SwapConfig()).bind(model, torch.optim.AdamW(model.parameters()), HFEngine())
    assert swaprl.current() is rt
    with pytest.raises(swaprl.PhaseError, match=r"call swaprl.detach\(\) first"):
        swaprl.Runtime(swaprl.SwapConfig())
    rt.detach()
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()


def test_a_runtime_attached_later_is_registered_at_once_and_bound_when_the_trainer_is_ready(tiny_checkpoint):
    rt = swaprl.attach_later(until="the test binds it")
    assert swaprl.current() is rt
    with pytest.raises(swaprl.PhaseError, match="no trainer yet: the test binds it"):
        rt.status()
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert rt.bind(model, opt, HFEngine()) is rt and swaprl.current() is rt
    with rt.phase("generate"):
        assert rt.status()["phase"] == "generate"
    with pytest.raises(swaprl.PhaseError, match="bound to a trainer already"):
        rt.bind(model, opt, HFEngine())
    rt.detach()


def test_detach_says_what_it_brought_back_and_runs_on_detach_newest_first(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(optimizer_states="host"))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)  # the states are made, and live in host memory
    states = sum(t.numel() * t.element_size() for t in optimizer_tensors(opt) if t.numel() > 1)
    assert states > 0 and rt.status()["optimizer"]["host_bytes"] >= states
    calls = []
    rt.on_detach(lambda: calls.append("first"))
    rt.on_detach(lambda: 1 / 0)  # a failing callback is logged; the others still run
    rt.on_detach(lambda: calls.append("last"))
    done = rt.detach()
    assert calls == ["last", "first"]
    assert done["brought_back_bytes"] >= states and done["host_released_bytes"] >= states
    assert rt.detach() == {}  # a second detach does nothing
    opt.step()  # plain torch again


def test_a_callback_that_exits_still_lets_detach_finish_and_the_exit_goes_on(tiny_checkpoint):
    """sys.exit() inside an on_detach callback: every other callback runs, the runtime is detached, and the
    SystemExit reaches the caller (it is not logged away as a failed callback)."""
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(optimizer_states="host"))
    calls = []
    rt.on_detach(lambda: calls.append("first"))
    rt.on_detach(lambda: sys.exit(3))
    rt.on_detach(lambda: calls.append("last"))
    with pytest.raises(SystemExit) as exited:
        rt.detach()
    assert exited.value.code == 3 and calls == ["last", "first"]
    with pytest.raises(swaprl.PhaseError, match="no swaprl runtime is attached"):
        swaprl.current()
    opt.step()  # plain torch again


@pytest.mark.parametrize("device", DEVICES)
def test_attach_interrupted_while_host_memory_is_prepared_leaves_nothing_behind(tiny_checkpoint, device):
    import threading

    from swaprl.checkpoints import random_model

    class InterruptedEngine(grpo.ReplicaEngine):
        def sleep(self, level):  # attach's last step; the host buffers are being prepared in the background
            raise KeyboardInterrupt

    model = load(tiny_checkpoint, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grpo.run(model, opt, HFEngine(model), steps=1)  # states exist: they must survive the interrupted attach
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = [t.detach().clone() for t in optimizer_tensors(opt)]
    threads = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        swaprl.attach(model, opt, InterruptedEngine(random_model("tiny", device="cpu")))
    left = [t.name for t in set(threading.enumerate()) - threads if t.name.startswith("swaprl-host")]
    assert not left  # the preparation was joined and its buffer released
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()
    assert_bitwise_equal({n: p.detach() for n, p in model.named_parameters()}, before)
    for t, b in zip(optimizer_tensors(opt), states):
        assert t.device == b.device
        torch.testing.assert_close(t, b, rtol=0, atol=0)
    rt = swaprl.attach(model, opt, "hf")  # attachable again, and the runtime works
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)


# ---------------------------------------------------------------- faults


@pytest.mark.parametrize("exc", [ValueError("user bug"), KeyboardInterrupt()])
def test_exception_inside_a_phase_block_leaves_a_consistent_runtime(tiny_checkpoint, exc):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    before = [t.clone() for t in optimizer_tensors(opt)]
    with pytest.raises(type(exc)):
        with swaprl.phase("generate"):
            raise exc
    assert rt.current_phase == "train"
    assert rt.status()["optimizer"]["location"] == "device"
    for t, b in zip(optimizer_tensors(opt), before):
        torch.testing.assert_close(t, b, rtol=0, atol=0)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)  # and the next phase() works


@pytest.mark.parametrize("interrupted_after", ["offload optimizer", "offload grads"])
def test_interrupt_halfway_through_a_transition_rolls_back(tiny_checkpoint, interrupted_after):
    """Ctrl-C between two steps of train->generate: the finished steps are undone and nothing is lost."""
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(grads="offload"))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    prompts = [[1, 2, 3]]
    loss = grpo.policy_loss(model, prompts, [[4, 5], [6, 7]], n=2)
    loss.backward()  # gradients present, so both resources have something to move
    grads = [p.grad.clone() for p in model.parameters()]
    states = [t.clone() for t in optimizer_tensors(opt)]

    grpo.enter_generate_interrupted_after(rt, interrupted_after)
    st = rt.status()
    assert rt.current_phase == "train"
    assert st["optimizer"]["location"] == st["grads"]["location"] == "device"
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    for t, s in zip(optimizer_tensors(opt), states):
        torch.testing.assert_close(t, s, rtol=0, atol=0)
    with swaprl.phase("generate"):
        assert rt.status()["grads"]["location"] == "host"


def test_an_engine_attach_builds_starts_after_host_memory_and_a_failed_attach_closes_it(tiny_checkpoint,
                                                                                          monkeypatch):
    """attach(model, opt, build): the host buffers the optimizer states will need start being locked first, so the
    locking runs under the engine's start (tens of seconds for a vLLM engine); if attach fails after building the
    engine, it closes it, and nothing else is left behind."""
    import threading

    from swaprl.checkpoints import random_model
    from swaprl.placement import Placement

    order = []
    prepare = Placement.prepare_host

    def recorded(self, **kwargs):
        order.append("host")
        return prepare(self, **kwargs)

    monkeypatch.setattr(Placement, "prepare_host", recorded)

    class Built(grpo.ReplicaEngine):
        closed = False

        def close(self):
            Built.closed = True

    class BuiltThenInterrupted(Built):
        def sleep(self, level):  # attach's last step
            raise KeyboardInterrupt

    def build(kind):
        order.append("engine")
        return kind(random_model("tiny", device="cpu"))

    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grpo.run(model, opt, HFEngine(model), steps=1)  # states exist: they must survive the failed attach
    states = [t.detach().clone() for t in optimizer_tensors(opt)]
    threads = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        swaprl.attach(model, opt, lambda: build(BuiltThenInterrupted))
    assert order == ["host", "engine"] and Built.closed
    assert not [t.name for t in set(threading.enumerate()) - threads if t.name.startswith("swaprl-host")]
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()
    for t, b in zip(optimizer_tensors(opt), states):
        torch.testing.assert_close(t, b, rtol=0, atol=0)

    with pytest.raises(TypeError, match="engine must be a swaprl.Engine, not str"):  # what the function returned
        swaprl.attach(model, opt, lambda: "vllm")
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()

    order.clear()
    Built.closed = False
    rt = swaprl.attach(model, opt, lambda: build(Built))
    assert order == ["host", "engine"] and isinstance(rt.engine, Built) and rt.status()["host_buffers"]["bytes"] > 0
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    assert rt.last_sync.as_dict()["weights"] == "exact"  # the built engine was synced and proved
    rt.detach()
    assert not Built.closed  # an attached engine is the caller's to close


@pytest.mark.parametrize("engine, error, match", [
    ("vlm", ValueError, r"engine='vlm'; pass an Engine instance, a function that builds one, 'hf', 'vllm' or None"),
    (42, TypeError, r"engine must be a swaprl.Engine, a function that builds one, 'hf', 'vllm' or None, not int"),
])
def test_a_wrong_engine_is_refused_before_anything_is_allocated(tiny_checkpoint, engine, error, match):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(error, match=match):
        swaprl.attach(model, opt, engine)
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()


def test_a_step_is_in_flight_between_the_step_that_queues_copies_and_the_one_that_waits_for_them():
    from swaprl.undo import Step, in_flight

    steps = [Step("release cached memory", lambda: 0), Step("start offload optimizer", lambda: 0),
             Step("engine wake weights", lambda: 0), Step("sync weights", lambda: 0),
             Step("finish offload optimizer", lambda: 0, started_by="start offload optimizer"),
             Step("release cached memory", lambda: 0), Step("engine wake kv_cache", lambda: 0)]
    assert [in_flight(steps, at) for at in range(len(steps))] == [False, False, True, True, True, False, False]
    assert not in_flight(steps[:2] + steps[5:], 1)  # nothing waits for copies: none in flight
    assert not in_flight(steps, -1)


def test_a_backward_in_generate_is_refused_where_the_gradients_are_not_on_the_device(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, HFEngine(model), config=swaprl.SwapConfig(optimizer_states="swap"))
    with rt.phase("generate"):
        with pytest.raises(swaprl.PhaseError, match=r"backward\(\) was called in phase 'generate'.*grads='keep'"):
            grpo.policy_loss(model, [[1, 2, 3]], [[4, 6], [5, 7]], n=2).backward()
    opt.zero_grad(set_to_none=True)
    rt.detach()
    # With the gradients kept on the device a backward while generating accumulates where training finds it.
    rt = swaprl.attach(model, opt, HFEngine(model), config=swaprl.SwapConfig(optimizer_states="swap", grads="keep"))
    with rt.phase("generate"):
        grpo.policy_loss(model, [[1, 2, 3]], [[4, 6], [5, 7]], n=2).backward()
    with rt.phase("train"):
        opt.step()
    rt.detach()
