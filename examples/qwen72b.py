"""Qwen2.5-72B GRPO with swaprl: print the memory plan, refuse if it cannot fit, else run the GRPO loop.

Whatever the machine, the first thing printed is the plan of the target this example stands for: the full model
on one 8 x H200 node, in fp32 precision with fp32 AdamW states (`swaprl plan qwen2.5-72b --cluster 8xH200`), at the
vLLM TP and in the precise mode the planner picks, and why. Then comes the plan of what this machine runs, and the
run.

It trains in fp32 precision by default, since RL fine-tuning's updates at lr ~1e-6 are mostly lost on bf16
parameters: the plan compares fp32 master weights beside bf16 parameters (`--master-weights`) with fp32 parameter
shards under bf16 compute (`--fp32-params`) and the loop runs the one that fits with the lowest predicted step
cost (docs/plan.md, Cost); either flag pins its mode, and `--bf16-only` trains bf16 parameters and AdamW states
with no fp32 copy, as this example did before.

    python examples/qwen72b.py                          # no GPU: the same loop on the tiny preset, on the CPU
    python examples/qwen72b.py --layers 2               # one GPU: 72B's layer shapes cut to 2 of its 80 layers
    python examples/qwen72b.py --model /path/to/Qwen2.5-72B    # a local checkpoint
    torchrun --nproc-per-node 8 examples/qwen72b.py --layers 80    # the full model on one 8-GPU node, vLLM TP 8
    torchrun --nproc-per-node 2 examples/qwen72b.py --layers 20 --tp 1 --host-memory-gib 140
        # one GPU's share of that node on two: each GPU holds the engine weights of TP 4 at full depth, 1/8 of the
        # trainer, and 70 GiB of host memory (add --master-weights to pin fp32 master weights, kept with their
        # AdamW states wherever the plan's split homes them)

The loop is `examples/grpo.py` (colocated vLLM when it is installed and a GPU is present, else the embedded engine):
prompts -> rollouts -> a verifiable reward -> a policy-gradient step, with `with phase("generate")` and
`with phase("train")`, on its random-token task (`--task even-tokens`), whose prompts have exactly the length the
plan was made for, or on `--dataset FILE.jsonl`. Output (`--out`, default out/qwen72b): metrics.json, the memory
profile and its report; with `--save-steps N` a checkpoint every N steps, which `--resume` goes on from (on this
number of ranks or another), and with `--export-hf DIR` the trained model as a transformers checkpoint.
The run takes the plan's split of the optimizer states over device, swap and host memory, its sleep level, its KV
cache per GPU, the micro batch it fits, and each rank's share of its host budget.

Under torchrun the trainer is sharded with FSDP2 over all ranks and vLLM runs tensor-parallel over `--tp` GPUs
(default: the GPUs of a node), one engine per group; `--prompts` is per rank. Rank 0 prints the plan and writes
the report; each rank writes its own profile (profile.rank{N}.jsonl). Several nodes: torchrun's rendezvous
(`--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`), nothing else changes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo  # noqa: E402  (the loop itself)

from swaprl import plan as planner  # noqa: E402
from swaprl.config import format_optimizer_states  # noqa: E402
from swaprl.plan.result import describe_precision  # noqa: E402


# The mission: Qwen2.5-72B, full-parameter, trained and served on the same GPUs of one 8-GPU node.
TARGET = ["qwen2.5-72b", "--cluster", "8xH200"]  # the TP too is the plan's: --tp auto, by predicted step cost


def print_target() -> None:
    """The target's precision and verdict, in a few lines before this run's plan."""
    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    target = planner.from_args(parser.parse_args(TARGET))
    r = target.inputs["rollout"]
    print(f"the target: Qwen2.5-72B, all {target.layers} layers, on one 8 x H200 node, vLLM TP {target.inputs['tp']}, "
          f"{r['prompts']} prompts x {r['completions_per_prompt']} completions of {r['prompt_tokens']} + "
          f"{r['completion_tokens']} tokens per step (`swaprl plan {' '.join(TARGET)}` for the whole plan)")
    print(f"  precision {why_precision(target)}")
    print(f"  {target.verdict}")


def why_precision(p: planner.Plan, pinned: str | None = None) -> str:
    """The plan's precision mode and why it is the one: what `--precision auto` found, or the flag that pinned it."""
    if "precision_auto" in p.inputs:
        return f"chosen by the plan: {p.inputs['precision_auto']['why']}"
    return f"{p.precision} ({describe_precision(p.inputs)}), as {pinned or 'asked'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="local checkpoint directory (default: random weights)")
    ap.add_argument("--layers", type=int, default=None, help="cut the random checkpoint to this many layers")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=None, help="default: 8 on a GPU, 2 on the CPU")
    ap.add_argument("--completions", type=int, default=None, help="default: 8 on a GPU, 4 on the CPU")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 256 on a GPU, 32 on the CPU")
    ap.add_argument("--tp", type=int, default=None,
                    help="vLLM tensor-parallel size under torchrun (default: the GPUs of a node)")
    precision = ap.add_mutually_exclusive_group()
    precision.add_argument("--master-weights", action="store_true",
                           help="pin fp32 master weights of the bf16 parameters, kept with their fp32 AdamW states in "
                                "the homes the plan's split gives them (`swaprl plan --master-weights`; default: the "
                                "precise mode the plan picks)")
    precision.add_argument("--fp32-params", action="store_true",
                           help="pin fp32 parameter shards (and fp32 AdamW states) under bf16 compute: 16 bytes per "
                                "parameter with the states (`swaprl plan --param-dtype float32`; default: the "
                                "precise mode the plan picks)")
    precision.add_argument("--bf16-only", action="store_true",
                           help="bf16 parameters and AdamW states updated in place, no fp32 copy: updates below "
                                "bf16's resolution are lost (`swaprl plan --precision bf16`; what this example "
                                "trained before fp32 precision)")
    ap.add_argument("--host-memory-gib", type=float, default=None,
                    help="host memory per node to plan for (default: the machine's); each rank's runtime then holds "
                         "at most its share of the plan's pinned budget (SwapConfig.host_budget_bytes)")
    ap.add_argument("--release-other", action=argparse.BooleanOptionalAction, default=None,
                    help="release vLLM's CUDA graphs, buffers and workspaces while it sleeps (default: wherever "
                         "swaprl.vmm can; the plan counts what the engine will do)")
    ap.add_argument("--lend-pages", action=argparse.BooleanOptionalAction, default=None,
                    help="wake vLLM on the pages under torch's free cached blocks (VLLMEngine's lend_pages; on "
                         "where it can be by default)")
    ap.add_argument("--trace-step", type=int, default=None, metavar="N",
                    help="record step N with torch's profiler (examples/grpo.py --trace-step)")
    ap.add_argument("--memory-step", type=int, default=None, metavar="N",
                    help="record step N's allocations with torch's memory history (examples/grpo.py --memory-step)")
    ap.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                    help="train on a JSONL file of {\"prompt\", \"answer\"} records (examples/grpo.py --dataset) "
                         "instead of the random-token task; the plan is made for the task's 16-token prompts, so "
                         "longer prompts take more room than it counts")
    ap.add_argument("--save-steps", type=int, default=0, metavar="N",
                    help="a checkpoint every N steps under OUT/checkpoints (examples/grpo.py --save-steps)")
    ap.add_argument("--resume", action="store_true",
                    help="go on from the newest intact checkpoint under OUT/checkpoints, on this number of ranks or "
                         "another (examples/grpo.py --resume); the plan, made again, gives the loop the same settings")
    ap.add_argument("--export-hf", default=None, metavar="DIR",
                    help="at the end, the trained model as a transformers checkpoint in DIR (examples/grpo.py "
                         "--export-hf)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="vLLM without CUDA graphs and torch.compile (examples/grpo.py --enforce-eager; planned too)")
    ap.add_argument("--deterministic", action="store_true",
                    help="a run that repeats bit for bit, so that a resume continues it exactly (examples/grpo.py "
                         "--deterministic; implies --enforce-eager)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="where the random-weight checkpoint is written and reused (examples/grpo.py "
                         "--checkpoint-dir)")
    ap.add_argument("--out", default="out/qwen72b")
    args = ap.parse_args(argv)
    args.enforce_eager = args.enforce_eager or args.deterministic

    # torchrun sets these; a plain `python` run is one rank.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    gpus = torch.cuda.device_count()
    if gpus > 1 and world == 1:
        print(f"{gpus} GPUs are visible: launch one rank per GPU with `torchrun --nproc-per-node {gpus} "
              "examples/qwen72b.py` (FSDP2 + vLLM tensor parallelism), or use one GPU (CUDA_VISIBLE_DEVICES=0)",
              file=sys.stderr)
        return 2
    on_gpu = gpus >= 1
    tp = args.tp or (per_node if on_gpu else 1)
    args.prompts = args.prompts or (8 if on_gpu else 2)
    args.completions = args.completions or (8 if on_gpu else 4)
    args.max_tokens = args.max_tokens or (256 if on_gpu else 32)
    preset = "qwen2.5-72b" if on_gpu else "tiny"
    model = args.model or preset
    if on_gpu:
        # This rank's own GPU: the current device is still GPU 0 on every rank here (grpo.main sets it later), and a
        # query of it would leave a CUDA context of every other rank's process on GPU 0 for the whole run.
        total = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[1]
        host = int(args.host_memory_gib * 2**30) if args.host_memory_gib else psutil.virtual_memory().total
        cluster = planner.Cluster(gpus_per_node=per_node, nodes=world // per_node, gpu_memory_bytes=total,
                                  host_memory_bytes=host)
    else:  # the CPU stands in for the GPU: plan against the machine's memory
        mem = psutil.virtual_memory().total
        cluster = planner.Cluster(gpus_per_node=1, gpu_memory_bytes=mem // 2, host_memory_bytes=mem // 2)
    # The plan's rollout is the whole step's: every rank brings --prompts prompts.
    rollout = planner.Rollout(prompts=args.prompts * world, completions_per_prompt=args.completions,
                              prompt_tokens=16, completion_tokens=args.max_tokens)
    layers = args.layers if (args.layers or args.model) else (None if not on_gpu else 2)
    release = args.release_other
    if release is None:  # the engine's own default rule, so that the plan counts what it will hold
        from swaprl.engines.vllm import pools_unavailable

        release = pools_unavailable(cuda=on_gpu, tensor_parallel_size=tp) is None
    # What the loop does, pinned: the parameters stay on the GPU (FSDP2 shards cannot be swapped), the gradients are
    # freed, activation checkpointing is on; the plan chooses the optimizer states' split and the sleep level.
    pinned = {"params": "keep", "grads": "free", "activation_checkpointing": True}
    # The precision: the plan's precise mode unless a flag pins one; the loop computes in bf16 in every mode.
    precision = ("master-weights" if args.master_weights else "fp32-params" if args.fp32_params else
                 "bf16" if args.bf16_only else "auto")
    pinned_by = next((f"--{flag.replace('_', '-')} pins it" for flag in ("master_weights", "fp32_params", "bf16_only")
                      if getattr(args, flag)), None)
    # The loop's micro batch is planned too (its activations): the most sequences per forward/backward, up to 8,
    # that the plan fits; the loop then runs with that micro batch.
    for micro in (8, 4, 2, 1):
        the_plan = planner.plan(model, cluster=cluster, rollout=rollout, layers=layers, tp=tp, settings=pinned,
                                fsdp_units="split",  # examples/grpo.py shards with shard_causal_lm
                                micro_batch_tokens=micro * rollout.sequence_tokens, release_other=release,
                                cuda_graphs=not args.enforce_eager,
                                precision=precision, optimizer_dtype="bfloat16" if args.bf16_only else "float32")
        if the_plan.ok:
            break
    if rank == 0:
        print_target()
        print(f"\nthis run: precision {why_precision(the_plan, pinned_by)}")
        print(the_plan.table())
        if not on_gpu:
            print("\nno GPU here: the loop generates with transformers (swaprl.engines.HFEngine), and half of this "
                  "machine's memory stands in for the GPU the plan above puts vLLM on")
    if not the_plan.ok:
        if rank == 0:
            print(f"\nthis run cannot fit: {the_plan.verdict}", file=sys.stderr)
        return 2
    loop = ["--steps", str(args.steps), "--micro-batch", str(micro), "--prompts", str(args.prompts),
            "--completions", str(args.completions),
            "--max-tokens", str(args.max_tokens), "--prompt-tokens", "16", "--out", args.out,
            "--task", "even-tokens"]  # prompts of exactly the planned length: the plan is checked against the run
    if args.model:
        loop += ["--model", args.model]
    else:
        loop += ["--preset", preset] + (["--layers", str(layers)] if layers else [])
    if on_gpu:
        # The KV cache the plan made room for, not what is free when the engine starts: vLLM 0.26 leaves its CUDA
        # graphs out of its own sizing (2.2 GiB per GPU at 72B's width), which the plan counts as engine memory.
        loop += ["--dtype", "bfloat16", "--tp", str(tp), "--kv-cache-gib", f"{the_plan.kv_cache_bytes / 2**30:.3f}"]
    loop += ["--release-other" if release else "--no-release-other"]
    if args.lend_pages is not None:
        loop += ["--lend-pages" if args.lend_pages else "--no-lend-pages"]
    for flag, value in (("--trace-step", args.trace_step), ("--memory-step", args.memory_step),
                        ("--dataset", args.dataset), ("--save-steps", args.save_steps or None),
                        ("--export-hf", args.export_hf), ("--checkpoint-dir", args.checkpoint_dir)):
        if value is not None:
            loop += [flag, str(value)]
    loop += ["--resume"] if args.resume else []
    loop += ["--enforce-eager"] if args.enforce_eager else []
    loop += ["--deterministic"] if args.deterministic else []
    chosen = the_plan.swap_config()
    # the mode the plan chose, as the loop's flags (the loop's own default is fp32 masters, so bf16 is named too); on
    # the CPU the loop's default dtype is float32
    loop += {"master-weights": ["--master-weights"], "fp32-params": ["--fp32-params"],
             "bf16": ["--bf16-only"]}[the_plan.precision]
    loop += [] if on_gpu else ["--dtype", "bfloat16"]
    budget = the_plan.host_budget_bytes / cluster.gpus_per_node / 2**30  # the ranks of a node share it
    loop += ["--optimizer-states", format_optimizer_states(chosen["optimizer_states"]),
             "--sleep-level", str(chosen["sleep_level"]), "--host-budget-gib", f"{budget:.3f}"]
    grpo.main(loop)
    if rank == 0:
        print(f"memory report: {Path(args.out) / 'report' / 'report.html'}")
    return 0


if __name__ == "__main__":
    grpo.expandable_segments()  # before the plan reads the GPU; a run of the script only, as in grpo.py
    sys.exit(main())
