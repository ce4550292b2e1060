"""What the core install brings and what its extras do: the package imports only the core's packages at its
modules' top level, a missing optional package is an ImportError naming the extra that installs it, and the version
is written in one place."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from swaprl._extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "swaprl"
CORE = {"torch", "psutil", "pynvml", "packaging"}  # pynvml: the nvidia-ml-py distribution's module
# Imported where present, each use falling back without it: numpy (every extra that draws from it brings it),
# triton (CUDA builds of torch bring it), huggingface_hub (transformers brings it).
OPTIONAL = {package for _, packages in EXTRAS.values() for package in packages} | {"numpy", "triton",
                                                                                  "huggingface_hub"}


def _project() -> dict:
    import tomllib  # Python 3.11's; the suite's other tests run on 3.10 too

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _third_party_imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level package, imported at the module's top level) for each absolute import in `path` of a package
    outside the standard library and swaprl; imports under `if TYPE_CHECKING:` are left out (never run)."""
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)) and not getattr(child, "level", 0):
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                for name in names:
                    package = name.partition(".")[0]
                    if package not in sys.stdlib_module_names and package not in ("swaprl", "__future__"):
                        found.append((package, top))
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return found


def test_the_package_imports_only_the_core_install_at_its_modules_top_level():
    top_level, unknown = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        for package, top in _third_party_imports(path):
            where = f"{path.relative_to(ROOT)}: {package}"
            if top and package not in CORE:
                top_level.append(where)
            if package not in CORE | OPTIONAL:
                unknown.append(where)
    assert not top_level, f"imported at a module's top level but not in the core install: {top_level}"
    assert not unknown, f"imported but in no extra of swaprl/_extras.py: {unknown}"


def test_the_core_install_is_the_runtimes_packages_and_each_extra_is_in_pyproject():
    project = _project()
    core = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    assert core == {"torch", "psutil", "nvidia-ml-py", "packaging"}
    extras = project["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    assert "swaprl[hf,report]" in extras["test"]  # the suite's CPU tests import transformers and draw figures


def _without(monkeypatch, package: str) -> None:
    """Make `package` (and its submodules) unimportable, as when it is not installed."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


def test_a_missing_extra_is_named_with_its_pip_command(monkeypatch, tmp_path):
    from swaprl.checkpoints import hf_config, write_random_checkpoint
    from swaprl.compat import vllm as vllm_compat
    from swaprl.integrations import trl as trl_integration
    from swaprl.profile import report

    pip = re.escape('pip install -e ".[')  # the suite runs from the checkout: its own extras are the ones to name
    _without(monkeypatch, "matplotlib")
    with pytest.raises(ImportError, match=rf"swaprl report's figures: matplotlib is not installed.*{pip}report\]"):
        report.memory_figure(None)
    _without(monkeypatch, "transformers")
    with pytest.raises(ImportError, match=rf"transformers is not installed.*{pip}hf\]"):
        hf_config("tiny")
    _without(monkeypatch, "safetensors")
    with pytest.raises(ImportError, match=rf"safetensors is not installed.*{pip}hf\]"):
        write_random_checkpoint("tiny", tmp_path)
    _without(monkeypatch, "trl")
    with pytest.raises(ImportError, match=rf"swaprl.integrations.trl: trl is not installed.*{pip}trl\]"):
        trl_integration.wrap(object())
    _without(monkeypatch, "vllm")
    with pytest.raises(ImportError, match=rf"VLLMEngine: vllm is not installed.*{pip}vllm\].*{pip}cpu-vllm\]"):
        vllm_compat.installed_version()


def test_an_installed_release_is_told_the_released_packages_extras(monkeypatch, tmp_path):
    """Without pyproject.toml beside the package (a wheel's install), the hint names `swaprl[extra]`."""
    from swaprl import _extras

    monkeypatch.setattr(_extras, "__file__", str(tmp_path / "site-packages" / "swaprl" / "_extras.py"))
    assert _extras.install_hint("trl") == "pip install 'swaprl[trl]'"
    assert _extras.install_hint("vllm") == ("pip install 'swaprl[vllm]'; on a CPU-only machine: "
                                            "pip install 'swaprl[cpu-vllm]'")


def test_a_missing_module_of_another_package_is_left_as_it_is():
    from swaprl._extras import needs

    with pytest.raises(ModuleNotFoundError, match="swaprl_no_such_module"), needs("report"):
        import swaprl_no_such_module  # noqa: F401


def test_the_version_is_written_once():
    """pyproject.toml reads it from swaprl/_version.py, which `swaprl --version` and the profiles' headers use."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "swaprl._version.__version__"}
