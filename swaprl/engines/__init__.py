"""Generation engines: `HFEngine` (the trainer's own module) and `VLLMEngine` (a colocated vLLM, optional).

The engines depend on nothing of the trainer's side: what they leave free for it arrives as a number
(`VLLMEngine(reserve_bytes=...)`); `swaprl.attach` builds the engine it is asked for by name."""

from __future__ import annotations

import importlib.util

from .base import Engine, EngineStateError, Sampling
from .hf import HFEngine

__all__ = ["Engine", "EngineStateError", "HFEngine", "Sampling", "VLLMEngine", "vllm_available"]


def vllm_available() -> bool:
    """True when the `vllm` package can be imported (it is an optional extra: `pip install -e ".[vllm]"`)."""
    return importlib.util.find_spec("vllm") is not None


def __getattr__(name: str):
    if name == "VLLMEngine":  # imported lazily: importing vLLM is slow and pins its own torch
        from .vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
