"""`SwapConfig(optimizer_states="host")`: the optimizer states stay in host memory and `optimizer.step()` streams
them through the device in chunks. Real models and real torch optimizers against plain training, bit for bit."""

from __future__ import annotations

import copy
import io
import json
import warnings

import pytest
import torch

import swaprl
from swaprl.engines import HFEngine

from . import grpo
from .test_runtime import DEVICES, assert_bitwise_equal, load, optimizer_tensors

MiB = 2**20
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_single_tensor": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}


def host_config(**kwargs) -> swaprl.SwapConfig:
    # The smallest chunk allowed: the tiny model's 2.8 MiB of AdamW states take three chunks, so the third reuses
    # the first's staging buffer.
    return swaprl.SwapConfig(optimizer_states="host", stream_chunk_bytes=MiB, **kwargs)


def trained(checkpoint, host: bool, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                         swaprl.Runtime | None]:
    """The tiny model after `steps` GRPO steps with AdamW: plain torch (`host` False) or streamed from the host."""
    model = load(checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=host_config()) if host else None
    grpo.run(model, opt, HFEngine(model) if rt is None else rt.engine, steps=steps, runtime=rt)
    return model, opt, rt


def trained_twice(checkpoint) -> tuple[torch.nn.Module, torch.optim.Optimizer, tuple]:
    """Two identical models with AdamW after one plain GRPO step: one for swaprl, one (a pair) as the reference."""
    model = load(checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = copy.deepcopy((model, opt))
    grpo.run(model, opt, HFEngine(model), steps=1)
    grpo.run(reference[0], reference[1], HFEngine(reference[0]), steps=1)
    return model, opt, reference


def streamed_steps(rt: swaprl.Runtime) -> list[dict]:
    events: list[dict] = []
    rt.add_listener(lambda e: events.append(e) if e.get("transition") == "optimizer.step" else None)
    return events


def snapshot(model, opt) -> tuple[dict, list[torch.Tensor]]:
    return ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            [t.detach().cpu().clone() for t in optimizer_tensors(opt)])


def assert_same_training(a, b) -> None:
    (p0, s0), (p1, s1) = a, b
    assert_bitwise_equal(p0, p1)
    assert len(s0) == len(s1) > 0
    for x, y in zip(s0, s1):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_streamed_step_is_bitwise_plain_training(tiny_checkpoint, device, opt_name):
    """N GRPO steps with the states in host memory, streamed in several chunks, end where plain training ends."""
    if device == "cuda":
        torch.use_deterministic_algorithms(True)
    results, events = [], []
    for host in (False, True):
        model = load(tiny_checkpoint, device)
        opt = OPTIMIZERS[opt_name](model.parameters())
        engine = HFEngine(model)
        rt = swaprl.attach(model, opt, engine, config=host_config()) if host else None
        if rt is not None:
            events = streamed_steps(rt)
        losses = grpo.run(model, opt, engine, steps=3, runtime=rt)
        swaprl.detach()
        results.append((losses, snapshot(model, opt)))
    torch.use_deterministic_algorithms(False)
    (l0, a), (l1, b) = results
    assert l0 == l1
    assert_same_training(a, b)
    state_bytes = sum(t.numel() * t.element_size() for t in b[1])
    assert len(events) == 3 and events[0]["chunks"] >= 2  # sized as if the states were twice the parameters
    assert all(e["chunks"] >= 2 for e in events) or state_bytes < MiB  # Adafactor's factored states fit one
    # The first step creates the states on the device and only copies them out; later ones copy them both ways.
    assert events[0]["h2d_bytes"] == 0 and events[0]["d2h_bytes"] > 0
    assert events[-1]["h2d_bytes"] == events[-1]["d2h_bytes"] > 0
    assert events[-1]["d2h_bytes"] <= state_bytes


def test_a_closure_runs_once_per_step(tiny_checkpoint):
    def train(host: bool):
        model = load(tiny_checkpoint)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rt = swaprl.attach(model, opt, config=host_config()) if host else None
        calls = []

        def closure():
            calls.append(1)
            opt.zero_grad(set_to_none=True)
            loss = grpo.policy_loss(model, [[1, 2, 3]], [[4, 6], [5, 7]], n=2)
            loss.backward()
            return loss

        losses = [opt.step(closure).item() for _ in range(2)]
        assert len(calls) == 2
        if rt is not None:
            assert rt.status()["optimizer"]["bytes"] == 0
        swaprl.detach()
        return losses, snapshot(model, opt)

    (l0, a), (l1, b) = train(False), train(True)
    assert l0 == l1
    assert_same_training(a, b)


def test_parameters_without_gradients_keep_their_states(tiny_checkpoint):
    """Only parameters with a gradient are stepped, as in torch; the others' states stay untouched at home."""
    results = []
    for host in (False, True):
        model, opt, rt = trained(tiny_checkpoint, host, steps=1)
        frozen = [p for n, p in model.named_parameters() if ".1." in n]  # layer 1
        loss = grpo.policy_loss(model, [[1, 2, 3]], [[4, 6], [5, 7]], n=2)
        loss.backward()
        for p in frozen:
            p.grad = None
        opt.step()
        if rt is not None:
            assert rt.status()["optimizer"]["bytes"] == 0
        swaprl.detach()
        results.append(snapshot(model, opt))
    assert_same_training(*results)


# ---------------------------------------------------------------- residency


def test_states_stay_in_host_memory_in_both_phases(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=host_config(grads="offload"))
    assert rt.status()["optimizer"] == {"location": "host", "bytes": 0, "host_bytes": 0}  # nothing before step 1
    grpo.run(model, opt, rt.engine, steps=2, runtime=rt)
    states = optimizer_tensors(opt)
    state_bytes = sum(t.numel() * t.element_size() for t in states)
    where = [(id(t), t.data_ptr()) for t in states]
    values = [t.clone() for t in states]
    assert all(t.device.type == "cpu" for t in states)
    assert rt.status()["optimizer"] == {"location": "host", "bytes": 0, "host_bytes": state_bytes}

    steps = []
    rt.add_listener(lambda e: steps.append(e["step"]) if e["type"] == "step" else None)
    loss = grpo.policy_loss(model, [[1, 2, 3]], [[4, 6], [5, 7]], n=2)
    loss.backward()  # gradients to move, so the transitions do move something
    for _ in range(2):
        with swaprl.phase("generate"):
            st = rt.status()
            assert st["optimizer"] == {"location": "host", "bytes": 0, "host_bytes": state_bytes}
            assert st["grads"]["location"] == "host"  # the gradients' policy still applies
        assert rt.status()["optimizer"] == {"location": "host", "bytes": 0, "host_bytes": state_bytes}
    assert "offload grads" in steps and not any("optimizer" in s for s in steps)
    assert [(id(t), t.data_ptr()) for t in optimizer_tensors(opt)] == where  # not moved, not even copied
    for t, v in zip(optimizer_tensors(opt), values):
        torch.testing.assert_close(t, v, rtol=0, atol=0)


def test_detach_brings_the_states_back_for_plain_torch(tiny_checkpoint):
    results = []
    for host in (False, True):
        model, opt, _ = trained(tiny_checkpoint, host, steps=2)
        ids = [id(t) for t in optimizer_tensors(opt)]
        swaprl.detach()
        assert [id(t) for t in optimizer_tensors(opt)] == ids
        assert "step" not in vars(opt) and "load_state_dict" not in vars(opt)  # the optimizer's own methods
        grpo.run(model, opt, HFEngine(model), steps=1)  # plain torch from here on
        results.append(snapshot(model, opt))
    assert_same_training(*results)


def test_attach_after_training_moves_existing_states_to_host(tiny_checkpoint):
    model, opt, reference = trained_twice(tiny_checkpoint)
    rt = swaprl.attach(model, opt, config=host_config())
    state_bytes = sum(t.numel() * t.element_size() for t in optimizer_tensors(opt))
    assert rt.status()["optimizer"] == {"location": "host", "bytes": 0, "host_bytes": state_bytes}
    grpo.run(model, opt, rt.engine, steps=2, runtime=rt)
    swaprl.detach()
    grpo.run(reference[0], reference[1], HFEngine(reference[0]), steps=2)
    assert_same_training(snapshot(model, opt), snapshot(*reference))


# ---------------------------------------------------------------- faults


class SleeplessEngine(swaprl.Engine):
    """An engine with weights of its own that cannot sleep: the last step of attach fails."""

    def generate(self, prompts, sampling):
        raise NotImplementedError

    def logprobs(self, sequences):
        raise NotImplementedError

    def sleep(self, level: int) -> None:
        raise RuntimeError("no sleep mode")


def test_a_failed_attach_gives_the_optimizer_back_as_it_was(tiny_checkpoint):
    model, opt, reference = trained_twice(tiny_checkpoint)
    before = [t.clone() for t in optimizer_tensors(opt)]
    with pytest.raises(RuntimeError, match="no sleep mode"):
        swaprl.attach(model, opt, SleeplessEngine(), config=host_config())
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()
    assert "step" not in vars(opt) and "load_state_dict" not in vars(opt)
    for t, b in zip(optimizer_tensors(opt), before):
        torch.testing.assert_close(t, b, rtol=0, atol=0)
    grpo.run(model, opt, HFEngine(model), steps=1)  # plain torch, no hook left behind
    grpo.run(reference[0], reference[1], HFEngine(reference[0]), steps=1)
    assert_same_training(snapshot(model, opt), snapshot(*reference))


def two_groups(model, opt_name="adamw"):
    """The model's parameters in two groups; the second starts in the streamed step's second chunk."""
    params = list(model.parameters())
    half = len(params) // 2
    groups = [{"params": params[:half]}, {"params": params[half:]}]
    if opt_name == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2)
    return torch.optim.AdamW(groups, lr=1e-2, foreach=False)


@pytest.mark.parametrize("opt_name", ["adamw", "adamw_single_tensor"])
@pytest.mark.parametrize("fail_at_step", [1, 2])
def test_an_error_inside_the_step_loses_nothing(tiny_checkpoint, opt_name, fail_at_step):
    """An optimizer that raises on its second parameter group, in a later chunk: every gradient comes back, every
    state is in host memory, and the optimizer is left exactly as plain torch leaves it; training then goes on."""
    results = []
    for host in (False, True):
        model = load(tiny_checkpoint)
        opt = two_groups(model, opt_name)
        rt = swaprl.attach(model, opt, config=host_config()) if host else None
        engine = HFEngine(model) if rt is None else rt.engine
        if fail_at_step == 2:
            grpo.run(model, opt, engine, steps=1, runtime=rt)
        loss = grpo.policy_loss(model, [[1, 2, 3]], [[4, 6], [5, 7]], n=2)
        loss.backward()
        grads = [(p.grad, p.grad.clone()) for p in model.parameters()]
        opt.param_groups[1]["betas"] = (0.9,)  # unpacking it fails before the group is touched
        with pytest.raises(ValueError, match="not enough values to unpack"):
            opt.step()
        for p, (g, value) in zip(model.parameters(), grads):
            assert p.grad is g
            torch.testing.assert_close(g, value, rtol=0, atol=0)
        if rt is not None:
            st = rt.status()["optimizer"]
            assert st["location"] == "host" and st["bytes"] == 0 and st["host_bytes"] > 0
        after_error = snapshot(model, opt)
        opt.param_groups[1]["betas"] = (0.9, 0.999)
        opt.step()
        opt.zero_grad(set_to_none=True)
        grpo.run(model, opt, engine, steps=1, runtime=rt)
        swaprl.detach()
        results.append((after_error, snapshot(model, opt)))
    assert_same_training(results[0][0], results[1][0])
    assert_same_training(results[0][1], results[1][1])


def test_a_step_method_taken_before_attach_is_refused(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = opt.step  # what a wrapper made before attach would hold
    swaprl.attach(model, opt, config=host_config())
    grpo.policy_loss(model, [[1, 2, 3]], [[4, 6], [5, 7]], n=2).backward()
    with pytest.raises(swaprl.PhaseError, match=r"reference to the step method taken before swaprl.attach\(\)"):
        step()


def test_host_budget_refuses_states_that_do_not_fit(tiny_checkpoint):
    # AdamW's states are known ahead: attach refuses before allocating anything.
    model = load(tiny_checkpoint)
    with pytest.raises(swaprl.HostBufferError, match=r"at attach .*streamed optimizer.* only 4096 bytes .*Nothing was "
                                                     r"allocated.*raise host_budget_bytes"):
        swaprl.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                      config=host_config(host_budget_bytes=4096))
    # SGD's momentum appears at the first step: that step completes and refuses to grow the buffer.
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    rt = swaprl.attach(model, opt, config=host_config(host_budget_bytes=4096))
    grpo.policy_loss(model, [[1, 2, 3]], [[4, 6], [5, 7]], n=2).backward()
    with pytest.raises(swaprl.HostBufferError, match=r"'host' home.* only 4096 bytes .*step\(\) itself "
                                                     r"completed.*raise host_budget_bytes"):
        opt.step()
    st = rt.status()["optimizer"]  # the states it made are in ordinary host memory, counted
    assert st["bytes"] == 0 and st["host_bytes"] == sum(t.numel() * t.element_size() for t in optimizer_tensors(opt))


# ---------------------------------------------------------------- checkpoints, schedulers, accelerate


@pytest.mark.parametrize("load_after_attach", [True, False])
def test_state_dict_round_trip_resumes_identically(tiny_checkpoint, load_after_attach):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=host_config())
    grpo.run(model, opt, rt.engine, steps=2, runtime=rt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    swaprl.detach()
    plain = load(tiny_checkpoint)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    grpo.run(plain, plain_opt, HFEngine(plain), steps=2)
    buf.seek(0)
    saved = torch.load(buf)
    assert_bitwise_equal(saved["model"], plain.state_dict())
    for pid, st in plain_opt.state_dict()["state"].items():
        assert_bitwise_equal(saved["optimizer"]["state"][pid], st)

    fresh = load(tiny_checkpoint)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(saved["model"])
    if not load_after_attach:
        fresh_opt.load_state_dict(saved["optimizer"])
    rt = swaprl.attach(fresh, fresh_opt, config=host_config())
    if load_after_attach:
        fresh_opt.load_state_dict(saved["optimizer"])
    state_bytes = sum(t.numel() * t.element_size() for t in optimizer_tensors(fresh_opt))
    assert rt.status()["optimizer"] == {"location": "host", "bytes": 0, "host_bytes": state_bytes}
    a = grpo.run(fresh, fresh_opt, rt.engine, steps=2, runtime=rt)
    swaprl.detach()
    b = grpo.run(plain, plain_opt, HFEngine(plain), steps=2)
    assert a == b
    assert_same_training(snapshot(fresh, fresh_opt), snapshot(plain, plain_opt))


def _perturbed(sd: dict, drop=()) -> dict:
    """A copy of a state dict with every floating state moved by one and the states of `drop` left out."""
    out = copy.deepcopy(sd)
    for pid in drop:
        out["state"].pop(pid)
    for st in out["state"].values():
        for k, v in st.items():
            if k != "step" and v.is_floating_point():
                v.add_(1.0)
    return out


def _trained_pair(checkpoint, steps: int = 2, **config):
    """The same training with plain torch and with the states in host memory: [(model, opt, rt or None)] x 2."""
    runs = []
    for host in (False, True):
        model = load(checkpoint)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rt = swaprl.attach(model, opt, config=host_config(**config)) if host else None
        grpo.run(model, opt, HFEngine(model) if rt is None else rt.engine, steps=steps, runtime=rt)
        runs.append((model, opt, rt))
        if rt is not None and len(runs) < 2:
            swaprl.detach()
    return runs


@pytest.mark.parametrize("dropped", [0, 3], ids=["every state", "some states missing"])
def test_a_state_dict_held_across_a_load_keeps_its_values(tiny_checkpoint, dropped):
    """`sd = opt.state_dict()` (no copy), then `opt.load_state_dict(other)` and more steps: plain torch leaves `sd`'s
    tensors as they were, and so must the host buffer, whose space the loaded states would otherwise reuse (whether
    they fit after the buffer's end or not); training stays plain torch's, and loading `sd` back resumes from it."""
    held, before, results = {}, {}, []
    for model, opt, rt in _trained_pair(tiny_checkpoint):
        # A first load that leaves room at the buffer's end, so that the next load's states fit there.
        opt.load_state_dict(_perturbed(opt.state_dict(), drop=range(0, 12, 4)))
        grpo.run(model, opt, HFEngine(model) if rt is None else rt.engine, steps=1, runtime=rt, first=2)
        sd = opt.state_dict()
        held[rt is None], before[rt is None] = sd, copy.deepcopy(sd["state"])
        opt.load_state_dict(_perturbed(sd, drop=range(0, 12, max(dropped, 1)) if dropped else ()))
        grpo.run(model, opt, HFEngine(model) if rt is None else rt.engine, steps=1, runtime=rt, first=3)
        for pid, st in before[rt is None].items():
            assert_bitwise_equal(sd["state"][pid], st)
        opt.load_state_dict(sd)
        grpo.run(model, opt, HFEngine(model) if rt is None else rt.engine, steps=1, runtime=rt, first=4)
        results.append(snapshot(model, opt))
        if rt is not None:
            swaprl.detach()
    assert_same_training(*results)


def test_a_resume_from_a_file_reuses_the_buffer_and_a_held_state_dict_is_counted(tiny_checkpoint):
    """`opt.load_state_dict(torch.load(f))` with nothing held lays the states into the same buffer, within a budget
    just above it; with a state_dict held, the old buffer it keeps alive counts against the budget, and a load that
    would overshoot is refused with the fix, nothing lost."""
    (_, plain_opt, _), = [_trained_pair(tiny_checkpoint)[0]]
    swaprl.detach()
    states = sum(t.numel() * t.element_size() for t in optimizer_tensors(plain_opt))
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=host_config(host_budget_bytes=int(states * 1.5)))
    grpo.run(model, opt, rt.engine, steps=2, runtime=rt)
    streamer = rt._placement.streamer
    f = io.BytesIO()
    torch.save(opt.state_dict(), f)
    f.seek(0)
    where = streamer.layout._buffer_span()
    opt.load_state_dict(_perturbed(torch.load(f)))
    assert streamer.layout._buffer_span() == where  # laid into the same buffer: nothing else views it
    held = opt.state_dict()
    before = copy.deepcopy(held["state"])
    loaded = _perturbed(held, drop=[0])
    with pytest.raises(swaprl.HostBufferError, match="A state_dict\\(\\) taken earlier still views"):
        opt.load_state_dict(loaded)
    for pid, st in before.items():
        assert_bitwise_equal(held["state"][pid], st)
    del held
    opt.load_state_dict(loaded)  # with the state_dict gone, its space is free again
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt, first=2)
    swaprl.detach()


def test_loading_the_optimizers_own_state_dict_keeps_one_buffer(tiny_checkpoint):
    """`opt.load_state_dict(opt.state_dict())`: the loaded states are the dict's own tensors, so nothing outside
    the optimizer keeps the old buffer: the host memory counted (what the budget checks) stays one buffer's, and
    training stays plain torch's."""
    results = []
    for model, opt, rt in _trained_pair(tiny_checkpoint, host_budget_bytes=None):
        held = rt.status()["host_buffers"]["bytes"] if rt is not None else None
        for step in range(2):
            opt.load_state_dict(opt.state_dict())
            if rt is not None:
                assert rt.status()["host_buffers"]["bytes"] == held
            grpo.run(model, opt, HFEngine(model) if rt is None else rt.engine, steps=1, runtime=rt, first=2 + step)
        results.append(snapshot(model, opt))
        if rt is not None:
            swaprl.detach()
    assert_same_training(*results)


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_lr_scheduler_progression_is_unchanged(tiny_checkpoint, scheduler_first):
    """torch's LRScheduler wraps optimizer.step on the instance too; built before or after attach, the learning
    rates and the training are those of plain torch, without its order warnings."""
    results = []
    for host in (False, True):
        model = load(tiny_checkpoint)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler_first else None
        rt = swaprl.attach(model, opt, config=host_config()) if host else None
        if sched is None:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        lrs = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # torch warns when the step order looks wrong
            for step in range(3):
                grpo.policy_loss(model, [[1, 2, 3]], [[4, 6 + step], [5, 7]], n=2).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                lrs.append(sched.get_last_lr()[0])
        if rt is not None:
            assert rt.status()["optimizer"]["bytes"] == 0
        swaprl.detach()
        results.append((lrs, snapshot(model, opt)))
    assert results[0][0] == results[1][0] == [5e-3, 2.5e-3, 1.25e-3]
    assert_same_training(results[0][1], results[1][1])


def test_accelerate_prepared_optimizer_steps_through_the_stream(tiny_checkpoint):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    results = []
    try:
        for host in (False, True):
            model = load(tiny_checkpoint)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            rt = swaprl.attach(model, opt, config=host_config()) if host else None
            events = streamed_steps(rt) if rt is not None else []
            accelerator = Accelerator(cpu=True)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
            prepared, prepared_opt, prepared_sched = accelerator.prepare(model, opt, sched)
            for step in range(3):
                accelerator.backward(grpo.policy_loss(prepared, [[1, 2, 3]], [[4, 6 + step], [5, 7]], n=2))
                prepared_opt.step()
                prepared_sched.step()
                prepared_opt.zero_grad()
            if rt is not None:
                assert len(events) == 3
            swaprl.detach()
            results.append(snapshot(model, opt))
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert_same_training(*results)


def test_profile_and_report_show_the_streamed_step(tiny_checkpoint, tmp_path):
    from swaprl.profile.report import load_run, transition_rows

    path = tmp_path / "run.jsonl"
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=host_config(profile=path))
    grpo.run(model, opt, rt.engine, steps=3, runtime=rt)
    state_bytes = sum(t.numel() * t.element_size() for t in optimizer_tensors(opt))
    swaprl.detach()
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    streamed = [r for r in recs if r["type"] == "step" and r["transition"] == "optimizer.step"]
    assert len(streamed) == 3
    assert all(r["chunks"] >= 2 and r["bytes"] == r["h2d_bytes"] + r["d2h_bytes"] for r in streamed)
    assert streamed[-1]["h2d_bytes"] == streamed[-1]["d2h_bytes"] == state_bytes
    phases = [r for r in recs if r["type"] == "phase" and r["from"] is not None]
    assert all(p["attribution"]["categories"]["optimizer"] == 0 for p in phases)  # never on the device
    rows = [r for r in transition_rows(load_run(path)) if r["transition"] == "optimizer.step"]
    assert len(rows) == 1 and rows[0]["count"] == 3 and rows[0]["bytes"] == 2 * state_bytes


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer_states="gpu"), r"optimizer_states='gpu'; use 'auto' .*, 'swap' .*, 'host' .* or a split such as"),
    (dict(optimizer_states={"gpu": 1.0}), r"unknown home\(s\) \['gpu'\]; the homes are \('device', 'swap', 'host'\)"),
    (dict(optimizer_states={"device": 0.5, "host": 0.4}), r"sums to 0.9; .* must sum to 1"),
    (dict(optimizer_states={"device": 1.5, "host": -0.5}), r"\['device'\]=1.5; give a fraction in \[0, 1\]"),
    (dict(optimizer_states={"device": 0.5, "host": 0.5}, overlap_optimizer_reload=True),
     r"no state is swapped.*drop overlap_optimizer_reload"),
    (dict(optimizer_states="host", stream_chunk_bytes=4096), r"stream_chunk_bytes=4096 .*use 256 MiB or more"),
    (dict(stream_chunk_bytes=1.5 * 2**30), r"stream_chunk_bytes=1610612736.0; give a byte count as an int"),
    (dict(optimizer_states="host", overlap_optimizer_reload=True), r"drop overlap_optimizer_reload"),
])
def test_config_validation_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        swaprl.SwapConfig(**kwargs)


def test_lbfgs_is_refused_with_the_fix(tiny_checkpoint):
    model = load(tiny_checkpoint)
    with pytest.raises(TypeError, match=r"LBFGS.*Use optimizer_states='swap'"):
        swaprl.attach(model, torch.optim.LBFGS(model.parameters()), config=host_config())
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()  # nothing was registered


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_device_peak_during_the_streamed_step_is_two_chunks():
    """64 MiB of parameters with 128 MiB of AdamW states, streamed 8 MiB at a time: the states never sit on the
    device, the step's peak stays within two staging chunks plus the foreach update's temporaries, a checkpoint
    loads without passing through the device, and training matches plain AdamW on the device bit for bit."""
    chunk = 8 * MiB
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)]).cuda()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    rt = swaprl.attach(model, opt, "hf", config=swaprl.SwapConfig(optimizer_states="host", stream_chunk_bytes=chunk))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(3):
        grads = [torch.randn(p.shape, device="cuda", generator=gen) for p in model.parameters()]
        for p, r, g in zip(model.parameters(), reference.parameters(), grads):
            p.grad, r.grad = g, g.clone()
        ref_opt.step()
        del grads
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()  # params, both models' grads, the reference's states
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        # Two staging buffers, and the foreach update's temporaries of about half a chunk (sqrt(exp_avg_sq)).
        assert peak <= 2 * chunk + chunk + 4 * MiB, (step, peak)
        assert torch.cuda.memory_allocated() - base <= 0, step  # nothing stays behind
        assert rt.status()["optimizer"]["bytes"] == 0
    checkpoint = io.BytesIO()
    torch.save(opt.state_dict(), checkpoint)
    checkpoint.seek(0)
    saved = torch.load(checkpoint, map_location="cpu")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.load_state_dict(saved)
    assert torch.cuda.max_memory_allocated() == base  # loaded straight into host memory
    assert rt.status()["optimizer"]["bytes"] == 0
    states = optimizer_tensors(opt)
    assert sum(t.numel() * t.element_size() for t in states) >= 2 * params
    assert all(t.is_pinned() for t in states if t.dim() > 0)  # the moments live in the page-locked buffer
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(states, optimizer_tensors(ref_opt)):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)


def test_a_state_dict_of_bf16_states_in_host_memory_saves_and_loads(tiny_checkpoint, tmp_path):
    """bf16 AdamW states and fp32 step counters side by side in one host buffer: torch.save refuses views of one
    storage as different types, so the state dict gives each its own storage over the same bytes, and the file
    holds the states' bytes, not the buffer's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=host_config())
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    sd = opt.state_dict()
    torch.save(sd, tmp_path / "opt.pt")
    states = sum(v.numel() * v.element_size() for st in sd["state"].values() for v in st.values())
    assert (tmp_path / "opt.pt").stat().st_size < states + 2**20
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(loaded["state"][i][k], v) and loaded["state"][i][k].dtype == v.dtype
    swaprl.detach()


# ---------------------------------------------------------------- a parameter larger than a chunk
SLICED = ["adamw", "adamw_single_tensor", "adamw_fused", "adamw_fused_amsgrad", "adam_amsgrad", "sgd_momentum"]
OPTIMIZERS["adamw_fused_amsgrad"] = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True, amsgrad=True)


def embedding_model(device: str, dtype=torch.float32) -> torch.nn.Module:
    """A 4 MiB embedding (fp32): its AdamW states, 8 MiB, are eight of the smallest chunk."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 256)).to(device, dtype)


def step_both(model: torch.nn.Module, opt, ref: torch.nn.Module, ref_opt, steps: int = 3) -> None:
    """`steps` optimizer steps of both pairs on the same random gradients."""
    for step in range(steps):
        for m in (model, ref):
            gen = torch.Generator().manual_seed(step)
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", SLICED)
def test_a_parameter_larger_than_a_chunk_is_stepped_in_pieces_bit_for_bit(device, opt_name):
    """The embedding's states pass through the device a chunk at a time, as slices stepped on their own: the
    staging stays two chunks, and parameters and states end bit for bit where the whole step puts them."""
    model = embedding_model(device)
    ref = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref.parameters())
    rt = swaprl.attach(model, opt, "hf", config=host_config())
    events = streamed_steps(rt)
    step_both(model, opt, ref, ref_opt)
    assert_same_training(snapshot(model, opt), snapshot(ref, ref_opt))
    # Every step takes the embedding in pieces of at most a chunk, the first too: Adam's states start as zeros,
    # made at their host home before it. SGD's momentum starts as the first gradient: its first step makes it whole.
    per_element = 4 * (3 if "amsgrad" in opt_name else 1 if opt_name == "sgd_momentum" else 2)  # fp32 moments
    pieces = -(-4096 * 256 // (MiB // per_element // 4096 * 4096))  # whole multiples of 4096 elements
    first = 1 if opt_name == "sgd_momentum" else 0
    assert [e["chunks"] for e in events[first:]] == [pieces + 1] * (3 - first), events
    swaprl.detach()


def test_states_made_at_home_keep_torchs_order_and_a_sparse_gradient_is_refused():
    """The embedding's first-step states are made before the step: the optimizer's state (and its state dict, byte
    for byte) still lists them in parameter order, as torch's own step does. An embedding of sparse gradients is
    refused at attach, and no state is left behind."""
    import io

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Embedding(4096, 256))  # the large one second
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, "hf", config=host_config())
    events = streamed_steps(rt)
    step_both(model, opt, ref, ref_opt, steps=1)
    assert events[0]["chunks"] > 2  # the embedding went in pieces at the first step
    assert list(opt.state_dict()["state"]) == list(ref_opt.state_dict()["state"]) == [0, 1, 2]
    saved, ref_saved = io.BytesIO(), io.BytesIO()
    torch.save(opt.state_dict(), saved)
    torch.save(ref_opt.state_dict(), ref_saved)
    assert saved.getvalue() == ref_saved.getvalue()
    swaprl.detach()

    sparse = torch.nn.Embedding(4096, 256, sparse=True)
    opt = torch.optim.Adam(sparse.parameters())
    with pytest.raises(ValueError, match="weight get sparse gradients"):  # refused before anything moves
        swaprl.attach(sparse, opt, "hf", config=host_config())
    assert not opt.state.get(sparse.weight) and "step" not in vars(opt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fails", ["in_a_group", "at_staging"])
def test_a_first_step_that_fails_before_a_parameter_in_pieces_leaves_its_states_zeros(device, fails, monkeypatch):
    """The embedding's first states are made at their host home, whose zeros only the step's copies out write. A
    first step that fails before the embedding's pieces step (a group torch refuses, or no memory for the staging
    buffers) leaves those homes holding zeros, not the junk the buffer held before: training then goes on bit for
    bit as plain torch's after the same failure (after no step, where plain torch would have had the memory)."""
    model = embedding_model(device)
    ref = copy.deepcopy(model)
    groups = lambda m: [{"params": [m[1].weight, m[1].bias]}, {"params": [m[0].weight]}]  # the embedding last
    opt, ref_opt = torch.optim.AdamW(groups(model), lr=1e-2), torch.optim.AdamW(groups(ref), lr=1e-2)
    rt = swaprl.attach(model, opt, "hf", config=host_config())
    buffer = rt._placement.streamer.layout.buffer
    buffer.span(buffer.capacity).fill_(0xFF)  # whatever the memory held before: as floats, NaNs
    events = streamed_steps(rt)
    for m in (model, ref):
        gen = torch.Generator().manual_seed(0)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
    if fails == "in_a_group":
        for o in (opt, ref_opt):
            o.param_groups[1]["betas"] = (0.9,)  # unpacking it fails before the group is touched
            with pytest.raises(ValueError, match="not enough values to unpack"):
                o.step()
            o.param_groups[1]["betas"] = (0.9, 0.999)
    else:
        empty = torch.empty

        def no_staging(*args, **kwargs):
            if kwargs.get("dtype") is torch.uint8:
                raise torch.OutOfMemoryError("no memory for the staging buffers")
            return empty(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(torch, "empty", no_staging)
            with pytest.raises(torch.OutOfMemoryError):
                opt.step()
    state = opt.state[model[0].weight]
    assert all(not torch.any(v) for v in state.values())  # made at home, zeros after the failure
    step_both(model, opt, ref, ref_opt, steps=2)
    # Parameter by parameter: after a failed first step the states made at home come first in `optimizer.state`.
    assert_bitwise_equal(model.state_dict(), ref.state_dict())
    for p, r in zip(model.parameters(), ref.parameters()):
        assert opt.state[p].keys() == ref_opt.state[r].keys()
        for key, value in opt.state[p].items():
            torch.testing.assert_close(value.cpu(), ref_opt.state[r][key].cpu(), rtol=0, atol=0)
    assert events and all(e["chunks"] > 2 for e in events)  # the embedding went in pieces
    swaprl.detach()


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_masters_larger_than_a_chunk_are_stepped_in_pieces_bit_for_bit(device):
    """bf16 parameters with fp32 masters: the embedding's master and its states (12 MiB) in pieces of 1 MiB, each
    piece's master cast into the model's bf16 embedding; against the recipe written by hand."""
    from .test_master import HandMasters

    model = embedding_model(device, torch.bfloat16)
    ref = copy.deepcopy(model)
    opt, hand = torch.optim.AdamW(model.parameters(), lr=1e-3), HandMasters(ref)
    rt = swaprl.attach(model, opt, "hf", config=host_config(master_weights=True))
    events = streamed_steps(rt)
    step_both(model, opt, ref, hand)
    assert_bitwise_equal({k: v.cpu() for k, v in model.state_dict().items()},
                         {k: v.cpu() for k, v in ref.state_dict().items()})
    masters = [local.cpu() for local in (m.detach() for g in opt.param_groups for m in g["params"])]
    for a, b in zip(masters, hand.masters):
        torch.testing.assert_close(a, b.detach().cpu(), rtol=0, atol=0)
    assert [e["chunks"] for e in events] == [-(-4096 * 256 // (MiB // 12 // 4096 * 4096)) + 1] * 3, events
    swaprl.detach()


@pytest.mark.parametrize("fused", [False, True])
def test_fused_fp32_masters_in_pieces_of_a_tail_free_length_are_bit_for_bit(fused):
    """12 bytes per element cut 1 MiB into 87381-element pieces, whose tails torch's fused CPU AdamW rounded unlike
    the whole tensor's body: pieces are whole multiples of 4096 elements."""
    from .test_master import LR, HandMasters

    model = embedding_model("cpu", torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused, amsgrad=True)
    hand = HandMasters(ref)
    hand.opt = torch.optim.AdamW(hand.masters, lr=LR, fused=fused, amsgrad=True)
    swaprl.attach(model, opt, "hf", config=host_config(master_weights=True))
    step_both(model, opt, ref, hand)
    assert_bitwise_equal(model.state_dict(), ref.state_dict())
    swaprl.detach()


def test_a_parameter_whose_elements_are_out_of_order_is_stepped_whole():
    """A transposed parameter flattens to a copy: stepped in pieces, the copy would take the update."""
    model, ref = (torch.nn.Module() for _ in range(2))
    torch.manual_seed(0)
    model.w = torch.nn.Parameter(torch.randn(1024, 512).t())
    ref.w = torch.nn.Parameter(model.w.detach().clone().t().contiguous().t())
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, "hf", config=host_config())
    events = streamed_steps(rt)
    step_both(model, opt, ref, ref_opt)
    assert_same_training(snapshot(model, opt), snapshot(ref, ref_opt))
    assert [e["chunks"] for e in events] == [1, 1, 1]
    swaprl.detach()


@pytest.mark.gpu
def test_a_parameter_larger_than_a_chunk_holds_the_device_to_two_chunks():
    """A 32 MiB embedding with 64 MiB of AdamW states, streamed 8 MiB at a time: stepped in pieces, every step's
    device peak (the first, which makes the states, too) stays within two staging chunks plus the update's
    temporaries (the whole parameter's states would need 64 MiB), and training matches plain AdamW on the device
    bit for bit."""
    chunk = 8 * MiB
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8192, 1024)).cuda()
    reference = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(reference.parameters(), lr=1e-3)
    rt = swaprl.attach(model, opt, "hf", config=swaprl.SwapConfig(optimizer_states="host", stream_chunk_bytes=chunk))
    events = streamed_steps(rt)
    for step in range(3):
        gen = torch.Generator(device="cuda").manual_seed(step)
        grad = torch.randn((8192, 1024), device="cuda", generator=gen)
        model[0].weight.grad, reference[0].weight.grad = grad, grad.clone()
        ref_opt.step()
        del grad
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= 2 * chunk + chunk + 4 * MiB, (step, peak)  # the first step too: its states start at home
    assert [e["chunks"] for e in events] == [8] * 3  # 64 MiB of states in pieces of 8 MiB
    torch.testing.assert_close(model[0].weight, reference[0].weight, rtol=0, atol=0)
    for a, b in zip(optimizer_tensors(opt), optimizer_tensors(ref_opt)):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)
    swaprl.detach()
