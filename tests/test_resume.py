"""examples/grpo.py's checkpoints and resumes against an adversarial user: a resume killed at any point of its start,
damaged checkpoints, resumes with other settings, saves that cannot write, runs that fail after attaching.

Real runs on the tiny preset on the CPU. The runs that are killed are forked children of tests/resume_worker.py
(torch and transformers imported once), killed with SIGKILL right after a chosen change to the files under --out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import swaprl

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
COMMON = ["--engine", "hf", "--warmup", "0"]


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


# ------------------------------------------------------------------------------------------- 6. nothing left attached
def test_a_run_that_fails_after_attaching_leaves_nothing_attached(tmp_path, monkeypatch):
    """main() whose profile cannot be opened (a full disk): the error comes out, the runtime is detached, and the
    same process can run again."""
    import grpo

    def no_profile(rt, path, **kw):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(grpo, "attach_profiler", no_profile)
    with pytest.raises(OSError, match="No space left"):
        grpo.main([*COMMON, "--steps", "1", "--out", str(tmp_path / "o"), "--checkpoint-dir", str(tmp_path / "ck")])
    with pytest.raises(swaprl.PhaseError, match="no swaprl runtime is attached"):
        swaprl.current()
    monkeypatch.undo()
    grpo.main([*COMMON, "--steps", "1", "--out", str(tmp_path / "o2"), "--checkpoint-dir", str(tmp_path / "ck")])
