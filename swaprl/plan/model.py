"""The model a plan is for: a preset or a local config.json, and the sizes of its dtypes."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ..presets import PRESETS, Preset, from_config, get_preset, shown_value

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
    """A preset by name (or a hub id that names one), or the architecture read from a local `config.json` (a file or
    its directory) of a dense decoder: Llama 3.x, Qwen2/2.5/3, Mistral, Gemma 2/3, Phi-3 (`presets.ARCHITECTURES`)."""
    if isinstance(model, Preset):
        spec = model
    else:
        path = Path(model)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"{path} is a directory without a config.json; give the directory of a checkpoint "
                                 "(or its config.json)")
            path = path / "config.json"
        if path.is_file():
            try:
                text = path.read_text()
            except OSError as exc:
                raise ValueError(f"cannot read {path} ({exc.strerror}); give a config.json this user can read") \
                    from None
            try:
                cfg = json.loads(text)
            # ValueError: bad JSON, or an integer past Python's digit limit; RecursionError: nested past the parser's
            except (ValueError, RecursionError) as exc:
                reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
                raise ValueError(f"{path} is not a config.json (not JSON Python can read: {reason}); give the "
                                 "config.json of a transformers checkpoint") from None
            spec = from_config(path.parent.name or str(path), cfg, where=str(path))
        elif str(model).endswith(".json") or str(model).startswith((".", os.sep)) or path.parent.is_dir() and \
                os.sep in str(model) and not _is_hub_id(str(model)):
            raise ValueError(f"no config.json at {model!s}; pass a checkpoint directory, its config.json, or a "
                             f"preset name ({', '.join(PRESETS)})")
        else:
            try:
                spec = get_preset(str(model))
            except ValueError as exc:
                if not _is_hub_id(str(model)):
                    raise
                raise ValueError(f"{model!s} is neither a local directory nor the name of a preset; the planner "
                                 "reads no hub: download its config.json (huggingface-cli download "
                                 f"{model} config.json --local-dir DIR) and pass DIR. Presets: "
                                 f"{', '.join(PRESETS)}") from exc
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= spec.num_hidden_layers:
            raise ValueError(f"layers={shown_value(layers)} is outside 1..{spec.num_hidden_layers} for {spec.name}; "
                             "give a whole number of layers in that range, or leave it out for the whole model")
        spec = dataclasses.replace(spec, num_hidden_layers=layers)
    return spec


def _is_hub_id(name: str) -> bool:
    """`owner/name`, as the Hugging Face hub names models."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", os.sep))
