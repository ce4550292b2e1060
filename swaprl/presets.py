"""Model architectures swaprl knows by name: the Qwen2.5 family (0.5B to 72B), a tiny Qwen2 for tests, Llama 3 and
3.1 (8B, 70B) and Qwen3 (8B, 32B); and any dense decoder's config.json (`from_config`).

The shapes are those of the published `config.json` files, so memory figures computed or measured on
random-weight checkpoints of these presets hold for the real models. `tiny` is a two-layer Qwen2 that runs in a
second on a CPU; its vocabulary matches the byte-level tokenizer that `swaprl.checkpoints` writes.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Every size a config gives (widths, head and layer counts, the vocabulary, the context) stays below this: torch and
# vLLM hold token ids, positions and many kernel indices in 32-bit integers, no released decoder comes near it, and
# the planner's products of such sizes (parameters, bytes) stay finite as floats.
SIZE_LIMIT = 2**31


@dataclass(frozen=True, slots=True)
class Architecture:
    """What a dense decoder of one transformers `model_type` holds beyond its sizes (the parameter count follows)."""

    hf_class: str
    qkv_bias: bool | None
    """q, k and v projections carry biases: always (True), never (False), or as the config's `attention_bias` says
    (None)."""
    o_bias: bool | None
    """The output projection carries a bias: never (False), or as `attention_bias` says (None)."""
    qk_norm: bool
    """Per-head RMSNorms on q and k (a `head_dim` weight each)."""
    norms_per_layer: int
    """RMSNorm weights of one decoder layer (the hidden size each)."""
    mlp_bias: bool | None = False
    """The MLP's projections carry biases: never, or as the config's `mlp_bias` says (None)."""


ARCHITECTURES: dict[str, Architecture] = {
    "qwen2": Architecture("Qwen2ForCausalLM", qkv_bias=True, o_bias=False, qk_norm=False, norms_per_layer=2),
    "qwen3": Architecture("Qwen3ForCausalLM", qkv_bias=None, o_bias=None, qk_norm=True, norms_per_layer=2),
    "llama": Architecture("LlamaForCausalLM", qkv_bias=None, o_bias=None, qk_norm=False, norms_per_layer=2,
                          mlp_bias=None),
    "mistral": Architecture("MistralForCausalLM", qkv_bias=False, o_bias=False, qk_norm=False, norms_per_layer=2),
    "gemma2": Architecture("Gemma2ForCausalLM", qkv_bias=None, o_bias=None, qk_norm=False, norms_per_layer=4),
    "gemma3_text": Architecture("Gemma3ForCausalLM", qkv_bias=None, o_bias=None, qk_norm=True, norms_per_layer=4),
    "phi3": Architecture("Phi3ForCausalLM", qkv_bias=False, o_bias=False, qk_norm=False, norms_per_layer=2),
}
"""The dense decoders the planner reads, by `model_type` (Llama 3.x, Qwen2/2.5/3, Mistral, Gemma 2/3, Phi-3)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    """The architecture fields of a dense decoder's `config.json` that decide shapes (and so memory)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    extra: dict = field(default_factory=dict)
    model_type: str = "qwen2"
    explicit_head_dim: int | None = None
    """The config's `head_dim` where it sets one (Qwen3, Gemma, Mistral-Nemo); else hidden / heads."""
    attention_bias: bool = False
    """The config's `attention_bias` (architectures whose biases follow it, `Architecture.qkv_bias`)."""
    mlp_bias: bool = False
    config: dict | None = None
    """The `config.json` this preset was read from (None: a Qwen2 config made from the fields)."""

    def __post_init__(self) -> None:
        check_shape({"model_type": self.model_type, "hidden_size": self.hidden_size,
                     "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
                     "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                     "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
                     "head_dim": self.explicit_head_dim, "tie_word_embeddings": self.tie_word_embeddings,
                     "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias, "rope_theta": self.rope_theta,
                     "rms_norm_eps": self.rms_norm_eps}, where=f"Preset {self.name!r}")

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.model_type]

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def _bias(self, rule: bool | None, flag: bool) -> bool:
        return flag if rule is None else rule

    def layer_parameters(self) -> dict[str, int]:
        """One decoder layer's parameters by part: "q", "k", "v" and "o" (weights with their biases), "qk_norm",
        "mlp", "norms". Engines split some over tensor-parallel ranks (`plan.formulas.engine_params_per_rank`)."""
        a, h, q, kv = self.architecture, self.hidden_size, self.q_dim, self.kv_dim
        qkv_bias, o_bias = self._bias(a.qkv_bias, self.attention_bias), self._bias(a.o_bias, self.attention_bias)
        mlp_bias = self._bias(a.mlp_bias, self.mlp_bias)
        i = self.intermediate_size
        return {"q": h * q + (q if qkv_bias else 0), "k": h * kv + (kv if qkv_bias else 0),
                "v": h * kv + (kv if qkv_bias else 0), "o": q * h + (h if o_bias else 0),
                "qk_norm": 2 * self.head_dim if a.qk_norm else 0,
                "mlp": 3 * h * i + ((2 * i + h) if mlp_bias else 0), "norms": a.norms_per_layer * h}

    def num_parameters(self, layers: int | None = None) -> int:
        """Exact parameter count of the transformers model with this shape (tests/test_plan.py builds it)."""
        n_layers = self.num_hidden_layers if layers is None else layers
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return n_layers * sum(self.layer_parameters().values()) + embed + head + self.hidden_size  # final norm

    def config_dict(self, *, layers: int | None = None, bos_token_id: int, eos_token_id: int) -> dict:
        """The `config.json` keyword dict of this architecture; `layers` cuts the depth (the per-layer shapes stay
        the real ones)."""
        depth = self.num_hidden_layers if layers is None else layers
        if self.config is not None:
            return {**self.config, "num_hidden_layers": depth, "bos_token_id": bos_token_id,
                    "eos_token_id": eos_token_id, "pad_token_id": bos_token_id}
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": depth,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "use_sliding_window": False,
            **self.extra,
        }


_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size", "max_position_embeddings", "head_dim")
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_DEFAULTS = {"max_position_embeddings": 32768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
             "attention_bias": False, "mlp_bias": False}
"""What the planner takes for a field a config.json leaves out (tie_word_embeddings: its architecture's default)."""


def shown_value(value: object) -> str:
    """`repr(value)`, short enough for one line of an error: a long integer as its leading digits and length."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        if value.bit_length() > 12_000:  # str() of an int past 4300 digits raises (sys.set_int_max_str_digits)
            return f"an integer of {value.bit_length()} bits"
        digits = str(abs(value))
        return f"{'-' if value < 0 else ''}{digits[:6]}... (a {len(digits)}-digit integer)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def check_shape(fields: Mapping[str, Any], *, where: str) -> None:
    """Refuse what no dense decoder has: sizes that are not integers in 1..SIZE_LIMIT-1, flags that are not booleans,
    constants that are not finite positive numbers, and heads that do not split as the attention needs. `fields`
    are named as config.json names them ("head_dim": None where the config sets none); the error starts with
    `where`."""
    model_type = fields["model_type"]
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {shown_value(model_type)} is not a dense decoder the planner knows; "
                         f"it reads {', '.join(ARCHITECTURES)} configs")
    for key in _SIZES:
        value = fields[key]
        if key == "head_dim" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < SIZE_LIMIT:
            default = (f", or leave the field out (the planner then takes {_DEFAULTS[key]})" if key in _DEFAULTS
                       else "")
            raise ValueError(f"{where}: {key}={shown_value(value)}; give it as a JSON integer from 1 to "
                             f"{SIZE_LIMIT - 1}{default}")
    for key in _FLAGS:
        if not isinstance(fields[key], bool):
            raise ValueError(f"{where}: {key}={shown_value(fields[key])}; give JSON true or false, not a string "
                             "or a number, or leave the field out for the architecture's default")
    # the comparisons refuse NaN and infinity too; the bound keeps an integer's conversion to float exact
    for key, what, high in (("rope_theta", "the rotary base, e.g. 10000.0, below 2**53", 2**53),
                            ("rms_norm_eps", "the RMSNorm epsilon, below 1, e.g. 1e-06", 1)):
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < high:
            raise ValueError(f"{where}: {key}={shown_value(value)}; give a finite positive number ({what}), or "
                             f"leave the field out (the planner then takes {_DEFAULTS[key]})")
    heads, kv, hidden = fields["num_attention_heads"], fields["num_key_value_heads"], fields["hidden_size"]
    if kv > heads or heads % kv:
        raise ValueError(f"{where}: num_key_value_heads={kv} must divide num_attention_heads={heads} (each KV head "
                         f"serves an equal group of query heads); give one of {_divisors(heads)[:16]}")
    head_dim = fields["head_dim"]
    if head_dim is None and hidden % heads:
        why = (f"num_attention_heads={heads} exceeds hidden_size={hidden}" if heads > hidden else
               f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        raise ValueError(f"{where}: {why}: without a head_dim each head gets hidden_size / num_attention_heads "
                         "dimensions; fix the sizes, or give the model's head_dim if it sets its own")
    if (head_dim or hidden // heads) % 2:
        shown = f"head_dim={head_dim}" if head_dim else f"head_dim=hidden_size / num_attention_heads={hidden // heads}"
        raise ValueError(f"{where}: {shown} is odd; rotary position embeddings turn pairs of dimensions, so each "
                         "head's size must be even: fix the sizes")


def from_config(name: str, cfg: dict[str, Any], *, where: str = "config") -> Preset:
    """The preset of a transformers `config.json` (as a dict) of a dense decoder; a ValueError naming what is missing,
    malformed (`check_shape`) or not supported (mixture-of-experts, a multimodal config, an architecture the planner
    does not know)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} holds a {type(cfg).__name__}, not a config.json's object of fields")
    if "text_config" in cfg and "hidden_size" not in cfg:
        raise ValueError(f"{where} describes a multimodal model ({cfg.get('model_type')}); give the planner its text "
                         "decoder's config (the text_config part, with its model_type) instead")
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(f"{where} describes a mixture-of-experts model; the planner handles dense models only")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {shown_value(model_type)} is not a dense decoder the planner knows; "
                         f"it reads {', '.join(ARCHITECTURES)} configs")
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}; the planner needs a dense decoder's config.json")
    # transformers reads a null num_key_value_heads or head_dim as "derive it"; any other field null is an error
    kv = cfg.get("num_key_value_heads")
    fields = {key: cfg.get(key, _DEFAULTS.get(key)) for key in (*_SIZES, *_FLAGS, "rope_theta", "rms_norm_eps")}
    fields |= {"model_type": model_type, "num_key_value_heads": cfg["num_attention_heads"] if kv is None else kv,
               "tie_word_embeddings": cfg.get("tie_word_embeddings", model_type.startswith("gemma"))}
    check_shape(fields, where=where)
    return Preset(name=name, hidden_size=fields["hidden_size"], intermediate_size=fields["intermediate_size"],
                  num_hidden_layers=fields["num_hidden_layers"], num_attention_heads=fields["num_attention_heads"],
                  num_key_value_heads=fields["num_key_value_heads"], vocab_size=fields["vocab_size"],
                  tie_word_embeddings=fields["tie_word_embeddings"],
                  max_position_embeddings=fields["max_position_embeddings"], rope_theta=float(fields["rope_theta"]),
                  rms_norm_eps=fields["rms_norm_eps"], model_type=model_type, explicit_head_dim=fields["head_dim"],
                  attention_bias=fields["attention_bias"], mlp_bias=fields["mlp_bias"], config=dict(cfg))


# The published config.json fields (shapes) of the common models the Qwen2.5 presets stand beside.
_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                     "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
    "llama-3.1-70b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
                      "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False,
                      "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                      "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
    "qwen3-8b": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
                 "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "attention_bias": False, "hidden_act": "silu"},
    "qwen3-32b": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120,
                  "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
                  "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                  "attention_bias": False, "hidden_act": "silu"},
}
_CONFIGS["llama-3-8b"] = {**_CONFIGS["llama-3.1-8b"], "max_position_embeddings": 8192}
_CONFIGS["llama-3-70b"] = {**_CONFIGS["llama-3.1-70b"], "max_position_embeddings": 8192}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # head_dim 32: the smallest head size vLLM's CPU attention supports.
        Preset(name="tiny", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=2048),
        Preset(name="qwen2.5-0.5b", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
        Preset(name="qwen2.5-1.5b", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
        Preset(name="qwen2.5-3b", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
        Preset(name="qwen2.5-7b", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
        Preset(name="qwen2.5-14b", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
               num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
               rms_norm_eps=1e-5),
        Preset(name="qwen2.5-32b", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
               num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
               rms_norm_eps=1e-5),
        Preset(name="qwen2.5-72b", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    )
}


PRESETS.update({name: from_config(name, cfg, where=f"preset {name}") for name, cfg in _CONFIGS.items()})


def get_preset(name: str) -> Preset:
    """Look a preset up by name, case-insensitive: "1.5b" is short for "qwen2.5-1.5b", and a hub id stands for the
    preset of its shapes ("meta-llama/Llama-3.1-70B-Instruct" for "llama-3.1-70b")."""
    # A hub id's model name, without its owner and post-training suffix, names the preset of its shapes.
    key = name.lower().rsplit("/", 1)[-1].removesuffix("-instruct").removesuffix("-it").removeprefix("meta-")
    if key not in PRESETS and f"qwen2.5-{key}" in PRESETS:
        key = f"qwen2.5-{key}"
    if key not in PRESETS:
        close = difflib.get_close_matches(key, PRESETS, n=1)
        raise ValueError(f"unknown model preset {name!r}{f' (did you mean {close[0]}?)' if close else ''}; choose "
                         f"one of {', '.join(PRESETS)}, or pass a local config.json (or the directory holding it) of "
                         "a dense decoder: Llama 3.x, Qwen2/2.5/3, Mistral, Gemma 2/3, Phi-3")
    return PRESETS[key]
