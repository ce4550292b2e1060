"""Bit-exact fingerprints of tensors, computed where the tensors live, that survive how engines lay weights out.

A fingerprint is the sum, modulo 2**48, of a 64-bit mix of each element's bit pattern. It depends on the multiset
of the elements' bits and on nothing else, which is what lets two sides that store the same weights differently
agree without either knowing the other's layout:

- a fused tensor (vLLM's `qkv_proj` holds q, k and v one after the other) fingerprints to the sum of its parts';
- shards (tensor-parallel ranks, FSDP2 ranks) sum to the whole tensor's fingerprint, whichever rows or columns each
  rank holds;
- zeros add nothing (the mix of 0 is 0), so padding (vLLM pads the vocabulary with zero rows) does not count.

It changes with any element whose bits change (one flipped bit in one element moves it), so a bucket that was not
sent, a tensor loaded into the wrong layer, or weights that were never loaded after a level-2 sleep are caught; it
cannot see elements of one tensor swapped with each other, which no copy of whole tensors produces. Two different
sets of weights collide with probability about 2**-48.

On CUDA the mix-and-sum is one Triton kernel per tensor (a single read of the tensor, results accumulated on the
device and read back once); elsewhere, and where Triton is missing, the same arithmetic runs as torch integer ops in
chunks. Both give the same numbers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

BITS = 48
MASK = (1 << BITS) - 1
# Odd multipliers of the mix (MurmurHash2's and xxHash's), below 2**63 so both int64 torch and Triton take them.
_K1 = 0x5BD1E9955BD1E995
_K2 = 0x27D4EB2F165667C5
_CHUNK = 1 << 24  # elements per torch-path chunk: bounds its int64 temporaries to 128 MiB
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened and viewed as integers of its element width (the bit patterns, not the values)."""
    flat = t.detach().reshape(-1)  # copies only a tensor that cannot be viewed flat
    if flat.dtype.is_floating_point or flat.dtype not in _INT_VIEW.values():
        flat = flat.view(_INT_VIEW[flat.element_size()])
    return flat


def _mix_torch(x: torch.Tensor) -> torch.Tensor:
    """The 64-bit mix on int64 `x` (zero-extended bit patterns): two multiply/xor-shift rounds, logical shifts."""
    x = x * _K1
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    x = x * _K2
    return x ^ ((x >> 29) & ((1 << 35) - 1))


def _fold_torch(t: torch.Tensor, out: torch.Tensor) -> None:
    flat = _bits(t)
    width = flat.element_size() * 8
    for lo in range(0, flat.numel(), _CHUNK):
        x = flat[lo: lo + _CHUNK].to(torch.int64)
        if width < 64:
            x = x & ((1 << width) - 1)  # zero-extend: the bits, not the signed value
        out += _mix_torch(x).sum()  # int64 addition wraps: the sum is exact modulo 2**64


@functools.cache
def _triton_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def fold(x_ptr, out_ptr, n, iters, K1: tl.constexpr, K2: tl.constexpr, WIDTH: tl.constexpr,
             BLOCK: tl.constexpr):
        # Persistent: each program folds every `programs`-th block into its own accumulator and adds it to the
        # result once, so the atomics are a few per SM rather than one per block.
        pid = tl.program_id(0).to(tl.int64)
        programs = tl.num_programs(0).to(tl.int64)
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        for i in range(iters):
            offs = (i * programs + pid) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0)
            if WIDTH == 8:
                z = x.to(tl.uint8, bitcast=True).to(tl.uint64)
            elif WIDTH == 16:
                z = x.to(tl.uint16, bitcast=True).to(tl.uint64)
            elif WIDTH == 32:
                z = x.to(tl.uint32, bitcast=True).to(tl.uint64)
            else:
                z = x.to(tl.uint64, bitcast=True)
            z = z * tl.full([BLOCK], K1, tl.uint64)
            z = z ^ (z >> 31)
            z = z * tl.full([BLOCK], K2, tl.uint64)
            z = z ^ (z >> 29)
            acc += z
        tl.atomic_add(out_ptr, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))

    return triton, fold


def _fold_triton(t: torch.Tensor, out: torch.Tensor) -> bool:
    found = _triton_kernel()
    if found is None:
        return False
    triton, kernel = found
    flat = _bits(t)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    block = 4096
    programs = min(triton.cdiv(flat.numel(), block), _programs(flat.device))
    iters = triton.cdiv(flat.numel(), block * programs)
    kernel[(programs,)](flat, out, flat.numel(), iters, K1=_K1, K2=_K2, WIDTH=flat.element_size() * 8,
                        BLOCK=block, num_warps=8)
    return True


@functools.cache
def _programs(device: torch.device) -> int:
    """Programs of the persistent kernel: enough resident blocks to keep every SM's loads in flight."""
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def fold_into(tensors: Sequence[torch.Tensor | None], *, cast: Sequence[torch.dtype | None] | None = None,
              device: torch.device | None = None) -> list[int]:
    """The fingerprint of each tensor (None counts as empty), each cast first to `cast[i]` where given.

    All tensors of one call live on one device; their fingerprints accumulate there and come back in one copy.
    """
    devices = {t.device for t in tensors if t is not None and t.numel()}
    if len(devices) > 1:
        raise ValueError(f"fold_into() takes tensors of one device, got {sorted(map(str, devices))}")
    where = devices.pop() if devices else (device or torch.device("cpu"))
    out = torch.zeros(len(tensors), dtype=torch.int64, device=where)
    use_triton = where.type == "cuda"
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if t is None or t.numel() == 0:
                continue
            want = cast[i] if cast is not None else None
            if want is not None and t.dtype != want:
                # Cast a chunk at a time: a whole fp32 embedding cast to bf16 at once could need gigabytes.
                flat = t.detach().reshape(-1)
                for lo in range(0, flat.numel(), _CHUNK * 8):
                    _fold_one(flat[lo: lo + _CHUNK * 8].to(want), out[i: i + 1], use_triton)
            else:
                _fold_one(t, out[i: i + 1], use_triton)
    return [v & MASK for v in out.tolist()]


def _fold_one(t: torch.Tensor, out: torch.Tensor, use_triton: bool) -> None:
    if not (use_triton and _fold_triton(t, out)):
        _fold_torch(t, out)


def fingerprint(t: torch.Tensor) -> int:
    """The fingerprint of one tensor (see the module's docstring)."""
    return fold_into([t])[0]


def combine(values: Sequence[int], times: int = 1) -> int:
    """Fingerprints of disjoint parts summed into the whole's, each counted `times` times (replicated copies)."""
    return (times * sum(values)) & MASK
