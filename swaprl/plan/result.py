"""What the planner answers: the verdict on each candidate, and the plan (its tables, its JSON)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ..config import STATE_HOMES
from .formulas import CATEGORIES, HOST_CATEGORIES, PHASES
from .hardware import gib
from .inputs import Settings

_TABLE_CANDIDATES = 6  # candidates a table lists when none fits (JSON has all)


def describe_cost(cost: dict[str, float]) -> str:
    """A step cost's terms in words (§Cost)."""
    return (f"{cost['total_s']:.2f} s = rollout decode {cost['decode_s']:.2f} s + PCIe copies "
            f"{cost['copies_s']:.2f} s + weight sync {cost['sync_s']:.2f} s")


def describe_precision(inputs: dict) -> str:
    """How the trainer keeps its weights, in words (§Trainer state)."""
    if inputs["master_weights"]:
        return f"{inputs['param_dtype']} parameters, an fp32 master copy of each kept with its states"
    if inputs["param_dtype"] == "float32":
        return f"fp32 parameter shards and {inputs['grad_dtype']} gradients, {inputs['compute_dtype']} compute"
    return f"{inputs['param_dtype']} parameters updated in place, no fp32 copy"


def _trainer(inputs: dict) -> str:
    """How the trainer is spread, in words: DeepSpeed's stage over its GPUs, or FSDP2's shard degree and units."""
    layout, shard = inputs.get("layout", "fsdp2"), inputs["shard_degree"]
    if layout != "fsdp2":
        return f"DeepSpeed ZeRO-{layout[-1]} over {shard} GPUs"
    return f"shard degree {shard}" + (f" ({inputs.get('fsdp_units', 'root')} units)" if shard > 1 else "")


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
    """The verdict of the same step with fp32 parameters (fp32 parameters and gradients, FSDP2's
    MixedPrecisionPolicy computing in bf16: 16 bytes per parameter with AdamW), when the precision is "bf16" (the
    trainer's parameters below fp32, no master copy); None otherwise (§Trainer state)."""
    step_cost: dict[str, float] | None = None
    """The predicted seconds that rank this plan against the other sizes and precisions (§Cost): "decode_s" (the
    rollout's decode at the GPU's memory bandwidth), "copies_s" (`copy_seconds`), "sync_s" (the weight sync on the
    device) and their "total_s"; None when nothing fits. A ranking, not a step time."""
    precision: str | None = None
    """How the trainer keeps its weights (§Trainer state): "master-weights", "fp32-params" or "bf16" (in
    `inputs["precision"]` too; `inputs["precision_auto"]` says why, when `precision="auto"` chose it)."""

    @property
    def ok(self) -> bool:
        return self.settings is not None

    def swap_config(self) -> dict:
        """The keyword arguments of `swaprl.SwapConfig` for the chosen settings (`Settings.swap_config`)."""
        if self.settings is None:
            raise ValueError(f"no setting fits, so there is no SwapConfig to give: {self.verdict}")
        masters = {"master_weights": True} if self.inputs.get("master_weights") else {}
        return {**self.settings.swap_config(), **masters}

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
        # The answer first, in one line; then why (the tensor-parallel size chosen, the changes that would fit).
        lines = [f"verdict   {self.verdict}"]
        if "precision_auto" in i:
            lines.append(f"precision auto: {i['precision_auto']['why']}; "
                         + ", ".join(i["precision_auto"]["tried"].values()))
        elif self.precision:
            lines.append(f"precision {self.precision} (as asked): {describe_precision(i)}" + (
                "; updates below the parameters' resolution are lost (RL at lr ~1e-6 needs --precision auto)"
                if self.precision == "bf16" else ""))
        if "tp_auto" in i:
            lines.append(f"tp        auto: {i['tp_auto']['why']}; " + ", ".join(
                f"tp={t} {what}" for t, what in i["tp_auto"]["tried"].items()))
        lines += [f"  - {s}" for s in self.suggestions]
        if self.full_precision:
            lines.append(f"fp32 parameters (--param-dtype float32): {self.full_precision}")
        lines += [
            "",
            f"model     {self.model}: {self.parameters / 1e9:.2f} B parameters, {self.layers} layers",
            (f"cluster   {c['nodes']} x {c['gpus_per_node']} GPUs of {gib(c['gpu_memory_bytes'])} GiB, "
             f"host {gib(c['host_memory_bytes'])} GiB per node, copies at {c['copy_bytes_per_s'] / 1e9:.0f} GB/s "
             "per GPU and direction"),
            (f"trainer   {_trainer(i)}, "
             f"params {i['param_dtype']}, grads {i['grad_dtype']}, "
             f"{i['optimizer']} states {i['optimizer_dtype']}{' + fp32 master' if i['master_weights'] else ''}, "
             f"compute {i['compute_dtype']}, micro batch {i['micro_batch_tokens']} tokens"),
            (f"engine    vLLM TP {i['tp']} ({i['engines']} engine{'s' if i['engines'] != 1 else ''}), "
             f"weights {i['engine_dtype']}, "
             f"KV {i['kv_dtype']}, max {i['engine_max_batched_tokens']} batched tokens / {i['engine_max_seqs']} seqs, "
             f"CUDA graphs {'on' if i['cuda_graphs'] else 'off'}"),
            (f"rollout   {r['prompts']} prompts x {r['completions_per_prompt']} = "
             f"{r['prompts'] * r['completions_per_prompt']} sequences of {r['prompt_tokens']}+"
             f"{r['completion_tokens']} tokens (global), {self.sequences_per_engine} per engine"),
            f"settings  {self.settings.label() if self.settings else 'none fits'}",
            "states    per GPU " + ", ".join(
                f"{home} {gib(self.state_bytes[home])} GiB ({self.shown.optimizer_states[home]:.2f})"
                for home in STATE_HOMES) + f" of {gib(sum(self.state_bytes.values()))} GiB",
            "",
            f"{'per GPU (GiB)':<24}{'train':>10}{'generate':>10}",
        ]
        for cat in CATEGORIES:
            lines.append(f"  {cat:<22}" + "".join(f"{gib(self.gpu[p][cat]):>10}" for p in PHASES))
        lines.append(f"  {'total':<22}" + "".join(f"{gib(self.total(p)):>10}" for p in PHASES))
        lines.append(f"  {'budget':<22}" + "".join(f"{gib(self.gpu_budget_bytes[p]):>10}" for p in PHASES)
                     + f"  (train: {i['gpu_utilization_cap']:.0%} of the GPU; generate: the GPU less the engine's "
                     f"{gib(i['engine_reserve_bytes'])} GiB reserve)")
        lines.append(f"  {'fits':<22}" + "".join(f"{'yes' if self.fits[p] else 'NO':>10}" for p in PHASES))
        lines += ["", f"{'per node host (GiB)':<24}{'train':>10}{'generate':>10}"]
        for cat in HOST_CATEGORIES:
            lines.append(f"  {cat:<22}" + "".join(f"{gib(self.host[p][cat]):>10}" for p in PHASES))
        lines.append(f"  pinned {gib(self.host_pinned_bytes)} GiB of a {gib(self.host_budget_bytes)} GiB budget "
                     f"(host minus {gib(i['host_margin_bytes'])} GiB margin): "
                     f"{'fits' if self.fits['host'] else 'DOES NOT FIT'}")
        waves = "no sequence fits" if self.waves is None else (
            "one wave" if self.waves == 1 else f"{self.waves} waves")
        streamed = 2 * self.state_bytes["host"]
        held = self.kv_cache_bytes // max(self.kv_bytes_per_token, 1)  # tokens
        short_context = [f"          it holds {held} tokens, fewer than the model's context: start the engine with "
                         "max_model_len no longer (vLLM refuses one its KV cache cannot hold)"] \
            if 0 < held < i.get("max_position_embeddings", 0) else []
        lines += ["", (f"KV cache  {gib(self.kv_cache_bytes)} GiB per GPU, {self.kv_bytes_per_token / 1024:.1f} "
                       f"KiB per token: {self.concurrent_sequences} sequences of "
                       f"{r['prompt_tokens'] + r['completion_tokens']} tokens at once per engine; "
                       f"{self.sequences_per_engine} per engine -> {waves}"),
                  *short_context,
                  (f"copies    {gib(self.moved_bytes)} GiB per GPU per step, both ways ({gib(streamed)} of it "
                   f"streamed by the optimizer step): {self.copy_seconds:.2f} s at "
                   f"{c['copy_bytes_per_s'] / 1e9:.0f} GB/s"),
                  *([f"cost      {describe_cost(self.step_cost)} (a prediction that ranks plans, not a step time)"]
                    if self.step_cost else []), ""]
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
            lines.append(f" {mark} {cand.settings.describe():<{width}}{gib(cand.moved_bytes):>8}  {cand.verdict}")
        if len(shown) < len(self.candidates):
            rest = "more aggressive, not needed" if chosen is not None else "more, none fits; see --json"
            lines.append(f"   ({len(self.candidates) - len(shown)} {rest})")
        return "\n".join(lines).rstrip() + "\n"

