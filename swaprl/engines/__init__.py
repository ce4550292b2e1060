"""Generation engines: `HFEngine` (the trainer's own module) and `VLLMEngine` (a colocated vLLM, optional)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from ..checkpoints import checkpoint_dir_of
from ..config import SwapConfig
from ..memory import default_reserve_bytes
from ..placement import device_state_growth
from .base import Engine, EngineStateError, Sampling
from .hf import HFEngine

__all__ = ["Engine", "EngineStateError", "HFEngine", "Sampling", "VLLMEngine", "engine_name", "engine_reserve_bytes",
           "make_engine", "vllm_available"]

logger = logging.getLogger(__name__)


def vllm_available() -> bool:
    """True when the `vllm` package can be imported (it is an optional extra: `pip install swaprl[vllm]`)."""
    return importlib.util.find_spec("vllm") is not None


def make_engine(engine: Engine | str | None, model: torch.nn.Module, config: SwapConfig,
                optimizer: torch.optim.Optimizer | None = None) -> Engine:
    """`engine` as given, or built from its name (`engine_name`). A vLLM engine sized from the free memory leaves
    room for the optimizer states that will stay on the device while it generates (the "device" home of
    `config.optimizer_states`)."""
    if isinstance(engine, Engine):
        return engine
    if engine_name(engine, model) == "hf":
        return HFEngine()
    from .vllm import VLLMEngine

    reserve = engine_reserve_bytes(optimizer, config) if optimizer is not None else None
    return VLLMEngine.for_model(model, config=config, reserve_bytes=reserve)


def engine_name(engine: str | None, model: torch.nn.Module) -> str:
    """The engine `engine` names: "hf", "vllm" (from the model's checkpoint directory), or for None vLLM when it is
    installed, a GPU is present and the model was loaded from a local checkpoint directory, else "hf". Anything else
    is refused, naming every form `attach` accepts."""
    accepted = "an Engine instance, a function that builds one, 'hf', 'vllm' or None"
    if engine is not None and not isinstance(engine, str):
        raise TypeError(f"engine must be a swaprl.Engine, {accepted.removeprefix('an Engine instance, ')}, not "
                        f"{type(engine).__name__}")
    if engine is None:
        local = checkpoint_dir_of(model) is not None
        engine = "vllm" if vllm_available() and torch.cuda.is_available() and local else "hf"
        logger.info("engine: %s", engine)
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine={engine!r}; pass {accepted}")
    return engine


def engine_reserve_bytes(optimizer: torch.optim.Optimizer, config: SwapConfig) -> int | None:
    """What a vLLM engine sized now from the free memory (`VLLMEngine(reserve_bytes=...)`) must leave free: its
    default reserve plus the optimizer states that will stay on the device while it generates (the "device" home,
    created by the first optimizer step: `placement.device_state_growth`). None: nothing to add to the default."""
    growth = device_state_growth(optimizer, config)
    if not growth or not torch.cuda.is_available():
        return None
    return default_reserve_bytes(torch.cuda.mem_get_info()[1]) + growth


def __getattr__(name: str):
    if name == "VLLMEngine":  # imported lazily: importing vLLM is slow and pins its own torch
        from .vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
