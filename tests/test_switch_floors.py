"""benchmarks/switch_floors.py: each switch step of a recorded run against its floor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swaprl.profile.report import load_run

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
GiB, MiB = 2**30, 2**20


def profile(path: Path, *, cycles: int = 3, level: int = 2, blocking: tuple[int, ...] = ()) -> Path:
    """A rank's profile of `cycles` switches each way, as the runtime records them, with the engine's pool in the
    header (four 1 GiB weight allocations, two 2 GiB KV ones). The offload's copies run under the wake-up, started
    after the first release; in the switches to generate numbered in `blocking` (no room for the engine beside the
    states) the offload runs whole before that release."""
    t = 1_700_000_000.0
    recs: list[dict] = [{"schema": "swaprl.profile", "version": 1, "type": "header", "rank": 0, "world_size": 1,
                         "device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3", "device_total": 80 * GiB,
                         "copy_bandwidth": {"h2d_GBps": 50.0, "d2h_GBps": 40.0, "d2d_GBps": 1000.0},
                         "alloc_conf": "expandable_segments:True", "interval_s": 0.05, "t0": t,
                         "engine_pool": {"weights": [GiB] * 4, "kv_cache": [2 * GiB] * 2}}]

    def phase(name, src, cycle):
        recs.append({"type": "phase", "t": t, "phase": name, "from": src, "cycle": cycle, "seconds": 0.5,
                     "bytes": 0, "status": {"engine": {"sleep_level": level, "weights_bytes": 4 * GiB}},
                     "attribution": {"total": 0, "source": "nvml", "categories": {}}})

    def step(transition, name, seconds, nbytes=0, **extra):
        nonlocal t
        t += seconds
        recs.append({"type": "step", "t": t, "transition": transition, "step": name, "bytes": nbytes,
                     "seconds": seconds, **extra})

    phase("train", None, None)
    for c in range(1, cycles + 1):
        slow = 2 if c == 1 else 1  # the first cycle is slower and left out
        if c in blocking:
            step("train->generate", "offload optimizer", 0.2, 8 * GiB)
        step("train->generate", "release cached memory", 0.2 * slow, 30 * GiB)
        if c not in blocking:
            step("train->generate", "start offload optimizer", 0.001, 0, issued=True)
        step("train->generate", "engine wake weights", 0.1 * slow)
        step("train->generate", "sync weights", 0.05, 4 * GiB)
        if c not in blocking:
            step("train->generate", "finish offload optimizer", 0.01, 8 * GiB, span_seconds=0.4)
        step("train->generate", "release cached memory", 0.03, 8 * GiB)
        step("train->generate", "engine wake kv_cache", 0.06)
        phase("generate", "train", c)
        step("generate->train", "engine sleep", 0.1)
        step("generate->train", "reload optimizer", 0.002, 8 * GiB, issued=True)
        phase("train", "generate", c)
        step("optimizer.step", "stream optimizer states", 1.0, 20 * GiB, h2d_bytes=10 * GiB, d2h_bytes=10 * GiB)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_each_switch_step_gets_the_floor_of_what_it_did(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import switch_floors

    run = load_run(profile(tmp_path / "p.jsonl"))
    measured = {"create_map": {"weights": 0.02, "kv_cache": 0.01}, "unmap_release": {"weights": 0.03,
                "kv_cache": 0.015}, "empty_cache_s_per_byte": 0.004 / GiB, "weights_bytes": 4 * GiB}
    table = {(r["transition"], r["step"]): r for r in switch_floors.rows(run, measured)}
    # the same name twice in one switch, told apart by the step after it
    first = table[("train->generate", "release cached memory (before engine wake weights)")]
    second = table[("train->generate", "release cached memory (before engine wake kv_cache)")]
    assert first["count"] == second["count"] == 2  # the first cycle left out
    assert first["time_s"] == pytest.approx(0.2) and first["floor_s"] == pytest.approx(30 * 0.004)
    assert second["floor_s"] == pytest.approx(8 * 0.004)
    assert table[("train->generate", "engine wake weights")]["floor_s"] == pytest.approx(0.02)
    assert table[("train->generate", "engine wake kv_cache")]["floor_s"] == pytest.approx(0.01)
    assert table[("generate->train", "engine sleep")]["floor_s"] == pytest.approx(0.045)  # level 2: unmaps only
    sync = table[("train->generate", "sync weights")]
    assert sync["floor_s"] == pytest.approx(4 * GiB / 1000e9) and sync["ratio"] == pytest.approx(sync["floor_s"] / 0.05)
    finish = table[("train->generate", "finish offload optimizer")]  # waited for copies started earlier: the span
    assert finish["span"] and finish["time_s"] == pytest.approx(0.4)
    assert finish["floor_s"] == pytest.approx(8 * GiB / 40e9)
    streamed = table[("optimizer.step", "stream optimizer states")]
    assert streamed["floor_s"] == pytest.approx(10 * GiB / 40e9)  # each way at its own rate, the slower one
    assert table[("generate->train", "reload optimizer")]["issued"]
    assert table[("train->generate", "start offload optimizer")]["floor_s"] is None
    text = switch_floors.markdown(run, list(table.values()), measured)
    assert "| generate->train | reload optimizer | 2 | 8.00 | issued | 0.1718 | - |" in text
    # at level 1 the sleep also copies the weights out; an unmeasured pool gives no floor rather than a wrong one
    run1 = load_run(profile(tmp_path / "p1.jsonl", level=1))
    sleep1 = {(r["transition"], r["step"]): r for r in switch_floors.rows(run1, measured)}[
        ("generate->train", "engine sleep")]
    assert sleep1["floor_s"] == pytest.approx(0.045 + 4 * GiB / 40e9)
    wake1 = {(r["transition"], r["step"]): r for r in switch_floors.rows(run1, measured)}[
        ("train->generate", "engine wake weights")]
    assert wake1["floor_s"] == pytest.approx(0.02 + 4 * GiB / 50e9)  # and its wake-up copies them back
    bare = {(r["transition"], r["step"]): r for r in switch_floors.rows(run, {})}
    assert bare[("train->generate", "engine wake weights")]["floor_s"] is None
    release = bare[("train->generate", "release cached memory (before engine wake weights)")]
    assert release["floor_is"] == "torch's release was not measured"


def test_steps_keep_their_rows_when_a_switch_skips_one_or_a_phase_steps_twice(tmp_path, monkeypatch):
    """Two optimizer steps per train phase are one row; a switch that skips the release before the wake-up (the
    engine's weights fit in what is free) does not file its other release under the skipped one; the first
    switch is left out, not each row's first record."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import switch_floors

    path = profile(tmp_path / "p.jsonl", cycles=4)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    out = []
    for r in recs:
        if r.get("phase") == "generate" and r["cycle"] >= 3:  # switches 3 and 4 skip the first release
            drop = next(i for i in range(len(out) - 1, -1, -1) if out[i].get("step") == "release cached memory"
                        and out[i]["bytes"] == 30 * GiB)
            del out[drop]
        out.append(r)
        if r.get("step") == "stream optimizer states":
            out.append({**r, "t": r["t"] + 1e-3})  # a second optimizer step in the same phase
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    table = {(r["transition"], r["step"]): r for r in switch_floors.rows(load_run(path), {})}
    assert [s for tr, s in table if tr == "optimizer.step"] == ["stream optimizer states"]
    assert table[("optimizer.step", "stream optimizer states")]["count"] == 6  # 2 per phase, the first phase's out
    before_weights = table[("train->generate", "release cached memory (before engine wake weights)")]
    before_kv = table[("train->generate", "release cached memory (before engine wake kv_cache)")]
    assert before_weights["count"] == 1 and before_weights["bytes"] == 30 * GiB  # switch 2's only
    assert before_kv["count"] == 3 and before_kv["bytes"] == 8 * GiB  # switches 2-4, whichever came first


def test_the_release_before_the_wake_up_keeps_one_row_whether_or_not_the_offload_overlaps(tmp_path, monkeypatch):
    """The first release is followed by the offload's start in a switch whose copies run under the wake-up, by the
    wake-up itself after a blocking offload: one row either way, named by the engine step after it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import switch_floors

    run = load_run(profile(tmp_path / "p.jsonl", cycles=4, blocking=(3,)))
    names = [s for tr, s in switch_floors.occurrences(run) if s.startswith("release cached memory")]
    assert sorted(names) == ["release cached memory (before engine wake kv_cache)",
                             "release cached memory (before engine wake weights)"], names


def test_main_measures_what_the_profile_records_and_says_what_it_lacks(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import switch_floors

    calls = []
    monkeypatch.setattr(switch_floors, "measure", lambda pool, release, weights, repeats: calls.append(
        (pool, release, weights)) or {"notes": []})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    out = switch_floors.main([str(profile(tmp_path / "p.jsonl", level=1))])
    # the run's allocator settings; what a level-1 sleep copies: the weights' allocations, whole
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert calls[-1] == ({"weights": [GiB] * 4, "kv_cache": [2 * GiB] * 2}, 30 * GiB, 4 * GiB)
    assert out["measured"]["notes"] == []

    old = tmp_path / "old.jsonl"  # recorded before the header had the engine's pool or the allocator settings
    recs = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    del recs[0]["engine_pool"], recs[0]["alloc_conf"]
    old.write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    notes = switch_floors.main([str(old)])["measured"]["notes"]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ""  # not guessed
    assert calls[-1] == ({}, 30 * GiB, 4 * GiB)
    assert any("allocator settings" in n for n in notes) and any("no `engine_pool`" in n for n in notes)


def test_an_fsdp2_sync_is_bounded_by_its_gather_from_the_other_ranks(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import switch_floors

    run = load_run(profile(tmp_path / "p.jsonl"))
    sync = ("train->generate", "sync weights")
    local = {(r["transition"], r["step"]): r for r in switch_floors.rows(run, {})}[sync]
    assert local["floor_s"] == pytest.approx(4 * GiB / 1000e9)  # no gather rate given: the device copy only
    gathered = {(r["transition"], r["step"]): r for r in switch_floors.rows(
        run, {"gather_GBps": 100.0, "world_size": 2})}[sync]
    assert gathered["floor_s"] == pytest.approx(2 * GiB / 100e9) and "bench_allgather" in gathered["floor_is"]
    one = {(r["transition"], r["step"]): r for r in switch_floors.rows(run, {"gather_GBps": 100.0})}[sync]
    assert one["floor_s"] == local["floor_s"]  # one rank gathers nothing


def test_bench_allgather_says_how_to_run_it(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_allgather

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="run it under torchrun"):
        bench_allgather.main([])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_bench_allgather_measures_the_gather_between_two_gpus(tmp_path):
    out = tmp_path / "ag.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(BENCHMARKS / "bench_allgather.py"), "--mib", "16", "--repeats", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["bytes_per_rank"] == 16 * MiB and r["gathered_GBps"] > 1


def test_a_profile_without_a_device_is_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import switch_floors

    path = tmp_path / "cpu.jsonl"
    path.write_text(json.dumps({"schema": "swaprl.profile", "version": 1, "type": "header", "rank": 0,
                                "device": "cpu", "t0": 0.0}) + "\n")
    with pytest.raises(SystemExit, match="without a CUDA device"):
        switch_floors.main([str(path)])


@pytest.mark.gpu
def test_floors_are_measured_on_the_gpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_vmm
    import switch_floors

    g = bench_vmm.Driver(torch.cuda.current_device()).granularity
    measured = switch_floors.measure({"weights": [g, 3 * g], "kv_cache": [8 * g]}, 256 * MiB, 4 * g, 1)
    assert set(measured["create_map"]) == set(measured["unmap_release"]) == {"weights", "kv_cache"}
    assert min(measured["create_map"].values()) > 0 and min(measured["unmap_release"].values()) > 0
    assert measured["empty_cache_s_per_byte"] > 0 and measured["release_measured_bytes"] == 256 * MiB
