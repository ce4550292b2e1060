"""`swaprl plan` (and `python -m swaprl.plan`): the planner's command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..config import PARAM_POLICIES, STATES_PER_PARAMETER, parse_optimizer_states
from .hardware import (
    CLUSTERS,
    COUNT_LIMIT,
    GPUS,
    MAX_COPY_BYTES_PER_S,
    MAX_GPU_MEMORY_BYTES,
    MAX_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_HOST_MEMORY_BYTES,
    GiB,
    check_gpus,
    check_number,
    get_cluster,
)
from .inputs import GRADS, SLEEP_LEVELS, Rollout
from .result import Plan
from .search import PRECISIONS, plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `swaprl plan`'s arguments to `parser` (cli.py calls this, then `run(args)`; `from_args` gives the plan)."""
    parser.add_argument("model", help="a preset (qwen2.5-0.5b ... qwen2.5-72b, llama-3.1-8b/70b, llama-3-8b/70b, "
                        "qwen3-8b/32b, tiny), a hub id naming one, or a local config.json or its directory "
                        "(Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3)")
    parser.add_argument("--cluster", default="8xH200", help=f"NxGPU with a GPU among {', '.join(GPUS)} (e.g. 2xH100, "
                        f"16xH200), or one of {', '.join(CLUSTERS)}, which carry their host memory (default 8xH200); "
                        "the flags below override its fields")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--gpu-memory-gib", type=float)
    parser.add_argument("--host-memory-gib", type=float)
    parser.add_argument("--shard-degree", type=int, help="FSDP shard degree (default: all GPUs)")
    parser.add_argument("--tp", type=_tp, default="auto",
                        help="vLLM tensor-parallel size, or auto (the default): of the sizes that fit, the one with "
                             "the lowest predicted step cost (docs/plan.md, Cost)")
    parser.add_argument("--layers", type=int, help="cut the model to this many layers")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step, global (default 64)")
    parser.add_argument("--completions", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch-tokens", type=int, help="trainer tokens per micro batch (default: 1 sequence)")
    parser.add_argument("--precision", default="auto", choices=PRECISIONS,
                        help="how the trainer keeps its weights: auto (the default) plans the precise modes, "
                             "master-weights (bf16 parameters, an fp32 master copy of each with its states) and "
                             "fp32-params (fp32 parameter shards, bf16 compute), and keeps the one that fits with the "
                             "lowest predicted step cost; bf16: bf16 parameters updated in place, no fp32 copy")
    parser.add_argument("--param-dtype", help="the trainer's parameter shards (default: as --precision says; float32 "
                        "pins fp32-params, a lower one without --master-weights pins bf16)")
    parser.add_argument("--grad-dtype", help="default: the param dtype")
    parser.add_argument("--optimizer-dtype", default="float32")
    parser.add_argument("--master-weights", action="store_true",
                        help="fp32 master copy of the bf16 parameters, kept with their states in the homes the split "
                             "gives them (SwapConfig(master_weights=True))")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(STATES_PER_PARAMETER))
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument("--engine-dtype", default="bfloat16")
    parser.add_argument("--kv-dtype", help="default: the engine dtype")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in the engine")
    parser.add_argument("--fsdp-units", default="root", choices=["root", "split"],
                        help="root: the embedding and lm_head in FSDP's root unit (accelerate, TRL); split: units of "
                             "their own (swaprl.distributed.shard_causal_lm, the examples)")
    parser.add_argument("--layout", default="fsdp2", choices=["fsdp2", "zero2", "zero3"],
                        help="fsdp2: FSDP2 over --shard-degree GPUs (or one unsharded GPU); zero2 / zero3: DeepSpeed "
                             "ZeRO-2 / ZeRO-3 over every GPU, wrapped by swaprl (docs/plan.md, Trainer state)")
    parser.add_argument("--release-other", action="store_true",
                        help="the engine releases its graphs and buffers while asleep (VLLMEngine release_other)")
    parser.add_argument("--processes-per-gpu", type=int, default=1)
    parser.add_argument("--gpu-utilization", type=float, default=0.92, help="share of GPU memory train may fill")
    parser.add_argument("--engine-reserve-gib", type=float,
                        help="GPU memory the engine leaves free in generate (default: 2 GiB or 3%% of the GPU)")
    parser.add_argument("--host-margin-gib", type=float, help="host memory kept free (default 10%% + 6 GiB/GPU)")
    parser.add_argument("--copy-gb-per-s", type=float,
                        help="pinned host<->GPU copy rate per GPU and direction, all GPUs copying (GB/s)")
    parser.add_argument("--optimizer-states",
                        help="pin the optimizer states' homes: swap, host, or a split of their bytes such as "
                        "device=0.2,swap=0.5,host=0.3 (default: the least on the device that lets the host fit, "
                        "then as much swapped as train holds)")
    parser.add_argument("--grads", choices=GRADS, help="pin the gradients' setting")
    parser.add_argument("--params", choices=PARAM_POLICIES, help="pin the parameters' setting")
    parser.add_argument("--sleep-level", type=int, choices=SLEEP_LEVELS, help="pin the engine's sleep level")
    parser.add_argument("--activation-checkpointing", choices=("on", "off"), help="pin activation checkpointing")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _tp(text: str) -> int | str:
    if text.lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp {text!r}: give a tensor-parallel size (1, 2, 4, 8) or auto") from None


# The numeric flags, each with its bound and what it is. They are checked here, as typed, so that an error names the
# flag and its unit; the planner's dataclasses check the fields they become against the same bounds.
_COUNT_FLAGS = {"nodes": (COUNT_LIMIT, "a positive number of nodes"),
                "gpus_per_node": (MAX_GPUS_PER_NODE, "a positive number of GPUs"),
                "shard_degree": (MAX_GPUS, "a positive number of GPUs"),
                **dict.fromkeys(("prompts", "completions", "prompt_tokens", "completion_tokens", "micro_batch_tokens",
                                 "max_num_batched_tokens", "max_num_seqs"), (COUNT_LIMIT, "a positive integer"))}
_GIB_FLAGS = {"gpu_memory_gib": (MAX_GPU_MEMORY_BYTES, False, "the memory of one GPU in GiB, above 0"),
              "host_memory_gib": (MAX_HOST_MEMORY_BYTES, False, "the host memory of one node in GiB, above 0"),
              "engine_reserve_gib": (MAX_GPU_MEMORY_BYTES, True, "GPU memory in GiB, 0 or more"),
              "host_margin_gib": (MAX_HOST_MEMORY_BYTES, True, "host memory in GiB, 0 or more")}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bytes(args: argparse.Namespace, name: str) -> int | None:
    """The bytes of a GiB flag, None when it was not given."""
    value = getattr(args, name)
    if value is None:
        return None
    high, zero, what = _GIB_FLAGS[name]
    check_number(value, _flag(name), what, high / GiB, zero=zero)
    if not zero and int(value * GiB) < 1:  # what the planner counts in is bytes
        raise ValueError(f"{_flag(name)} {value}: less than one byte; give {what}")
    return int(value * GiB)


def from_args(args: argparse.Namespace) -> Plan:
    """The plan of `swaprl plan`'s parsed arguments; ValueError on bad input."""
    for name, (high, what) in _COUNT_FLAGS.items():
        if getattr(args, name) is not None:
            check_number(getattr(args, name), _flag(name), what, high, integer=True)
    if args.copy_gb_per_s is not None:
        check_number(args.copy_gb_per_s, "--copy-gb-per-s", "the pinned copy rate of one GPU in GB/s, above 0",
                     MAX_COPY_BYTES_PER_S / 1e9)
    cluster = get_cluster(args.cluster)
    overrides = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
                 "gpu_memory_bytes": _bytes(args, "gpu_memory_gib"),
                 "host_memory_bytes": _bytes(args, "host_memory_gib"),
                 "copy_bytes_per_s": None if args.copy_gb_per_s is None else args.copy_gb_per_s * 1e9}
    cluster = dataclasses.replace(cluster, **{k: v for k, v in overrides.items() if v is not None})
    check_gpus(cluster.nodes, cluster.gpus_per_node, names=("--nodes", "--gpus-per-node"))
    pinned = {k: getattr(args, k) for k in ("grads", "params", "sleep_level") if getattr(args, k) is not None}
    if args.optimizer_states is not None:
        pinned["optimizer_states"] = parse_optimizer_states(args.optimizer_states)
    if args.activation_checkpointing is not None:
        pinned["activation_checkpointing"] = args.activation_checkpointing == "on"
    return plan(
        args.model, cluster=cluster, layers=args.layers, shard_degree=args.shard_degree,
        fsdp_units=args.fsdp_units, layout=args.layout, tp=args.tp,
        rollout=Rollout(prompts=args.prompts, completions_per_prompt=args.completions,
                        prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens),
        micro_batch_tokens=args.micro_batch_tokens, precision=args.precision, param_dtype=args.param_dtype,
        grad_dtype=args.grad_dtype,
        optimizer_dtype=args.optimizer_dtype, master_weights=args.master_weights, optimizer=args.optimizer,
        compute_dtype=args.compute_dtype, engine_dtype=args.engine_dtype, kv_dtype=args.kv_dtype,
        engine_max_batched_tokens=args.max_num_batched_tokens, engine_max_seqs=args.max_num_seqs,
        cuda_graphs=not args.enforce_eager, release_other=args.release_other,
        processes_per_gpu=args.processes_per_gpu,
        gpu_utilization_cap=args.gpu_utilization,
        engine_reserve_bytes=_bytes(args, "engine_reserve_gib"), host_margin_bytes=_bytes(args, "host_margin_gib"),
        settings=pinned)


def run(args: argparse.Namespace) -> int:
    """Print the plan of `args` (a table, or JSON with --json); 0 if a setting fits, 1 if none does, 2 on bad input."""
    try:
        result = from_args(args)
    except ValueError as exc:
        print(f"swaprl plan: error: {exc}", file=sys.stderr)
        return 2
    print(result.to_json(indent=1) if args.json else result.table())
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    from ..cli import quiet_on_closed_pipe

    from .. import __version__

    parser = argparse.ArgumentParser(prog="python -m swaprl.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"swaprl {__version__}")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return quiet_on_closed_pipe(lambda: run(args))

