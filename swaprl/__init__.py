"""swaprl: a sleep-mode memory-swapping runtime for colocated RL training and generation.

    rt = swaprl.attach(model, optimizer)          # the engine defaults to the embedded HF engine
    with swaprl.phase("generate"):                # optimizer states in host memory, engine awake
        completions = rt.engine.generate(prompts, swaprl.Sampling(max_tokens=256, n=8))
    with swaprl.phase("train"):                   # engine asleep, optimizer states back on the device
        loss.backward(); optimizer.step()
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from .config import SwapConfig
from .distributed import is_fsdp2
from .engines.base import Engine, EngineStateError, Sampling
from .residency import HostBufferError, local_tensor
from .runtime import Phase, PhaseError, Runtime
from .verify import SyncReport

__all__ = ["attach", "phase", "detach", "current", "SwapConfig", "Runtime", "Sampling", "Engine", "SyncReport",
           "PhaseError", "HostBufferError", "EngineStateError"]
__version__ = "0.1.0"

logger = logging.getLogger(__name__)
_default: Runtime | None = None


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine: Engine | str | None = None, *,
           config: SwapConfig | None = None) -> Runtime:
    """Register the default runtime for `model` trained by `optimizer`, generating with `engine`.

    `engine`: an `Engine`, "hf" (generate with the trainer's own module), "vllm" (a colocated vLLM engine built
    from the model's checkpoint directory), or None: vLLM when it is installed, a GPU is present and the model was
    loaded from a local checkpoint directory; else "hf".
    Validates everything before moving any memory.
    """
    global _default
    if _default is not None:
        raise PhaseError("swaprl.attach() was already called and its runtime is still attached; call "
                         "swaprl.detach() first (or keep the Runtime that attach() returned)")
    config = config if config is not None else SwapConfig()
    if not isinstance(config, SwapConfig):
        raise TypeError(f"config must be a swaprl.SwapConfig, not {type(config).__name__}")
    _check_trainer(model, optimizer)
    if config.params == "offload" and is_fsdp2(model):
        # FSDP2 all-gathers from a padded buffer of its own (FSDPParam._sharded_param_data) of which the parameter's
        # shard is a view: moving the shard would free nothing, and the optimizer would update a copy FSDP never
        # reads again.
        raise ValueError("SwapConfig(params='offload') with a model sharded by FSDP2 (fully_shard): its parameter "
                         "shards live in buffers FSDP2 owns, which swaprl cannot move. Use params='keep' (the "
                         "shards are 1/world of the model), or have FSDP2 keep them in host memory for good: "
                         "fully_shard(module, offload_policy=CPUOffloadPolicy())")
    if config.optimizer_states == "host":
        _check_streamable(model, optimizer)
    engine = _make_engine(engine, model, config)
    if engine.shares_trainer_weights and config.params == "offload":
        raise ValueError(f"SwapConfig(params='offload') with {type(engine).__name__}, which generates with the "
                         "trainer's own parameters: they must stay on the device. Use params='keep', or an engine "
                         "with its own weights (vLLM).")
    engine.bind(model)
    _default = Runtime(model, optimizer, engine, config)
    if config.profile is not None:
        from .profile import attach_profiler

        attach_profiler(_default, config.profile)
    return _default


def current() -> Runtime:
    """The attached runtime; raises if there is none."""
    if _default is None:
        raise PhaseError("no swaprl runtime is attached: call swaprl.attach(model, optimizer) first")
    return _default


@contextlib.contextmanager
def phase(name: Phase) -> Iterator[Runtime]:
    """`with swaprl.phase("generate"):` / `with swaprl.phase("train"):` on the attached runtime."""
    with current().phase(name) as rt:
        yield rt


def detach() -> None:
    """Detach the default runtime (its state becomes resident again); a no-op when none is attached."""
    if _default is not None:
        _default.detach()


def _unregister(rt: Runtime) -> None:
    global _default
    if _default is rt:
        _default = None


def _check_trainer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    mine = {id(p) for p in model.parameters()}
    foreign = [(gi, pi, tuple(p.shape)) for gi, g in enumerate(optimizer.param_groups)
               for pi, p in enumerate(g["params"]) if id(p) not in mine]
    if foreign:
        listed = ", ".join(f"group {g} param {i} shape {s}" for g, i, s in foreign[:5])
        raise ValueError(f"{len(foreign)} optimizer parameter(s) are not parameters of the model ({listed}); build "
                         "the optimizer from this model's parameters, e.g. AdamW(model.parameters()), after any "
                         "wrapping or moving of the model")


def _check_streamable(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse what `SwapConfig(optimizer_states="host")` cannot step a chunk of parameters at a time."""
    if is_fsdp2(model) or any(local_tensor(p) is not p for p in model.parameters()):
        # A DTensor's optimizer update goes through DTensor dispatch over its shards, whose states swaprl moves as
        # their local tensors; stepping a chunk of them that way has not been made to work.
        raise ValueError("SwapConfig(optimizer_states='host') with DTensor parameters (a model sharded by FSDP2's "
                         "fully_shard, or tensor parallelism): the streamed optimizer step handles plain tensors "
                         "only. Use optimizer_states='swap' (the shards' states are 1/world of the model), or have "
                         "FSDP2 keep the shards and their optimizer step on the host: "
                         "fully_shard(module, offload_policy=CPUOffloadPolicy())")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError("SwapConfig(optimizer_states='host') with LBFGS: its state (the search directions) spans "
                        "all parameters together, so it cannot be stepped a chunk of parameters at a time. Use "
                        "optimizer_states='swap'")


def _make_engine(engine: Engine | str | None, model: torch.nn.Module, config: SwapConfig) -> Engine:
    if isinstance(engine, Engine):
        return engine
    from .engines import HFEngine, vllm_available

    if engine is None:
        path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        has_checkpoint = bool(path) and (Path(path) / "config.json").exists()
        engine = "vllm" if vllm_available() and torch.cuda.is_available() and has_checkpoint else "hf"
        logger.info("engine: %s", engine)
    if engine == "hf":
        return HFEngine()
    if engine == "vllm":
        from .engines.vllm import VLLMEngine

        return VLLMEngine.for_model(model, config=config)
    raise ValueError(f"engine={engine!r}; pass an Engine instance, 'hf', 'vllm' or None")
