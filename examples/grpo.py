"""A hand-written GRPO loop with swaprl: generate -> verifiable reward -> policy-gradient step.

    python examples/grpo.py                                    # tiny model, embedded engine, CPU is fine
    python examples/grpo.py --preset qwen2.5-1.5b --engine vllm --steps 10 --prompts 8 --completions 8 \
        --max-tokens 256 --out out/grpo-1.5b                   # one GPU, colocated vLLM
    torchrun --nproc-per-node 2 examples/grpo.py --preset qwen2.5-1.5b --engine vllm --tp 2 --out out/grpo-2gpu

Under torchrun the trainer is sharded with FSDP2 over all ranks (loaded shard by shard: no rank holds the whole
model) and each group of `--tp` consecutive ranks shares one vLLM engine; `--prompts` is per rank.

No hub is needed: without `--model PATH` it writes a random-weight checkpoint of `--preset` first. The task is
built-in arithmetic with exact answers through the model's chat template, or `--dataset FILE.jsonl` of
{"prompt", "answer"} records (tasks.py); the reward is the exact answer plus a format term, or `--reward
module:function`. The objective is GRPO's: group-normalised advantages, the PPO-clipped ratio to the probabilities
at rollout time (`--updates N` optimizer steps per rollout), and a truncated importance weight from the engine's own
log-probabilities of the tokens it sampled (`--tis-cap`), which also give the rollout-training mismatch per step;
`--kl-coef` adds a per-token KL penalty to the policy the run started from (a frozen reference; off by default).
Each step prints its time split (generate, train, phase switches); `--out` receives metrics.json, a line per step in
metrics.jsonl (reward, exact answers, loss, clip fraction, importance weights, mismatch), the memory profile and its
report, and with `--save-steps N` a checkpoint every N steps, from which `--resume` goes on, on this number of
ranks or another (`swaprl.saving`: torch.distributed.checkpoint's files of the model, the optimizer states wherever
they live, the fp32 masters by parameter name, the random streams, the step and the data position; run_files.py:
each checkpoint has a manifest of its files' sizes and checksums and of the settings that change the computation,
checked before a resume reads anything; the files a resume rewrites are written beside and renamed). `--export-hf
DIR` writes the trained model at the end as a transformers checkpoint (`swaprl.saving.export_hf`: the fp32 masters
cast to the model's dtype, FSDP2's shards gathered), which transformers and vLLM load.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import itertools
import json
import logging
import math
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import swaprl
from swaprl import memory, saving
from swaprl.profile import attach_profiler
from swaprl.compat.torch import deterministic_algorithms, deterministic_cublas
from swaprl.compat.transformers import enable_activation_checkpointing
from swaprl.config import parse_optimizer_states

import run_files  # (beside this file: checkpoints and the files a resume rewrites)
import tasks  # noqa: E402  (beside this file: the task data and rewards)

log = logging.getLogger("grpo")


def reward(completion: list[int]) -> float:
    return sum(t % 2 == 0 for t in completion) / max(len(completion), 1)


def advantages(rewards: list[float], n: int) -> torch.Tensor:
    """Group-normalised: each completion's reward against the other completions of its prompt."""
    groups = torch.tensor(rewards, dtype=torch.float32).view(-1, n)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()


def grpo_loss(model, prompts, completions, n, *, micro_batch: int, pad_id: int, rewards: list[float] | None = None,
              engine_logprobs: list[torch.Tensor] | None = None, old_logprobs: list[torch.Tensor] | None = None,
              clip: float = 0.2, tis_cap: float = 2.0, ref_logprobs: list[torch.Tensor] | None = None,
              kl_coef: float = 0.0, stats: dict | None = None, score_only: bool = False):
    """Backward the GRPO objective over micro-batches; returns (loss, tokens), or with `score_only` each
    completion's token log-probabilities under the model (no gradient).

    Per completion token: the PPO-clipped ratio of the model's probability to its probability at rollout time
    (`old_logprobs`; without them, the model's own, detached: one update per rollout, ratio 1), times the
    completion's group-normalised advantage, times the truncated importance weight min(p_rollout / p_engine,
    `tis_cap`) from the engine's own log-probabilities of the tokens it sampled (`engine_logprobs`): the correction
    for the engine and the trainer computing slightly different probabilities. Each completion's mean over its
    tokens, summed over the batch and divided by its size. With `ref_logprobs` (a frozen reference's), each token
    also pays `kl_coef` times the KL estimate exp(r - l) - (r - l) - 1 of l = log p_model against r = log p_ref.
    `stats` receives the clip fraction, the importance weights' mean and truncated fraction, the mismatch mean
    |log p_trainer - log p_engine| and, with a reference, the KL's mean."""
    rewards = rewards if rewards is not None else [reward(c) for c in completions]
    adv = advantages(rewards, n)
    device = next(model.parameters()).device
    total, tokens, scored = 0.0, 0, []
    sums = {"clipped": 0.0, "weight": 0.0, "truncated": 0.0, "mismatch": 0.0, "kl": 0.0}
    for lo in range(0, len(completions), micro_batch):
        hi = min(lo + micro_batch, len(completions))
        rows = [list(prompts[i // n]) + list(completions[i]) for i in range(lo, hi)]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.float32)
        behaviour = torch.zeros((len(rows), width - 1), dtype=torch.float32)
        old = torch.zeros((len(rows), width - 1), dtype=torch.float32)
        ref = torch.zeros((len(rows), width - 1), dtype=torch.float32)
        for j, r in enumerate(rows):
            start, end = len(prompts[(lo + j) // n]), len(r)
            ids[j, : len(r)] = torch.tensor(r)
            mask[j, start:end] = 1.0
            if engine_logprobs is not None:  # position k predicts token k + 1
                behaviour[j, start - 1:end - 1] = engine_logprobs[lo + j][: end - start]
            if old_logprobs is not None:
                old[j, start - 1:end - 1] = old_logprobs[lo + j]
            if ref_logprobs is not None:
                ref[j, start - 1:end - 1] = ref_logprobs[lo + j]
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad() if score_only else contextlib.nullcontext():
            logits = model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]
        m = mask[:, 1:]
        if score_only:
            scored += [logp[j][m[j].bool()].cpu() for j in range(len(rows))]
            continue
        at_rollout = old.to(device) if old_logprobs is not None else logp.detach()
        ratio = torch.exp(logp - at_rollout)
        a = adv[lo:hi].to(device)[:, None]
        objective = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
        weight = torch.ones_like(logp)
        if engine_logprobs is not None:
            diff = at_rollout - behaviour.to(device)
            weight = torch.exp(diff).clamp(max=tis_cap)
            sums["truncated"] += float(((diff.exp() > tis_cap).float() * m).sum())
            sums["mismatch"] += float((diff.abs() * m).sum())
        per_token = weight * objective
        if ref_logprobs is not None:
            d = ref.to(device) - logp
            kl = torch.exp(d) - d - 1
            per_token = per_token - kl_coef * kl
            sums["kl"] += float((kl.detach() * m).sum())
        per_seq = (per_token * m).sum(1) / m.sum(1).clamp(min=1)
        loss = -per_seq.sum() / len(completions)
        loss.backward()
        total += loss.item()
        tokens += int(m.sum().item())
        sums["clipped"] += float((((ratio - 1).abs() > clip).float() * m).sum())
        sums["weight"] += float((weight.detach() * m).sum())
        del logits, logp
    if score_only:
        return scored
    if stats is not None:
        stats.update({"clip_fraction": sums["clipped"] / max(tokens, 1),
                      "tis_weight_mean": sums["weight"] / max(tokens, 1)})
        if engine_logprobs is not None:
            stats.update({"tis_truncated_fraction": sums["truncated"] / max(tokens, 1),
                          "mismatch_mean_abs_dlogp": sums["mismatch"] / max(tokens, 1)})
        if ref_logprobs is not None:
            stats["kl"] = sums["kl"] / max(tokens, 1)
    return total, tokens


def optimizer_states(text: str) -> str | dict[str, float]:
    if text.strip() == "auto":
        return "auto"
    try:
        return parse_optimizer_states(text)
    except ValueError as exc:  # argparse shows the message of this type only
        raise argparse.ArgumentTypeError(str(exc)) from exc


COMPUTATION = ("model", "preset", "layers", "engine", "dtype", "master_weights", "fp32_params", "bf16_only", "task",
               "dataset", "reward", "prompts", "completions", "prompt_tokens", "max_tokens", "micro_batch", "updates",
               "clip", "tis_cap", "kl_coef", "lr", "seed", "tp", "enforce_eager", "deterministic")
"""The flags that change what a run computes (the model, the data, the objective, the optimizer, the sampling, the
engine's kernels): a checkpoint records them (`computation`) and a resume refuses a change to any of them. The
micro-batch is one: it changes the order of the gradients' sums, and a resume is bit for bit."""
FREE = ("steps", "out", "save_steps", "resume", "export_hf", "report_to", "trace_step", "memory_step", "warmup",
        "checkpoint_dir", "verify", "verify_tolerance", "sleep_level", "optimizer_states", "host_budget_gib",
        "gpu_memory_utilization", "kv_cache_gib", "max_model_len", "release_other", "lend_pages")
"""The flags a resume may change: how long it runs, where its files go, what it records or checks (the probe keeps
the random streams as it found them), and where memory lives (every home of the optimizer states trains bit for bit
the same). The number of ranks may change too: each rank loads the rows of its own shards."""


def uses_vllm(args) -> bool:
    return args.engine == "vllm" or (args.engine == "auto" and torch.cuda.is_available()
                                     and swaprl.engines.vllm_available())


def computation(args) -> dict:
    """The COMPUTATION flags as this run computes with them: the engine resolved ("auto" is the same engine on the
    same machine), and those it does not use left out (--prompt-tokens but with --task even-tokens: the prompts'
    own length otherwise; the vLLM engine's flags with the embedded one)."""
    settings = {k: getattr(args, k) for k in COMPUTATION}
    settings["engine"] = "vllm" if uses_vllm(args) else "hf"
    if args.dataset or args.task != "even-tokens":
        del settings["prompt_tokens"]
    if settings["engine"] == "hf":
        del settings["tp"], settings["enforce_eager"]
    if not settings["deterministic"]:  # recorded when on: checkpoints from before the flag resume as they were
        del settings["deterministic"]
    return settings


def resolve_precision(args) -> None:
    """fp32 precision unless --bf16-only: on a GPU bf16 parameters with fp32 master weights (bf16 compute at half the
    device bytes of fp32 parameters), on the CPU fp32 parameters; --dtype, --master-weights and --fp32-params pin
    a mode. Sets args.dtype and args.master_weights to what the run trains with, which checkpoints record."""
    if args.bf16_only and (args.master_weights or args.fp32_params or args.dtype == "float32"):
        raise SystemExit("--bf16-only trains bf16 parameters without fp32 masters: drop --master-weights, "
                         "--fp32-params and --dtype float32, or drop --bf16-only")
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() or args.bf16_only or args.master_weights else "float32"
    if args.dtype == "bfloat16" and not (args.bf16_only or args.fp32_params):
        args.master_weights = True


def precision(args) -> str:
    """What the run trains in, in words, for its first lines."""
    if args.fp32_params:
        return f"fp32 parameters and AdamW states, {args.dtype} compute"
    if args.master_weights:
        return "fp32 master weights and AdamW states of bf16 parameters (bf16 compute)"
    if args.dtype == "float32":
        return "fp32 parameters and AdamW states"
    return "bf16 parameters and AdamW states, no fp32 masters (--bf16-only)"


def check_args(args) -> None:
    """Refuse, before anything loads, settings that cannot train (each error names the flag and the fix)."""
    problems = []
    for name, low in (("steps", 1), ("prompts", 1), ("completions", 2), ("max_tokens", 1), ("micro_batch", 1),
                      ("updates", 1), ("save_steps", 0), ("prompt_tokens", 1), ("tp", 1), ("warmup", 0),
                      ("max_model_len", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            problems.append(f"--{name.replace('_', '-')} {value}: give at least {low}"
                            + (" (a GRPO group needs two completions to compare)" if name == "completions" else ""))
    for name, default in (("host_budget_gib", "what the OS reports available"),
                          ("kv_cache_gib", "sized from the memory free when the engine starts")):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value * 2**30 >= 1):  # NaN too
            problems.append(f"--{name.replace('_', '-')} {value}: give a finite size in GiB above 0, e.g. 8, or "
                            f"leave the flag out ({default})")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        problems.append(f"--gpu-memory-utilization {args.gpu_memory_utilization}: give a fraction in (0, 1], e.g. "
                        "0.5, or leave the flag out (sized from the free memory)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        problems.append(f"--lr {args.lr}: give a finite learning rate above 0, e.g. 1e-5")
    if not 0 <= args.seed <= 2**31 - 1:
        problems.append(f"--seed {args.seed}: give a seed from 0 to {2**31 - 1}")
    if not 0 < args.clip < 1:
        problems.append(f"--clip {args.clip}: give a ratio bound in (0, 1), e.g. 0.2")
    if not args.tis_cap >= 1:  # NaN too
        problems.append(f"--tis-cap {args.tis_cap}: give a truncation of 1 or more, e.g. 2")
    if args.verify_tolerance and not args.verify:
        problems.append("--verify-tolerance judges the probe sampled after each weight check: drop --no-verify")
    if not (math.isfinite(args.kl_coef) and args.kl_coef >= 0):
        problems.append(f"--kl-coef {args.kl_coef}: give 0 (no reference) or a positive coefficient, e.g. 0.04")
    if args.updates > args.prompts:
        problems.append(f"--updates {args.updates}: each update takes whole prompts, and a rollout has "
                        f"--prompts {args.prompts}")
    if args.master_weights and args.dtype != "bfloat16":
        problems.append("--master-weights keeps fp32 masters of bf16 parameters: add --dtype bfloat16")
    if "tensorboard" in args.report_to and not args.out:
        problems.append("--report-to tensorboard writes under --out: give --out DIR")
    if "wandb" in args.report_to:
        try:
            import wandb  # noqa: F401
        except ImportError:
            problems.append("--report-to wandb needs the wandb package: pip install wandb")
    if args.model is None:
        try:
            from swaprl.presets import get_preset
            get_preset(args.preset)
        except ValueError as exc:
            problems.append(f"--preset {args.preset}: {exc}")
    elif not (Path(args.model) / "config.json").is_file():
        problems.append(f"--model {args.model}: no config.json there; give a local checkpoint directory "
                        "(save_pretrained's), or leave --model out for a random checkpoint of --preset")
    if args.layers is not None and args.layers < 1:
        problems.append(f"--layers {args.layers}: give at least 1")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        problems.append(f"--out {args.out} is a file: give a directory")
    if args.export_hf and Path(args.export_hf).exists() and not Path(args.export_hf).is_dir():
        problems.append(f"--export-hf {args.export_hf} is a file: give a directory (one there is replaced whole)")
    elif args.export_hf:
        problems += export_problems(args)
    if args.verify_tolerance:
        try:
            bounds = [float(x) for x in args.verify_tolerance.split(",")]
        except ValueError:
            bounds = []
        if len(bounds) != 2:
            problems.append(f"--verify-tolerance {args.verify_tolerance}: give two numbers, MAX,MEAN (e.g. 1,0.05)")
        elif not all(math.isfinite(b) and b > 0 for b in bounds):
            problems.append(f"--verify-tolerance {args.verify_tolerance}: give two positive numbers, MAX,MEAN "
                            "(e.g. 1,0.05)")
    for flag, step in (("--trace-step", args.trace_step), ("--memory-step", args.memory_step)):
        if step is not None and not (args.out and 0 <= step < args.steps):
            problems.append(f"{flag} {step}: give a step from 0 to --steps - 1 ({args.steps - 1}), and --out DIR "
                            "for what it records")
    if args.memory_step is not None and not torch.cuda.is_available():
        problems.append(f"--memory-step {args.memory_step}: torch's memory history is its CUDA allocator's; run on "
                        "a GPU, or drop the flag")
    if problems:
        raise SystemExit("; ".join(problems))


def model_dir(args) -> Path:
    """The checkpoint directory the run loads its model from: --model, or the random one of --preset it writes."""
    name = args.preset + (f"-{args.layers}l" if args.layers else "")
    return Path(args.model) if args.model else Path(args.checkpoint_dir) / name


def export_problems(args) -> list[str]:
    """What is wrong with --export-hf DIR, which the end of the run replaces whole (moved aside and removed, not
    written into as save_pretrained does): DIR may not be --out or the model's directory, nor hold either, and a
    directory there must be a model's already (a config.json), not one of other files."""
    export = Path(args.export_hf).resolve()
    for what, kept in (("--out", args.out), ("the model's directory", model_dir(args))):
        kept = Path(kept).resolve() if kept else None
        if kept is not None and (export == kept or export in kept.parents):
            return [(f"--export-hf {args.export_hf} is {what} {kept} or holds it, and the export replaces that "
                     "directory whole at the end: give a directory of its own (inside --out is fine)")]
    if export.is_dir() and not (export / "config.json").is_file() and (found := sorted(export.iterdir())):
        listed = ", ".join(f.name for f in found[:3]) + (", ..." if len(found) > 3 else "")
        return [(f"--export-hf {args.export_hf} holds files that are no model's ({listed}), and the export replaces "
                 "the directory whole at the end: give a new directory, or an earlier export to replace")]
    return []


def check_resumable(manifest: dict, settings: dict, args) -> None:
    """A checkpoint resumes the run that wrote it: a change to a setting of what it computes (`settings`, against
    those its manifest records) is refused, naming each flag with both values."""
    saved, step = manifest.get("meta", {}).get("settings", {}), manifest["step"]
    saved = saved if isinstance(saved, dict) else {}  # (not what grpo.py writes: every setting reads as changed)
    unset = "(not used)"
    changed = [f"--{k.replace('_', '-')} {saved.get(k, unset)!r} -> {settings.get(k, unset)!r}"
               for k in COMPUTATION if saved.get(k, unset) != settings.get(k, unset)]
    if changed:
        raise SystemExit(f"--resume: the checkpoint's run had other settings ({'; '.join(changed)}); resume with "
                         "its settings, or start a new run with another --out")
    for flag, at in (("--trace-step", args.trace_step), ("--memory-step", args.memory_step)):
        if at is not None and at < step:
            raise SystemExit(f"{flag} {at}: the run resumes at step {step}; give a step from {step} to --steps - 1 "
                             f"({args.steps - 1})")
    if step >= args.steps:
        raise SystemExit(f"--resume: the newest checkpoint is at step {step}, and --steps {args.steps} asks for no "
                         f"more; give --steps above {step} to go on")


def load_checkpoint(path: Path, model, optimizer, step: int) -> saving.Loaded:
    """The checkpoint at `path`, whose manifest checks passed, loaded into the model and the optimizer (after
    attach: each state goes where its home keeps it), on however many ranks this run has."""
    try:
        loaded = saving.load(path, model, optimizer)
    except (ValueError, OSError, RuntimeError) as exc:
        raise SystemExit(f"--resume: {path} matches its manifest, yet it cannot be loaded ({type(exc).__name__}: "
                         f"{exc}); was it written by another torch or swaprl version? Resume with that one, or start "
                         "a new run with another --out") from exc
    if loaded.extra.get("step") != step:
        raise SystemExit(f"--resume: {path} is not grpo.py's checkpoint of step {step} (it holds step "
                         f"{loaded.extra.get('step')!r}); start a new run with another --out")
    return loaded


def lines_before(path: Path, step: int) -> list[str]:
    """The lines of metrics.jsonl for the steps before `step`, one per step: what a run resumed at `step` keeps (a
    line cut by a kill, always the last, is not one)."""
    kept: dict[int, str] = {}
    for raw in path.read_bytes().splitlines() if path.exists() else []:
        try:  # a line damaged on disk (bytes that are not UTF-8 too) is skipped like a cut one
            line = raw.decode()
            at = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(at, int) and at < step:
            kept.setdefault(at, line)
    if missing := sorted(set(range(step)) - set(kept)):
        log.warning("%s lacks the lines of steps %s; the resumed run goes on without them", path, missing)
    return [kept[k] for k in sorted(kept)]


def run_stem(out: Path, first: int | None, world: int) -> str:
    """The name of this run's profile and report: "profile" (report/), "profile.resumed-N" for a resume at step N,
    and ".runK" after either for the K-th run of that name, so that no run writes over another's files."""
    base = "profile" if first is None else f"profile.resumed-{first}"

    def taken(stem: str) -> bool:
        return (any(out.glob(f"{stem}.jsonl*")) or any(out.glob(f"{stem}.rank*.jsonl*"))
                or (out / stem.replace("profile", "report", 1)).exists())

    stem = next(s for k in itertools.count(1) if not taken(s := base + (f".run{k}" if k > 1 else "")))
    if world > 1:  # rank 0's, before any rank writes its profile
        chosen = [stem]
        dist.broadcast_object_list(chosen, src=0)
        stem = chosen[0]
    return stem


def report_to(text: str) -> str:
    unknown = {k.strip() for k in text.split(",")} - {"none", "tensorboard", "wandb", ""}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {sorted(unknown)}; use none, tensorboard or wandb")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local checkpoint directory (default: write a random one)")
    ap.add_argument("--preset", default="tiny", help="architecture of the random checkpoint (tiny ... qwen2.5-72b)")
    ap.add_argument("--layers", type=int, default=None, help="cut the random checkpoint to this many layers")
    ap.add_argument("--engine", default="auto", choices=["auto", "hf", "vllm"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="trainer parameters (default: bfloat16 on a GPU, with fp32 master weights, and float32 on "
                         "the CPU: fp32 precision either way, see --bf16-only)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--completions", type=int, default=4, help="completions per prompt (the GRPO group)")
    ap.add_argument("--task", default="arithmetic", choices=["arithmetic", "even-tokens"],
                    help="arithmetic: built-in problems with exact answers through the chat template (tasks.py); "
                         "even-tokens: random token ids as prompts, rewarded by the share of even ids (a load for "
                         "benchmarks, --prompt-tokens long)")
    ap.add_argument("--dataset", default=None,
                    help="a JSONL file of {\"prompt\": ..., \"answer\": ...} records (GSM8K's format) instead of the "
                         "built-in arithmetic")
    ap.add_argument("--reward", default=None, metavar="MODULE:FUNCTION",
                    help="a function of (completion text, problem) -> float instead of the built-in exact-answer "
                         "and format rewards")
    ap.add_argument("--updates", type=int, default=1,
                    help="optimizer steps per rollout, each on a share of the prompts; from the second on, the "
                         "PPO ratio to the rollout-time probabilities is clipped")
    ap.add_argument("--clip", type=float, default=0.2, help="PPO clip range of the ratio")
    ap.add_argument("--tis-cap", type=float, default=2.0,
                    help="truncation of the importance weight p_trainer / p_engine over the rollout's tokens")
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="weight of a per-token KL penalty to the policy as the run started (a frozen reference); "
                         "0, the default, keeps no reference. The reference is a second copy of the parameters on "
                         "the device in both phases, outside what swaprl moves, and a forward per rollout")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="with --task even-tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--sleep-level", default="auto", choices=["auto", "1", "2"])
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip the weight check after each weight sync (on by default: the engine's weights are "
                         "proved to be the trainer's; the rollout-training mismatch is measured on the rollouts "
                         "themselves either way)")
    ap.add_argument("--verify-tolerance", default=None, metavar="MAX,MEAN",
                    help="stop when the mismatch on swaprl's fixed probe, sampled after each sync, exceeds these "
                         "|dlogp| bounds (SwapConfig.verify_tolerance); default: no probe, no bound")
    ap.add_argument("--optimizer-states", default="auto", type=optimizer_states,
                    help="where the AdamW states live (SwapConfig.optimizer_states): 'auto' (the default; with the "
                         "engine this loop builds inside attach, 'swap'), 'swap' (host memory while generating), "
                         "'host' (host memory always, streamed through optimizer.step()), or a split "
                         "of their bytes such as device=0.3,swap=0.3,host=0.4 (what `swaprl plan` prints)")
    ap.add_argument("--bf16-only", action="store_true",
                    help="bf16 parameters and AdamW states, no fp32 masters: updates at RL learning rates (~1e-6) "
                         "mostly round away in bf16; only for a run that wants the bf16 footprint anyway")
    ap.add_argument("--master-weights", action="store_true",
                    help="fp32 master weights for the --dtype (bf16) parameters, kept with their fp32 AdamW states "
                         "in whatever home --optimizer-states gives them (SwapConfig.master_weights; "
                         "`swaprl plan --master-weights`)")
    ap.add_argument("--fp32-params", action="store_true",
                    help="fp32 parameters, and so fp32 AdamW states, with --dtype compute: FSDP2's "
                         "MixedPrecisionPolicy under torchrun, autocast on one device (`swaprl plan --param-dtype "
                         "float32`)")
    ap.add_argument("--host-budget-gib", type=float, default=None,
                    help="host memory this rank's runtime may hold (SwapConfig.host_budget_bytes); default: what "
                         "the OS reports available, shared by the node's ranks")
    ap.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size under torchrun")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="vLLM's KV cache per GPU (its kv_cache_memory_bytes), e.g. what `swaprl plan` gives; default: "
                         "sized from the memory free when the engine starts")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs (faster start)")
    ap.add_argument("--deterministic", action="store_true",
                    help="a run that repeats bit for bit on the GPU, so that a resume continues the run it resumes "
                         "exactly: torch's deterministic kernels, and vLLM without CUDA graphs and torch.compile "
                         "(implies --enforce-eager)")
    ap.add_argument("--release-other", action=argparse.BooleanOptionalAction, default=None,
                    help="vLLM: release its CUDA graphs, buffers and workspaces while it sleeps (VLLMEngine's "
                         "release_other; default: wherever swaprl.vmm can)")
    ap.add_argument("--lend-pages", action=argparse.BooleanOptionalAction, default=None,
                    help="vLLM: wake on the pages under torch's free cached blocks instead of handing them back to "
                         "the driver (VLLMEngine's lend_pages; on where it can be by default)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="steps left out of the medians (first-time costs: kernel compilations, buffers not "
                         "prepared at attach)")
    ap.add_argument("--out", default=None, help="directory for metrics.json(l), profile.jsonl, the report and the "
                                                 "checkpoints")
    ap.add_argument("--save-steps", type=int, default=0,
                    help="write a checkpoint every N steps under OUT/checkpoints (model, optimizer states with the "
                         "fp32 masters, RNG and data position, through torch.distributed.checkpoint: a resume may run "
                         "on another number of ranks; the newest two are kept); 0: none")
    ap.add_argument("--report-to", default="none", metavar="{none,tensorboard,wandb}", type=report_to,
                    help="where the per-step metrics also go, comma-separated: TensorBoard event files under "
                         "OUT/tensorboard, or a wandb run (each needs its package); metrics.jsonl is always written")
    ap.add_argument("--trace-step", type=int, default=None, metavar="N",
                    help="record step N (its switches, generation and training) with torch's profiler into "
                         "OUT/trace.stepN[.rankR].json, a Chrome trace (chrome://tracing, Perfetto): swaprl's steps "
                         "are named in it; and its two switches with Python's profiler, which also times the calls "
                         "into C extensions that torch's does not see (vLLM's virtual-memory calls), into "
                         "OUT/trace.stepN[.rankR].switches.txt (the calls by their own time; Python's own code runs "
                         "slower under it)")
    ap.add_argument("--memory-step", type=int, default=None, metavar="N",
                    help="record step N's device allocations with torch's memory history into "
                         "OUT/memory.stepN[.rankR].pickle (drag it onto pytorch.org/memory_viz; "
                         "benchmarks/memory_streams.py splits the free cached blocks at its peak by stream)")
    ap.add_argument("--export-hf", default=None, metavar="DIR",
                    help="at the end, write the trained model to DIR as a transformers checkpoint (config, "
                         "safetensors in the model's dtype, cast from the fp32 masters with --master-weights, "
                         "generation config, the tokenizer files of the model's checkpoint), which "
                         "AutoModelForCausalLM.from_pretrained and vLLM load; written beside and renamed, so an "
                         "earlier DIR is replaced whole (DIR may not be --out, the model's directory, or one of other "
                         "files)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest intact checkpoint under OUT/checkpoints (its files checked "
                         "against its manifest; a change to a setting of the computation is refused)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default=str(Path(tempfile.gettempdir()) / "swaprl-checkpoints"),
                    help="where random checkpoints are written (and reused)")
    return ap


def make_engine(args, path: Path, config: swaprl.SwapConfig, reserve_bytes: int | None):
    if not uses_vllm(args):
        return swaprl.engines.HFEngine()
    from swaprl.engines.vllm import VLLMEngine

    max_len = args.max_model_len or (args.prompt_tokens + args.max_tokens + 8)
    # The KV cache is sized now, from the free memory: `reserve_bytes` leaves room for the optimizer states that will
    # stay on the device while generating (a split's "device" home), which the first optimizer step creates.
    return VLLMEngine(path, dtype="bfloat16", max_model_len=max_len, enforce_eager=args.enforce_eager,
                      gpu_memory_utilization=config.gpu_memory_utilization,
                      kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None,
                      reserve_bytes=reserve_bytes, seed=args.seed,
                      tensor_parallel_size=args.tp, release_other=args.release_other, lend_pages=args.lend_pages)


ALLOC_CONF = "expandable_segments:True,large_segment_size_mb:64"
"""torch's allocator settings the scripts start with: segments that grow in place in pages of 64 MiB."""


def expandable_segments() -> None:
    """Have torch's CUDA allocator grow its segments in place, in pages of 64 MiB, and unmap what it frees, unless
    the caller chose its allocator settings (set PYTORCH_CUDA_ALLOC_CONF, even empty, to keep torch's default). The
    scripts call it when run, not `main()`, which leaves the environment of a process that imports it alone.

    Without expandable segments, torch keeps freed blocks of the sizes it first cut: at 72B-20L's train peak on
    2 x H200 it held 15.6-26.6 GiB per GPU reserved but unallocated. The page size sets what every switch pays the
    driver: the engine's wake-ups map torch's pages at its own addresses and its sleeps unmap them, one call per
    page, so larger pages cost less per GiB than torch's 20 MiB ones; but only whole pages can back an allocation
    of the engine's, and at 256 MiB a third of 72B's weights (each layer's attention matrices, under a page) woke
    on new memory instead (benchmarks/results/). Must run before the first CUDA allocation; swaprl's pausable pools
    and vLLM's sleep-mode pool bring their own allocators."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF


def init_distributed() -> tuple[int, int, str]:
    """(rank, world size, device) for this process: one GPU per rank under torchrun, the CPU without a GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        return 0, 1, "cuda" if cuda else "cpu"
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", local) if cuda else None)
    return dist.get_rank(), world, f"cuda:{local}" if cuda else "cpu"


def load_sharded(path: Path, dtype: torch.dtype, device: str, compute: torch.dtype | None = None) -> torch.nn.Module:
    """The checkpoint at `path` as an FSDP2 model over all ranks, each rank reading only its rows of each tensor;
    with `compute`, FSDP2 gathers the `dtype` shards in that dtype for the forward and backward (MixedPrecisionPolicy)
    and reduces the gradients in `dtype`.

    The model is built without parameter storage (buffers such as the rotary frequencies are real), sharded, given
    storage on `device`, and filled from the safetensors files: a 72B model never exists whole on any rank.
    """
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoConfig, AutoModelForCausalLM

    from swaprl.distributed import shard_causal_lm

    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=dtype)} if compute else {}
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    model.tie_weights()  # accelerate's empty init re-creates the parameters after transformers tied them
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    shard_causal_lm(model, **policy)  # the embedding and an untied lm_head apart from the root
    model.to_empty(device=device)
    files = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            files.update({k: f for k in st.keys()})
    world, rank = dist.get_world_size(), dist.get_rank()
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        for name, p in model.named_parameters():  # tied weights are listed once, under the name the file has
            local = p.to_local()
            rows = -(-p.shape[0] // world)  # FSDP2 shards dim 0 like torch.chunk
            with safe_open(files[name], "pt") as st:
                part = st.get_slice(name)[rank * rows: rank * rows + local.shape[0]]
            local.copy_(part.to(dtype))
    return model


@contextlib.contextmanager
def entered(name: str, calls: cProfile.Profile | None):
    """`swaprl.phase(name)`, its switch recorded by `calls` when given: Python's profiler sees the time of every
    call the switch makes, C extensions' included (vLLM's virtual-memory calls), which torch's profiler does not."""
    with contextlib.ExitStack() as stack:
        if calls is not None:
            calls.enable()
        try:
            stack.enter_context(swaprl.phase(name))
        finally:
            if calls is not None:
                calls.disable()
        yield


def write_calls(calls: cProfile.Profile, path: Path) -> None:
    """The switches' calls by their own time, the largest first (files named without their directories), then who
    called the ten largest (a cost such as torch's memory statistics is spread over many callers), then the calls by
    the time spent in them and what they called (which step of a switch holds the time)."""
    text = io.StringIO()
    stats = pstats.Stats(calls, stream=text).strip_dirs().sort_stats("tottime")
    stats.print_stats(40)
    stats.print_callers(10)
    stats.sort_stats("cumulative").print_stats(60)
    path.write_text(text.getvalue())


def main(argv: list[str] | None = None) -> dict:
    undo: list = []  # what a failure closes, the last opened first: a run that fails leaves nothing attached
    try:
        return _run(argv, undo)
    except BaseException:
        for close in reversed(undo):
            with contextlib.suppress(Exception):
                close()
        raise


def _run(argv: list[str] | None, undo: list) -> dict:
    """main(), which puts in `undo` what it opens (and takes out what it closes)."""
    args = build_parser().parse_args(argv)
    if args.deterministic:
        args.enforce_eager = True  # vLLM's compiled kernels and CUDA graphs vary from one engine start to the next
        try:
            deterministic_cublas()
        except ValueError as exc:
            raise SystemExit(f"--deterministic: {exc}") from None
    rank, world, device = init_distributed()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    from transformers import AutoModelForCausalLM

    from swaprl.checkpoints import write_random_checkpoint

    out = Path(args.out) if args.out else None
    if (args.save_steps or args.resume) and out is None:
        raise SystemExit("--save-steps and --resume keep their checkpoints under --out: give --out DIR")
    resolve_precision(args)
    check_args(args)
    log.info("precision: %s", precision(args))
    settings = computation(args)  # as given: the built-in task sets --prompt-tokens from its prompts below
    checkpoints = run_files.Checkpoints(out / "checkpoints", rank=rank, world=world) if out else None
    newest = checkpoints.newest() if checkpoints else None
    if newest is not None and not args.resume:  # a fresh run would rewrite the logs that run's resume goes on with
        raise SystemExit(f"{out / 'checkpoints'} holds another run's checkpoints (newest {newest.name}): --resume "
                         "to go on with it, or give a new --out (nothing was deleted)")
    if out is not None and not args.resume and (out / "metrics.jsonl").is_file() and \
            (out / "metrics.jsonl").stat().st_size:  # its lines would be replaced by this run's
        raise SystemExit(f"{out / 'metrics.jsonl'} holds another run's metrics: give a new --out, or remove that "
                         "run's directory first (nothing was deleted)")
    resumed = resumed_step = None
    if args.resume:  # the newest intact checkpoint, checked before anything loads
        try:
            resumed, manifest = checkpoints.newest_intact()
        except run_files.CheckpointError as exc:
            raise SystemExit(str(exc)) from None
        check_resumable(manifest, settings, args)
        resumed_step = manifest["step"]
    if out and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    # This run's profile and report, under names no earlier run of this directory took.
    stem = run_stem(out, resumed_step, world) if out else None
    path = model_dir(args)
    if not args.model and rank == 0:
        write_random_checkpoint(args.preset, path, layers=args.layers, seed=args.seed)
    if world > 1:
        dist.barrier()  # the checkpoint and the output directory exist
    task = args.dataset or (None if args.task == "even-tokens" else args.task)
    if task is not None:  # problems of its own on each rank; the engine's longest sequence fits their prompts
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        problems = tasks.Problems(args.dataset, args.seed + 1000 * rank)
        score = tasks.load_reward(args.reward)
        args.prompt_tokens = problems.longest_prompt(tokenizer)
    torch.manual_seed(args.seed)
    compute = getattr(torch, args.dtype)
    dtype = torch.float32 if args.fp32_params else compute

    def load() -> torch.nn.Module:  # FSDP2 over the ranks under torchrun, else whole on this device
        if world > 1:
            return load_sharded(path, dtype, device, compute=compute if args.fp32_params else None)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)

    model = load()
    # One device with fp32 parameters: the forward and backward in the compute dtype.
    autocast = (torch.autocast(device.split(":")[0], dtype=compute) if args.fp32_params and world == 1
                else contextlib.nullcontext())
    reference = None
    if args.kl_coef > 0:  # the policy the run started from (a resumed run's too), frozen; its load draws no random
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.startswith("cuda") else []):
            reference = load()
        reference.requires_grad_(False)
        reference.config.use_cache = False
    enable_activation_checkpointing(model)  # only active in training mode, and from_pretrained returns eval mode
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    level = args.sleep_level if args.sleep_level == "auto" else int(args.sleep_level)
    # This loop never reads the optimizer states itself, so their reload may overlap the forward pass (host-resident
    # states have no reload).
    states = args.optimizer_states
    swapped = states in ("auto", "swap") or isinstance(states, dict) and states["swap"] > 0
    config = swaprl.SwapConfig(sleep_level=level, verify_sync=args.verify, grads="free",
                               optimizer_states=args.optimizer_states, master_weights=args.master_weights,
                               verify_tolerance=(tuple(float(x) for x in args.verify_tolerance.split(","))
                                                 if args.verify_tolerance else None),
                               # the mismatch comes from the rollouts' own log-probabilities (grpo_loss); the probe
                               # only where a tolerance judges it
                               mismatch_probe=args.verify_tolerance is not None,
                               overlap_optimizer_reload=swapped,
                               host_budget_bytes=(int(args.host_budget_gib * 2**30)
                                                  if args.host_budget_gib is not None else None),
                               gpu_memory_utilization=args.gpu_memory_utilization)
    # Built by attach, once the host buffers have started page-locking in the background: the locking runs under the
    # engine's start rather than before the first step.
    rt = swaprl.attach(model, optimizer, lambda reserve_bytes: make_engine(args, path, config, reserve_bytes),
                       config=config)
    engine = rt.engine
    undo += [engine.close, swaprl.detach]
    profiler = attach_profiler(rt, out / f"{stem}.jsonl") if out else None
    if profiler is not None:  # closed before the report is written, whether or not the runtime is detached
        undo.append(profiler.close)
    log.info("engine %s, trainer %s%s on %s, optimizer states %s", type(engine).__name__,
             str(dtype).removeprefix("torch.") + (" with fp32 master weights" if args.master_weights else ""),
             f" computing in {args.dtype}" if args.fp32_params else "", device,
             args.optimizer_states)

    switch = {"s": 0.0}
    rt.add_listener(lambda e: switch.__setitem__("s", switch["s"] + e["seconds"]) if e["type"] == "phase" else None)
    vocab = min(model.config.vocab_size, 256)  # byte tokens: inside every tokenizer swaprl writes
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)  # prompts of its own on each rank
    pad_id = model.generation_config.pad_token_id or 0
    cuda = device.startswith("cuda")

    def device_used() -> int | None:
        return memory.device_used_bytes(torch.device(device)) if cuda else None

    def history_off() -> None:  # torch's memory history, recorded in --memory-step
        torch.cuda.memory._record_memory_history(enabled=None)

    first = 0
    if resumed is not None:  # after attach: the states load where their homes are, the masters with them
        loaded = load_checkpoint(resumed, model, optimizer, resumed_step)
        if loaded.rank_extra is not None:  # (torch's random streams are put back by the load)
            gen.set_state(loaded.rank_extra["prompts"])
        else:  # a rank the saving run did not have: prompts of its own from its seed, at the step's position
            log.warning("rank %d was not in the %d-rank run that saved %s: its prompts start afresh from its seed",
                        rank, loaded.world, resumed.name)
        if task is not None:  # every rank draws --prompts problems a step: rank 0's position is each rank's
            problems.position = loaded.extra["data_position"]
        first = resumed_step
        log.info("resumed from %s (saved by %d rank(s), resumed on %d): step %d", resumed, loaded.world, world, first)
    reporter = Reporter(args.report_to, out, vars(args), rank == 0, first, args.steps)
    undo.append(reporter.close)
    metrics_lines = out / "metrics.jsonl" if out else None
    if metrics_lines and rank == 0:  # one line per step: those after the checkpoint are done again
        run_files.replace_file(metrics_lines, "".join(line + "\n" for line in lines_before(metrics_lines, first)))

    steps = []
    for step in range(first, args.steps):
        if task is None:
            prompts = torch.randint(0, vocab, (args.prompts, args.prompt_tokens), generator=gen).tolist()
        else:
            drawn = problems.take(args.prompts)
            prompts = [tasks.encode(tokenizer, p) for p in drawn]
        switch["s"] = 0.0
        calls = None  # Python's profiler, in the traced step's two switches only
        if step == args.memory_step:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc", stacks="python")
            undo.append(history_off)
        if step == args.trace_step:
            trace = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if cuda else []))
            trace.start()
            undo.append(trace.stop)
            calls = cProfile.Profile()
        t0 = time.perf_counter()
        with entered("generate", calls):
            tg = time.perf_counter()
            # The engine's log-probabilities of the tokens it sampled come with the rollout (vLLM: from the sampling
            # pass itself): the importance weights' denominators.
            completions, engine_lp = rt.engine.generate_scored(prompts, swaprl.Sampling(
                max_tokens=args.max_tokens, n=args.completions, seed=args.seed + step))
            gen_s = time.perf_counter() - tg
            used_generate = device_used()
        if task is None:
            rewards, correct = [reward(c) for c in completions], None
        else:
            texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
            problem_of = [drawn[i // args.completions] for i in range(len(completions))]
            rewards = [tasks.scored(score, t, p) for t, p in zip(texts, problem_of)]
            correct = statistics.fmean(tasks.correct(t, p) for t, p in zip(texts, problem_of))
        stats: dict = {}
        with entered("train", calls):
            tt = time.perf_counter()
            loss, train_tokens = train_on(model, optimizer, prompts, completions, rewards, engine_lp, args, pad_id,
                                          autocast, stats, reference)
            if cuda:
                torch.cuda.synchronize()
            train_s = time.perf_counter() - tt
            used_train = device_used()
        total = time.perf_counter() - t0
        if step == args.memory_step:
            torch.cuda.memory._dump_snapshot(str(out / f"memory.step{step}{f'.rank{rank}' if world > 1 else ''}"
                                                     ".pickle"))
            history_off()
            undo.remove(history_off)
        if step == args.trace_step:
            trace.stop()
            undo.remove(trace.stop)
            name = f"trace.step{step}{f'.rank{rank}' if world > 1 else ''}"
            trace.export_chrome_trace(str(out / f"{name}.json"))
            write_calls(calls, out / f"{name}.switches.txt")
        rollout_tokens = sum(map(len, completions))
        mean_reward = statistics.fmean(rewards)
        if world > 1:  # every rank's rollouts: the step's loss, reward and tokens
            loss, mean_reward, rollout_tokens, train_tokens = all_ranks_sum([loss, mean_reward, rollout_tokens,
                                                                             train_tokens], device)
            loss, mean_reward = loss / world, mean_reward / world
            rollout_tokens, train_tokens = int(rollout_tokens), int(train_tokens)
            if correct is not None:
                correct = all_ranks_sum([correct], device)[0] / world
        check = rt.last_sync.max_abs_diff if rt.last_sync else None
        sync = rt.last_sync.as_dict() if rt.last_sync else None
        rec = {"step": step, "step_s": total, "generate_s": gen_s, "train_s": train_s, "switch_s": switch["s"],
               "rollout_tokens": rollout_tokens, "train_tokens": train_tokens, "loss": loss, "reward": mean_reward,
               "correct": correct, **stats, "sync_max_abs_diff": check, "sync": sync,
               # Whole-device figures at the end of each phase (torch's own peak counts vLLM's pool even asleep).
               "device_used_end_of_generate": used_generate, "device_used_end_of_train": used_train}
        steps.append(rec)
        figures = {k: rec[k] for k in ("loss", "reward", "correct", *stats, "rollout_tokens", "step_s",
                                       "generate_s", "train_s", "switch_s") if rec[k] is not None}
        if cuda:
            figures["device_used_end_of_train_gib"] = used_train / 2**30
        reporter.step(step, figures)
        if metrics_lines and rank == 0:
            run_files.append_line(metrics_lines, json.dumps({k: rec[k] for k in (
                "step", "loss", "reward", "correct", *stats, "rollout_tokens", "train_tokens", "step_s",
                "switch_s")}))
        if args.save_steps and (step + 1) % args.save_steps == 0:
            if metrics_lines and rank == 0:  # the lines of the steps it holds are on disk before the checkpoint is
                run_files.fsync_file(metrics_lines)
            extra = {"step": step + 1, "data_position": problems.position if task else None, "args": vars(args)}

            def write(d: Path, extra=extra) -> list[Path]:  # every rank's shards, the random streams with them
                return saving.save(d, model, optimizer, extra=extra, rank_extra={"prompts": gen.get_state()})

            try:
                checkpoints.save(step + 1, write, meta={"settings": settings})
            except run_files.CheckpointError as exc:
                raise SystemExit(str(exc)) from None
        said = [f"weights {sync['weights']}"] if sync else []
        said += [f"probe max|dlogp| {check:.3g}"] if check is not None else []
        if "mismatch_mean_abs_dlogp" in stats:
            said.append(f"rollout mean|dlogp| {stats['mismatch_mean_abs_dlogp']:.3g}")
        log.info("step %d: %.2f s (generate %.2f, train %.2f, switches %.3f = %.1f%%), %d rollout tokens, "
                 "reward %.3f%s", step, total, gen_s, train_s, switch["s"], 100 * switch["s"] / total,
                 rollout_tokens, mean_reward, "".join(", " + x for x in said))
    for close in (reporter.close, profiler.close if profiler is not None else None):
        if close is not None:
            close()
            undo.remove(close)
    if args.export_hf:
        export_hf(Path(args.export_hf).resolve(), model, optimizer, path, rank)  # ("." has no name to rename)
    if not rt.status()["optimizer_homes"]["host"]:
        swaprl.detach()
    # else: detach() would bring the host-resident states back to the GPU for plain torch, and they were put on the
    # host (by the config, or by "auto" at the first step) because they do not fit there; the process ends here,
    # which releases everything. (A failure from here on still detaches: it is left in `undo`.)
    engine.close()
    undo.remove(engine.close)

    timed = steps[args.warmup:] or steps
    med = {k: statistics.median(s[k] for s in timed) if timed else None
           for k in ("step_s", "generate_s", "train_s", "switch_s")}
    summary = {"args": vars(args), "engine": type(engine).__name__, "device": device, "world_size": world,
               "gpu": torch.cuda.get_device_name() if cuda else None,
               "torch": torch.__version__, "swaprl": swaprl.__version__, "median": med,
               "switch_fraction": med["switch_s"] / med["step_s"] if timed else None, "steps": steps,
               "resumed_from": first if resumed is not None else None}
    if out:
        names = [f"{stem}.jsonl"] if world == 1 else [f"{stem}.rank{r}.jsonl" for r in range(world)]
        summary.update(profiles=names, report=stem.replace("profile", "report", 1))
    if world > 1:
        dist.barrier()  # every rank's profile is complete
    if out and rank == 0:  # one report over the profiles of all ranks (profile.rank{N}.jsonl under torchrun)
        run_files.replace_file(out / "metrics.json", json.dumps(summary, indent=1, default=str))
        try:
            from swaprl.profile.report import load_run, write_report

            runs = [load_run(out / n) for n in names]
            run_files.replace_dir(out / summary["report"], lambda d: write_report(runs, d))
        except ImportError:
            log.info("report module unavailable; the profiles are in %s", out)
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, default=str))
    if world > 1 and not isinstance(engine, swaprl.engines.HFEngine):
        dist.barrier()  # vLLM tears its own process groups down at exit; destroying them first would fail
    elif world > 1:
        dist.destroy_process_group()
    return summary


def export_hf(target: Path, model, optimizer, source: Path, rank: int) -> None:
    """The trained model as a transformers checkpoint at `target`: every rank gathers (FSDP2), rank 0 writes it
    into a directory beside `target` and renames it there, so a kill leaves the old export or the new one."""
    def fill(d: Path) -> None:
        saving.export_hf(d, model, optimizer, tokenizer_from=source)

    if rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        run_files.replace_dir(target, fill)
        log.info("exported the trained model to %s", target)
    else:
        saving.export_hf(None, model, optimizer, tokenizer_from=source)


def train_on(model, optimizer, prompts, completions, rewards, engine_lp, args, pad_id, autocast,
             stats: dict, reference=None) -> tuple[float, int]:
    """`args.updates` optimizer steps over the rollout, each on a share of its prompts (with all their
    completions); from the second on the model has moved, so the ratio to the probabilities at rollout time, scored
    before the first, is clipped. With a `reference` model, its log-probabilities are scored first, for the KL."""
    n, k = args.completions, max(1, min(args.updates, len(prompts)))
    kw = dict(micro_batch=args.micro_batch, pad_id=pad_id, clip=args.clip, tis_cap=args.tis_cap)
    # --deterministic: the model's forwards and backwards (the optimizer's step is elementwise)
    kernels = deterministic_algorithms if args.deterministic else contextlib.nullcontext
    old = ref = None
    with autocast, kernels():
        if k > 1:
            old = grpo_loss(model, prompts, completions, n, score_only=True, **kw)
        if reference is not None:
            ref = grpo_loss(reference, prompts, completions, n, score_only=True, **kw)
            # No backward follows: FSDP2 would keep the reference's root and lm_head gathered through generation.
            swaprl.distributed.reshard(reference)
    loss = tokens = 0
    bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        c = slice(lo * n, hi * n)
        part: dict = {}
        with autocast, kernels():
            part_loss, part_tokens = grpo_loss(model, prompts[lo:hi], completions[c], n, rewards=rewards[c],
                                               engine_logprobs=engine_lp[c], old_logprobs=old and old[c],
                                               ref_logprobs=ref and ref[c], kl_coef=args.kl_coef, stats=part, **kw)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss, tokens = loss + part_loss * (hi - lo) / len(prompts), tokens + part_tokens
        for key, value in part.items():  # token-weighted over the updates
            stats[key] = stats.get(key, 0.0) + value * part_tokens
    for key in stats:
        stats[key] /= max(tokens, 1)
    return loss, tokens


class Reporter:
    """A progress bar on rank 0 and the per-step metrics to TensorBoard and wandb (`--report-to`)."""

    def __init__(self, kinds: str, out: Path | None, config: dict, main: bool, first: int, total: int) -> None:
        from tqdm import tqdm

        wanted = {k.strip() for k in report_to(kinds).split(",")} - {"none", ""}
        if "tensorboard" in wanted and out is None:
            raise SystemExit("--report-to tensorboard writes under --out: give --out DIR")
        self.bar = tqdm(total=total, initial=first, unit="step", disable=not main, dynamic_ncols=True)
        self.tensorboard = self.wandb = None
        if not main:
            return
        if "tensorboard" in wanted:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise SystemExit(f"--report-to tensorboard needs the tensorboard package: pip install tensorboard "
                                 f"({exc})") from exc
            self.tensorboard = SummaryWriter(str(out / "tensorboard"), purge_step=first)  # a resume rewrites after
        if "wandb" in wanted:
            try:
                import wandb
            except ImportError as exc:
                raise SystemExit("--report-to wandb needs the wandb package: pip install wandb") from exc
            self.wandb = wandb.init(project="swaprl", config=config, dir=str(out) if out else None, resume="allow")

    def step(self, step: int, figures: dict) -> None:
        self.bar.update(1)
        self.bar.set_postfix({k: f"{figures[k]:.3g}" for k in ("reward", "loss", "switch_s") if k in figures})
        if self.tensorboard is not None:
            for key, value in figures.items():
                self.tensorboard.add_scalar(f"grpo/{key}", value, step + 1)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(figures, step=step + 1)

    def close(self) -> None:
        self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def all_ranks_sum(values: list[float], device: str) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


if __name__ == "__main__":
    expandable_segments()  # a run of the script, not a caller's process (tests call main() in theirs)
    main()
