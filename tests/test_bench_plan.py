"""benchmarks/bench_plan.py --smoke: the planner-validation benchmark's path on the CPU (tiny preset, HF engine).

    python -m pytest tests/test_bench_plan.py -q

Checks the plumbing the GPU run relies on: a plan per depth, one child process per depth running GRPO cycles under
swaprl with the plan's settings, the profile read back, the comparison table, the final JSON line and the files in
--out. With no device figure on a CPU the phase totals are not compared; the trainer's own categories are, and the
plan must match them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_smoke_plans_measures_each_depth_in_its_own_process_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_plan

    out = tmp_path / "out"
    result = bench_plan.main(["--smoke", "--out", str(out), "--workdir", str(tmp_path / "ck")])
    printed = capsys.readouterr().out.strip().splitlines()

    assert set(result["depths"]) == {"1", "2"}
    for depth, d in result["depths"].items():
        assert d["ok"], d
        assert d["plan"]["ok"] and d["plan"]["layers"] == int(depth)
        # the child attached with the SwapConfig the plan chose: the tiny model's states stay on the device, beside a
        # full wave of its rollout's KV cache
        assert d["plan"]["swap_config"]["optimizer_states"] == {"device": 1.0, "swap": 0.0, "host": 0.0}
        assert d["settings_run"] == d["plan"]["settings"]
        assert d["engine"]["kind"] == "HFEngine" and len(d["cycles"]) == 2
        assert d["cycles"][-1]["longest_sequence"] <= 16 and d["cycles"][-1]["completion_tokens"] > 0
        for phase, row in d["compare"].items():
            assert row["measured"] is None and row["ratio"] is None and not row["flag"], (phase, row)
        # the trainer's tensors at the end of train (gradients still there): the plan's bytes, AdamW's step
        # counters aside
        cats = {c["category"]: c for c in d["compare"]["train"]["categories"]}
        for cat in ("params", "grads", "optimizer"):
            assert abs(cats[cat]["ratio"] - 1) < 0.01 and not cats[cat]["flag"], cats[cat]
        assert cats["kv_cache"]["measured"] is None  # no engine figures from the embedded engine on a CPU
    assert result["within_10pct"] is False  # nothing to be within on a CPU

    assert printed[0].split()[:3] == ["depth", "phase", "planned"]
    assert any("no device figure" in line for line in printed)
    final = json.loads(printed[-1])
    assert final["benchmark"] == "plan" and set(final["depths"]) == {"1", "2"}
    saved = json.loads((out / "plan_validation.json").read_text())
    assert saved["settings"]["preset"] == "tiny" and saved["settings"]["dtype"] == "float32"
    readme = (out / "README.md").read_text()
    assert "python benchmarks/bench_plan.py --smoke" in readme and "No phase total was measured" in readme
    assert (out / "profile_1l.jsonl.gz").exists() and (out / "profile_2l.jsonl.gz").exists()


def test_bench_vmm_refuses_without_a_gpu_or_with_bad_sizes(monkeypatch):
    """benchmarks/bench_vmm.py (the page-table floor of a switch) says what it needs instead of measuring nothing."""

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_vmm

    with pytest.raises(SystemExit, match="--repeats 0: give 1 or more"):
        bench_vmm.main(["--repeats", "0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="run it on a machine with a CUDA GPU"):
            bench_vmm.main(["--gib", "1"])


@pytest.mark.gpu
def test_bench_vmm_maps_real_memory_and_reports_every_way(tmp_path, monkeypatch):
    """On a GPU: each way of handing memory over is timed on mappings proved to hold the bytes written."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_vmm

    r = bench_vmm.main(["--gib", "0.25", "--pieces-mib", "2,4", "--repeats", "1", "--overlap",
                        "--out", str(tmp_path / "v.json")])
    assert r["bytes"] == 256 * 2**20 and set(r["pieces"]) == {"2", "4"}
    assert r["overlap"]["piece"] == 4 * 2**20 and r["overlap"]["serial"] > 0 and r["overlap"]["together"] > 0
    for t in r["pieces"].values():
        assert set(t) == {"create_map", "unmap_release", "unmap_only", "map_only"} and min(t.values()) > 0
    assert r["write_floor_s"] > 0 and r["torch_empty_fresh"] > 0
    assert "map + access with kept handles, 2 MiB pieces" in (tmp_path / "v.md").read_text()
    # A sleep-mode pool's own allocations (bench_transitions' floor of the engine's wake-ups): each rounded up to the
    # granularity, one handle each.
    drv = bench_vmm.Driver(torch.cuda.current_device())
    g = drv.granularity
    m = bench_vmm.map_sizes(drv, [g, g + 1, 32 * g], 1)
    assert m["allocations"] == 3 and m["bytes"] == 35 * g and m["create_map"] > 0 and m["unmap_release"] > 0
    with pytest.raises(ValueError, match="no allocation sizes"):
        bench_vmm.map_sizes(drv, [], 1)
