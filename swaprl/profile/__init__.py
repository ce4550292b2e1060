"""Memory profiling: record where device and host memory go across phases, then report on it.

    prof = swaprl.profile.attach_profiler(rt, "run.jsonl")   # or SwapConfig(profile=...)
    ...                                                       # train / generate as usual
    prof.close()                                              # or swaprl.detach()
    python -m swaprl report run.jsonl -o report/

Off by default. `recorder` writes the JSON Lines file (its docstring gives the schema), `attribution` splits the
device memory into categories at each phase boundary, `report` turns one file per rank into HTML and Markdown.
"""

from __future__ import annotations

from .attribution import CATEGORIES, attribute
from .recorder import Profiler, attach_configured, attach_profiler

__all__ = ["attach_profiler", "attach_configured", "Profiler", "attribute", "CATEGORIES"]
