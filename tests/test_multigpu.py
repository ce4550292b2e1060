"""Two GPUs under torchrun: an FSDP2 trainer and colocated vLLM engines, tensor-parallel over both GPUs (TP=2) or
one per GPU (TP=1, data parallel). One torchrun launch per layout (vLLM's sleep-mode allocator allows one engine per
process); each rank runs 3 train -> generate -> train cycles of Qwen2.5-0.5B (tests/fsdp_worker.py) and reports.

    python -m pytest -q -m gpu tests/test_multigpu.py      # about 3-4 minutes on 2 x H200
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swaprl.engines import vllm_available

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(torch.cuda.device_count() < 2 or not vllm_available(),
                                 reason="needs 2 CUDA GPUs and vllm")]
WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"
MiB = 2**20


def launch(tmp: Path, tp: int, checkpoints: Path) -> list[dict]:
    out = tmp / f"tp{tp}"
    env = {**os.environ, "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), "vllm", "--tp", str(tp), "--out", str(out),
                           "--checkpoint-dir", str(checkpoints)], env=env, capture_output=True, text=True, check=False,
                          timeout=400)
    (tmp / f"tp{tp}.log").write_text(proc.stdout + proc.stderr)
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    errors = [r["error"] for r in results if "error" in r]
    assert proc.returncode == 0 and len(results) == 2 and not errors, (errors or proc.stderr[-6000:])
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    tmp = tmp_path_factory.mktemp("multigpu")
    checkpoints = tmp / "checkpoints"
    return {tp: launch(tmp, tp, checkpoints) for tp in (2, 1)}


@pytest.mark.parametrize("tp", [2, 1])
def test_every_cycle_generates_on_both_ranks_and_passes_the_on_policy_check(runs, tp):
    for r in runs[tp]:
        for i, c in enumerate(r["cycles"]):
            where = f"tp={tp} rank {r['rank']} cycle {i}"
            assert c["completions"] == c["expected_completions"] and c["tokens_in_vocab"], where
            # Every tensor of every rank's engine shard proved equal to the FSDP2 trainer's, summed over the group.
            assert c["sync"]["ok"] and c["sync"]["weights"] == "exact" and not c["sync"]["unreadable"], (where,
                                                                                                      c["sync"])
            # Each rank's engine scores its own sequences (they differ in length between ranks) like its trainer.
            assert c["probe_shapes_ok"], where
            assert c["probe_max_diff"] <= 0.25, (where, c["probe_max_diff"])  # bf16 engine vs fp32 trainer


@pytest.mark.parametrize("tp", [2, 1])
def test_engine_logprobs_move_with_the_trainer(runs, tp):
    for r in runs[tp]:  # two optimizer steps move the engine's scores well beyond its bf16 rounding
        noise = max(c["sync"]["mean"] for c in r["cycles"])
        moved = (r["rank"], r["engine_moved_mean"], r["trainer_moved_mean"], noise)
        assert r["engine_moved_mean"] > max(4 * noise, 1e-3), moved
        assert abs(r["engine_moved_mean"] - r["trainer_moved_mean"]) < 0.5 * r["trainer_moved_mean"], moved


@pytest.mark.parametrize("tp", [2, 1])
def test_entering_generate_frees_this_ranks_optimizer_states(runs, tp):
    for r in runs[tp]:
        for i, c in enumerate(r["cycles"][1:], start=1):  # the first cycle has no optimizer state yet
            states, drop = c["optimizer_bytes"], c["allocated_drop_entering_generate"]
            assert states > 500 * MiB
            # What torch holds for live tensors drops by the states, for the engine's KV cache to take: lent where
            # it wakes on torch's pages (and then it did), else handed back.
            assert 0.95 * states - 64 * MiB < drop < 1.05 * states + 64 * MiB, (tp, r["rank"], i, drop, states)
            lent = c["lent_while_generating"]
            assert lent is None or lent > 0, (tp, r["rank"], i, lent)


def test_memory_share_is_the_same_on_every_rank_and_tp_shards_the_weights(runs):
    for tp in (2, 1):
        shares = {r["engine"]["gpu_memory_utilization"] for r in runs[tp]}
        assert len(shares) == 1 and 0.5 < shares.pop() < 1, (tp, shares)
    tp2, tp1 = runs[2][0]["engine"]["weights_bytes"], runs[1][0]["engine"]["weights_bytes"]
    assert tp2 < 0.7 * tp1, (tp2, tp1)  # each rank holds about half the engine (norms are replicated)
