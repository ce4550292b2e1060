"""Model architectures swaprl knows by name: the Qwen2.5 family (0.5B to 72B), a tiny Qwen2 for tests, Llama 3 and
3.1 (8B, 70B) and Qwen3 (8B, 32B); and any dense decoder's config.json (`from_config`).

The shapes are those of the published `config.json` files, so memory figures computed or measured on
random-weight checkpoints of these presets hold for the real models. `tiny` is a two-layer Qwen2 that runs in a
second on a CPU; its vocabulary matches the byte-level tokenizer that `swaprl.checkpoints` writes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any


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
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {self.model_type!r} is not a dense decoder the planner knows; it reads "
                             f"{', '.join(ARCHITECTURES)}")

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


def from_config(name: str, cfg: dict[str, Any], *, where: str = "config") -> Preset:
    """The preset of a transformers `config.json` (as a dict) of a dense decoder; a ValueError naming what is missing
    or not supported (mixture-of-experts, a multimodal config, an architecture the planner does not know)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} holds a {type(cfg).__name__}, not a config.json's object of fields")
    if "text_config" in cfg and "hidden_size" not in cfg:
        raise ValueError(f"{where} describes a multimodal model ({cfg.get('model_type')}); give the planner its text "
                         "decoder's config (the text_config part, with its model_type) instead")
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(f"{where} describes a mixture-of-experts model; the planner handles dense models only")
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {model_type!r} is not a dense decoder the planner knows; it reads "
                         f"{', '.join(ARCHITECTURES)} configs")
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}; the planner needs a dense decoder's config.json")
    for key in (*need, "num_key_value_heads", "head_dim"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}: {key}={value!r}; a config.json gives it as a positive integer")
    heads = cfg["num_attention_heads"]
    tie = cfg.get("tie_word_embeddings", model_type.startswith("gemma"))
    return Preset(name=name, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                  num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
                  num_key_value_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
                  tie_word_embeddings=bool(tie), max_position_embeddings=cfg.get("max_position_embeddings", 32768),
                  rope_theta=float(cfg.get("rope_theta", 1_000_000.0)), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                  model_type=model_type, explicit_head_dim=cfg.get("head_dim"),
                  attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
                  config=dict(cfg))


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
