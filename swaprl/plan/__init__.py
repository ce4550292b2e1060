"""Memory planner: does an online-RL step of a model fit a cluster, under which swap settings, with how much KV cache?

    python -m swaprl.plan qwen2.5-72b --cluster 8xH200 --tp 4 --prompts 64 --completions 8 \\
        --prompt-tokens 512 --completion-tokens 1024 [--json]

`plan(...)` computes the bytes of every memory category, per GPU and per host, in the two phases of a step:
`train` (the engine asleep) and `generate` (the engine awake with weights and KV cache). The optimizer states are
split over three homes: "device" (on the GPU in both phases), "swap" (in pinned host memory for `generate` only)
and "host" (in pinned host memory in both phases, streamed through the GPU by the optimizer step). For every point
of the search (gradients, parameters, sleep level, checkpointing) the planner homes the states by the runtime's own
policy (`swaprl.homes`) on the room it predicts: on the device what the host cannot hold and what `generate` holds
beside a full wave of the rollout's KV cache, swapped as much of the rest as `train` holds, the remainder streamed.
It tries the
points from the one that moves the fewest bytes between host and GPU to the most aggressive, those that stream
nothing first, and picks the first under which both phases and the host fit; when none does, the verdict names the
phase that overflows, by how much, and the single changes that would make it fit. By default it plans both precise
modes (fp32 masters beside bf16 parameters, or fp32 parameter shards) and every tensor-parallel size, and keeps the
fitting one with the lowest predicted step cost.

Every formula and constant is written out once, in docs/plan.md; the functions below cite its sections (§).

The package by concern: `hardware` (clusters), `model` (presets, config.json, dtypes), `inputs` (the rollout, the
settings of a point, the validated inputs), `formulas` (one pure function per formula of docs/plan.md), `search`
(`plan()`), `result` (`Plan`: its table and JSON), `cli` (`swaprl plan`). No torch is imported.
"""

from __future__ import annotations

from .cli import add_arguments, from_args, main, run
from .formulas import CATEGORIES, HOST_CATEGORIES, PHASES
from .hardware import CLUSTERS, Cluster, GiB, MiB, get_cluster
from .inputs import Rollout, Settings
from .model import dtype_bytes, load_model
from .result import Candidate, Plan
from .search import plan

__all__ = ["plan", "Plan", "Candidate", "Cluster", "CLUSTERS", "get_cluster", "Rollout", "Settings", "load_model",
           "dtype_bytes", "add_arguments", "from_args", "run", "main", "PHASES", "CATEGORIES", "HOST_CATEGORIES",
           "GiB", "MiB"]
