"""swaprl: a sleep-mode memory-swapping runtime for colocated RL training and generation.

    rt = swaprl.attach(model, optimizer)          # the engine defaults to the embedded HF engine
    with swaprl.phase("generate"):                # optimizer states in host memory, engine awake
        completions = rt.engine.generate(prompts, swaprl.Sampling(max_tokens=256, n=8))
    with swaprl.phase("train"):                   # engine asleep, optimizer states back on the device
        loss.backward(); optimizer.step()
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch

from . import checks
from ._version import __version__ as __version__
from .config import SwapConfig
from .engines import engine_name, make_engine
from .engines.base import Engine, EngineStateError, Sampling
from .errors import HostBufferError, PhaseError
from .runtime import Phase, Runtime, check_none_attached, current
from .verify import SyncReport

__all__ = ["attach", "phase", "detach", "current", "SwapConfig", "Runtime", "Sampling", "Engine", "SyncReport",
           "PhaseError", "HostBufferError", "EngineStateError"]

logger = logging.getLogger(__name__)


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           engine: Engine | Callable[[], Engine] | str | None = None, *, config: SwapConfig | None = None) -> Runtime:
    """Register the default runtime for `model` trained by `optimizer`, generating with `engine`.

    `engine`: an `Engine`; a function that builds one (`lambda: VLLMEngine(path, ...)`); "hf" (generate with the
    trainer's own module); "vllm" (a colocated vLLM engine built from the model's checkpoint directory); or None:
    vLLM when it is installed, a GPU is present and the model was loaded from a local checkpoint directory, else
    "hf". A function, or a name, builds the engine once the host memory the optimizer states will need has started
    to be page-locked in the background, so that the locking runs under the engine's start; if attach then fails,
    it closes the engine it built. Validates everything before moving any memory or building an engine.
    """
    check_none_attached()
    config = config if config is not None else SwapConfig()
    checks.check_trainer(model, optimizer, config)
    if not isinstance(engine, Engine) and not callable(engine):
        name = engine_name(engine, model)  # refused here, before anything is allocated
        engine = functools.partial(make_engine, name, model, config, optimizer)
    rt = Runtime(model, optimizer, engine, config)
    if config.profile is not None:  # the profile package is imported only when used
        from .profile import attach_configured

        attach_configured(rt)
    return rt


@contextlib.contextmanager
def phase(name: Phase) -> Iterator[Runtime]:
    """`with swaprl.phase("generate"):` / `with swaprl.phase("train"):` on the attached runtime."""
    with current().phase(name) as rt:
        yield rt


def detach() -> dict[str, int]:
    """Detach the attached runtime (its state becomes resident again; see `Runtime.detach`); {} when none is."""
    try:
        rt = current()
    except PhaseError:
        return {}
    return rt.detach()
