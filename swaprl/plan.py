"""Memory planner: does an online-RL step of a model fit a cluster, under which swap settings, with how much KV cache?

    python -m swaprl.plan qwen2.5-72b --cluster 8xH200 --tp 4 --prompts 64 --completions 8 \\
        --prompt-tokens 512 --completion-tokens 1024 [--json]

`plan(...)` computes the bytes of every memory category, per GPU and per host, in the two phases of a step:
`train` (the engine asleep) and `generate` (the engine awake with weights and KV cache). The optimizer states are
split over three homes: "device" (on the GPU in both phases), "swap" (in pinned host memory for `generate` only)
and "host" (in pinned host memory in both phases, streamed through the GPU by the optimizer step). For every point
of the search (gradients, parameters, sleep level, checkpointing) the planner picks the split: on the device only
what the host cannot hold, swapped as much of the rest as `train` holds, the remainder streamed. It tries the
points from the one that moves the fewest bytes between host and GPU to the most aggressive, those that stream
nothing first, and picks the first under which both phases and the host fit; when none does, the verdict names the
phase that overflows, by how much, and the single changes that would make it fit.

Every formula and constant is written out once, in docs/plan.md; the functions below cite its sections (§).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .config import MEMORY_CATEGORIES as CATEGORIES
from .config import (
    OPTIMIZER_STATES,
    PARAM_POLICIES,
    STATE_HOMES,
    GradPolicy,
    OptimizerStates,
    ParamPolicy,
    SwapConfig,
    format_optimizer_states,
    parse_optimizer_states,
)
from .memory import default_reserve_bytes
from .presets import PRESETS, Preset, get_preset

GiB = 2**30
MiB = 2**20
PHASES = ("train", "generate")
HOST_CATEGORIES = ("params", "grads", "optimizer", "engine_weights")

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp8": "float8", "fp8_e4m3": "float8", "fp8_e5m2": "float8", "float8_e4m3fn": "float8",
                  "float8_e5m2": "float8"}
_STATES_PER_PARAM = {"adamw": 2, "adam": 2, "sgd": 1, "lion": 1}  # state tensors per parameter (§Trainer state)

# §Constants: per GPU, measured on an H100 (torch 2.11, vLLM 0.26) unless docs/plan.md says otherwise.
_CUDA_CONTEXT_BYTES = 684 * MiB  # CUDA context, loaded kernels and cuBLAS workspace of one process
_NCCL_BYTES_PER_GROUP = 512 * MiB  # NCCL buffers of one communicator this GPU belongs to (NVLS off); estimate
_ENGINE_RESIDENT_BYTES = 288 * MiB  # what a sleeping vLLM engine keeps beyond its process's CUDA context
_CUDA_GRAPH_BYTES = 1334 * MiB  # vLLM's CUDA-graph pool and the compiled kernels, when graphs are captured
# A sleeping engine with VLLMEngine(release_other=True): loaded kernels, cuBLAS workspaces and the executable decode
# graphs, all that its pausable pools cannot release (Qwen2.5-1.5B: 232 MiB, 7B: 238 MiB; §Constants)
_ENGINE_POOLED_RESIDENT_BYTES = 240 * MiB
_PROFILE_H, _PROFILE_I = 3.2, 3.25  # vLLM's profile forward keeps ~(3.2 h + 3.25 i / tp) elements per token
_SAMPLER_FP32_COPIES = 1.5  # live [max_num_seqs, vocab] fp32 tensors at the sampler's peak (measured <= 1.8)
_LOGITS_FP32_COPIES = 3  # fp32 logits, log-softmax and its gradient alive at the loss's backward
_VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before splitting it over TP ranks
_KV_BLOCK_TOKENS = 16  # vLLM's KV block size: a sequence holds whole blocks
_HOST_MARGIN_FRACTION = 0.10  # of host memory kept for the OS, page cache and data
_HOST_MARGIN_PER_GPU = 6 * GiB  # resident memory of one GPU process (torch, CUDA libraries, vLLM, tokenizer)

# The search space, each axis from the least to the most moving value (§Search). The optimizer states' modes and
# the parameters' settings are SwapConfig's, in its order; the gradients' are SwapConfig's in §Search's order, and
# the sleep levels leave out "auto", which SwapConfig resolves before anything runs.
_STREAM_CHUNK_BYTES = 2**30  # SwapConfig.stream_chunk_bytes' default (§Phases)
_GRADS = ("free", "keep", "offload")
_SLEEP_LEVELS = (2, 1)
_CHECKPOINTING = (False, True)
_SUGGESTIONS = 6  # changes listed at most
_TABLE_CANDIDATES = 6  # candidates a table lists when none fits (JSON has all)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def dtype_bytes(name: str) -> tuple[str, int]:
    """The canonical name and element size of a dtype given as "bf16", "bfloat16", "torch.bfloat16", ..."""
    key = str(name).lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPE_BYTES)} "
                         f"(or an alias: {', '.join(_DTYPE_ALIASES)})")
    return key, _DTYPE_BYTES[key]


def _check_positive_ints(obj, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}")


# Pinned copy rates per GPU and direction (§Clusters). Several GPUs: 36 GB/s measured with both GPUs of a 2 x H200
# host copying both ways at once, standing in for 8-GPU nodes of H200s and H100s (not measured with 8). One GPU:
# 55 GB/s each way, measured on one H100 (benchmarks/results/transitions_qwen2.5-7b_h100.md: 55.4 device-to-host,
# 55.1 host-to-device), assumed for one H200 too (the same PCIe generation).
_NODE_COPY_RATE = 36e9
_ONE_GPU_COPY_RATE = 55e9


@dataclass(kw_only=True, slots=True)
class Cluster:
    """The machines: identical nodes of identical GPUs."""

    gpus_per_node: int
    """GPUs in one node; the engine's tensor parallelism stays inside a node."""
    gpu_memory_bytes: int
    """Memory of one GPU as CUDA reports it (`torch.cuda.mem_get_info()[1]`), the base of the utilisation cap."""
    host_memory_bytes: int
    """Host memory of one node (`free -b` total); pinned buffers for swapped tensors come out of it."""
    nodes: int = 1
    """Number of nodes."""
    copy_bytes_per_s: float = _NODE_COPY_RATE
    """Pinned host <-> GPU copy rate of one GPU, per direction, while every GPU of the node copies both ways at once
    (the default is the slowest measured, §Clusters); it prices the bytes a step moves, not whether it fits."""

    def __post_init__(self) -> None:
        _check_positive_ints(self, ("gpus_per_node", "gpu_memory_bytes", "host_memory_bytes", "nodes"))
        rate = self.copy_bytes_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
            raise ValueError(f"Cluster.copy_bytes_per_s must be a positive number of bytes per second, e.g. 36e9, "
                             f"got {rate!r}")

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


# cudaMemGetInfo totals (nvidia-smi's total less the 480 MiB the driver keeps) and host memory (§Clusters).
_H100_BYTES = 85_017_493_504  # measured: 81559 MiB - 480 MiB
_H200_BYTES = 150_251_503_616  # 143771 MiB - 480 MiB (the H100's driver reserve, assumed)
CLUSTERS: dict[str, Cluster] = {
    "8xH200": Cluster(gpus_per_node=8, gpu_memory_bytes=_H200_BYTES, host_memory_bytes=560 * GiB,
                      copy_bytes_per_s=_NODE_COPY_RATE),
    "8xH100": Cluster(gpus_per_node=8, gpu_memory_bytes=_H100_BYTES, host_memory_bytes=1024 * GiB,
                      copy_bytes_per_s=_NODE_COPY_RATE),
    "1xH200": Cluster(gpus_per_node=1, gpu_memory_bytes=_H200_BYTES, host_memory_bytes=128 * GiB,
                      copy_bytes_per_s=_ONE_GPU_COPY_RATE),
    "1xH100": Cluster(gpus_per_node=1, gpu_memory_bytes=_H100_BYTES, host_memory_bytes=128 * GiB,
                      copy_bytes_per_s=_ONE_GPU_COPY_RATE),
}


def get_cluster(name: str) -> Cluster:
    """A copy of a named cluster ("8xH200", "8xH100", "1xH200", "1xH100"; case-insensitive)."""
    for key, value in CLUSTERS.items():
        if key.lower() == name.lower():
            return dataclasses.replace(value)
    raise ValueError(f"unknown cluster {name!r}; choose one of {', '.join(CLUSTERS)} or build a "
                     "Cluster(gpus_per_node=..., gpu_memory_bytes=..., host_memory_bytes=..., nodes=...)")


@dataclass(kw_only=True, slots=True)
class Rollout:
    """The rollout of one RL step over the whole cluster (global, not per GPU)."""

    prompts: int
    """Prompts per step, over all engines together."""
    completions_per_prompt: int
    """Completions sampled per prompt (GRPO's group size)."""
    prompt_tokens: int
    """Longest prompt, in tokens."""
    completion_tokens: int
    """Longest completion (`max_tokens`), in tokens."""

    def __post_init__(self) -> None:
        _check_positive_ints(self, ("prompts", "completions_per_prompt", "prompt_tokens", "completion_tokens"))

    @property
    def sequences(self) -> int:
        return self.prompts * self.completions_per_prompt

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """One point of the swap search space; the names are those of `swaprl.SwapConfig` (`swap_config()`)."""

    optimizer_states: OptimizerStates | Mapping[str, float] = "swap"
    """The optimizer states' split over their homes, as `SwapConfig.optimizer_states` takes it; stored as the
    fractions of every home, {"device": d, "swap": s, "host": h} ("swap" is {"device": 0, "swap": 1, "host": 0}).
    "device": on the GPU in both phases; "swap": in host memory for `generate`, back on the GPU for `train`; "host":
    in host memory in both phases, streamed through the GPU by the optimizer step a chunk at a time."""
    grads: GradPolicy = "free"
    """In `generate`: drop the gradients (they are rebuilt by the next backward), copy them to host, or keep them."""
    params: ParamPolicy = "keep"
    """In `generate`: keep the trainer's parameter shards on the GPU or copy them to host."""
    sleep_level: Literal[1, 2] = 2
    """In `train`: vLLM sleep level 1 (weights copied to host) or 2 (weights dropped, re-synced at wake)."""
    activation_checkpointing: bool = True
    """Recompute each decoder layer in backward instead of keeping its activations."""

    def __post_init__(self) -> None:
        # SwapConfig's own rules and messages for the three forms (a name, or fractions summing to 1)
        split = SwapConfig(optimizer_states=self.optimizer_states).state_split()
        object.__setattr__(self, "optimizer_states", split)
        if self.grads not in _GRADS:
            raise ValueError(f"grads={self.grads!r}; use one of {', '.join(_GRADS)}")
        if self.params not in PARAM_POLICIES:
            raise ValueError(f"params={self.params!r}; use one of {', '.join(PARAM_POLICIES)}")
        if self.sleep_level not in _SLEEP_LEVELS:
            raise ValueError(f"sleep_level={self.sleep_level!r}; use 1 or 2")
        if not isinstance(self.activation_checkpointing, bool):
            raise TypeError(f"activation_checkpointing={self.activation_checkpointing!r}; use True or False")

    def states(self) -> str | dict[str, float]:
        """`optimizer_states` in SwapConfig's shortest form: "swap" or "host" when one home holds them all, else the
        split."""
        return next((home for home in OPTIMIZER_STATES if self.optimizer_states[home] == 1.0),
                    dict(self.optimizer_states))

    def describe(self) -> str:
        ckpt = "on" if self.activation_checkpointing else "off"
        states = self.states()
        if states == "swap":
            states = ""  # the default: said by label()
        elif not isinstance(states, str):  # the form --optimizer-states takes
            states = format_optimizer_states(states)
        return (f"grads={self.grads} params={self.params} sleep_level={self.sleep_level} checkpointing={ckpt}"
                + (f" optimizer_states={states}" if states else ""))

    def label(self) -> str:
        """How the optimizer states move, then `describe()`."""
        states = self.states()
        moves = ("optimizer offload" if states == "swap" else "optimizer states in host memory" if states == "host"
                 else "optimizer states on the device" if states["device"] == 1 else "optimizer states split")
        return f"{moves}, {self.describe()}"

    def swap_config(self) -> dict:
        """The keyword arguments of `swaprl.SwapConfig` for these settings. Activation checkpointing is the model's
        to switch on (`model.gradient_checkpointing_enable()`); every other SwapConfig field keeps its default."""
        return {"optimizer_states": self.states(), "grads": self.grads, "params": self.params,
                "sleep_level": self.sleep_level}


@dataclass(kw_only=True, slots=True)
class Candidate:
    """The verdict on one point of the search space."""

    settings: Settings
    moved_bytes: int
    """Bytes each GPU copies to and from host per step (both directions), the search order."""
    fits: dict[str, bool]
    """Per check: "train", "generate" (GPU) and "host" (pinned memory of a node)."""
    overflow_bytes: dict[str, int]
    """Per check, how much is missing (0 where it fits)."""
    verdict: str


@dataclass(kw_only=True, slots=True)
class Plan:
    """What `plan` found: the bytes of the chosen settings (or of the closest miss) and every candidate's verdict."""

    model: str
    parameters: int
    layers: int
    inputs: dict
    """The validated inputs (cluster, parallelism, dtypes, rollout, engine limits), canonical names."""
    settings: Settings | None
    """The chosen settings; None when nothing fits."""
    shown: Settings
    """The settings whose bytes are below: the chosen ones, or the closest miss."""
    gpu: dict[str, dict[str, int]]
    """phase -> category -> bytes on one GPU."""
    host: dict[str, dict[str, int]]
    """phase -> category -> pinned bytes on one node that hold data in that phase."""
    host_pinned_bytes: int
    """Pinned host bytes per node, all buffers together (allocated once and kept, §Host)."""
    gpu_budget_bytes: dict[str, int]
    """phase -> bytes the phase may fill on one GPU: `train` the utilisation cap, `generate` the GPU less the
    engine's reserve (what a self-sized VLLMEngine takes, §Phases)."""
    host_budget_bytes: int
    fits: dict[str, bool]
    kv_cache_bytes: int
    """Room for the KV cache on one GPU in `generate` (pass it to vLLM as `kv_cache_memory_bytes`)."""
    kv_bytes_per_token: int
    """KV-cache bytes one token takes on one GPU."""
    concurrent_sequences: int
    """Sequences of prompt+completion tokens whose KV cache fits on one engine at once."""
    sequences_per_engine: int
    waves: int | None
    """Rounds of generation one engine needs for its share of the rollout; None when no sequence fits."""
    state_bytes: dict[str, int]
    """The optimizer states of one GPU by home ("device", "swap", "host"), under the shown settings (§Split)."""
    moved_bytes: int
    """Bytes one GPU copies between host and device per step, both directions together (§Copies)."""
    copy_seconds: float
    """The time of those copies at the cluster's copy rate, a floor: the swapped bytes' copies overlap the engine's
    wake and sleep, the streamed ones add to the optimizer step (§Copies)."""
    candidates: list[Candidate]
    verdict: str
    suggestions: list[str] = field(default_factory=list)
    full_precision: str | None = None
    """The verdict of the same step with fp32 master weights (fp32 parameters and gradients, FSDP2's
    MixedPrecisionPolicy computing in bf16: 16 bytes per parameter with AdamW), when the trainer's parameters are
    below fp32 and it keeps no master copy; None otherwise (§Trainer state)."""

    @property
    def ok(self) -> bool:
        return self.settings is not None

    def swap_config(self) -> dict:
        """The keyword arguments of `swaprl.SwapConfig` for the chosen settings (`Settings.swap_config`)."""
        if self.settings is None:
            raise ValueError(f"no setting fits, so there is no SwapConfig to give: {self.verdict}")
        return self.settings.swap_config()

    def total(self, phase: str) -> int:
        return sum(self.gpu[phase].values())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        data = dict(data)
        data["settings"] = None if data["settings"] is None else Settings(**data["settings"])
        data["shown"] = Settings(**data["shown"])
        data["candidates"] = [Candidate(**{**c, "settings": Settings(**c["settings"])}) for c in data["candidates"]]
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def table(self) -> str:
        """A human-readable report, sizes in GiB."""
        i = self.inputs
        c = i["cluster"]
        r = i["rollout"]
        lines = [
            f"model     {self.model}: {self.parameters / 1e9:.2f} B parameters, {self.layers} layers",
            (f"cluster   {c['nodes']} x {c['gpus_per_node']} GPUs of {_gib(c['gpu_memory_bytes'])} GiB, "
             f"host {_gib(c['host_memory_bytes'])} GiB per node, copies at {c['copy_bytes_per_s'] / 1e9:.0f} GB/s "
             "per GPU and direction"),
            (f"trainer   shard degree {i['shard_degree']}, params {i['param_dtype']}, grads {i['grad_dtype']}, "
             f"{i['optimizer']} states {i['optimizer_dtype']}{' + fp32 master' if i['master_weights'] else ''}, "
             f"compute {i['compute_dtype']}, micro batch {i['micro_batch_tokens']} tokens"),
            (f"engine    vLLM TP {i['tp']} ({i['engines']} engines), weights {i['engine_dtype']}, "
             f"KV {i['kv_dtype']}, max {i['engine_max_batched_tokens']} batched tokens / {i['engine_max_seqs']} seqs, "
             f"CUDA graphs {'on' if i['cuda_graphs'] else 'off'}"),
            (f"rollout   {r['prompts']} prompts x {r['completions_per_prompt']} = "
             f"{r['prompts'] * r['completions_per_prompt']} sequences of {r['prompt_tokens']}+"
             f"{r['completion_tokens']} tokens (global), {self.sequences_per_engine} per engine"),
            f"settings  {self.settings.label() if self.settings else 'none fits'}",
            "states    per GPU " + ", ".join(
                f"{home} {_gib(self.state_bytes[home])} GiB ({self.shown.optimizer_states[home]:.2f})"
                for home in STATE_HOMES) + f" of {_gib(sum(self.state_bytes.values()))} GiB",
            "",
            f"{'per GPU (GiB)':<24}{'train':>10}{'generate':>10}",
        ]
        for cat in CATEGORIES:
            lines.append(f"  {cat:<22}" + "".join(f"{_gib(self.gpu[p][cat]):>10}" for p in PHASES))
        lines.append(f"  {'total':<22}" + "".join(f"{_gib(self.total(p)):>10}" for p in PHASES))
        lines.append(f"  {'budget':<22}" + "".join(f"{_gib(self.gpu_budget_bytes[p]):>10}" for p in PHASES)
                     + f"  (train: {i['gpu_utilization_cap']:.0%} of the GPU; generate: the GPU less the engine's "
                     f"{_gib(i['engine_reserve_bytes'])} GiB reserve)")
        lines.append(f"  {'fits':<22}" + "".join(f"{'yes' if self.fits[p] else 'NO':>10}" for p in PHASES))
        lines += ["", f"{'per node host (GiB)':<24}{'train':>10}{'generate':>10}"]
        for cat in HOST_CATEGORIES:
            lines.append(f"  {cat:<22}" + "".join(f"{_gib(self.host[p][cat]):>10}" for p in PHASES))
        lines.append(f"  pinned {_gib(self.host_pinned_bytes)} GiB of a {_gib(self.host_budget_bytes)} GiB budget "
                     f"(host minus {_gib(i['host_margin_bytes'])} GiB margin): "
                     f"{'fits' if self.fits['host'] else 'DOES NOT FIT'}")
        waves = "no sequence fits" if self.waves is None else (
            "one wave" if self.waves == 1 else f"{self.waves} waves")
        streamed = 2 * self.state_bytes["host"]
        lines += ["", (f"KV cache  {_gib(self.kv_cache_bytes)} GiB per GPU, {self.kv_bytes_per_token / 1024:.1f} "
                       f"KiB per token: {self.concurrent_sequences} sequences of "
                       f"{r['prompt_tokens'] + r['completion_tokens']} tokens at once per engine; "
                       f"{self.sequences_per_engine} per engine -> {waves}"),
                  (f"copies    {_gib(self.moved_bytes)} GiB per GPU per step, both ways ({_gib(streamed)} of it "
                   f"streamed by the optimizer step): {self.copy_seconds:.2f} s at "
                   f"{c['copy_bytes_per_s'] / 1e9:.0f} GB/s"), ""]
        chosen = next((k for k, cand in enumerate(self.candidates) if cand.settings == self.settings), None)
        if chosen is not None:
            shown = self.candidates[:chosen + 1]
        else:  # the first few and the closest miss
            shown = self.candidates[:_TABLE_CANDIDATES]
            shown += [c for c in self.candidates if c.settings == self.shown and c not in shown]
        header = "candidates: streaming nothing first, then least moving (* = shown above)"
        width = max(max(len(cand.settings.describe()) for cand in shown) + 2, len(header) - 1)
        lines.append(f"{header:<{width + 3}}moved GiB/GPU/step  verdict")
        for cand in shown:
            mark = "*" if cand.settings in (self.settings, self.shown) else " "
            lines.append(f" {mark} {cand.settings.describe():<{width}}{_gib(cand.moved_bytes):>8}  {cand.verdict}")
        if len(shown) < len(self.candidates):
            rest = "more aggressive, not needed" if chosen is not None else "more, none fits; see --json"
            lines.append(f"   ({len(self.candidates) - len(shown)} {rest})")
        lines += ["", f"verdict   {self.verdict}"]
        lines += [f"  - {s}" for s in self.suggestions]
        if self.full_precision:
            lines.append(f"fp32 master weights: {self.full_precision}")
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Spec:
    """Validated inputs of one evaluation (private: `plan` builds it from its keywords)."""

    model: Preset
    cluster: Cluster
    rollout: Rollout
    shard_degree: int
    tp: int
    param_dtype: str
    grad_dtype: str
    optimizer_dtype: str
    master_weights: bool
    optimizer: str
    compute_dtype: str
    engine_dtype: str
    kv_dtype: str
    micro_batch_tokens: int
    engine_max_batched_tokens: int
    engine_max_seqs: int
    cuda_graphs: bool
    release_other: bool
    processes_per_gpu: int
    gpu_utilization_cap: float
    engine_reserve_bytes: int
    host_margin_bytes: int
    pinned: tuple[tuple[str, object], ...]

    def __post_init__(self) -> None:
        m, c, tp, s = self.model, self.cluster, self.tp, self.shard_degree
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp={tp!r}: the engine's tensor-parallel size must be a positive integer")
        if tp > c.gpus_per_node or c.gpus_per_node % tp:
            raise ValueError(f"tp={tp} must divide gpus_per_node={c.gpus_per_node} (vLLM tensor parallelism stays "
                             f"inside one node); use tp in {_divisors(c.gpus_per_node)}")
        if m.num_attention_heads % tp:
            raise ValueError(f"tp={tp} does not divide {m.name}'s {m.num_attention_heads} attention heads; use tp in "
                             f"{[d for d in _divisors(c.gpus_per_node) if m.num_attention_heads % d == 0]}")
        kv = m.num_key_value_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(f"tp={tp} and {m.name}'s {kv} KV heads: vLLM needs the KV heads divisible by tp, or tp "
                             f"divisible by the KV heads (then they are replicated); pick another tp")
        if not isinstance(s, int) or s < 1 or c.gpus % s:
            raise ValueError(f"shard_degree={s!r} must divide the {c.gpus} GPUs of the cluster (FSDP shards over "
                             f"groups of shard_degree GPUs and replicates across groups); use one of "
                             f"{_divisors(c.gpus)}")
        if self.optimizer not in _STATES_PER_PARAM:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(_STATES_PER_PARAM)}")
        if self.master_weights and self.param_dtype == "float32":
            raise ValueError("master_weights=True keeps an fp32 copy of low-precision parameters, but "
                             "param_dtype is already float32; drop master_weights or use param_dtype='bfloat16'")
        for name in ("micro_batch_tokens", "engine_max_batched_tokens", "engine_max_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.gpu_utilization_cap <= 1.0:
            raise ValueError(f"gpu_utilization_cap={self.gpu_utilization_cap} must lie in (0, 1]; vLLM's default "
                             "is 0.9, swaprl's 0.92")
        if not 0 <= self.engine_reserve_bytes < c.gpu_memory_bytes:
            raise ValueError(f"engine_reserve_bytes={self.engine_reserve_bytes} must lie in [0, gpu_memory_bytes="
                             f"{c.gpu_memory_bytes}); it is what VLLMEngine(reserve_bytes=...) leaves free")
        if not 0 <= self.host_margin_bytes < c.host_memory_bytes:
            raise ValueError(f"host_margin_bytes={self.host_margin_bytes} must lie in [0, host_memory_bytes="
                             f"{c.host_memory_bytes})")
        tokens = self.rollout.sequence_tokens
        if tokens > m.max_position_embeddings:
            raise ValueError(f"prompt_tokens + completion_tokens = {tokens} exceeds {m.name}'s "
                             f"max_position_embeddings={m.max_position_embeddings}; shorten the rollout")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def load_model(model: str | os.PathLike | Preset, *, layers: int | None = None) -> Preset:
    """A preset by name, or the architecture read from a local `config.json` (a file or its directory)."""
    if isinstance(model, Preset):
        spec = model
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            spec = _preset_from_config(path)
        elif os.sep in str(model) or str(model).endswith(".json"):
            raise ValueError(f"no config.json at {model!s}; pass a checkpoint directory, its config.json, or a "
                             f"preset name ({', '.join(PRESETS)})")
        else:
            spec = get_preset(str(model))
    if layers is not None:
        if not isinstance(layers, int) or not 1 <= layers <= spec.num_hidden_layers:
            raise ValueError(f"layers={layers!r} is outside 1..{spec.num_hidden_layers} for {spec.name}")
        spec = dataclasses.replace(spec, num_hidden_layers=layers)
    return spec


def _preset_from_config(path: Path) -> Preset:
    cfg = json.loads(path.read_text())
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; the planner needs a dense decoder's config.json "
                         "(Qwen2 / Llama style)")
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(f"{path} describes a mixture-of-experts model; the planner handles dense models only")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * heads != cfg["hidden_size"]:
        raise ValueError(f"{path}: head_dim={head_dim} x {heads} heads != hidden_size={cfg['hidden_size']}; "
                         "the planner assumes head_dim = hidden_size / num_attention_heads")
    return Preset(name=path.parent.name or str(path), hidden_size=cfg["hidden_size"],
                  intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                  num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
                  vocab_size=cfg["vocab_size"], tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                  max_position_embeddings=cfg.get("max_position_embeddings", 32768))


# --- formulas (docs/plan.md) -------------------------------------------------------------------------------------


def _kv_heads_per_rank(m: Preset, tp: int) -> int:
    """§Engine: KV heads are split over TP ranks, or replicated (one per rank) when there are fewer than ranks."""
    return max(m.num_key_value_heads // tp, 1)


def _engine_params_per_rank(m: Preset, tp: int) -> int:
    """§Engine: parameters one TP rank of vLLM holds (norms replicated, KV heads replicated when kv < tp)."""
    h, i, hd = m.hidden_size, m.intermediate_size, m.head_dim
    kv_dim = _kv_heads_per_rank(m, tp) * hd
    q = (h * h + h) // tp
    kv = 2 * (h * kv_dim + kv_dim)
    o = h * h // tp
    mlp = 3 * h * i // tp
    per_layer = q + kv + o + mlp + 2 * h
    vocab = -(-m.vocab_size // _VOCAB_PADDING) * _VOCAB_PADDING
    embed = -(-vocab // tp) * h
    head = 0 if m.tie_word_embeddings else embed
    return m.num_hidden_layers * per_layer + embed + head + h


def _kv_bytes_per_token(m: Preset, tp: int, kv_bytes: int) -> int:
    """§KV cache: K and V of every layer for one token, on one TP rank."""
    return 2 * m.num_hidden_layers * _kv_heads_per_rank(m, tp) * m.head_dim * kv_bytes


def _engine_profile_peak(s: _Spec) -> int:
    """§Engine: the larger of vLLM's profile forward (max_num_batched_tokens) and its sampler run (max_num_seqs)."""
    m, tp = s.model, s.tp
    b = dtype_bytes(s.engine_dtype)[1]
    per_token = _PROFILE_H * m.hidden_size + _PROFILE_I * m.intermediate_size / tp
    forward = int(s.engine_max_batched_tokens * b * per_token)
    vocab = -(-m.vocab_size // _VOCAB_PADDING) * _VOCAB_PADDING
    sampler = int(min(s.engine_max_seqs, s.engine_max_batched_tokens) * vocab * 4 * _SAMPLER_FP32_COPIES)
    return max(forward, sampler)


def _layer_activation_bytes(m: Preset, tokens: int, b: int) -> int:
    """§Activations: what one Qwen2 decoder layer saves for backward (SDPA attention, SwiGLU, fp32 RMSNorm)."""
    kv_dim = m.num_key_value_heads * m.head_dim
    return tokens * b * (10 * m.hidden_size + 2 * kv_dim + 4 * m.intermediate_size)


def _train_activation_bytes(s: _Spec, checkpointing: bool) -> int:
    """§Activations: saved activations, then the largest of the loss's backward, the lm_head's backward and a
    layer's, + FSDP's buffers."""
    m, t = s.model, s.micro_batch_tokens
    b = dtype_bytes(s.compute_dtype)[1]
    layer = _layer_activation_bytes(m, t, b)
    outside = t * b * 4 * m.hidden_size  # embedding output and the final norm
    logits = t * m.vocab_size * (b + 4 * _LOGITS_FP32_COPIES)
    head = _head_backward_bytes(s, t, b)
    if checkpointing:
        peak = m.num_hidden_layers * t * m.hidden_size * b + outside + max(logits, 2 * layer, head)
    else:
        peak = m.num_hidden_layers * layer + outside + max(logits, layer, head)
    return peak + _fsdp_working_bytes(s)


def _head_backward_bytes(s: _Spec, t: int, b: int) -> int:
    """§Activations: the lm_head's backward in a micro batch after the first: the logits the loss holds and their
    gradient, and the head weight's new gradient, formed whole before it is added into `.grad`. Unsharded only:
    with FSDP the root's unsharded gradient is already in the fsdp term."""
    if s.shard_degree > 1:
        return 0
    m = s.model
    return t * m.vocab_size * (2 * b + 4) + m.vocab_size * m.hidden_size * dtype_bytes(s.grad_dtype)[1]


def _fsdp_working_bytes(s: _Spec) -> int:
    """§Activations: unsharded parameters (2 layers + the root's embedding/lm_head) and gradients before the
    reduce-scatter (1 layer + the root's), when the trainer shards at all."""
    if s.shard_degree == 1:
        return 0
    layer, root = _unit_params(s.model)
    b_c, b_g = dtype_bytes(s.compute_dtype)[1], dtype_bytes(s.grad_dtype)[1]
    return (2 * layer + root) * b_c + (layer + root) * b_g


def _unit_params(m: Preset) -> tuple[int, int]:
    """The parameters of FSDP's units: one decoder layer, and the root (embedding, lm_head unless tied, final norm)."""
    h, i, kv_dim = m.hidden_size, m.intermediate_size, m.num_key_value_heads * m.head_dim
    layer = 2 * h * h + h + 2 * (h * kv_dim + kv_dim) + 3 * h * i + 2 * h
    return layer, m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + h


def _cuda_context_bytes(s: _Spec) -> int:
    """§Constants: one CUDA context per process, plus NCCL buffers per communicator this GPU is in."""
    groups = int(s.cluster.gpus > 1) + int(s.tp > 1)
    return s.processes_per_gpu * _CUDA_CONTEXT_BYTES + groups * _NCCL_BYTES_PER_GROUP


def _state_bytes_per_param(s: _Spec) -> int:
    """§Trainer state: optimizer-state bytes of one parameter (its states, and the fp32 master copy if kept)."""
    return _STATES_PER_PARAM[s.optimizer] * dtype_bytes(s.optimizer_dtype)[1] + (4 if s.master_weights else 0)


def _trainer_state(s: _Spec) -> dict[str, int]:
    """§Trainer state: per-GPU shards of parameters, gradients and optimizer states."""
    n = s.model.num_parameters()
    b_p, b_g = (dtype_bytes(d)[1] for d in (s.param_dtype, s.grad_dtype))
    return {"params": -(-n * b_p // s.shard_degree), "grads": -(-n * b_g // s.shard_degree),
            "optimizer": -(-n * _state_bytes_per_param(s) // s.shard_degree)}


def _largest_state_bytes(s: _Spec) -> int:
    """§Phases: the states of the largest parameter (the embedding, or an MLP matrix) on one GPU: FSDP2 shards
    every parameter, and each rank streams its own shard's states."""
    m = s.model
    return -(-max(m.vocab_size, m.intermediate_size) * m.hidden_size * _state_bytes_per_param(s) // s.shard_degree)


def _staging_bytes(s: _Spec, streamed: int) -> int:
    """§Phases: the streamed states' bytes on one GPU during the optimizer step: two staging chunks, each at least
    the largest parameter's states; all of them when a single chunk holds them; none when nothing streams."""
    chunk = max(_STREAM_CHUNK_BYTES, _largest_state_bytes(s))
    return streamed if chunk >= streamed else 2 * chunk


def _home_bytes(s: _Spec, split: Mapping[str, float]) -> dict[str, int]:
    """§Split: the optimizer states of one GPU by home; the homes' bytes add up to the states' exactly."""
    total = _trainer_state(s)["optimizer"]
    device = round(split["device"] * total)
    host = total - device if split["swap"] == 0 else min(round(split["host"] * total), total - device)
    return {"device": device, "swap": total - device - host, "host": host}


def _engine_weight_bytes(s: _Spec) -> int:
    return _engine_params_per_rank(s.model, s.tp) * dtype_bytes(s.engine_dtype)[1]


def _budgets(s: _Spec) -> dict[str, int]:
    """§Phases, §Host, §KV cache: what each check allows, and the KV cache `generate` must keep at least."""
    seq_tokens = -(-s.rollout.sequence_tokens // _KV_BLOCK_TOKENS) * _KV_BLOCK_TOKENS
    return {"train": int(s.cluster.gpu_memory_bytes * s.gpu_utilization_cap),
            # a self-sized VLLMEngine fills the GPU up to its reserve, whatever the cap says
            "generate": s.cluster.gpu_memory_bytes - s.engine_reserve_bytes,
            "host": s.cluster.host_memory_bytes - s.host_margin_bytes,
            "one_sequence": _kv_bytes_per_token(s.model, s.tp, dtype_bytes(s.kv_dtype)[1]) * seq_tokens}


def _phase_bytes(s: _Spec, st: Settings) -> dict[str, dict[str, int]]:
    """§Phases, §Host: both phases' bytes under `st` on one GPU and one node's host, but for the optimizer states
    and the KV cache (0 here): they are what the split and the engine share out."""
    state = _trainer_state(s)
    engine_weights = _engine_weight_bytes(s)
    graphs = _CUDA_GRAPH_BYTES if s.cuda_graphs else 0
    ctx = _cuda_context_bytes(s)
    zero = dict.fromkeys(CATEGORIES, 0)
    gpn = s.cluster.gpus_per_node
    return {
        "train": {**zero, "params": state["params"], "grads": state["grads"],
                  "engine_other": _ENGINE_POOLED_RESIDENT_BYTES if s.release_other else _ENGINE_RESIDENT_BYTES + graphs,
                  "activations": _train_activation_bytes(s, st.activation_checkpointing), "cuda_context": ctx},
        "generate": {**zero, "params": state["params"] if st.params == "keep" else 0,
                     "grads": state["grads"] if st.grads == "keep" else 0, "engine_weights": engine_weights,
                     "engine_other": _ENGINE_RESIDENT_BYTES + graphs + _engine_profile_peak(s),
                     "cuda_context": ctx},
        "host_train": {**dict.fromkeys(HOST_CATEGORIES, 0),
                       "engine_weights": engine_weights * gpn if st.sleep_level == 1 else 0},
        "host_generate": {**dict.fromkeys(HOST_CATEGORIES, 0),
                          "grads": state["grads"] * gpn if st.grads == "offload" else 0,
                          "params": state["params"] * gpn if st.params == "offload" else 0},
    }


def _pinned_bytes(phases: dict[str, dict[str, int]]) -> int:
    """§Host: one buffer per category, allocated once and kept: the larger phase's bytes of each."""
    return sum(max(phases["host_train"][c], phases["host_generate"][c]) for c in HOST_CATEGORIES)


def _choose_split(s: _Spec, st: Settings) -> dict[str, float]:
    """§Split: on the device the least share that leaves the host part within the host's room, swapped as much of
    the rest as `train` holds, the remainder streamed ("host"); whole percents, rounded towards fitting. Where a
    home's edge falls inside the states, half the largest parameter's states are kept free on both sides of it:
    the runtime gives each parameter one home, whichever its middle byte falls in (`placement.assign_homes`)."""
    phases, budget = _phase_bytes(s, st), _budgets(s)
    total = _trainer_state(s)["optimizer"]
    edge = -(-_largest_state_bytes(s) // 2)

    def percent_within(room: int) -> int:  # the whole percents of the states that fit `room`
        return 100 if total <= room else max((room - edge) * 100 // total, 0)

    host_room = (budget["host"] - _pinned_bytes(phases)) // s.cluster.gpus_per_node
    # train holds the device and swap homes, and two staging chunks whenever any state streams
    train_room = budget["train"] - sum(phases["train"].values())
    resident = 100 if total <= train_room else percent_within(train_room - _staging_bytes(s, total))
    generate_room = budget["generate"] - sum(phases["generate"].values()) - budget["one_sequence"]
    device = 0 if total <= host_room else -(-(total - host_room + edge) * 100 // total)
    # more than the GPU holds in either phase stays over the host's budget, where the verdict reports it
    device = min(device, resident, percent_within(generate_room))
    swap = resident - device
    return {"device": device / 100, "swap": swap / 100, "host": (100 - resident) / 100}


def _copies(s: _Spec, st: Settings, homes: dict[str, int]) -> tuple[int, float]:
    """§Copies: bytes one GPU copies to and from host per step under `st`, and their time at the cluster's rate
    (the switches' copies one direction at a time, the streamed step's both ways at once)."""
    state = _trainer_state(s)
    switches = 2 * (homes["swap"] + (state["grads"] if st.grads == "offload" else 0)
                    + (state["params"] if st.params == "offload" else 0)
                    + (_engine_weight_bytes(s) if st.sleep_level == 1 else 0))
    rate = s.cluster.copy_bytes_per_s
    return switches + 2 * homes["host"], switches / rate + homes["host"] / rate


def _evaluate(s: _Spec, st: Settings) -> dict:
    """Both phases' bytes under one setting, and whether each check passes (§Phases, §Host, §KV cache)."""
    phases, budget = _phase_bytes(s, st), _budgets(s)
    train, generate = phases["train"], phases["generate"]
    homes = _home_bytes(s, st.optimizer_states)
    train["optimizer"] = homes["device"] + homes["swap"] + _staging_bytes(s, homes["host"])
    generate["optimizer"] = homes["device"]
    gpn = s.cluster.gpus_per_node
    phases["host_generate"]["optimizer"] = (homes["swap"] + homes["host"]) * gpn
    phases["host_train"]["optimizer"] = homes["host"] * gpn
    kv_room = budget["generate"] - sum(generate.values())
    generate["kv_cache"] = max(kv_room, 0)
    kv_token = _kv_bytes_per_token(s.model, s.tp, dtype_bytes(s.kv_dtype)[1])
    one_seq = budget["one_sequence"]
    concurrent = max(kv_room, 0) // one_seq
    pinned = _pinned_bytes(phases)
    moved, seconds = _copies(s, st, homes)
    overflow = {"train": max(sum(train.values()) - budget["train"], 0),
                "generate": max(one_seq - kv_room, 0),
                "host": max(pinned - budget["host"], 0)}
    fits = {k: v == 0 for k, v in overflow.items()}
    problems = []
    if not fits["train"]:
        problems.append(f"train needs {_gib(sum(train.values()))} of {_gib(budget['train'])} GiB "
                        f"(over by {_gib(overflow['train'])})")
    if not fits["generate"]:
        if kv_room < 0:
            problems.append(f"generate needs {_gib(budget['generate'] - kv_room)} of {_gib(budget['generate'])} GiB "
                            f"before any KV cache (over by {_gib(overflow['generate'])} with one sequence)")
        else:
            problems.append(f"generate leaves {_gib(kv_room)} GiB for KV, less than one sequence "
                            f"({_gib(one_seq)} GiB; over by {_gib(overflow['generate'])})")
    if not fits["host"]:
        problems.append(f"host needs {_gib(pinned)} of {_gib(budget['host'])} GiB pinned per node "
                        f"(over by {_gib(overflow['host'])})")
    verdict = "fits" if not problems else "; ".join(problems)
    return {"gpu": {"train": train, "generate": generate},
            "host": {"train": phases["host_train"], "generate": phases["host_generate"]},
            "pinned": pinned, "budget": {"train": budget["train"], "generate": budget["generate"]},
            "host_budget": budget["host"], "kv_room": max(kv_room, 0), "kv_token": kv_token,
            "concurrent": concurrent, "homes": homes, "moved": moved, "seconds": seconds, "fits": fits,
            "overflow": overflow, "verdict": verdict}


def _candidates(s: _Spec) -> list[Settings]:
    """§Search: every allowed point, each with the split `_choose_split` gives it unless the split is pinned."""
    pinned = dict(s.pinned)
    axes = {"grads": _GRADS, "params": PARAM_POLICIES, "sleep_level": _SLEEP_LEVELS,
            "activation_checkpointing": _CHECKPOINTING}
    values = [(pinned[k],) if k in pinned else v for k, v in axes.items()]
    points = [Settings(grads=g, params=p, sleep_level=lvl, activation_checkpointing=ac)
              for g, p, lvl, ac in itertools.product(*values)]
    return [dataclasses.replace(st, optimizer_states=pinned.get("optimizer_states") or _choose_split(s, st))
            for st in points]


def _search(s: _Spec) -> tuple[Settings | None, Settings, dict, list[Candidate]]:
    """§Search: the candidates in order (streaming nothing first, then by bytes moved, then per axis, least moving
    first); the first that fits, or None and the closest miss."""
    results = []
    for st in _candidates(s):
        ev = _evaluate(s, st)
        results.append((st, ev, Candidate(settings=st, moved_bytes=ev["moved"], fits=ev["fits"],
                                          overflow_bytes=ev["overflow"], verdict=ev["verdict"])))

    def key(result: tuple) -> tuple:
        st, ev, _ = result
        return (st.optimizer_states["host"] > 0, ev["moved"], _CHECKPOINTING.index(st.activation_checkpointing),
                _GRADS.index(st.grads), PARAM_POLICIES.index(st.params), _SLEEP_LEVELS.index(st.sleep_level))

    results.sort(key=key)
    candidates = [c for *_, c in results]
    chosen = next(((st, ev) for st, ev, _ in results if all(ev["fits"].values())), None)
    if chosen is None:
        st, ev, _ = min(results, key=lambda r: sum(r[1]["overflow"].values()))
        return None, st, ev, candidates
    return chosen[0], chosen[0], chosen[1], candidates


def _suggestions(s: _Spec) -> list[str]:
    """§Search: single changes of the inputs under which some setting fits, else pairs of them."""
    c, r = s.cluster, s.rollout
    alternatives: list[tuple[str, dict]] = []
    for tp in _divisors(c.gpus_per_node):
        if tp > s.tp:
            alternatives.append((f"tp={tp}", {"tp": tp}))
    shard = s.shard_degree * 2 if s.shard_degree == c.gpus else s.shard_degree
    alternatives.append((f"nodes={c.nodes * 2} (shard_degree={shard})",
                         {"cluster": dataclasses.replace(c, nodes=c.nodes * 2), "shard_degree": shard}))
    if s.shard_degree < c.gpus:
        for d in _divisors(c.gpus):
            if d > s.shard_degree:
                alternatives.append((f"shard_degree={d}", {"shard_degree": d}))
    if dtype_bytes(s.optimizer_dtype)[1] > 2:
        alternatives.append(("optimizer_dtype='bfloat16'", {"optimizer_dtype": "bfloat16"}))
    if s.master_weights:
        alternatives.append(("master_weights=False", {"master_weights": False}))
    if dtype_bytes(s.kv_dtype)[1] > 1:
        alternatives.append(("kv_dtype='float8'", {"kv_dtype": "float8"}))
    if s.micro_batch_tokens // 2 >= r.sequence_tokens:  # a micro batch holds whole sequences
        alternatives.append((f"micro_batch_tokens={s.micro_batch_tokens // 2}",
                             {"micro_batch_tokens": s.micro_batch_tokens // 2}))
    if r.completion_tokens > 1:
        alternatives.append((f"completion_tokens={r.completion_tokens // 2}",
                             {"rollout": dataclasses.replace(r, completion_tokens=r.completion_tokens // 2)}))
    if s.pinned:
        alternatives.append(("no pinned settings", {"pinned": ()}))

    def fits_with(change: dict) -> Settings | None:
        try:
            alt = dataclasses.replace(s, **change)
        except ValueError:
            return None
        return _search(alt)[0]

    out = []
    for label, change in alternatives:
        if (chosen := fits_with(change)) is not None:
            out.append(f"would fit with {label} ({chosen.describe()})")
    if out:
        return out[:_SUGGESTIONS]
    for (label_a, a), (label_b, b) in itertools.combinations(alternatives, 2):
        if set(a) & set(b):
            continue
        if (chosen := fits_with({**a, **b})) is not None:
            out.append(f"would fit with {label_a} and {label_b} ({chosen.describe()})")
    nothing = ("no change tried (more TP, more nodes or shard degree, bf16 optimizer states, fp8 KV, a smaller micro "
               "batch, half the completions; alone or two together) is enough; use a bigger cluster")
    return out[:_SUGGESTIONS] or [nothing]


def plan(model: str | os.PathLike | Preset, *, cluster: Cluster | str, rollout: Rollout,
         shard_degree: int | None = None, tp: int = 1, param_dtype: str = "bfloat16", grad_dtype: str | None = None,
         optimizer_dtype: str = "float32", master_weights: bool = False, optimizer: str = "adamw",
         compute_dtype: str = "bfloat16", engine_dtype: str = "bfloat16", kv_dtype: str | None = None,
         micro_batch_tokens: int | None = None, layers: int | None = None, engine_max_batched_tokens: int = 16384,
         engine_max_seqs: int = 1024, cuda_graphs: bool = True, release_other: bool = False,
         processes_per_gpu: int = 1,
         gpu_utilization_cap: float = 0.92, engine_reserve_bytes: int | None = None,
         host_margin_bytes: int | None = None, settings: dict | None = None) -> Plan:
    """Plan the memory of one online-RL step of `model` on `cluster` (formulas: docs/plan.md).

    model: a preset name ("qwen2.5-72b", "7b", "tiny"), a local checkpoint directory or its config.json, or a
        `Preset`; `layers` cuts its depth (the reduced-depth runs that validate the plan).
    cluster: a `Cluster` or a name in `CLUSTERS`.
    rollout: the global rollout of one step; each of the `gpus / tp` engines gets an equal share.
    shard_degree: GPUs the trainer's FSDP/ZeRO-3 shards over (default: all); it must divide the GPU count.
    tp: vLLM tensor-parallel size (inside one node).
    param_dtype, grad_dtype (default: param_dtype), optimizer_dtype: dtypes of the trainer's parameter shards,
        gradients and optimizer states; master_weights adds an fp32 copy of low-precision parameters.
    optimizer: "adamw"/"adam" (2 states per parameter), "sgd" (momentum) or "lion" (1 state).
    compute_dtype: dtype of activations and of FSDP's unsharded parameters.
    engine_dtype, kv_dtype (default: engine_dtype): vLLM's weights and KV cache.
    micro_batch_tokens: tokens in one forward/backward of the trainer (default: one sequence, prompt+completion).
    engine_max_batched_tokens, engine_max_seqs: vLLM's max_num_batched_tokens and max_num_seqs (its defaults on
        GPUs of 70 GiB or more); they size the engine's profile run. cuda_graphs: False for enforce_eager.
    release_other: the engine releases its graphs and buffers while it sleeps (VLLMEngine's `release_other`,
        swaprl.kernels): `train` then counts only what its pools cannot release.
    processes_per_gpu: 1 when the engine lives in the trainer's process (vLLM's external_launcher), 2 otherwise.
    gpu_utilization_cap: the share of each GPU's memory `train` may fill (headroom for allocator fragmentation).
    engine_reserve_bytes: what the engine leaves free in `generate` (VLLMEngine's `reserve_bytes`; default its own
        rule, 2 GiB or 3% of the GPU): the engine sizes its KV cache to fill the rest (§Phases).
    host_margin_bytes: host memory per node not available to pinned buffers (default: 10% + 6 GiB per GPU).
    settings: pin some swap settings, e.g. {"grads": "offload", "sleep_level": 1} or a split of the optimizer
        states, {"optimizer_states": {"device": 0.2, "swap": 0.8}} ("swap" and "host" are splits too); the rest are
        searched, the split chosen for each candidate (§Split).
    """
    if isinstance(cluster, str):
        cluster = get_cluster(cluster)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster or one of {', '.join(CLUSTERS)}, got {cluster!r}")
    if not isinstance(rollout, Rollout):
        raise TypeError(f"rollout must be a Rollout(prompts=..., completions_per_prompt=..., prompt_tokens=..., "
                        f"completion_tokens=...), got {rollout!r}")
    spec_model = load_model(model, layers=layers)
    param_dtype = dtype_bytes(param_dtype)[0]
    grad_dtype = dtype_bytes(grad_dtype or param_dtype)[0]
    engine_dtype = dtype_bytes(engine_dtype)[0]
    settings = dict(settings or {})
    unknown = set(settings) - {"optimizer", "optimizer_states", "grads", "params", "sleep_level",
                               "activation_checkpointing"}
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; pin any of optimizer_states, grads, params, "
                         "sleep_level, activation_checkpointing")
    if settings.pop("optimizer", "offload") != "offload":
        raise ValueError("settings['optimizer'] can only be 'offload': the optimizer states always leave the GPU "
                         "in generate")
    pinned = Settings(**settings)  # validates the pinned values
    if "optimizer_states" in settings:
        settings["optimizer_states"] = pinned.optimizer_states  # the fractions of every home
    if not isinstance(processes_per_gpu, int) or processes_per_gpu not in (1, 2):
        raise ValueError(f"processes_per_gpu={processes_per_gpu!r}; use 1 (the engine inside the trainer's process) "
                         "or 2 (an engine process beside each trainer process)")
    if host_margin_bytes is None:
        host_margin_bytes = int(cluster.host_memory_bytes * _HOST_MARGIN_FRACTION
                                + cluster.gpus_per_node * processes_per_gpu * _HOST_MARGIN_PER_GPU)
        host_margin_bytes = min(host_margin_bytes, cluster.host_memory_bytes - 1)
    s = _Spec(model=spec_model, cluster=cluster, rollout=rollout,
              shard_degree=cluster.gpus if shard_degree is None else shard_degree, tp=tp,
              param_dtype=param_dtype, grad_dtype=grad_dtype, optimizer_dtype=dtype_bytes(optimizer_dtype)[0],
              master_weights=bool(master_weights), optimizer=str(optimizer).lower(),
              compute_dtype=dtype_bytes(compute_dtype)[0], engine_dtype=engine_dtype,
              kv_dtype=dtype_bytes(kv_dtype or engine_dtype)[0],
              micro_batch_tokens=rollout.sequence_tokens if micro_batch_tokens is None else micro_batch_tokens,
              engine_max_batched_tokens=engine_max_batched_tokens, engine_max_seqs=engine_max_seqs,
              cuda_graphs=bool(cuda_graphs), release_other=bool(release_other), processes_per_gpu=processes_per_gpu,
              gpu_utilization_cap=float(gpu_utilization_cap),
              engine_reserve_bytes=int(default_reserve_bytes(cluster.gpu_memory_bytes) if engine_reserve_bytes is None
                                       else engine_reserve_bytes),
              host_margin_bytes=int(host_margin_bytes),
              pinned=tuple(sorted(settings.items())))
    return _build(s)


def _waves(s: _Spec, concurrent: int) -> tuple[int, int | None]:
    """§KV cache: sequences per engine at once (vLLM's max_num_seqs caps them), and the rounds of generation one
    engine needs for its share of the rollout (None when no sequence fits)."""
    per_engine = -(-s.rollout.sequences // (s.cluster.gpus // s.tp))
    per_wave = min(concurrent, s.engine_max_seqs)
    return per_wave, (-(-per_engine // per_wave) if per_wave else None)


def _fit_summary(s: _Spec, chosen: Settings, ev: dict) -> str:
    """What a fitting plan gives: the KV cache, the rollout's waves and the bytes moved per step."""
    per_wave, waves = _waves(s, ev["concurrent"])
    rollout = "the rollout runs in one wave" if waves == 1 else (
        f"the rollout needs {waves} waves of at most {per_wave} sequences per engine")
    return (f"fits with {chosen.label()}; {_gib(ev['kv_room'])} GiB of KV cache per GPU, {rollout}; "
            f"{_gib(ev['moved'])} GiB per GPU over PCIe per step, {ev['seconds']:.2f} s at "
            f"{s.cluster.copy_bytes_per_s / 1e9:.0f} GB/s")


def _full_precision(s: _Spec) -> str | None:
    """§Trainer state: the verdict of the same step with fp32 master weights (param_dtype = grad_dtype = float32
    under bf16 compute), when the trainer's parameters are below fp32 and it keeps no master copy."""
    if dtype_bytes(s.param_dtype)[1] >= 4 or s.master_weights:
        return None
    alt = dataclasses.replace(s, param_dtype="float32", grad_dtype="float32")
    chosen, shown, ev, _ = _search(alt)
    head = (f"param_dtype=float32 ({8 + _state_bytes_per_param(alt)} B per parameter with the states, "
            f"{s.compute_dtype} compute)")
    if chosen is None:
        return f"{head} fits nothing; closest: {shown.describe()}: {ev['verdict']}"
    return f"{head} {_fit_summary(alt, chosen, ev)}"


def _build(s: _Spec) -> Plan:
    chosen, shown, ev, candidates = _search(s)
    engines = s.cluster.gpus // s.tp
    per_engine = -(-s.rollout.sequences // engines)
    waves = _waves(s, ev["concurrent"])[1]
    if chosen is not None:
        verdict = _fit_summary(s, chosen, ev)
        if chosen != candidates[0].settings:
            first = candidates[0]
            verdict += f" (the least moving candidate fails: {first.verdict})"
        suggestions = []
    else:
        verdict = f"nothing fits; closest: {shown.describe()}: {ev['verdict']}"
        suggestions = _suggestions(s)
    m = s.model
    inputs = {
        "cluster": dataclasses.asdict(s.cluster), "rollout": dataclasses.asdict(s.rollout),
        "shard_degree": s.shard_degree, "tp": s.tp, "engines": engines, "param_dtype": s.param_dtype,
        "grad_dtype": s.grad_dtype, "optimizer_dtype": s.optimizer_dtype, "master_weights": s.master_weights,
        "optimizer": s.optimizer, "compute_dtype": s.compute_dtype, "engine_dtype": s.engine_dtype,
        "kv_dtype": s.kv_dtype, "micro_batch_tokens": s.micro_batch_tokens,
        "engine_max_batched_tokens": s.engine_max_batched_tokens, "engine_max_seqs": s.engine_max_seqs,
        "cuda_graphs": s.cuda_graphs, "release_other": s.release_other, "processes_per_gpu": s.processes_per_gpu,
        "gpu_utilization_cap": s.gpu_utilization_cap, "engine_reserve_bytes": s.engine_reserve_bytes,
        "host_margin_bytes": s.host_margin_bytes,
        "pinned_settings": dict(s.pinned),
    }
    return Plan(model=m.name, parameters=m.num_parameters(), layers=m.num_hidden_layers, inputs=inputs,
                settings=chosen, shown=shown, gpu=ev["gpu"], host=ev["host"], host_pinned_bytes=ev["pinned"],
                gpu_budget_bytes=ev["budget"], host_budget_bytes=ev["host_budget"],
                fits={"train": ev["fits"]["train"], "generate": ev["fits"]["generate"], "host": ev["fits"]["host"]},
                kv_cache_bytes=ev["kv_room"], kv_bytes_per_token=ev["kv_token"], concurrent_sequences=ev["concurrent"],
                sequences_per_engine=per_engine, waves=waves, state_bytes=ev["homes"], moved_bytes=ev["moved"],
                copy_seconds=ev["seconds"], candidates=candidates, verdict=verdict, suggestions=suggestions,
                full_precision=_full_precision(s))


# --- command line (`swaprl plan`, or `python -m swaprl.plan`) ----------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `swaprl plan`'s arguments to `parser` (cli.py calls this, then `run(args)`; `from_args` gives the plan)."""
    parser.add_argument("model", help="preset name (tiny, qwen2.5-0.5b ... qwen2.5-72b) or a checkpoint directory")
    parser.add_argument("--cluster", default="8xH200", help=f"one of {', '.join(CLUSTERS)} (default 8xH200); "
                        "the flags below override its fields")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--gpu-memory-gib", type=float)
    parser.add_argument("--host-memory-gib", type=float)
    parser.add_argument("--shard-degree", type=int, help="FSDP shard degree (default: all GPUs)")
    parser.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    parser.add_argument("--layers", type=int, help="cut the model to this many layers")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step, global (default 64)")
    parser.add_argument("--completions", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch-tokens", type=int, help="trainer tokens per micro batch (default: 1 sequence)")
    parser.add_argument("--param-dtype", default="bfloat16")
    parser.add_argument("--grad-dtype", help="default: the param dtype")
    parser.add_argument("--optimizer-dtype", default="float32")
    parser.add_argument("--master-weights", action="store_true", help="fp32 master copy of the parameters")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(_STATES_PER_PARAM))
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument("--engine-dtype", default="bfloat16")
    parser.add_argument("--kv-dtype", help="default: the engine dtype")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in the engine")
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
    parser.add_argument("--grads", choices=_GRADS, help="pin the gradients' setting")
    parser.add_argument("--params", choices=PARAM_POLICIES, help="pin the parameters' setting")
    parser.add_argument("--sleep-level", type=int, choices=_SLEEP_LEVELS, help="pin the engine's sleep level")
    parser.add_argument("--activation-checkpointing", choices=("on", "off"), help="pin activation checkpointing")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def from_args(args: argparse.Namespace) -> Plan:
    """The plan of `swaprl plan`'s parsed arguments; ValueError on bad input."""
    cluster = get_cluster(args.cluster)
    overrides = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
                 "gpu_memory_bytes": None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GiB),
                 "host_memory_bytes": None if args.host_memory_gib is None else int(args.host_memory_gib * GiB),
                 "copy_bytes_per_s": None if args.copy_gb_per_s is None else args.copy_gb_per_s * 1e9}
    cluster = dataclasses.replace(cluster, **{k: v for k, v in overrides.items() if v is not None})
    pinned = {k: getattr(args, k) for k in ("grads", "params", "sleep_level") if getattr(args, k) is not None}
    if args.optimizer_states is not None:
        pinned["optimizer_states"] = parse_optimizer_states(args.optimizer_states)
    if args.activation_checkpointing is not None:
        pinned["activation_checkpointing"] = args.activation_checkpointing == "on"
    return plan(
        args.model, cluster=cluster, layers=args.layers, shard_degree=args.shard_degree, tp=args.tp,
        rollout=Rollout(prompts=args.prompts, completions_per_prompt=args.completions,
                        prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens),
        micro_batch_tokens=args.micro_batch_tokens, param_dtype=args.param_dtype, grad_dtype=args.grad_dtype,
        optimizer_dtype=args.optimizer_dtype, master_weights=args.master_weights, optimizer=args.optimizer,
        compute_dtype=args.compute_dtype, engine_dtype=args.engine_dtype, kv_dtype=args.kv_dtype,
        engine_max_batched_tokens=args.max_num_batched_tokens, engine_max_seqs=args.max_num_seqs,
        cuda_graphs=not args.enforce_eager, release_other=args.release_other,
        processes_per_gpu=args.processes_per_gpu,
        gpu_utilization_cap=args.gpu_utilization,
        engine_reserve_bytes=None if args.engine_reserve_gib is None else int(args.engine_reserve_gib * GiB),
        host_margin_bytes=None if args.host_margin_gib is None else int(args.host_margin_gib * GiB),
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
    parser = argparse.ArgumentParser(prog="python -m swaprl.plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
