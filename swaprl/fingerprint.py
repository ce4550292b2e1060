"""Bit-exact fingerprints of tensors, computed where the tensors live, that survive how engines lay weights out.

A fingerprint is the sum, modulo 2**48, of a mix of each element's bit pattern. It depends on the multiset of the
elements' bits and on nothing else, which is what lets two sides that store the same weights differently agree
without either knowing the other's layout:

- a fused tensor (vLLM's `qkv_proj` holds q, k and v one after the other) fingerprints to the sum of its parts';
- shards (tensor-parallel ranks, FSDP2 ranks) sum to the whole tensor's fingerprint, whichever rows or columns each
  rank holds;
- zeros add nothing (the mix of 0 is 0), so padding (vLLM pads the vocabulary with zero rows) does not count.

The mix of an element of up to 4 bytes is MurmurHash3's 32-bit finalizer, a bijection: one element whose bits
change moves the sum by a non-zero amount below 2**32, so it is always caught. Many changed elements (a bucket that
was not sent, a tensor loaded into the wrong layer, weights never loaded after a level-2 sleep) cancel out with
probability about 2**-32 or less. 8-byte elements get a 64-bit mix (two multiply/xor-shift rounds). It cannot see
elements of one tensor swapped with each other, which no copy of whole tensors produces. The 32-bit mix keeps the
CUDA kernel near the speed of reading memory, where a 64-bit mix for every element is limited by the integer
multiplies (benchmarks/results/verify_cost_h100 has both against the read floor).

On CUDA the mix-and-sum is one Triton kernel launch per element width for all the tensors of a call (a single read
of each tensor, results accumulated on the device and read back once, past any copies a transition has queued:
`swaprl.readback`); elsewhere, and where Triton is missing, the same arithmetic runs as torch integer ops in chunks.
Both give the same numbers.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .compat import cuda as cuda_compat
from .compat import deepspeed as deepspeed_compat
from .readback import to_device, to_list
from .sync import trainer_weights

logger = logging.getLogger(__name__)

BITS = 48
MASK = (1 << BITS) - 1
# Multipliers of the 64-bit mix (MurmurHash2's and xxHash's), below 2**63 so both int64 torch and Triton take them,
# and of the 32-bit one (MurmurHash3's fmix32).
_K1 = 0x5BD1E9955BD1E995
_K2 = 0x27D4EB2F165667C5
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35
_LOW32 = (1 << 32) - 1
_CHUNK = 1 << 24  # elements per torch-path chunk: bounds its int64 temporaries to 128 MiB
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ALIGN = 16  # bytes, and elements per kernel length: what lets the kernel's loads be 16 bytes wide
_BLOCK = 4096  # elements per load of the kernel
_STEPS = 64  # loads per program at most: 256 Ki elements (closer to the read floor than 256; bench_fingerprint)
_PROGRAMS_PER_SM = 8  # at least, where a launch has that many blocks
_TEMP_BYTES = 1 << 28  # casts and copies held at once by the check (it runs beside the KV cache)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened and viewed as integers of its element width (the bit patterns, not the values)."""
    flat = t.detach().reshape(-1)  # copies only a tensor that cannot be viewed flat
    if flat.dtype.is_floating_point or flat.dtype not in _INT_VIEW.values():
        flat = flat.view(_INT_VIEW[flat.element_size()])
    return flat


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    """fmix32 on int64 `x` holding zero-extended 32-bit values; int64 products wrap, their low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _LOW32
    x = x ^ (x >> 13)
    x = (x * _M2) & _LOW32
    return x ^ (x >> 16)


def _mix64_torch(x: torch.Tensor) -> torch.Tensor:
    """The 64-bit mix on int64 `x` (bit patterns): two multiply/xor-shift rounds, logical shifts."""
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
        out += (_mix32_torch(x) if width <= 32 else _mix64_torch(x)).sum()  # int64 sums wrap: exact mod 2**64


@functools.cache
def _triton_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # One launch folds every tensor of one element width, so a check of a model's few hundred tensors is a few
    # launches, not a few hundred: one launch per tensor costs Python and launch time per tensor, many times the
    # time of reading them (benchmarks/results/verify_cost_h100).
    # `table` lists, for each of the `items` tensors, its first program (and, last, the grid's size), its address,
    # its length and its output slot; a program finds its tensor by a binary search over the first programs and
    # folds `steps` * BLOCK of its elements. `_Folder` hands it only 16-byte-aligned addresses and lengths divisible
    # by 16: the hints below let the loads be 16 bytes wide. `items` is left unspecialized, so one variant per
    # element width serves every call, and the ones `warm_up` compiles are the ones the check uses.
    @triton.jit(do_not_specialize=["items", "steps"])
    def fold(table_ptr, out_ptr, items, steps, K1: tl.constexpr, K2: tl.constexpr, M1: tl.constexpr,
             M2: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        g = tl.program_id(0).to(tl.int64)
        lo = items * 0
        hi = items - 1
        while lo < hi:  # the last tensor whose first program is at most g
            mid = (lo + hi + 1) // 2
            if tl.load(table_ptr + mid) <= g:
                lo = mid
            else:
                hi = mid - 1
        address = tl.load(table_ptr + items + 1 + lo)
        if WIDTH == 8:
            x_ptr = address.to(tl.pointer_type(tl.uint8))
        elif WIDTH == 16:
            x_ptr = address.to(tl.pointer_type(tl.uint16))
        elif WIDTH == 32:
            x_ptr = address.to(tl.pointer_type(tl.uint32))
        else:
            x_ptr = address.to(tl.pointer_type(tl.uint64))
        x_ptr = tl.multiple_of(x_ptr, 16)
        n = tl.multiple_of(tl.load(table_ptr + 2 * items + 1 + lo), 16)
        start = (g - tl.load(table_ptr + lo)) * steps * BLOCK
        lanes = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        for i in range(tl.minimum(tl.cdiv(n - start, BLOCK), steps)):  # a short tensor's program loads it once
            base = start + i * BLOCK
            x = tl.load(x_ptr + base + lanes, mask=lanes < n - base, other=0)
            if WIDTH == 64:
                z = x * tl.full([BLOCK], K1, tl.uint64)
                z = z ^ (z >> 31)
                z = z * tl.full([BLOCK], K2, tl.uint64)
                z = z ^ (z >> 29)
                acc += z
            else:
                w = x.to(tl.uint32)  # unsigned: zero-extended, the bits
                w = w ^ (w >> 16)
                w = w * M1  # uint32 products wrap, as fmix32 wants
                w = w ^ (w >> 13)
                w = w * M2
                w = w ^ (w >> 16)
                acc += w.to(tl.uint64)
        slot = tl.load(table_ptr + 3 * items + 1 + lo)
        tl.atomic_add(out_ptr + slot, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))

    return triton, fold


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


class _Folder:
    """Folds tensors into `out[slot]` (int64 sums that wrap, exact mod 2**64). With the kernel, the 16-byte-aligned
    bulk of each waits for `flush`, which folds all of one element width in one launch; the few elements before
    and after the bulk fold at once in torch ops. Without it, everything folds at once in torch ops."""

    def __init__(self, out: torch.Tensor, use_kernel: bool) -> None:
        self.out = out
        self.kernel = _triton_kernel() if use_kernel else None
        # element size -> (tensor, kept alive until its launch; its aligned bulk's address and length; slot)
        self.pending: dict[int, list[tuple[torch.Tensor, int, int, int]]] = {}
        self.temp_bytes = 0  # held by the pending temporaries
        # The launches' tables in page-locked memory, which the kernels read: kept as long as the folder, which
        # `fold_into` holds until its readback has waited for the stream.
        self.keep: list[torch.Tensor] = []

    def add(self, t: torch.Tensor, slot: int) -> None:
        if self.kernel is None:
            _fold_torch(t, self.out[slot: slot + 1])
            return
        if not t.is_contiguous():
            self._room_for(t.numel() * t.element_size())
            t = t.contiguous()
        # The kernel needs only the address: no views on this path, which runs for every tensor of a model.
        size, n, address = t.element_size(), t.numel(), t.data_ptr()
        head = min((-address % _ALIGN) // size, n)
        bulk = (n - head) // _ALIGN * _ALIGN
        if bulk < n:  # rare: a view off a 16-byte boundary, or a length not divisible by 16
            flat = _bits(t)
            for part in (flat[:head], flat[head + bulk:]):
                if part.numel():
                    _fold_torch(part, self.out[slot: slot + 1])
        if bulk:
            self.pending.setdefault(size, []).append((t, address + head * size, bulk, slot))

    def add_cast(self, t: torch.Tensor, dtype: torch.dtype, slot: int) -> None:
        """Fold `t` cast to `dtype`."""
        self._room_for(t.numel() * dtype.itemsize)
        self.add(t.to(dtype), slot)

    def _room_for(self, nbytes: int) -> None:
        """A temporary (a cast, a contiguous copy of a strided tensor) lives until its launch: launch what is
        pending first if the temporaries would hold more than `_TEMP_BYTES`."""
        if self.temp_bytes + nbytes > _TEMP_BYTES:
            self.flush()
        self.temp_bytes += nbytes

    def flush(self) -> None:
        """Launch the kernel over what is pending. `out` holds the sums once the current stream has passed it."""
        if self.kernel is not None:
            triton, kernel = self.kernel
            for size, items in self.pending.items():
                _, addresses, lengths, slots = zip(*items)
                # Loads per program: up to _STEPS, over which a program's search, reduction and atomic add spread,
                # but enough programs to keep every SM loading (a launch of one cast tensor, flushed alone).
                steps = max(1, min(_STEPS, sum(lengths) // (_BLOCK * _PROGRAMS_PER_SM * _sms(self.out.device))))
                per_program = _BLOCK * steps
                firsts = list(itertools.accumulate((triton.cdiv(n, per_program) for n in lengths), initial=0))
                table, host = to_device(firsts + [*addresses, *lengths, *slots], self.out.device)
                with torch.cuda.device(self.out.device) if self.out.is_cuda else contextlib.nullcontext():
                    kernel[(firsts[-1],)](table, self.out, len(items), steps, K1=_K1, K2=_K2, M1=_M1, M2=_M2,
                                          WIDTH=size * 8, BLOCK=_BLOCK, num_warps=8)
                if host is not None:
                    self.keep.append(host)
        self.pending.clear()
        self.temp_bytes = 0


def warm_up(device: torch.device) -> threading.Thread | None:
    """Compile the CUDA kernel for 2- and 4-byte elements (bf16/fp16 and fp32 weights) in a background thread, on a
    stream of its own, so the first weight check does not wait for Triton to compile (seconds, against
    milliseconds for a later check: benchmarks/results/cold_start_h100). Started at attach before the engine is
    built, so it runs under the engine's start; attach joins the thread it returns before returning itself, so no
    check runs beside it. The thread may run while vLLM captures CUDA graphs: it is allowed CUDA calls then
    (`allow_calls_during_capture`). None without CUDA."""
    if device.type != "cuda":
        return None

    def compile_kernel() -> None:
        try:
            with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
                cuda_compat.allow_calls_during_capture()
                # 64 elements of each width: an aligned bulk, the one variant every later call uses.
                fold_into([torch.ones(64, dtype=d, device=device) for d in (torch.int16, torch.int32)])
                to_list(torch.zeros(1, dtype=torch.float64, device=device))  # what distributed.all_reduce reads
        except Exception:  # the check compiles it then, on its own thread
            logger.warning("compiling the fingerprint kernel ahead failed", exc_info=True)

    thread = threading.Thread(target=compile_kernel, name="swaprl-fingerprint-warm-up", daemon=True)
    thread.start()
    return thread


def fold_into(tensors: Sequence[torch.Tensor | None], *, cast: Sequence[torch.dtype | None] | None = None,
              device: torch.device | None = None) -> list[int]:
    """The fingerprint of each tensor (None counts as empty), each cast first to `cast[i]` where given.

    All tensors of one call live on one device; their fingerprints accumulate there and come back in one copy.
    """
    devices = {t.device for t in tensors if t is not None and t.numel()}
    if len(devices) > 1:
        raise ValueError(f"fold_into() takes tensors of one device, got {sorted(map(str, devices))}")
    where = devices.pop() if devices else (device or torch.device("cpu"))
    use_triton = where.type == "cuda"
    out = torch.zeros(len(tensors), dtype=torch.int64, device=where)
    folder = _Folder(out, use_triton)
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if t is None or t.numel() == 0:
                continue
            want = cast[i] if cast is not None else None
            if want is not None and t.dtype != want:
                # Cast a piece at a time: a whole fp32 embedding cast to bf16 at once could need gigabytes.
                flat = t.detach().reshape(-1)
                step = _TEMP_BYTES // want.itemsize
                for lo in range(0, flat.numel(), step):
                    folder.add_cast(flat[lo: lo + step], want, i)
            else:
                folder.add(t, i)
        folder.flush()
    return [v & MASK for v in to_list(out)]


def fingerprint(t: torch.Tensor) -> int:
    """The fingerprint of one tensor (see the module's docstring)."""
    return fold_into([t])[0]


def combine(values: Sequence[int], times: int = 1) -> int:
    """Fingerprints of disjoint parts summed into the whole's, each counted `times` times (replicated copies)."""
    return (times * sum(values)) & MASK


# ---------------------------------------------------------------- whole modules, shards, engine groups
class WeightPrint(NamedTuple):
    """One tensor an engine holds, as the weight check sees it (`swaprl.verify`)."""

    fingerprint: int
    """`swaprl.fingerprint` of the tensor, summed over the ranks that hold one engine's shards or replicas."""
    numel: int
    """Elements held, summed likewise (0: held in a form that cannot be read back)."""
    dtype: torch.dtype
    sources: tuple[str, ...]
    """The checkpoint names loaded into it: one, or several for a fused tensor (q, k, v into vLLM's qkv_proj)."""


def module_fingerprints(model: torch.nn.Module, *, sent: dict[str, torch.dtype] | None = None,
                        held: dict[str, torch.dtype] | None = None) -> dict[str, tuple[int, int]]:
    """(fingerprint, numel) of each parameter by checkpoint name, whole even when sharded, cast to `sent[name]`
    and then to `held[name]` where given (what the sync sends, then what the engine stores).

    An FSDP2 parameter's fingerprint is the sum of its shards', reduced over its mesh, and a DeepSpeed ZeRO-3
    parameter's the sum of its partitions', reduced over its partition group (`swaprl.compat.deepspeed.local_part`):
    nothing is gathered. Collective under torchrun when the model has DTensor or ZeRO-3 parameters. Tied names share
    one computation.
    """
    named = trainer_weights(model)
    sent, held = sent or {}, held or {}
    first: dict[tuple[int, torch.dtype | None, torch.dtype | None], str] = {}
    unique: list[str] = []
    for name, p in named.items():
        key = (id(p), sent.get(name), held.get(name))
        if key not in first:
            first[key] = name
            unique.append(name)
    by_mesh: dict[object, list[str]] = {}  # a mesh, or a ZeRO-3 partition group: what the parts are summed over
    local: dict[str, torch.Tensor | None] = {}
    for name in unique:
        p = named[name]
        mesh = _shard_mesh(p)
        if mesh is not None:
            by_mesh.setdefault(mesh, []).append(name)
            local[name] = p.to_local()
        elif deepspeed_compat.is_partitioned(p):
            local[name], group = deepspeed_compat.local_part(p)
            by_mesh.setdefault(_Group(group), []).append(name)
        elif hasattr(p, "full_tensor"):  # another DTensor layout: gather this one parameter (collective)
            local[name] = p.full_tensor()
        else:
            local[name] = p
    values = dict(zip(unique, _fold_cast([local[n] for n in unique], [sent.get(n) for n in unique],
                                         [held.get(n) for n in unique])))
    for mesh, names in by_mesh.items():  # shards -> whole: one sum over each mesh
        summed = _all_reduce_sum([values[n] for n in names], mesh.get_group())
        values.update(zip(names, (v & MASK for v in summed)))
    out = {}
    for name, p in named.items():
        origin = first[(id(p), sent.get(name), held.get(name))]
        out[name] = (values[origin], deepspeed_compat.full_numel(p))
    return out


def _fold_cast(tensors: list[torch.Tensor], sent: list, held: list) -> list[int]:
    """Fingerprints of `tensors`, each cast to its `sent` then `held` dtype, grouped by device."""
    out = [0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        casts = []
        for i in idx:
            t, s, h = tensors[i], sent[i], held[i]
            if s is not None and h is not None and s != h and t.dtype != s:
                # Two casts (trainer -> sent -> held) are not one: cast to the sent dtype here, the kernel casts on.
                tensors[i] = t = t.detach().to(s)
            casts.append(h if h is not None else s)
        for i, v in zip(idx, fold_into([tensors[i] for i in idx], cast=casts)):
            out[i] = v
    return out


class _Group:
    """A process group where `module_fingerprints` wants a mesh: what it sums the parts over."""

    def __init__(self, group) -> None:
        self.group = group

    def get_group(self):
        return self.group

    def __hash__(self) -> int:
        return id(self.group)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Group) and other.group is self.group


def _shard_mesh(p: torch.Tensor):
    """The 1-D device mesh a DTensor parameter is sharded over (FSDP2), or None."""
    placements = getattr(p, "placements", None)
    mesh = getattr(p, "device_mesh", None)
    if placements is None or mesh is None or mesh.ndim != 1:
        return None
    return mesh if all(pl.is_shard() for pl in placements) else None


def _all_reduce_sum(values: list[int], group) -> list[int]:
    import torch.distributed as dist

    device = (torch.device("cuda", torch.cuda.current_device())
              if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available() else torch.device("cpu"))
    t = torch.tensor(values, dtype=torch.int64, device=device)  # each < 2**48: the sum of 2**15 ranks fits
    dist.all_reduce(t, group=group)
    return to_list(t)


def sum_over_group(prints: dict[str, WeightPrint], group) -> dict[str, WeightPrint]:
    """Each tensor's fingerprint and element count summed over the ranks of `group` (one engine's ranks, which
    hold its tensors in shards or replicas); `prints` must list the same names on every rank."""
    if group is None:
        return prints
    names = sorted(prints)
    summed = _all_reduce_sum([prints[n].fingerprint for n in names] + [prints[n].numel for n in names], group)
    k = len(names)
    return {n: WeightPrint(summed[i] & MASK, summed[k + i], prints[n].dtype, prints[n].sources)
            for i, n in enumerate(names)}
