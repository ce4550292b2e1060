"""The README's code runs as written, on the CPU, so that the front door cannot drift from the library.

    python -m pytest tests/test_readme.py -q      # about a minute on 2 CPU cores (TRL's start is most of it)

Every Python block of README.md and docs/*.md that follows the line `<!-- runs as written: tests/test_readme.py -->`
runs in a child process with no GPU visible, from an empty directory, against this checkout: a document's blocks
in order, as one script (the README's TRL block goes on from its quickstart, as a reader's session would). A block
that imports TRL is left out where TRL is not installed, and its test skips. The docs' `python -m swaprl plan`
command lines run as written too (they take well under a second). The examples' own commands run in
tests/test_examples.py, on the tiny preset.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- runs as written: tests/test_readme.py -->"
_MARKED = re.compile(re.escape(MARK) + r"[ \t]*\n```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_PLAN = re.compile(r"^\s*(python -m swaprl plan [^#\n]*?)\s*(?:#.*)?$", re.MULTILINE)
_DONE = "-- block {} ran --"


def marked_blocks(text: str) -> list[str]:
    """The Python blocks of `text` that follow the marker, in order."""
    return _MARKED.findall(text)


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def run_blocks(blocks: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`blocks` as one script in a child process on the CPU; after each block it prints that it ran."""
    script = "".join(f"{block}\nprint({_DONE.format(i)!r}, flush=True)\n" for i, block in enumerate(blocks))
    (cwd / "blocks.py").write_text(script)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "blocks.py"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


def _needs_trl(block: str) -> bool:
    return re.search(r"^\s*(from|import) trl\b", block, re.MULTILINE) is not None


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """The README's marked blocks, run once: (the blocks, which of them ran, the child's result)."""
    blocks = marked_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    runnable = [b for b in blocks if not _needs_trl(b) or importlib.util.find_spec("trl") is not None]
    return blocks, runnable, run_blocks(runnable, tmp_path_factory.mktemp("readme"))


def _check(result: subprocess.CompletedProcess, blocks: list[str], upto: int, doc: str = "README.md") -> None:
    assert _DONE.format(upto) in result.stdout, (
        f"marked block {upto} of {doc} did not run to its end (exit status {result.returncode}):\n"
        f"{blocks[upto][:300]}...\n--- stderr ---\n{result.stderr[-4000:]}")


def test_the_readme_marks_its_quickstart_and_its_trl_wrap():
    blocks = marked_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) == 2, "the README's quickstart and TRL blocks are no longer both marked as run by this test"
    quickstart, trl = blocks
    assert 'swaprl.phase("generate")' in quickstart and 'swaprl.phase("train")' in quickstart
    assert "rt.engine.generate(" in quickstart and "optimizer.step()" in quickstart
    assert "wrap(trainer)" in trl and _needs_trl(trl) and not _needs_trl(quickstart)


def test_the_quickstart_runs_as_written_and_moves_the_optimizer_states_while_generating(readme_run):
    blocks, _, result = readme_run
    _check(result, blocks, 0)
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, result.stdout
    assert all(line.endswith("states in host while generating") for line in steps), steps


def test_the_trl_wrap_runs_as_written_after_the_quickstart(readme_run):
    blocks, runnable, result = readme_run
    if len(runnable) < len(blocks):
        pytest.skip("needs TRL (pip install -e '.[trl]')")
    _check(result, blocks, 1)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("doc", [d for d in _documents() if d.name != "README.md"
                                 and marked_blocks(d.read_text(encoding="utf-8"))], ids=lambda d: d.name)
def test_the_docs_marked_blocks_run_as_written(doc, tmp_path):
    blocks = marked_blocks(doc.read_text(encoding="utf-8"))
    result = run_blocks(blocks, tmp_path)
    for i in range(len(blocks)):
        _check(result, blocks, i, doc.name)


def _plan_commands() -> list[tuple[str, str]]:
    found = []
    for doc in _documents():
        for command in _PLAN.findall(doc.read_text(encoding="utf-8")):
            found.append((doc.name, command))
    return found


def test_the_docs_show_a_plan_command():
    assert _plan_commands(), "no `python -m swaprl plan` line left in README.md or docs/ (this test runs them)"


@pytest.mark.parametrize("doc, command", _plan_commands(), ids=[f"{d}: {c}" for d, c in _plan_commands()])
def test_the_docs_plan_commands_run_as_written(doc, command, tmp_path):
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "swaprl"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, *args[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"{doc}: `{command}` exited {result.returncode}:\n{result.stderr[-2000:]}"
    assert result.stdout.startswith("verdict   fits"), result.stdout[:500]
