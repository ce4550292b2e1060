"""Model architectures swaprl knows by name: the Qwen2.5 family (0.5B to 72B) and a tiny Qwen2 for tests.

The shapes are those of the published Qwen2.5 `config.json` files, so memory figures computed or measured on
random-weight checkpoints of these presets hold for the real models. `tiny` is a two-layer Qwen2 that runs in a
second on a CPU; its vocabulary matches the byte-level tokenizer that `swaprl.checkpoints` writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    """The architecture fields of a Qwen2 `config.json` that decide shapes (and so memory)."""

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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self, layers: int | None = None) -> int:
        """Exact parameter count of `Qwen2ForCausalLM` with this shape (q/k/v carry biases, o/MLP do not)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        n_layers = self.num_hidden_layers if layers is None else layers
        attn = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k and v (+bias), o
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return n_layers * per_layer + embed + head + h  # final norm

    def config_dict(self, *, layers: int | None = None, bos_token_id: int, eos_token_id: int) -> dict:
        """A `Qwen2Config` keyword dict; `layers` cuts the depth (the per-layer shapes stay the real ones)."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers if layers is None else layers,
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


def get_preset(name: str) -> Preset:
    """Look a preset up by name (case-insensitive; "1.5b" is short for "qwen2.5-1.5b")."""
    key = name.lower()
    if key not in PRESETS and f"qwen2.5-{key}" in PRESETS:
        key = f"qwen2.5-{key}"
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
                         "or pass the path of a local checkpoint directory")
    return PRESETS[key]
