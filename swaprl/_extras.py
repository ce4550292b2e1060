"""The optional packages swaprl's modules import, and the extra of pyproject.toml that installs each.

The core install (`pip install swaprl`) brings what the runtime itself needs: torch, psutil, nvidia-ml-py and
packaging. Every other package is imported inside the function that uses it, never at a module's top level, so that
`import swaprl`, `swaprl plan` and the runtime work without it (tests/test_house.py checks this). Where a user first
reaches one (the report's figures, `swaprl.checkpoints`, `swaprl.integrations.trl.wrap`, `VLLMEngine`'s version
gate) the import sits under `needs(extra)`:

    with needs("report"):
        from matplotlib.figure import Figure

and a missing package is an ImportError naming the extra to install instead of a bare ModuleNotFoundError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "report": ("swaprl report's figures", ("matplotlib",)),
    "hf": ("Hugging Face checkpoints and models", ("transformers", "safetensors", "tokenizers", "accelerate")),
    "trl": ("swaprl.integrations.trl", ("trl", "transformers", "accelerate")),
    "vllm": ("swaprl.engines.VLLMEngine", ("vllm",)),
    "deepspeed": ("DeepSpeed ZeRO under swaprl.integrations.trl", ("deepspeed",)),
}
"""extra -> (what needs it, the top-level packages it brings that swaprl imports)."""


def install_hint(extra: str) -> str:
    """The pip command that installs `extra`, in the form the install in use takes: from a checkout (the README's
    `pip install -e .`, where pyproject.toml sits beside the package) its own extras, else the released package's.
    vLLM's also names the CPU build."""
    from_checkout = (Path(__file__).resolve().parent.parent / "pyproject.toml").is_file()

    def command(name: str) -> str:
        if from_checkout:
            return f'pip install -e ".[{name}]" (in the swaprl checkout)'
        return f"pip install 'swaprl[{name}]'"

    if extra == "vllm":
        return f"{command('vllm')}; on a CPU-only machine: {command('cpu-vllm')}"
    return command(extra)


@contextlib.contextmanager
def needs(extra: str) -> Iterator[None]:
    """Inside: imports of `extra`'s packages. One that is not installed raises an ImportError saying what needs it
    and the pip command that installs it; a missing module of any other package propagates as it is."""
    what, packages = EXTRAS[extra]
    try:
        yield
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in packages:
            raise
        raise ImportError(f"{what}: {top} is not installed (swaprl's core install leaves it out); "
                          f"{install_hint(extra)}", name=exc.name) from exc
