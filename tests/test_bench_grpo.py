"""benchmarks/bench_grpo.py --smoke: the three ways in their own processes on the tiny preset without vLLM, on CPU.

    python -m pytest tests/test_bench_grpo.py -q

Checks the plumbing the GPU run relies on: one child per way, results collected, the table, the final JSON line,
the JSON file and the markdown next to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_smoke_runs_the_three_ways_and_reports(tmp_path, monkeypatch, capsys):
    pytest.importorskip("trl")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_grpo

    out = tmp_path / "grpo.json"
    result = bench_grpo.main(["--smoke", "--out", str(out), "--workdir", str(tmp_path / "ck")])
    printed = capsys.readouterr().out.strip().splitlines()

    assert list(result["ways"]) == ["a", "b", "c"]
    for way, w in result["ways"].items():
        assert w["ok"], (way, w["attempts"])
        m = w["median"]
        assert 0 < m["generate_s"] < m["step_s"] < 60, (way, m)
        assert m["rollout_tokens"] > 0 and m["rollout_tok_s"] > 0 and m["train_tok_s"] > 0, (way, m)
        assert 0 <= m["switch_s"] < m["step_s"], (way, m)
        assert len(w["steps"]) == 2  # one warm-up step, one timed
        if way in "ab":  # TRL's runs record each call of the engine; the record is kept in the merged result
            assert isinstance(w["extra"]["rollouts"], list), (way, w["extra"])
            assert w["extra"]["deterministic_backwards"] == 0
            assert "alloc_conf" in w["extra"] and "page_mib" in w["extra"]  # the allocator settings it ran under
    assert result["ways"]["a"]["step_ratio_to_trl"] == 1.0
    assert result["ways"]["b"]["median"]["switch_s"] > 0  # swaprl's phase events were counted
    assert result["ways"]["c"]["extra"]["engine"] == "HFEngine"

    header, *rows = [line for line in printed if line.startswith(("way ", "a ", "b ", "c "))]
    assert "speed/TRL" in header and [r[0] for r in rows] == ["a", "b", "c"]
    final = json.loads(printed[-1])
    assert final["benchmark"] == "grpo" and set(final["ways"]) == {"a", "b", "c"}
    assert json.loads(out.read_text())["versions"]["trl"]
    md = out.with_suffix(".md").read_text()
    assert "python benchmarks/bench_grpo.py --smoke" in md and "swaprl loop" in md and "No attempt failed" in md


def test_switch_floor_counts_each_cycles_copies_at_their_bandwidth(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_grpo

    floor = bench_grpo.SwitchFloor()
    floor.gbps = {"d2h": 50.0, "h2d": 25.0, "d2d_read_write": 1000.0}  # as measured on a GPU
    events = [  # in the runtime's order: a transition's steps, then its phase event
        {"type": "step", "step": "sync weights", "bytes": 10**9},  # step 0: no states yet, the sync only
        {"type": "step", "step": "engine wake kv_cache", "bytes": 0},
        {"type": "phase", "phase": "generate"},
        {"type": "phase", "phase": "train"},
        {"type": "step", "step": "start offload optimizer", "bytes": 0},  # step 1: the states leave...
        {"type": "step", "step": "finish offload optimizer", "bytes": 5 * 10**9},
        {"type": "phase", "phase": "generate"},
        {"type": "step", "step": "reload optimizer", "bytes": 5 * 10**9},  # ...and come back
        {"type": "phase", "phase": "train"},
        {"type": "step", "step": "stream optimizer states", "bytes": 10**12},  # optimizer.step's, not a switch's
    ]
    for e in events:
        floor.on_event(e)
    steps = [{}, {}]
    floor.fill(steps)
    assert steps[0]["switch_floor_s"] == pytest.approx(2e9 / 1000e9)
    assert steps[1]["switch_floor_s"] == pytest.approx(5e9 / 50e9 + 5e9 / 25e9)

    floor.fill(extra := [{}])  # the cycles do not line up with the steps: no floor rather than a wrong one
    assert extra == [{}]


def test_smoke_on_two_ranks_runs_ways_a_and_b_under_torchrun(tmp_path, monkeypatch, capsys):
    """--nproc 2: each way is one torchrun launch of two ranks (accelerate's DDP on gloo here), every rank reports,
    and the losses TRL logged are recorded step by step, the wrapped run's and a second plain run's (--spread) next
    to the first plain one's."""
    pytest.importorskip("trl")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_grpo

    out = tmp_path / "grpo.json"
    result = bench_grpo.main(["--smoke", "--ways", "a,b", "--nproc", "2", "--spread", "--deterministic",
                              "--out", str(out), "--workdir", str(tmp_path / "ck")])
    for way, w in result["ways"].items():
        assert w["ok"], (way, w["attempts"])
        assert w["extra"]["world_size"] == 2 and w["extra"]["deterministic_backwards"] > 0
        assert all(isinstance(s["loss"], float) for s in w["steps"]) and len(w["steps"]) == 2
        assert w["extra"]["trainers_left"] == 0  # no rank's trainer, model or process group outlives its run
    again = result["ways"]["a"]["again"]  # its record of the engine's calls kept, as the first run's is
    assert again["ok"] and len(again["steps"]) == 2 and isinstance(again["rollouts"], list), again
    md = out.with_suffix(".md").read_text()
    assert "ran as 2 ranks under torchrun" in md and "Losses of b against a" in md
    assert "deterministic algorithms" in md
    assert "Losses of a run again (the spread) against a" in md

    with pytest.raises(SystemExit, match="--ways a,b"):  # swaprl's own loop is not a torchrun way here
        bench_grpo.main(["--smoke", "--nproc", "2", "--out", str(out)])
    with pytest.raises(SystemExit, match="must divide"):
        bench_grpo.main(["--smoke", "--ways", "a,b", "--nproc", "2", "--vllm-tp", "4", "--out", str(out)])


def test_as_gpu_names_a_known_card_and_needs_one(monkeypatch):
    """--as-gpu (a GPU made to offer a smaller card's memory) is refused before anything runs when it cannot hold."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_grpo

    with pytest.raises(SystemExit, match="--as-gpu H300: unknown GPU; choose among .*H100"):
        bench_grpo.main(["--as-gpu", "H300", "--ways", "a"])
    with pytest.raises(SystemExit, match="--smoke runs on the CPU: drop one of them"):
        bench_grpo.main(["--as-gpu", "H100", "--smoke"])


def test_an_emulated_card_scales_vllms_share_to_the_same_bytes(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_grpo

    assert bench_grpo.engine_share(0.35, {}) == 0.35
    assert bench_grpo.engine_share(0.35, {"as_gpu_bytes": 80 * 2**30}, card_bytes=140 * 2**30) == pytest.approx(0.2)


def test_smoke_as_two_nodes_of_one_rank_each(tmp_path, monkeypatch):
    """--nnodes 2 --nproc 1: each way is two torchrun launches, one per node, meeting through the c10d rendezvous
    (LOCAL_WORLD_SIZE 1 on each), and both ranks report."""
    pytest.importorskip("trl")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_grpo

    with pytest.raises(SystemExit, match="--nnodes 2: give 1 or more, with --nproc"):
        bench_grpo.main(["--smoke", "--ways", "a,b", "--nnodes", "2"])
    out = tmp_path / "grpo.json"
    result = bench_grpo.main(["--smoke", "--ways", "a,b", "--nproc", "1", "--nnodes", "2", "--out", str(out),
                              "--workdir", str(tmp_path / "ck"), "--profile"])
    for way, w in result["ways"].items():
        assert w["ok"], (way, w["attempts"])
        assert w["extra"]["world_size"] == 2 and w["extra"]["local_world_size"] == 1
    assert "2 nodes of 1 on this machine" in out.with_suffix(".md").read_text()
    # --profile: way b's memory profile beside its result, one per rank (TRL alone has none)
    profiles = sorted(p.name for p in tmp_path.rglob("*.profile*.jsonl"))
    assert len(profiles) == 2 and all(n.startswith("b_") for n in profiles), profiles
    for p in tmp_path.rglob("*.profile*.jsonl"):
        records = [json.loads(line) for line in p.read_text().splitlines()]
        assert records[0]["schema"] == "swaprl.profile" and any(r["type"] == "phase" for r in records)



def test_runs_that_sampled_the_same_first_rollout_are_told_where_they_part(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_grpo

    def calls(*steps):
        return [{"numpy_before": "n", "prompts": "p", "weights": w, "completions": c, "requests": 128}
                for w, c in steps]

    a = calls(("w0", "x"), ("w1", "y"))
    again = calls(("w0", "z"), ("w2", "v"))
    b = calls(("w0", "z"), ("w3", "u"))
    b_same = calls(("w0", "z"), ("w2", "v"))
    b_sampled = calls(("w0", "z"), ("w2", "t"))
    # a's first rollout is nobody else's: only a again and b are compared, and they part at step 2's weights.
    assert bench_grpo.shared_rollouts([("way a", a), ("way b", b), ("way a again", again)]) == [
        "\nWay b and way a again sampled the same first rollout and part at step 2: other engine weights."]
    assert bench_grpo.shared_rollouts([("way a again", again), ("way b", b_same)]) == [
        "\nWay a again and way b sampled the same rollouts from the same engine weights at every one of 2 steps."]
    assert bench_grpo.shared_rollouts([("way a again", again), ("way b", b_sampled)]) == [
        "\nWay a again and way b sampled the same first rollout and part at step 2: the same engine weights, "
        "other completions."]
    assert bench_grpo.shared_rollouts([("way a", a), ("way b", b)]) == []
    # With the losses each run logged: equal to the last bit, or how far apart; a run without losses adds nothing.
    losses = {"way a again": [-3.7e-09, -0.0016819254960864782], "way b": [-3.7e-09, -0.0016819254960864782]}
    assert bench_grpo.shared_rollouts([("way a again", again), ("way b", b_same)], losses) == [
        "\nWay a again and way b sampled the same rollouts from the same engine weights at every one of 2 steps. "
        "Their losses: 2 of 2 steps equal to the last bit."]
    losses["way b"] = [-3.7e-09, -0.0026819254960864782, None]
    assert bench_grpo.shared_rollouts([("way a again", again), ("way b", b)], losses) == [
        "\nWay a again and way b sampled the same first rollout and part at step 2: other engine weights. "
        "Their losses: 1 of 2 steps equal to the last bit, largest difference 0.001."]
    assert bench_grpo.shared_rollouts([("way a again", again), ("way b", b)], {"way b": losses["way b"]}) == [
        "\nWay a again and way b sampled the same first rollout and part at step 2: other engine weights."]
    # Records with each request's digest: runs that sampled apart from the same inputs say by how many requests.
    a[0].update(each=["1", "2", "3"], shortest=[56, 900])
    b[0].update(each=["1", "2", "4"], shortest=[56, 1024])
    assert bench_grpo.shared_rollouts([("way a", a), ("way b", b)]) == [
        "\nWay a and way b sampled apart from the same weights and prompts at step 1: 1 of 3 requests' completions "
        "differ (shortest: [56, 900] against [56, 1024])."]
