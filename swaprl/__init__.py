"""swaprl: a sleep-mode memory-swapping runtime for colocated RL training and generation.

    rt = swaprl.attach(model, optimizer)          # the engine defaults to the embedded HF engine
    with swaprl.phase("generate"):                # optimizer states in host memory, engine awake
        completions = rt.engine.generate(prompts, swaprl.Sampling(max_tokens=256, n=8))
    with swaprl.phase("train"):                   # engine asleep, optimizer states back on the device
        loss.backward(); optimizer.step()

The names below are loaded on first use (PEP 562), so `import swaprl.plan`, `swaprl.cli` or
`swaprl.profile.report` do not import torch.
"""

from __future__ import annotations

import importlib
import importlib.util

from ._version import __version__ as __version__

__all__ = ["attach", "attach_later", "phase", "detach", "current", "SwapConfig", "Runtime", "Sampling", "Engine",
           "SyncReport", "PhaseError", "HostBufferError", "EngineStateError"]

_WHERE = {"attach": "attachment", "attach_later": "attachment", "phase": "attachment", "detach": "attachment",
          "current": "attachment", "Runtime": "attachment",
          "SwapConfig": "config", "Sampling": "engines.base", "Engine": "engines.base",
          "EngineStateError": "engines.base", "SyncReport": "verify", "PhaseError": "errors",
          "HostBufferError": "errors"}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value  # found once: later lookups are plain attribute reads
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # a submodule: swaprl.engines, swaprl.memory, ...
    raise AttributeError(f"module 'swaprl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
