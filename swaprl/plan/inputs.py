"""What a plan is asked: the rollout, the swap settings of one point of the search, and the validated inputs
(`Spec`) every formula takes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..config import (
    OPTIMIZER_STATES,
    PARAM_POLICIES,
    STATES_PER_PARAMETER,
    GradPolicy,
    OptimizerStates,
    ParamPolicy,
    SwapConfig,
    format_optimizer_states,
)
from ..presets import Preset, shown_value
from .hardware import COUNT_LIMIT, Cluster, check_gpus, check_number
from .model import dtype_bytes

# The search space, each axis from the least to the most moving value (§Search). The optimizer states' modes and
# the parameters' settings are SwapConfig's, in its order; the gradients' are SwapConfig's in §Search's order, and
# the sleep levels leave out "auto", which SwapConfig resolves before anything runs.
STREAM_CHUNK_BYTES = 2**30  # SwapConfig.stream_chunk_bytes' default (§Phases)
GRADS = ("free", "keep", "offload")
SLEEP_LEVELS = (2, 1)
CHECKPOINTING = (False, True)
# How the trainer's FSDP units are cut (§Activations): one root unit around the embedding and lm_head, or those two
# as units of their own.
FSDP_UNITS = ("root", "split")
# How the trainer is spread (§Trainer state): FSDP2 (or one unsharded GPU), or DeepSpeed's ZeRO-2 or ZeRO-3 with
# swaprl's homes for its fp32 partitions and states (`swaprl.integrations.trl` under accelerate's DeepSpeed plugin).
LAYOUTS = ("fsdp2", "zero2", "zero3")
REDUCE_BUCKET_ELEMENTS = 5 * 10**8
"""DeepSpeed's `reduce_bucket_size` default, which accelerate's config from open-r1's zero2.yaml and zero3.yaml
leaves: the bucket of gradients being reduced, in their dtype; ZeRO-2 makes it for each backward, ZeRO-3 holds it
for good (§Activations, §Phases)."""
ZERO3_SUB_GROUP_ELEMENTS = 10**9
"""DeepSpeed's `sub_group_size` default (open-r1's zero3.yaml leaves it): ZeRO-3 steps, and swaprl homes, each
rank's partitions in sub-groups of at least this many elements (§Split)."""


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
        for name in ("prompts", "completions_per_prompt", "prompt_tokens", "completion_tokens"):
            check_number(getattr(self, name), f"Rollout.{name}", "a positive integer", COUNT_LIMIT, integer=True)

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
        if self.grads not in GRADS:
            raise ValueError(f"grads={self.grads!r}; use one of {', '.join(GRADS)}")
        if self.params not in PARAM_POLICIES:
            raise ValueError(f"params={self.params!r}; use one of {', '.join(PARAM_POLICIES)}")
        if self.sleep_level not in SLEEP_LEVELS:
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



@dataclass(frozen=True, kw_only=True, slots=True)
class Spec:
    """Validated inputs of one evaluation (private: `plan` builds it from its keywords)."""

    model: Preset
    cluster: Cluster
    rollout: Rollout
    shard_degree: int
    fsdp_units: str
    layout: str
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
        # first: the messages below list the divisors of the GPU count
        check_gpus(c.nodes, c.gpus_per_node, names=("Cluster.nodes", "Cluster.gpus_per_node"))
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp={shown_value(tp)}: the engine's tensor-parallel size must be a positive integer")
        if tp > c.gpus_per_node or c.gpus_per_node % tp:
            raise ValueError(f"tp={tp} must divide gpus_per_node={c.gpus_per_node} (vLLM tensor parallelism stays "
                             f"inside one node); use tp in {divisors(c.gpus_per_node)}")
        if m.num_attention_heads % tp:
            raise ValueError(f"tp={tp} does not divide {m.name}'s {m.num_attention_heads} attention heads; use tp in "
                             f"{[d for d in divisors(c.gpus_per_node) if m.num_attention_heads % d == 0]}")
        kv = m.num_key_value_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(f"tp={tp} and {m.name}'s {kv} KV heads: vLLM needs the KV heads divisible by tp, or tp "
                             f"divisible by the KV heads (then they are replicated); pick another tp")
        if isinstance(s, bool) or not isinstance(s, int) or s < 1 or c.gpus % s:
            raise ValueError(f"shard_degree={shown_value(s)} must divide the {c.gpus} GPUs of the cluster (FSDP "
                             "shards over groups of shard_degree GPUs and replicates across groups); use one of "
                             f"{divisors(c.gpus)}")
        if self.fsdp_units not in FSDP_UNITS:
            raise ValueError(f"fsdp_units={self.fsdp_units!r}; use 'root' (decoder layers, and one root unit holding "
                             "the embedding and lm_head: accelerate's FSDP2, TRL's) or 'split' (the embedding and an "
                             "untied lm_head as units of their own: swaprl.distributed.shard_causal_lm, the examples')")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; use 'fsdp2' (FSDP2, or one unsharded GPU), 'zero2' or 'zero3' "
                             "(DeepSpeed ZeRO-2 or ZeRO-3)")
        if self.layout in ("zero2", "zero3"):
            name = self.layout
            if s != c.gpus:
                raise ValueError(f"layout={name!r} partitions over every GPU (DeepSpeed's data-parallel world), so "
                                 f"shard_degree={s} must be the cluster's {c.gpus} GPUs; leave shard_degree out")
            if self.fsdp_units != "root":
                raise ValueError(f"fsdp_units is FSDP2's unit layout; leave it out with layout={name!r}")
            if dtype_bytes(self.param_dtype)[1] < 4 and not self.master_weights:
                raise ValueError(f"layout={name!r} with parameters below fp32 keeps DeepSpeed's fp32 partitions "
                                 "(its bf16 mode): use precision='master-weights' (or 'auto'), not 'bf16'")
            pinned = dict(self.pinned)
            if name == "zero2" and pinned.get("grads") == "offload":
                raise ValueError("under layout='zero2' DeepSpeed holds no gradients between optimizer steps (its "
                                 "partition of them is made in the backward and freed after the step) and swaprl "
                                 "moves none: pin grads='free', or 'keep' for a generation inside an accumulation "
                                 "window, which finds the window's partition still held")
            split = pinned.get("optimizer_states")
            if name == "zero2" and isinstance(split, dict) and split.get("host", 0) > 0:
                raise ValueError("under layout='zero2' the states cannot have the 'host' home: it streams them "
                                 "through the device inside the step, and ZeRO-2 keeps views of them that a home in "
                                 "host memory would leave behind. Pin 'swap' or a split of 'device' and 'swap', or "
                                 "use layout='zero3', where swaprl streams them")
            if name == "zero2" and pinned.get("params") == "offload":
                raise ValueError("under layout='zero2' the bf16 parameters are DeepSpeed's flat groups, whole on "
                                 "every GPU, and stay there: pin params='keep', or leave it out")
            if name == "zero3" and (pinned.get("grads") == "offload" or pinned.get("params") == "offload"):
                raise ValueError("under layout='zero3' swaprl releases ZeRO-3's gradient buffer for 'generate' "
                                 "(grads 'free') or keeps it ('keep'), and leaves its bf16 partitions on the GPU: "
                                 "pin grads='free' or 'keep' and params='keep', or leave them out")
        if self.optimizer not in STATES_PER_PARAMETER:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(STATES_PER_PARAMETER)}")
        if self.master_weights and self.param_dtype == "float32":
            raise ValueError("master_weights=True keeps an fp32 copy of low-precision parameters, but "
                             "param_dtype is already float32; drop master_weights or use param_dtype='bfloat16'")
        tokens = self.rollout.sequence_tokens
        if tokens > m.max_position_embeddings:  # first: it also bounds the default micro batch, one sequence
            raise ValueError(f"prompt_tokens + completion_tokens = {tokens} exceeds {m.name}'s "
                             f"max_position_embeddings={m.max_position_embeddings}; shorten the rollout")
        for name in ("micro_batch_tokens", "engine_max_batched_tokens", "engine_max_seqs"):
            check_number(getattr(self, name), name, "a positive integer", COUNT_LIMIT, integer=True)
        if not 0.0 < self.gpu_utilization_cap <= 1.0:
            raise ValueError(f"gpu_utilization_cap={self.gpu_utilization_cap} (--gpu-utilization) must lie in "
                             "(0, 1]; vLLM's default is 0.9, swaprl's 0.92")
        if not 0 <= self.engine_reserve_bytes < c.gpu_memory_bytes:
            raise ValueError(f"engine_reserve_bytes={self.engine_reserve_bytes} must lie in [0, gpu_memory_bytes="
                             f"{c.gpu_memory_bytes}); it is what VLLMEngine(reserve_bytes=...) leaves free")
        if not 0 <= self.host_margin_bytes < c.host_memory_bytes:
            raise ValueError(f"host_margin_bytes={self.host_margin_bytes} must lie in [0, host_memory_bytes="
                             f"{c.host_memory_bytes})")
        if self.micro_batch_tokens < tokens:  # a trainer's forward takes whole sequences
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} is less than one sequence "
                             f"(prompt_tokens + completion_tokens = {tokens}); give a multiple of it, or leave it "
                             "out for one sequence per micro batch")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

