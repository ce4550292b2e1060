"""The search: every point of the swap settings evaluated with the formulas, the first that fits chosen, and the
changes that would make a miss fit; `plan()` builds the validated inputs and answers a `Plan`."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Callable

from ..config import PARAM_POLICIES, default_reserve_bytes
from ..presets import Preset
from .formulas import (
    budgets,
    choose_split,
    copies,
    home_bytes,
    kv_bytes_per_token,
    largest_state_bytes,
    phase_bytes,
    pinned_bytes,
    sequences_per_engine,
    staging_bytes,
    state_bytes_per_param,
    step_cost,
)
from .hardware import CLUSTERS, Cluster, GiB, get_cluster, gib
from .inputs import CHECKPOINTING, GRADS, SLEEP_LEVELS, Rollout, Settings, Spec, divisors
from .model import dtype_bytes, load_model
from .result import Candidate, Plan, describe_cost, describe_precision

_HOST_MARGIN_FRACTION = 0.10  # of host memory kept for the OS, page cache and data
_HOST_MARGIN_PER_GPU = 6 * GiB  # resident memory of one GPU process (torch, CUDA libraries, vLLM, tokenizer)
_SUGGESTIONS = 6  # changes listed at most


def _evaluate(s: Spec, st: Settings) -> dict:
    """Both phases' bytes under one setting, and whether each check passes (§Phases, §Host, §KV cache)."""
    phases, budget = phase_bytes(s, st), budgets(s)
    train, generate = phases["train"], phases["generate"]
    homes = home_bytes(s, st.optimizer_states)
    train["optimizer"] = homes["device"] + homes["swap"] + staging_bytes(s, homes["host"])
    generate["optimizer"] = homes["device"]
    gpn = s.cluster.gpus_per_node
    phases["host_generate"]["optimizer"] = (homes["swap"] + homes["host"]) * gpn
    phases["host_train"]["optimizer"] = homes["host"] * gpn
    kv_room = budget["generate"] - sum(generate.values())
    generate["kv_cache"] = max(kv_room, 0)
    kv_token = kv_bytes_per_token(s.model, s.tp, dtype_bytes(s.kv_dtype)[1])
    one_seq = budget["one_sequence"]
    concurrent = max(kv_room, 0) // one_seq
    pinned = pinned_bytes(phases)
    moved, seconds = copies(s, st, homes)
    overflow = {"train": max(sum(train.values()) - budget["train"], 0),
                "generate": max(one_seq - kv_room, 0),
                "host": max(pinned - budget["host"], 0)}
    fits = {k: v == 0 for k, v in overflow.items()}
    problems = []
    if not fits["train"]:
        problems.append(f"train needs {gib(sum(train.values()))} of {gib(budget['train'])} GiB "
                        f"(over by {gib(overflow['train'])})")
    if not fits["generate"]:
        if kv_room < 0:
            problems.append(f"generate needs {gib(budget['generate'] - kv_room)} of {gib(budget['generate'])} GiB "
                            f"before any KV cache (over by {gib(overflow['generate'])} with one sequence)")
        else:
            problems.append(f"generate leaves {gib(kv_room)} GiB for KV, less than one sequence "
                            f"({gib(one_seq)} GiB; over by {gib(overflow['generate'])})")
    if not fits["host"]:
        problems.append(f"host needs {gib(pinned)} of {gib(budget['host'])} GiB pinned per node "
                        f"(over by {gib(overflow['host'])})")
    verdict = "fits" if not problems else "; ".join(problems)
    return {"gpu": {"train": train, "generate": generate},
            "host": {"train": phases["host_train"], "generate": phases["host_generate"]},
            "pinned": pinned, "budget": {"train": budget["train"], "generate": budget["generate"]},
            "host_budget": budget["host"], "kv_room": max(kv_room, 0), "kv_token": kv_token,
            "concurrent": concurrent, "homes": homes, "moved": moved, "seconds": seconds, "fits": fits,
            "overflow": overflow, "verdict": verdict}


def _candidates(s: Spec) -> list[Settings]:
    """§Search: every allowed point, each with the split `choose_split` gives it unless the split is pinned."""
    pinned = dict(s.pinned)
    # ZeRO-3: its gradient buffer is released or kept, never offloaded; ZeRO-2 holds no gradients between steps.
    # Both keep their bf16 parameters on the GPU (§Phases).
    grads = {"zero2": ("free",), "zero3": tuple(g for g in GRADS if g != "offload")}.get(s.layout, GRADS)
    axes = {"grads": grads, "params": PARAM_POLICIES if s.layout == "fsdp2" else ("keep",), "sleep_level": SLEEP_LEVELS,
            "activation_checkpointing": CHECKPOINTING}
    values = [(pinned[k],) if k in pinned else v for k, v in axes.items()]
    points = [Settings(grads=g, params=p, sleep_level=lvl, activation_checkpointing=ac)
              for g, p, lvl, ac in itertools.product(*values)]
    return [dataclasses.replace(st, optimizer_states=pinned.get("optimizer_states") or choose_split(s, st))
            for st in points]


def _search(s: Spec) -> tuple[Settings | None, Settings, dict, list[Candidate]]:
    """§Search: the candidates in order (streaming nothing first, then by bytes moved, then per axis, least moving
    first); the first that fits, or None and the closest miss."""
    results = []
    for st in _candidates(s):
        ev = _evaluate(s, st)
        results.append((st, ev, Candidate(settings=st, moved_bytes=ev["moved"], fits=ev["fits"],
                                          overflow_bytes=ev["overflow"], verdict=ev["verdict"])))

    # The homes end at parameters' edges: traffic that differs by less than the largest parameter's states out and
    # back is where an edge fell, not a difference between the settings, which the axes' order then decides.
    grain = 2 * largest_state_bytes(s)

    def key(result: tuple) -> tuple:
        st, ev, _ = result
        return (st.optimizer_states["host"] > 0, round(ev["moved"] / grain),
                CHECKPOINTING.index(st.activation_checkpointing),
                GRADS.index(st.grads), PARAM_POLICIES.index(st.params), SLEEP_LEVELS.index(st.sleep_level))

    results.sort(key=key)
    candidates = [c for *_, c in results]
    chosen = next(((st, ev) for st, ev, _ in results if all(ev["fits"].values())), None)
    if chosen is None:
        st, ev, _ = min(results, key=lambda r: sum(r[1]["overflow"].values()))
        return None, st, ev, candidates
    return chosen[0], chosen[0], chosen[1], candidates


def _suggestions(s: Spec) -> list[str]:
    """§Search: single changes of the inputs under which some setting fits, else pairs of them."""
    c, r = s.cluster, s.rollout
    alternatives: list[tuple[str, dict]] = []
    for tp in divisors(c.gpus_per_node):
        if tp > s.tp:
            alternatives.append((f"tp={tp}", {"tp": tp}))
    shard = s.shard_degree * 2 if s.shard_degree == c.gpus else s.shard_degree
    alternatives.append((f"nodes={c.nodes * 2} (shard_degree={shard})",
                         {"cluster": dataclasses.replace(c, nodes=c.nodes * 2), "shard_degree": shard}))
    if s.shard_degree < c.gpus:
        for d in divisors(c.gpus):
            if d > s.shard_degree:
                alternatives.append((f"shard_degree={d}", {"shard_degree": d}))
    if dtype_bytes(s.optimizer_dtype)[1] > 2:
        alternatives.append(("optimizer_dtype='bfloat16'", {"optimizer_dtype": "bfloat16"}))
    fp32 = {"param_dtype": "float32", "grad_dtype": "float32"}
    low = {"param_dtype": "bfloat16", "grad_dtype": "bfloat16"}
    if s.master_weights:  # the other precise mode, then none
        alternatives += [("precision='fp32-params'", {"master_weights": False, **fp32}),
                         ("precision='bf16' (no fp32 copy)", {"master_weights": False})]
    elif dtype_bytes(s.param_dtype)[1] >= 4:
        alternatives += [("precision='master-weights'", {"master_weights": True, **low}),
                         ("precision='bf16' (no fp32 copy)", low)]
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
    nothing = ("no change tried (more TP, more nodes or shard degree, bf16 optimizer states, another precision, fp8 "
               "KV, a smaller micro batch, half the completions; alone or two together) is enough; use a bigger "
               "cluster")
    return out[:_SUGGESTIONS] or [nothing]


def plan(model: str | os.PathLike | Preset, *, cluster: Cluster | str, rollout: Rollout,
         shard_degree: int | None = None, fsdp_units: str = "root", layout: str = "fsdp2", tp: int | str = "auto",
         precision: str = "auto", param_dtype: str | None = None,
         grad_dtype: str | None = None,
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
    fsdp_units: "root" (the default: decoder layers, and one root unit holding the embedding and lm_head, as
        accelerate's FSDP2 wraps TRL's model) or "split" (the embedding and an untied lm_head as units of their own:
        `swaprl.distributed.shard_causal_lm`, the examples'); it sets the unsharded working set (§Activations).
    layout: "fsdp2" (the default: FSDP2 over `shard_degree` GPUs, or one unsharded GPU) or "zero3" (DeepSpeed
        ZeRO-3 over every GPU, wrapped by `swaprl.integrations.trl`: fp32 partitions in both precise modes, homed a
        sub-group at a time, its gradient buffer released for 'generate'; §Trainer state).
    tp: vLLM tensor-parallel size (inside one node), or "auto" (the default): of the sizes the node and the model
        allow, the one that fits with the lowest predicted step cost (§Cost); `inputs["tp_auto"]` says
        what each size gave (§Search).
    precision: how the trainer keeps its weights in fp32 (§Trainer state). "auto" (the default): of the precise modes,
        "master-weights" (bf16 parameters, an fp32 master copy of each with its states) and "fp32-params" (fp32
        parameter shards and gradients under bf16 compute), the one that fits with the lowest predicted step cost
        (§Cost); `inputs["precision_auto"]` says what each gave. "bf16": parameters below fp32 updated in place, no
        fp32 copy (updates below their resolution are lost). `master_weights=True` or a `param_dtype` pin the mode
        they name (fp32: "fp32-params"; below fp32 without masters: "bf16").
    param_dtype, grad_dtype (default: param_dtype), optimizer_dtype: dtypes of the trainer's parameter shards
        (default: as `precision` says, bfloat16 but for "fp32-params"), gradients and optimizer states;
        master_weights adds an fp32 copy of low-precision parameters.
    optimizer: "adamw"/"adam" (2 states per parameter), "sgd" (momentum) or "lion" (1 state).
    compute_dtype: dtype of activations and of FSDP's unsharded parameters.
    engine_dtype, kv_dtype (default: engine_dtype): vLLM's weights and KV cache.
    micro_batch_tokens: tokens in one forward/backward of the trainer (default: one sequence, prompt+completion).
    engine_max_batched_tokens, engine_max_seqs: vLLM's max_num_batched_tokens and max_num_seqs (its defaults on
        GPUs of 70 GiB or more); they size the engine's profile run. cuda_graphs: False for enforce_eager.
    release_other: the engine releases its graphs and buffers while it sleeps (VLLMEngine's `release_other`,
        swaprl.vmm): `train` then counts only what its pools cannot release.
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
    modes = _precisions(precision, None if param_dtype is None else dtype_bytes(param_dtype), bool(master_weights))
    low = "bfloat16" if param_dtype is None or dtype_bytes(param_dtype)[1] >= 4 else dtype_bytes(param_dtype)[0]
    engine_dtype = dtype_bytes(engine_dtype)[0]
    settings = dict(settings or {})
    unknown = set(settings) - {"optimizer", "optimizer_states", "grads", "params", "sleep_level",
                               "activation_checkpointing"}
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; pin any of optimizer_states, grads, params, "
                         "sleep_level, activation_checkpointing")
    if settings.pop("optimizer", "offload") != "offload":
        raise ValueError("settings['optimizer'] can only be 'offload'; pin where the optimizer states live with "
                         "settings['optimizer_states'] ('swap', 'host' or a split with 'device')")
    pinned = Settings(**settings)  # validates the pinned values
    if "optimizer_states" in settings:
        settings["optimizer_states"] = pinned.optimizer_states  # the fractions of every home
    if not isinstance(processes_per_gpu, int) or processes_per_gpu not in (1, 2):
        raise ValueError(f"processes_per_gpu={processes_per_gpu!r}; use 1 (the engine inside the trainer's process) "
                         "or 2 (an engine process beside each trainer process)")
    # Numbers at all, before the int() and float() below would overflow on an infinity or fail unnamed on NaN; the
    # ranges are Spec's to check.
    for name, value in (("engine_reserve_bytes", engine_reserve_bytes), ("host_margin_bytes", host_margin_bytes),
                        ("gpu_utilization_cap", gpu_utilization_cap)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value)):
            raise ValueError(f"{name}={value!r}; give a finite number ({name.replace('_', ' ')})")
    if host_margin_bytes is None:
        host_margin_bytes = int(cluster.host_memory_bytes * _HOST_MARGIN_FRACTION
                                + cluster.gpus_per_node * processes_per_gpu * _HOST_MARGIN_PER_GPU)
        host_margin_bytes = min(host_margin_bytes, cluster.host_memory_bytes - 1)
    fields = dict(model=spec_model, cluster=cluster, rollout=rollout,
              shard_degree=cluster.gpus if shard_degree is None else shard_degree, fsdp_units=fsdp_units,
              layout=layout,
              optimizer_dtype=dtype_bytes(optimizer_dtype)[0], optimizer=str(optimizer).lower(),
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

    def of(mode: str) -> dict:  # the inputs of one precision mode
        weights = "float32" if mode == "fp32-params" else low
        return {**fields, "param_dtype": weights, "grad_dtype": dtype_bytes(grad_dtype or weights)[0],
                "master_weights": mode == "master-weights"}

    def build(mode: str, *, suggest: bool) -> Plan:
        if tp != "auto":
            return _build(Spec(tp=tp, **of(mode)), suggest=suggest)
        return _auto_tp(of(mode), suggest=suggest)

    if len(modes) == 1:
        result = build(modes[0], suggest=True)
        result.precision = result.inputs["precision"] = modes[0]
        return result
    return _auto_precision({mode: build(mode, suggest=False) for mode in modes},
                           lambda mode, tp_size: _suggestions(Spec(tp=tp_size, **of(mode))))


PRECISIONS = ("auto", "master-weights", "fp32-params", "bf16")
"""§Trainer state: `plan(precision=...)`, `--precision`. The precise modes keep every weight's update in fp32."""
PRECISE = ("fp32-params", "master-weights")  # compared by "auto", in this order at equal cost
_COST_TERMS = {"decode_s": "rollout's decode", "copies_s": "PCIe copies", "sync_s": "weight sync"}  # §Cost


def _precisions(precision: str, param_dtype: tuple[str, int] | None, master_weights: bool) -> tuple[str, ...]:
    """The precision modes to plan: the one asked for, the one `master_weights` or `param_dtype` names, or both
    precise modes; a ValueError naming the fix where they disagree."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; use one of {', '.join(PRECISIONS)} ('auto': the precise mode, "
                         "master-weights or fp32-params, with the lowest predicted step cost)")
    fp32 = param_dtype is not None and param_dtype[1] >= 4
    if master_weights and fp32:
        raise ValueError("master_weights=True keeps an fp32 copy of low-precision parameters, but param_dtype is "
                         f"already {param_dtype[0]}; drop master_weights (precision='fp32-params') or use "
                         "param_dtype='bfloat16'")
    named = ("master-weights" if master_weights else None if param_dtype is None else
             "fp32-params" if fp32 else "bf16")
    if precision == "auto":
        return (named,) if named else PRECISE
    # bf16 parameters (given or not) are what master-weights keeps beside its fp32 copies
    agrees = named in (None, precision) or (precision == "master-weights" and named == "bf16")
    if not agrees:
        asked = "master_weights=True" if master_weights else f"param_dtype={param_dtype[0]!r}"
        raise ValueError(f"precision={precision!r} but {asked} asks for {named!r}; drop one of them, or give "
                         f"precision={named!r}")
    return (precision,)


def _auto_precision(plans: dict[str, Plan], suggest: Callable[[str, int], list[str]]) -> Plan:
    """§Trainer state: of the precise modes' plans, the one that fits with the lowest predicted step cost (§Cost),
    or, when none fits, the closest miss with the changes that would make it fit (`suggest(mode, tp)`); say what
    each gave."""
    def summary(mode: str) -> str:
        p = plans[mode]
        if not p.ok:  # the verdict's checks that fail, without the closest candidate's settings
            return f"{mode} does not fit ({p.verdict.split(': ', 2)[-1]})"
        return (f"{mode} fits at tp={p.inputs['tp']}, {p.kv_cache_bytes / GiB:.1f} GiB of KV per GPU, "
                f"{p.step_cost['total_s']:.2f} s")

    fitting = [mode for mode in plans if plans[mode].ok]
    if fitting:
        chosen = min(fitting, key=lambda mode: (plans[mode].step_cost["total_s"], PRECISE.index(mode)))
        why = f"{chosen} ({describe_precision(plans[chosen].inputs)}): "
        other = next((mode for mode in fitting if mode != chosen), None)
        mine = plans[chosen].step_cost
        theirs = plans[other].step_cost if other else None
        if theirs is None:
            why += "the only precise mode that fits"
        elif mine["total_s"] == theirs["total_s"]:
            why += (f"the precise modes that fit have the same predicted step cost, {mine['total_s']:.2f} s, and "
                    f"{chosen} comes first at equal cost")
        else:  # the term that sets them apart the most
            term = max(_COST_TERMS, key=lambda k: theirs[k] - mine[k])
            why += (f"of the precise modes that fit, the lowest predicted step cost, {mine['total_s']:.2f} s against "
                    f"{theirs['total_s']:.2f} s for {other}, mostly in the {_COST_TERMS[term]} ({mine[term]:.2f} s "
                    f"against {theirs[term]:.2f} s)")
    else:
        chosen = min(plans, key=lambda mode: sum(next(c.overflow_bytes for c in plans[mode].candidates
                                                      if c.settings == plans[mode].shown).values()))
        why = (f"{chosen} ({describe_precision(plans[chosen].inputs)}): no precise mode fits, this one misses by "
               "the least")
        plans[chosen].suggestions = suggest(chosen, plans[chosen].inputs["tp"])
    result = plans[chosen]
    result.precision = result.inputs["precision"] = chosen
    result.inputs["precision_auto"] = {"chosen": chosen, "why": why,
                                       "tried": {mode: summary(mode) for mode in plans}}
    return result


def _auto_tp(fields: dict, *, suggest: bool = True) -> Plan:
    """§Search: plan every tensor-parallel size the node and the model allow; keep the one that fits with the lowest
    predicted step cost (§Cost; the smaller size at equal cost), or, when none fits, the closest miss; say what each
    gave."""
    plans, tried = {}, {}
    Spec(tp=1, **fields)  # what is wrong whatever the size (one rank always splits the heads): said as it is
    for tp in divisors(fields["cluster"].gpus_per_node):
        try:
            spec = Spec(tp=tp, **fields)
        except ValueError as exc:  # heads or KV heads that do not split over tp ranks
            tried[tp] = f"not allowed: {exc}"
            continue
        plans[tp] = _build(spec, suggest=False)
        p = plans[tp]
        tried[tp] = (f"fits, {p.kv_cache_bytes / GiB:.1f} GiB of KV per GPU, "
                     f"{'one wave' if p.waves == 1 else f'{p.waves} waves'}, {p.step_cost['total_s']:.2f} s"
                     if p.ok else "does not fit")
    if not plans:
        raise ValueError(f"no tensor-parallel size fits the model on {fields['cluster'].gpus_per_node} GPUs a node: "
                         + "; ".join(f"tp={t}: {why}" for t, why in tried.items()))
    fitting = [t for t, p in plans.items() if p.ok]
    if fitting:
        chosen = min(fitting, key=lambda t: (plans[t].step_cost["total_s"], t))
        why = (f"tp={chosen}: of the sizes that fit, the lowest predicted step cost, "
               f"{describe_cost(plans[chosen].step_cost)}")
        result = _build(Spec(tp=chosen, **fields), suggest=suggest)  # with the fp32 line of the chosen size
    else:
        chosen = min(plans, key=lambda t: sum(next(c.overflow_bytes for c in plans[t].candidates
                                                   if c.settings == plans[t].shown).values()))
        why = f"tp={chosen}: no size fits, this one misses by the least"
        result = _build(Spec(tp=chosen, **fields), suggest=suggest)  # with the changes that would make it fit
    result.inputs["tp_auto"] = {"chosen": chosen, "why": why, "tried": {str(t): v for t, v in tried.items()}}
    return result


def _waves(s: Spec, concurrent: int) -> tuple[int, int | None]:
    """§KV cache: sequences per engine at once (vLLM's max_num_seqs caps them), and the rounds of generation one
    engine needs for its share of the rollout (None when no sequence fits)."""
    per_engine = sequences_per_engine(s)
    per_wave = min(concurrent, s.engine_max_seqs)
    return per_wave, (-(-per_engine // per_wave) if per_wave else None)


def _fit_summary(s: Spec, chosen: Settings, ev: dict) -> str:
    """What a fitting plan gives: the KV cache, the rollout's waves and the bytes moved per step."""
    per_wave, waves = _waves(s, ev["concurrent"])
    rollout = "the rollout runs in one wave" if waves == 1 else (
        f"the rollout needs {waves} waves of at most {per_wave} sequences per engine")
    return (f"fits with {chosen.label()}; {gib(ev['kv_room'])} GiB of KV cache per GPU, {rollout}; "
            f"{gib(ev['moved'])} GiB per GPU over PCIe per step, {ev['seconds']:.2f} s at "
            f"{s.cluster.copy_bytes_per_s / 1e9:.0f} GB/s")


def _full_precision(s: Spec) -> str | None:
    """§Trainer state: the verdict of the same step with fp32 parameters (param_dtype = grad_dtype = float32 under
    bf16 compute, `--param-dtype float32`; not `--master-weights`, which keeps bf16 parameters and an fp32 copy with
    the states), when the trainer's parameters are below fp32 and it keeps no master copy."""
    if dtype_bytes(s.param_dtype)[1] >= 4 or s.master_weights:
        return None
    alt = dataclasses.replace(s, param_dtype="float32", grad_dtype="float32")
    chosen, shown, ev, _ = _search(alt)
    head = (f"param_dtype=float32 ({8 + state_bytes_per_param(alt)} B per parameter with the states, "
            f"{s.compute_dtype} compute)")
    if chosen is None:
        return f"{head} fits nothing; closest: {shown.describe()}: {ev['verdict']}"
    return f"{head} {_fit_summary(alt, chosen, ev)}"


def _build(s: Spec, *, suggest: bool = True) -> Plan:
    chosen, shown, ev, candidates = _search(s)
    engines = s.cluster.gpus // s.tp
    per_engine = sequences_per_engine(s)
    waves = _waves(s, ev["concurrent"])[1]
    if chosen is not None:
        verdict = _fit_summary(s, chosen, ev)
        suggestions = []
        cost = step_cost(s, chosen, ev["homes"], waves)
    else:
        verdict = f"nothing fits; closest: {shown.describe()}: {ev['verdict']}"
        suggestions = _suggestions(s) if suggest else []
        cost = None
    m = s.model
    inputs = {
        "cluster": dataclasses.asdict(s.cluster), "rollout": dataclasses.asdict(s.rollout),
        "max_position_embeddings": m.max_position_embeddings,
        "shard_degree": s.shard_degree, "fsdp_units": s.fsdp_units, "layout": s.layout, "tp": s.tp,
        "engines": engines,
        "param_dtype": s.param_dtype,
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
                full_precision=_full_precision(s) if suggest else None, step_cost=cost)

