"""Memory profiling: record where device and host memory go across phases, then report on it.

    prof = swaprl.profile.attach_profiler(rt, "run.jsonl")   # or SwapConfig(profile=...)
    ...                                                       # train / generate as usual
    prof.close()                                              # or swaprl.detach()
    python -m swaprl report run.jsonl -o report/

Off by default. `recorder` writes the JSON Lines file (its docstring gives the schema), `attribution` splits the
device memory into categories at each phase boundary, `report` turns one file per rank into HTML and Markdown. The
recorder's names are loaded on first use, so `swaprl report` runs without torch.
"""

from __future__ import annotations

import importlib

SCHEMA = "swaprl.profile"
VERSION = 1
"""The profile's schema and its version, in every file's header; `report` reads this version only."""

__all__ = ["attach_profiler", "attach_configured", "Profiler", "attribute", "CATEGORIES"]

_WHERE = {"attach_profiler": "recorder", "attach_configured": "recorder", "Profiler": "recorder",
          "attribute": "attribution", "CATEGORIES": "attribution"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'swaprl.profile' has no attribute {name!r}")
