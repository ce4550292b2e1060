"""A Ctrl-C at any point of a switch, an attach, a detach, a master install, an optimizer step or an optimizer load
leaves the runtime telling the truth, the next phase working, and training bit for bit what plain torch trains
(`swaprl.interrupts`).

A real SIGINT is sent to the process at the n-th function entry or C return of the code under test (a profile
hook: deterministic), for n over the whole of it; Python's own handler raises KeyboardInterrupt wherever the main
thread next checks for signals, which is what a Ctrl-C does. Inside a critical section it is raised once the
section ends; elsewhere at once. Each case is then checked for consistency, and training goes on. A stride over n
keeps the cases to a few hundred: outcomes change only at the sections' edges, and each test asserts that both
kinds of outcome occurred. A real timer then interrupts many cycles at random points.
"""

from __future__ import annotations

import copy
import logging
import signal
import sys

import pytest
import torch

import swaprl
from swaprl.engines import HFEngine
from swaprl.optimizer_hooks import masters_of

from . import grpo
from .test_master import LR, HandMasters
from .test_runtime import load
from .test_streamed_step import assert_same_training, snapshot

pytestmark = pytest.mark.usefixtures("ctrl_c")
MiB = 2**20
CONFIGS = {"swap": dict(optimizer_states="swap"), "host": dict(optimizer_states="host", stream_chunk_bytes=MiB),
           "masters": dict(master_weights=True, optimizer_states="host", stream_chunk_bytes=MiB),
           "masters swapped": dict(master_weights=True, optimizer_states="swap")}
PROMPTS, COMPLETIONS = [[1, 2, 3]], [[4, 6], [5, 7]]


def config(kind: str) -> swaprl.SwapConfig:
    return swaprl.SwapConfig(verify_sync=False, **CONFIGS[kind])


def trainer(checkpoint, kind: str):
    model = load(checkpoint)
    if CONFIGS[kind].get("master_weights"):
        model = model.to(torch.bfloat16)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def plain_twin(checkpoint, kind: str):
    """Plain torch's side: the recipe by hand for master weights."""
    model, opt = trainer(checkpoint, kind)
    return model, (HandMasters(model) if CONFIGS[kind].get("master_weights") else opt)


def backward(model) -> None:
    grpo.policy_loss(model, PROMPTS, COMPLETIONS, n=2).backward()


def events(fn) -> int:
    """The function entries and C returns `fn()` goes through."""
    count = 0

    def hook(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_return")

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def interrupted_at(n: int, fn) -> bool:
    """Run `fn()` with a SIGINT sent at its n-th function entry or C return; True if KeyboardInterrupt came out."""
    count = 0

    def hook(frame, event, arg):
        nonlocal count
        if event in ("call", "c_return"):
            count += 1
            if count == n:
                sys.setprofile(None)
                signal.raise_signal(signal.SIGINT)

    sys.setprofile(hook)
    try:
        fn()
    except KeyboardInterrupt:
        return True
    finally:
        sys.setprofile(None)
    return False


def lines_run(fn, files: tuple[str, ...], *, interrupt_at: int | None = None) -> int:
    """Run `fn()`; returns the lines and instructions it ran in the files of swaprl named `files`. With
    `interrupt_at` n, a SIGINT is sent at the n-th: finer than `interrupted_at`, since a loop of attribute stores
    makes no function entry or C return, yet CPython checks for signals at each of its backward jumps."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if not frame.f_code.co_filename.endswith(files):
            return None
        frame.f_trace_opcodes = True
        count += event in ("line", "opcode")
        if count == interrupt_at:
            sys.settrace(None)
            signal.raise_signal(signal.SIGINT)
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def interrupted_at_line(n: int, fn, files: tuple[str, ...]) -> bool:
    """`fn()` with a SIGINT sent at its n-th line or instruction in `files` (`lines_run`); True if KeyboardInterrupt
    came out, False if it ran fewer than n (nothing was sent)."""
    try:
        ran = lines_run(fn, files, interrupt_at=n)
    except KeyboardInterrupt:
        return True
    assert ran < n, f"the SIGINT sent at line event {n} never came out"
    return False


def cases(total: int, count: int) -> range:
    return range(1, total + 1, max(total // count, 1))


def assert_consistent(rt: swaprl.Runtime) -> None:
    """Outside every block: in "train", owned by no thread, every state where "train" wants it, nothing unsettled,
    and the optimizer's own methods and hooks in place."""
    st = rt.status()
    assert rt.current_phase == "train" and "unsettled" not in st, st
    assert rt._owner is None and rt._depth == 0  # what the next phase() and detach() refuse on
    if rt._placement.swaps_states:
        assert st["optimizer"]["location"] == "device", st["optimizer"]
    if rt._placement.homes.streams and rt.optimizer.state:
        assert st["optimizer"]["bytes"] == 0, st["optimizer"]  # all home (the device is the host here)
    assert "_swaprl_hooks" in vars(rt.optimizer) and "step" in vars(rt.optimizer)


def step_counts(opt) -> list[float]:
    return [float(s["step"]) for s in opt.state.values() if "step" in s]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_ctrl_c_anywhere_in_a_switch_or_a_step_leaves_the_runtime_true_and_training_exact(tiny_checkpoint, kind,
                                                                                               caplog):
    plain_model, plain = plain_twin(tiny_checkpoint, kind)
    model, opt = trainer(tiny_checkpoint, kind)
    rt = swaprl.attach(model, opt, HFEngine(model), config=config(kind))
    caplog.set_level(logging.WARNING, logger="swaprl.interrupts")

    def take_step(model, opt) -> None:
        backward(model)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for o, m in ((plain, plain_model), (opt, model)):  # the states exist: every switch moves them
        take_step(m, o)

    def cycle():
        with rt.phase("generate"):
            pass

    raised = 0
    for n in cases(events(cycle), 200):
        raised += interrupted_at(n, cycle)
        assert_consistent(rt)

    # A step stands whole or not at all: one that did not is taken again from the same gradients.
    backward(model)
    total = events(opt.step)
    opt.zero_grad(set_to_none=True)
    take_step(plain_model, plain)  # the counted step, taken on both sides
    for n in cases(total, 60):
        backward(model)
        backward(plain_model)
        before = step_counts(opt)
        raised += interrupted_at(n, opt.step)
        if step_counts(opt) == before:  # interrupted before it began
            opt.step()
        assert_consistent(rt)
        opt.zero_grad(set_to_none=True)
        plain.step()
        plain.zero_grad(set_to_none=True)
    deferred = sum("while swaprl is" in r.message for r in caplog.records)
    assert raised > 0 and deferred > 0, (raised, deferred)  # at once outside a section, deferred inside one

    for step in range(2):  # and the phases go on
        grpo.run(plain_model, plain, HFEngine(plain_model), steps=1, first=step)
        grpo.run(model, opt, rt.engine, steps=1, runtime=rt, first=step)
    assert_same_training(snapshot(plain_model, plain.opt if isinstance(plain, HandMasters) else plain),
                         snapshot(model, opt))
    swaprl.detach()


@pytest.mark.parametrize("kind", ["host", "masters"])
def test_a_ctrl_c_anywhere_in_attach_or_detach_leaves_all_attached_or_nothing(tiny_checkpoint, kind):
    """Attach (with a master install on an optimizer that has states already) and detach, interrupted at any point:
    either the runtime is attached and true, or nothing of it is left on the optimizer; training afterwards is
    bit for bit plain torch's."""
    model, _ = trainer(tiny_checkpoint, kind)
    params = list(model.parameters())

    def fresh():
        """An optimizer with states, which a step at lr=0 makes without changing the parameters."""
        opt = torch.optim.AdamW(params, lr=0.0)
        backward(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return opt

    def attach(opt):
        return lambda: swaprl.attach(model, opt, HFEngine(model), config=config(kind))

    def attach_and_detach():
        attach(fresh())()
        swaprl.detach()

    outcomes = set()
    for n in cases(events(attach_and_detach), 120):
        opt = fresh()
        interrupted_at(n, attach(opt))
        assert torch.is_grad_enabled()  # a Ctrl-C inside a `torch.no_grad()` entry must not leave it off
        try:
            rt = swaprl.current()
        except swaprl.PhaseError:  # nothing attached: nothing of it left
            outcomes.add("not attached")
            assert vars(opt).keys().isdisjoint({"step", "zero_grad", "load_state_dict", "_swaprl_hooks"}), vars(opt)
            assert [list(g["params"]) for g in opt.param_groups] == [params] and masters_of(opt) is None
            assert all(p in opt.state for p in params)  # the states it had
            continue
        outcomes.add("attached")
        assert_consistent(rt)
        if interrupted_at(n, rt.detach) and not rt._closed:
            outcomes.add("detach interrupted")
            assert_consistent(rt)
            rt.detach()
        with pytest.raises(swaprl.PhaseError):
            swaprl.current()
    assert {"not attached", "attached"} <= outcomes, outcomes

    plain_model, plain = plain_twin(tiny_checkpoint, kind)
    ours, opt = trainer(tiny_checkpoint, kind)
    rt = swaprl.attach(ours, opt, HFEngine(ours), config=config(kind))
    grpo.run(plain_model, plain, HFEngine(plain_model), steps=2)
    grpo.run(ours, opt, rt.engine, steps=2, runtime=rt)
    assert_same_training(snapshot(plain_model, plain.opt if isinstance(plain, HandMasters) else plain),
                         snapshot(ours, opt))
    swaprl.detach()


def test_a_timer_interrupting_many_cycles_leaves_the_runtime_true_and_training_exact(tiny_checkpoint):
    """SIGALRM once in each of 80 cycles of switches and streamed steps of master weights, at a random moment, its
    handler raising KeyboardInterrupt: every interrupted cycle leaves the runtime consistent, and the run trains
    what plain torch trains."""
    plain_model, plain = plain_twin(tiny_checkpoint, "masters")
    model, opt = trainer(tiny_checkpoint, "masters")
    rt = swaprl.attach(model, opt, HFEngine(model), config=config("masters"))

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    delays = torch.rand(80, generator=torch.Generator().manual_seed(0)).tolist()
    hits = 0
    try:
        for cycle in range(80):
            backward(model)
            backward(plain_model)
            before = step_counts(opt)
            try:  # (the timer is set and stopped inside: one that fires on either side is still caught)
                try:
                    signal.setitimer(signal.ITIMER_REAL, 0.0002 + 0.02 * delays[cycle])  # once, somewhere in the cycle
                    with rt.phase("generate"):
                        pass
                    opt.step()
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                hits += 1
            assert_consistent(rt)
            if step_counts(opt) == before:
                opt.step()
            opt.zero_grad(set_to_none=True)
            plain.step()
            plain.zero_grad(set_to_none=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert hits > 0
    assert_same_training(snapshot(plain_model, plain.opt), snapshot(model, opt))
    swaprl.detach()


@pytest.mark.parametrize("kind", ["host", "masters"])
def test_a_ctrl_c_anywhere_in_an_optimizer_load_keeps_the_model_and_loads_again_exactly(tiny_checkpoint, kind):
    """`optimizer.load_state_dict` with the states homed in host memory points each parameter's data at an empty
    host tensor for the length of torch's load, and the masters and the host buffer take the loaded values after
    it: a Ctrl-C at any line of swaprl's part of it leaves the model's weights as they were and the runtime true,
    and the load done again trains as plain torch does."""
    plain_model, plain = plain_twin(tiny_checkpoint, kind)
    model, opt = trainer(tiny_checkpoint, kind)
    rt = swaprl.attach(model, opt, HFEngine(model), config=config(kind))
    grpo.run(plain_model, plain, HFEngine(plain_model), steps=1)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    saved = copy.deepcopy(opt.state_dict())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    files = ("swaprl/optimizer_hooks.py", "swaprl/streaming.py", "swaprl/master.py")
    total = lines_run(lambda: opt.load_state_dict(saved), files)
    raised = 0
    for n in range(1, total + 1, max(total // 80, 1)):
        raised += interrupted_at_line(n, lambda: opt.load_state_dict(saved), files)
        now = model.state_dict()
        assert all(now[k].shape == w.shape and torch.equal(now[k], w) for k, w in weights.items()), n
        assert_consistent(rt)
    assert raised > 60, raised
    opt.load_state_dict(saved)
    grpo.run(plain_model, plain, HFEngine(plain_model), steps=1, first=1)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt, first=1)
    assert_same_training(snapshot(plain_model, plain.opt if isinstance(plain, HandMasters) else plain),
                         snapshot(model, opt))
    swaprl.detach()


def test_two_signals_inside_one_switch_both_reach_their_handlers(tiny_checkpoint):
    """A Ctrl-C and a SIGTERM whose handler asks the loop to stop, both during one switch: the Ctrl-C comes out once
    the switch is undone, and the SIGTERM handler has run too (CPython runs every pending handler; the first one's
    KeyboardInterrupt must not drop the others)."""
    model, opt = trainer(tiny_checkpoint, "swap")
    rt = swaprl.attach(model, opt, HFEngine(model), config=config("swap"))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    stop = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))

    def both(event):
        if event["type"] == "step" and event["step"] == "offload optimizer":  # once, inside the switch
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)

    remove = rt.add_listener(both)
    try:
        with pytest.raises(KeyboardInterrupt):
            with rt.phase("generate"):
                pytest.fail("the block must not run")
    finally:
        remove()
        signal.signal(signal.SIGTERM, previous)
    assert stop == [signal.SIGTERM]
    assert_consistent(rt)
    swaprl.detach()
