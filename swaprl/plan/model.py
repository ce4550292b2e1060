"""The model a plan is for: a preset or a local config.json, and the sizes of its dtypes."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ..presets import PRESETS, Preset, get_preset

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp8": "float8", "fp8_e4m3": "float8", "fp8_e5m2": "float8", "float8_e4m3fn": "float8",
                  "float8_e5m2": "float8"}


def dtype_bytes(name: str) -> tuple[str, int]:
    """The canonical name and element size of a dtype given as "bf16", "bfloat16", "torch.bfloat16", ..."""
    key = str(name).lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPE_BYTES)} "
                         f"(or an alias: {', '.join(_DTYPE_ALIASES)})")
    return key, _DTYPE_BYTES[key]



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

