"""How the package is put together, as users and the layering rely on it: the command-line tools, the planner and
the home policy they share with the runtime import no torch, and the engines import nothing of the trainer's
side."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "swaprl"


@pytest.mark.parametrize("module", ["swaprl", "swaprl.plan", "swaprl.cli", "swaprl.profile.report", "swaprl.homes"])
def test_the_planner_and_the_command_line_import_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_swaprl_report_and_plan_run_without_torch_imported(tmp_path):
    code = ("import sys; from swaprl.cli import main; rc = main(['plan', 'qwen2.5-7b', '--cluster', '1xH100']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verdict" in proc.stdout


def _imports(path: Path) -> set[str]:
    """The swaprl modules `path` imports (relative imports resolved), anywhere in the file."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    base = package.split(".")[:-1] if path.name != "__init__.py" else package.split(".")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                root = base[:len(base) - node.level + 1]
                module = ".".join(root + ([node.module] if node.module else []))
                names = [f"{module}.{a.name}" for a in node.names] + [module]
            else:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            out.update(n for n in names if n.startswith("swaprl"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("swaprl"))
    return out


def test_the_engines_import_nothing_of_the_trainers_side():
    above = ("swaprl.placement", "swaprl.runtime", "swaprl.attachment", "swaprl.engine_link", "swaprl.streaming",
             "swaprl.verify", "swaprl.integrations", "swaprl.state_homes", "swaprl.host_states",
             "swaprl.optimizer_hooks", "swaprl.host_budget", "swaprl.master")
    for path in (PACKAGE / "engines").glob("*.py"):
        wrong = sorted(m for m in _imports(path) if m.startswith(above))
        assert not wrong, f"{path.name} imports {wrong}"
    assert _imports(PACKAGE / "engines" / "__init__.py")  # the check reads imports at all
