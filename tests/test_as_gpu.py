"""benchmarks/as_gpu.py refuses what it cannot run, naming the fix (its run itself needs a GPU: the results' READMEs
say where it ran)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "as_gpu.py"


def _run(*args: str, alloc_conf: str | None = "expandable_segments:True") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if alloc_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          check=False, env=env)


def test_without_a_script_it_says_how_to_call_it():
    proc = _run("H100")
    assert proc.returncode != 0 and "usage: as_gpu.py GPU SCRIPT" in proc.stderr


def test_an_unknown_gpu_is_refused_with_the_known_ones():
    proc = _run("H1000", "examples/qwen72b.py")
    assert proc.returncode != 0 and "unknown GPU" in proc.stderr and "H100" in proc.stderr


def test_without_allocator_settings_in_the_environment_it_says_to_set_them():
    """torch takes its settings at the launcher's first allocation, before the script could set its own."""
    proc = _run("H100", "examples/qwen72b.py", alloc_conf=None)
    assert proc.returncode != 0 and "set PYTORCH_CUDA_ALLOC_CONF" in proc.stderr
