"""The planner's formulas, one pure function each, every one written out in docs/plan.md (the § it cites): the bytes
of each memory category in each phase, on one GPU and one node's host, for the validated inputs (`Spec`)."""

from __future__ import annotations

from collections.abc import Mapping

from ..config import MEMORY_CATEGORIES as CATEGORIES
from ..config import KV_WAVE_HEADROOM, STATES_PER_PARAMETER
from ..homes import Capacity, Room, by_fractions, decide, totals
from ..presets import Preset
from .hardware import MiB
from .inputs import REDUCE_BUCKET_ELEMENTS, STREAM_CHUNK_BYTES, ZERO3_SUB_GROUP_ELEMENTS, Settings, Spec
from .model import dtype_bytes

PHASES = ("train", "generate")
HOST_CATEGORIES = ("params", "grads", "optimizer", "engine_weights")

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


def kv_heads_per_rank(m: Preset, tp: int) -> int:
    """§Engine: KV heads are split over TP ranks, or replicated (one per rank) when there are fewer than ranks."""
    return max(m.num_key_value_heads // tp, 1)


def engine_params_per_rank(m: Preset, tp: int) -> int:
    """§Engine: parameters one TP rank of vLLM holds: q, o (weight) and the MLP split over the ranks, k and v split
    or replicated by KV head, the o bias, norms and q/k norms replicated."""
    part, h = m.layer_parameters(), m.hidden_size
    o_bias = part["o"] - m.q_dim * h
    per_layer = (part["q"] // tp + (part["k"] + part["v"]) * kv_heads_per_rank(m, tp) // m.num_key_value_heads
                 + (part["o"] - o_bias) // tp + o_bias + part["mlp"] // tp + part["qk_norm"] + part["norms"])
    vocab = -(-m.vocab_size // _VOCAB_PADDING) * _VOCAB_PADDING
    embed = -(-vocab // tp) * h
    head = 0 if m.tie_word_embeddings else embed
    return m.num_hidden_layers * per_layer + embed + head + h


def kv_bytes_per_token(m: Preset, tp: int, kv_bytes: int) -> int:
    """§KV cache: K and V of every layer for one token, on one TP rank."""
    return 2 * m.num_hidden_layers * kv_heads_per_rank(m, tp) * m.head_dim * kv_bytes


def engine_profile_peak(s: Spec) -> int:
    """§Engine: the larger of vLLM's profile forward (max_num_batched_tokens) and its sampler run (max_num_seqs)."""
    m, tp = s.model, s.tp
    b = dtype_bytes(s.engine_dtype)[1]
    per_token = _PROFILE_H * m.hidden_size + _PROFILE_I * m.intermediate_size / tp
    forward = int(s.engine_max_batched_tokens * b * per_token)
    vocab = -(-m.vocab_size // _VOCAB_PADDING) * _VOCAB_PADDING
    sampler = int(min(s.engine_max_seqs, s.engine_max_batched_tokens) * vocab * 4 * _SAMPLER_FP32_COPIES)
    return max(forward, sampler)


def layer_activation_bytes(m: Preset, tokens: int, b: int) -> int:
    """§Activations: what one decoder layer saves for backward (SDPA attention, SwiGLU, fp32 RMSNorm)."""
    return tokens * b * (8 * m.hidden_size + 2 * m.q_dim + 2 * m.kv_dim + 4 * m.intermediate_size)


def train_activation_bytes(s: Spec, checkpointing: bool) -> int:
    """§Activations: saved activations, then the largest of the loss's backward, the lm_head's backward and a
    layer's, + FSDP's buffers."""
    m, t = s.model, s.micro_batch_tokens
    b = dtype_bytes(s.compute_dtype)[1]
    layer = layer_activation_bytes(m, t, b)
    outside = t * b * 4 * m.hidden_size  # embedding output and the final norm
    logits = t * m.vocab_size * (b + 4 * _LOGITS_FP32_COPIES)
    head = head_backward_bytes(s, t, b)
    if checkpointing:
        peak = m.num_hidden_layers * t * m.hidden_size * b + outside + max(logits, 2 * layer, head)
    else:
        peak = m.num_hidden_layers * layer + outside + max(logits, layer, head)
    if s.layout == "zero2":
        # its step flattens each group's gradient partition (a copy in the gradients' dtype) and casts that to fp32
        # (the fp32 partition's `.grad`; the cast copies nothing in fp32), after the backward has freed the
        # activations: the larger of the two
        b_g = dtype_bytes(s.grad_dtype)[1]
        peak = max(peak, -(-m.num_parameters() // s.shard_degree) * (4 + (b_g if b_g < 4 else 0)))
    return peak + fsdp_working_bytes(s)


def head_backward_bytes(s: Spec, t: int, b: int) -> int:
    """§Activations: the lm_head's backward in a micro batch after the first: the logits the loss holds and their
    gradient, and the head weight's new gradient, formed whole before it is added into `.grad`. Unsharded only:
    with FSDP or ZeRO-3 the root's unsharded gradient is already in their working set. ZeRO-2's parameters are whole:
    its head's backward is the unsharded one."""
    if s.layout == "zero3" or (s.layout == "fsdp2" and s.shard_degree > 1):
        return 0
    m = s.model
    return t * m.vocab_size * (2 * b + 4) + m.vocab_size * m.hidden_size * dtype_bytes(s.grad_dtype)[1]


def fsdp_working_bytes(s: Spec) -> int:
    """§Activations: the unsharded working set of FSDP2's units, or ZeRO-3's (`zero3_working_bytes`); under ZeRO-2,
    whose parameters are whole, its reduce bucket (`reduce_bucket_bytes`), into which each gradient is copied as the
    backward makes it."""
    if s.layout == "zero2":
        return reduce_bucket_bytes(s)
    return zero3_working_bytes(s) if s.layout == "zero3" else fsdp2_working_bytes(s)


def reduce_bucket_bytes(s: Spec) -> int:
    """§Activations: DeepSpeed's bucket of gradients being reduced (`reduce_bucket_size`, its default), in their
    dtype; none outside DeepSpeed."""
    return REDUCE_BUCKET_ELEMENTS * dtype_bytes(s.grad_dtype)[1] if s.layout in ("zero2", "zero3") else 0


def zero3_working_bytes(s: Spec) -> int:
    """§Activations: ZeRO-3 gathers each module's parameters for its forward and backward (on one GPU too: into
    memory of their own) and prefetches the next, as FSDP2's root layout does (two layers and the root, one layer's
    and the root's gradients before their reduce), and its reduce bucket (`reduce_bucket_bytes`), which it holds
    in `generate` too (§Phases)."""
    layer, root = unit_params(s.model)
    b_c, b_g = dtype_bytes(s.compute_dtype)[1], dtype_bytes(s.grad_dtype)[1]
    return (2 * layer + root) * b_c + (layer + root) * b_g + reduce_bucket_bytes(s)


def fsdp2_working_bytes(s: Spec) -> int:
    """§Activations: unsharded parameters and gradients before their reduce-scatter, when the trainer shards at all.
    With the root holding the embedding and lm_head: 2 layers + the root, and 1 layer's gradients + the root's. With
    those as units of their own (untied): the largest of the backward's windows, each the unit being worked on and
    the prefetched next one, with the gradients of the first and the reduce-scatter input of the unit before it,
    which FSDP2 keeps until this unit's own reduce-scatter starts."""
    if s.shard_degree == 1:
        return 0
    layer, root = unit_params(s.model)
    b_c, b_g = dtype_bytes(s.compute_dtype)[1], dtype_bytes(s.grad_dtype)[1]
    if s.fsdp_units == "split" and not s.model.tie_word_embeddings:
        end = s.model.vocab_size * s.model.hidden_size
        # Backward order: lm_head, the layers from the last, the embedding (three layers show every window).
        order = [0, end, *[layer] * min(s.model.num_hidden_layers, 3), end, 0]
        return max((cur + following) * b_c + (cur + before) * b_g
                   for before, cur, following in zip(order, order[1:], order[2:]))
    return (2 * layer + root) * b_c + (layer + root) * b_g


def unit_params(m: Preset) -> tuple[int, int]:
    """The parameters of FSDP's units: one decoder layer, and the root (embedding, lm_head unless tied, final norm)."""
    h = m.hidden_size
    return sum(m.layer_parameters().values()), m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + h


def cuda_context_bytes(s: Spec) -> int:
    """§Constants: one CUDA context per process, plus NCCL buffers per communicator this GPU is in."""
    groups = int(s.cluster.gpus > 1) + int(s.tp > 1)
    return s.processes_per_gpu * _CUDA_CONTEXT_BYTES + groups * _NCCL_BYTES_PER_GROUP


def state_bytes_per_param(s: Spec) -> int:
    """§Trainer state: optimizer-state bytes of one parameter (its states, and the fp32 master copy if kept)."""
    # ZeRO steps an fp32 partition of its own in both precise modes: in fp32 too, DeepSpeed 0.19.8 copies the
    # model's (`swaprl.compat.deepspeed.partitions`).
    master = s.master_weights or s.layout in ("zero2", "zero3")
    return STATES_PER_PARAMETER[s.optimizer] * dtype_bytes(s.optimizer_dtype)[1] + (4 if master else 0)


def trainer_state(s: Spec) -> dict[str, int]:
    """§Trainer state: per-GPU shards of parameters, gradients and optimizer states. ZeRO-2 keeps the parameters
    whole on every GPU and partitions the rest. Its gradients in `train`: two partitions, since each backward after
    a step's first reduces into a new one while the previous holds the sum so far."""
    n = s.model.num_parameters()
    b_p, b_g = (dtype_bytes(d)[1] for d in (s.param_dtype, s.grad_dtype))
    zero2 = s.layout == "zero2"
    return {"params": n * b_p if zero2 else -(-n * b_p // s.shard_degree),
            "grads": (2 if zero2 else 1) * -(-n * b_g // s.shard_degree),
            "optimizer": -(-n * state_bytes_per_param(s) // s.shard_degree)}


def largest_state_bytes(s: Spec) -> int:
    """§Phases: the states of the largest parameter (the embedding, or an MLP matrix) on one GPU: FSDP2 shards
    every parameter, and each rank streams its own shard's states. ZeRO-2: its larger partition (`state_sizes`)."""
    if s.layout == "zero2":
        return max(state_sizes(s))
    m = s.model
    return -(-max(m.vocab_size, m.intermediate_size) * m.hidden_size * state_bytes_per_param(s) // s.shard_degree)


SLICED_OPTIMIZERS = ("adam", "adamw", "sgd")
"""§Phases: the optimizers whose streamed step takes a parameter larger than a chunk in pieces
(`swaprl.streaming.SLICEABLE`)."""


def staging_bytes(s: Spec, streamed: int) -> int:
    """§Phases: the streamed states' bytes on one GPU during the optimizer step: two staging chunks (for optimizers
    the step cannot slice, each at least the largest parameter's states); all of them when a single chunk holds
    them; none when nothing streams."""
    chunk = STREAM_CHUNK_BYTES if s.optimizer in SLICED_OPTIMIZERS else max(STREAM_CHUNK_BYTES, largest_state_bytes(s))
    return streamed if chunk >= streamed else 2 * chunk


def parameter_elements(m: Preset) -> list[int]:
    """§Split: the elements of each parameter in the order a transformers causal LM's `model.parameters()` gives
    them, the optimizer's: the embedding; per layer q, k, v and o (each weight, then its bias), the q/k norms, the
    MLP's gate, up and down (Phi-3: o, the fused qkv and gate_up, down), the layer's norms; the final norm; the
    lm_head unless tied."""
    part, h, i = m.layer_parameters(), m.hidden_size, m.intermediate_size

    def with_bias(whole: int, weight: int) -> list[int]:
        return [weight] + ([whole - weight] if whole > weight else [])

    if m.model_type == "phi3":  # Phi3Attention registers o_proj before its fused qkv_proj; no biases
        layer = [part["o"], part["q"] + part["k"] + part["v"], 2 * h * i, i * h]
    else:
        layer = [*with_bias(part["q"], h * m.q_dim), *with_bias(part["k"], h * m.kv_dim),
                 *with_bias(part["v"], h * m.kv_dim), *with_bias(part["o"], m.q_dim * h)]
        layer += [part["qk_norm"] // 2] * 2 if part["qk_norm"] else []
        mlp_bias = part["mlp"] > 3 * h * i  # gate and up biases of i, down's of h
        layer += [*with_bias(h * i + i * mlp_bias, h * i), *with_bias(h * i + i * mlp_bias, h * i),
                  *with_bias(i * h + h * mlp_bias, i * h)]
    layer += [h] * (part["norms"] // h)
    embed = m.vocab_size * h
    return [embed, *layer * m.num_hidden_layers, h] + ([] if m.tie_word_embeddings else [embed])


def parameter_groups(m: Preset) -> tuple[list[int], list[int]]:
    """§Split: the elements of each parameter (`parameter_elements`) in transformers' two optimizer groups: the
    weights it decays, then the biases and norms it does not."""
    params = parameter_elements(m)
    # The no-decay group holds the 1-D parameters (biases, norms), none longer than the widest dimension; every
    # matrix, the embedding included, is longer (hidden_size times a dimension) and decays.
    widest = max(m.hidden_size, m.q_dim, m.kv_dim, m.intermediate_size)
    return [n for n in params if n > widest], [n for n in params if n <= widest]


def zero2_partitions(s: Spec) -> list[int]:
    """§Split: the elements of one rank's ZeRO-2 fp32 partitions, one per optimizer parameter group (DeepSpeed's
    `single_partition_of_fp32_groups`): each group's parameters flattened and split evenly over the ranks."""
    return [-(-sum(group) // s.shard_degree) for group in parameter_groups(s.model)]


def zero3_sub_groups(s: Spec) -> list[int]:
    """§Split: the elements of one rank's ZeRO-3 sub-groups, in the order its fp32 partitions are listed: per
    optimizer parameter group (transformers' two: the weights it decays, then the biases and norms it does not),
    each parameter's partition (its elements over the ranks, rounded up) added to the sub-group until that reaches
    `ZERO3_SUB_GROUP_ELEMENTS` (DeepSpeed's `_create_fp16_sub_groups`)."""
    shard = s.shard_degree
    out = []
    for group in parameter_groups(s.model):
        held = 0
        for i, n in enumerate(group):
            held += -(-n // shard)
            if held >= ZERO3_SUB_GROUP_ELEMENTS or i == len(group) - 1:
                out.append(held)
                held = 0
    return out


def state_sizes(s: Spec) -> list[int]:
    """§Split: the optimizer-state bytes on one GPU (masters included) of each unit the homes place, in the
    optimizer's order. FSDP2: each parameter, every rank an equal share of it, counted here to the byte so that they
    add up to the states of §Trainer state exactly. ZeRO-3: each sub-group of the rank's partitions
    (`zero3_sub_groups`)."""
    per, shard = state_bytes_per_param(s), s.shard_degree
    if s.layout == "zero3":
        return [n * per for n in zero3_sub_groups(s)]
    if s.layout == "zero2":
        return [n * per for n in zero2_partitions(s)]
    out, elements, held = [], 0, 0
    for n in parameter_elements(s.model):
        elements += n
        upto = -(-elements * per // shard)
        out.append(upto - held)
        held = upto
    return out


def home_bytes(s: Spec, split: Mapping[str, float]) -> dict[str, int]:
    """§Split: the optimizer states of one GPU by home, as the runtime homes a split: whole parameters, each in the
    home its middle byte falls in (`homes.by_fractions`)."""
    sizes = state_sizes(s)
    return totals(sizes, by_fractions(sizes, split))


def engine_weight_bytes(s: Spec) -> int:
    return engine_params_per_rank(s.model, s.tp) * dtype_bytes(s.engine_dtype)[1]


def budgets(s: Spec) -> dict[str, int]:
    """§Phases, §Host, §KV cache: what each check allows, and the KV cache `generate` must keep at least."""
    seq_tokens = -(-s.rollout.sequence_tokens // _KV_BLOCK_TOKENS) * _KV_BLOCK_TOKENS
    return {"train": int(s.cluster.gpu_memory_bytes * s.gpu_utilization_cap),
            # a self-sized VLLMEngine fills the GPU up to its reserve, whatever the cap says
            "generate": s.cluster.gpu_memory_bytes - s.engine_reserve_bytes,
            "host": s.cluster.host_memory_bytes - s.host_margin_bytes,
            "one_sequence": kv_bytes_per_token(s.model, s.tp, dtype_bytes(s.kv_dtype)[1]) * seq_tokens}


def phase_bytes(s: Spec, st: Settings) -> dict[str, dict[str, int]]:
    """§Phases, §Host: both phases' bytes under `st` on one GPU and one node's host, but for the optimizer states
    and the KV cache (0 here): they are what the split and the engine share out."""
    state = trainer_state(s)
    engine_weights = engine_weight_bytes(s)
    graphs = _CUDA_GRAPH_BYTES if s.cuda_graphs else 0
    ctx = cuda_context_bytes(s)
    zero = dict.fromkeys(CATEGORIES, 0)
    gpn = s.cluster.gpus_per_node
    # kept for a generation inside an accumulation window: ZeRO-2's one partition of the window's sum
    between_steps = state["grads"] // 2 if s.layout == "zero2" else state["grads"]
    held = reduce_bucket_bytes(s) if s.layout == "zero3" else 0  # ZeRO-3's reduce bucket, made once
    return {
        "train": {**zero, "params": state["params"], "grads": state["grads"],
                  "engine_other": _ENGINE_POOLED_RESIDENT_BYTES if s.release_other else _ENGINE_RESIDENT_BYTES + graphs,
                  "activations": train_activation_bytes(s, st.activation_checkpointing), "cuda_context": ctx},
        # ZeRO-3: the bf16 partitions stay; the gradient buffer is released unless kept (`gradients_released`)
        "generate": {**zero, "params": state["params"] if st.params == "keep" else 0,
                     "grads": (between_steps if st.grads == "keep" else 0) + held, "engine_weights": engine_weights,
                     "engine_other": _ENGINE_RESIDENT_BYTES + graphs + engine_profile_peak(s),
                     "cuda_context": ctx},
        "host_train": {**dict.fromkeys(HOST_CATEGORIES, 0),
                       "engine_weights": engine_weights * gpn if st.sleep_level == 1 else 0},
        "host_generate": {**dict.fromkeys(HOST_CATEGORIES, 0),
                          "grads": state["grads"] * gpn if st.grads == "offload" else 0,
                          "params": state["params"] * gpn if st.params == "offload" else 0},
    }


def pinned_bytes(phases: dict[str, dict[str, int]]) -> int:
    """§Host: one buffer per category, allocated once and kept: the larger phase's bytes of each."""
    return sum(max(phases["host_train"][c], phases["host_generate"][c]) for c in HOST_CATEGORIES)


def sequences_per_engine(s: Spec) -> int:
    """§KV cache: each of the `gpus / tp` engines gets an equal share of the step's rollout, rounded up."""
    return -(-s.rollout.sequences // (s.cluster.gpus // s.tp))


def wave_kv_bytes(s: Spec, one_sequence: int) -> int:
    """§Split: the KV cache of one full wave of the rollout on one engine (every sequence it runs at once, at full
    length), with `KV_WAVE_HEADROOM`: what a larger KV cache leaves unused."""
    return int(min(sequences_per_engine(s), s.engine_max_seqs) * one_sequence * KV_WAVE_HEADROOM)


def generate_room(s: Spec, phases: dict[str, dict[str, int]]) -> int:
    """§Split: what `generate` leaves the optimizer states and the KV cache on one GPU, by the runtime's one room
    formula (`homes.Room.for_new`), with the GPU's free memory predicted and the engine's reserve kept."""
    held = sum(v for c, v in phases["generate"].items() if c not in ("optimizer", "kv_cache"))
    return Room(free=s.cluster.gpu_memory_bytes - held, reserve=s.engine_reserve_bytes).for_new()


def split_capacity(s: Spec, st: Settings, sizes: list[int]) -> Capacity:
    """§Split: the room of the homes under `st`, for `homes.decide`. "device": what the host cannot hold (to the
    end of the parameter it falls in) or what `generate` holds beside a full wave of the rollout's KV cache,
    whichever is more, but never so much that less than one sequence of KV cache is left. "resident" (the device
    and swap homes in `train`): what `train` leaves, less the staging chunks when any state streams."""
    phases, budget = phase_bytes(s, st), budgets(s)
    total = sum(sizes)
    host_room = (budget["host"] - pinned_bytes(phases)) // s.cluster.gpus_per_node
    need, host_edge = total - host_room, 0
    for size in sizes if need > 0 else ():
        host_edge += size
        if host_edge >= need:
            break
    room = generate_room(s, phases)
    # a swapped byte crosses the link twice a step; KV cache beyond a full wave carries no sequence
    device = min(max(host_edge, room - wave_kv_bytes(s, budget["one_sequence"])), room - budget["one_sequence"])
    train_room = budget["train"] - sum(phases["train"].values())
    resident = train_room if total <= train_room else train_room - staging_bytes(s, total)
    if s.layout == "zero2":
        # its step cannot stream (its views of the partitions would keep their device memory): no host home, and
        # what does not fit in train overflows it
        resident = total
    return Capacity(device=device, resident=resident)


def choose_split(s: Spec, st: Settings) -> dict[str, float]:
    """§Split: the homes `homes.decide` gives the parameters in the room `split_capacity` predicts, as the fraction
    of the states' bytes each holds (exact: `homes.by_fractions` gives the runtime the same homes back)."""
    sizes = state_sizes(s)
    held = totals(sizes, decide(sizes, split_capacity(s, st, sizes)))
    total = sum(held.values())
    return {home: n / total for home, n in held.items()}


def copies(s: Spec, st: Settings, homes: dict[str, int]) -> tuple[int, float]:
    """§Copies: bytes one GPU copies to and from host per step under `st`, and their time at the cluster's rate
    (the switches' copies one direction at a time, the streamed step's both ways at once)."""
    state = trainer_state(s)
    switches = 2 * (homes["swap"] + (state["grads"] if st.grads == "offload" else 0)
                    + (state["params"] if st.params == "offload" else 0)
                    + (engine_weight_bytes(s) if st.sleep_level == 1 else 0))
    rate = s.cluster.copy_bytes_per_s
    return switches + 2 * homes["host"], switches / rate + homes["host"] / rate



def step_cost(s: Spec, st: Settings, homes: dict[str, int], waves: int) -> dict[str, float]:
    """§Cost: the predicted seconds of the parts of a step that differ between the plans `--tp auto` and
    `--precision auto` compare, to rank them (not a step time): the rollout's decode, each step reading one engine
    rank's weights and its running sequences' KV cache at the GPU's memory bandwidth; the PCIe copies (`copies`);
    the weight sync, one copy of the rank's engine weights on the device."""
    r, bandwidth = s.rollout, s.cluster.memory_bandwidth_bytes_per_s
    weights = engine_weight_bytes(s)
    kv_token = kv_bytes_per_token(s.model, s.tp, dtype_bytes(s.kv_dtype)[1])
    # each completion token's step reads the weights once per wave, and the KV cache of the wave's sequences at
    # their length then: over a completion, the prompt and half the completion on average
    kv_read = sequences_per_engine(s) * kv_token * (r.prompt_tokens + r.completion_tokens / 2)
    decode = r.completion_tokens * (waves * weights + kv_read) / bandwidth
    terms = {"decode_s": decode, "copies_s": copies(s, st, homes)[1], "sync_s": 2 * weights / bandwidth}
    return {**terms, "total_s": sum(terms.values())}
