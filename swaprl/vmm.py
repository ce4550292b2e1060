"""Pausable device memory: a torch memory pool whose physical memory is released and restored at the same addresses.

    from swaprl import vmm
    if vmm.available():
        pool = vmm.PausablePool("engine", keep="allocated")
        with pool.use():                       # allocations on this thread go to the pool
            x = torch.ones(1 << 20, device="cuda")
        pool.pause()                           # device memory released; x's bytes kept on the host
        pool.resume()                          # mapped again at the same address; x holds what it held

The native part is `kernels/vmm_pool.cpp` (C++ against the CUDA driver's virtual-memory API; its header says how it
works and why it is bound this way). It is compiled on first use with the host C++ compiler into
`~/.cache/swaprl/kernels` (or `SWAPRL_CACHE_DIR`), keyed by the source's hash; `python -m swaprl.vmm` builds it
ahead and prints what it found. It needs `cuda.h` (a CUDA toolkit, found through `CUDA_HOME`, `/usr/local/cuda`
or the one Triton ships) and, to load, the CUDA driver. Without them `available()` is False and `unavailable()`
says why; everything else in swaprl works as without the pool (the engine then keeps its CUDA graphs and buffers on
the device while it sleeps).

Why a pool and not `cudaFree`: captured CUDA graphs and live tensors hold raw device addresses. Releasing the
physical memory while keeping the address range reserved (`cuMemUnmap` / `cuMemRelease`, the range still held) and
mapping new memory there later (`cuMemCreate` / `cuMemMap`) keeps every such address valid.

What survives a pause (`keep`): "allocated" copies the bytes of the pool's allocated blocks (live tensors:
persistent buffers, workspaces) to a page-locked host buffer and back; "nothing" keeps no bytes, for memory whose
contents are rewritten before they are read (a CUDA graph's private pool: its replay writes every intermediate
before reading it, and its inputs live elsewhere). Free blocks the caching allocator holds in the pool are never
copied.

To check that claim for a given program, set `SWAPRL_POOL_FILL=0xff` (any byte): every resume then writes that byte
over the memory it maps before restoring what was kept, so a read of memory the pause dropped sees NaN (in bf16 and
fp32) instead of stale bytes that may happen to be right. It costs a device memset per resume; leave it unset
otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from .compat import torch as torch_compat

logger = logging.getLogger(__name__)

KEEP = ("allocated", "nothing")
_LIBRARY = "libswaprl_vmm"
_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, or "error": why it cannot be; "slots": slots in use


def source_path() -> Path:
    """The native source: inside the installed package (a wheel) or the checkout's `kernels/` (editable)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_kernels" / "vmm_pool.cpp", here.parent / "kernels" / "vmm_pool.cpp"):
        if candidate.exists():
            return candidate
    raise FileNotFoundError("swaprl's native source vmm_pool.cpp is missing from the installation: reinstall swaprl "
                            "(pip install swaprl, or pip install -e . in a checkout)")


def cuda_include_dir() -> Path | None:
    """A directory with the CUDA driver API's header (cuda.h): CUDA_HOME's, /usr/local/cuda's, or Triton's copy."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates = [Path(r) / "include" for r in roots if r]
    try:
        import triton  # ships the header for its own launcher

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "include")
    except ImportError:
        pass
    return next((c for c in candidates if (c / "cuda.h").exists()), None)


def build(out_dir: Path | None = None, *, force: bool = False) -> Path:
    """Compile the native pool into `out_dir` (default: the cache); returns the library's path. Raises
    `RuntimeError` naming what is missing (compiler, cuda.h) or the compiler's own message."""
    src = source_path()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    out_dir = Path(out_dir or os.environ.get("SWAPRL_CACHE_DIR") or Path.home() / ".cache" / "swaprl") / "kernels"
    lib = out_dir / f"{_LIBRARY}-{digest}.so"
    if lib.exists() and not force:
        return lib
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found to build swaprl's pausable pool: install g++ (apt install g++) or "
                           "set CXX")
    include = cuda_include_dir()
    if include is None:
        raise RuntimeError("cuda.h not found to build swaprl's pausable pool: install the CUDA toolkit headers and "
                           "set CUDA_HOME to the toolkit's directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    # libcuda is not linked: it is resolved when the library loads, against the driver the process already uses
    # (loaded globally by `_load`), so building needs no driver and no stub library.
    cmd = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", f"-I{include}", str(src), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building swaprl's pausable pool failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: several ranks may build at once
    return lib


def _load() -> ctypes.CDLL:
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        if "error" in _state:
            raise RuntimeError(_state["error"])
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
            path = Path(os.environ["SWAPRL_VMM_LIBRARY"]) if os.environ.get("SWAPRL_VMM_LIBRARY") else build()
            lib = ctypes.CDLL(str(path))
        except (OSError, RuntimeError, FileNotFoundError) as exc:
            _state["error"] = f"swaprl's pausable pool is unavailable: {exc}"
            raise RuntimeError(_state["error"]) from exc
        lib.swaprl_vmm_error.restype = ctypes.c_char_p
        lib.swaprl_vmm_stat.restype = ctypes.c_uint64
        lib.swaprl_vmm_stat.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.swaprl_vmm_pause.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                                         ctypes.POINTER(ctypes.c_uint64), ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_uint64, ctypes.c_int]
        lib.swaprl_vmm_resume.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.swaprl_vmm_lend.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64),
                                        ctypes.c_int, ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
        lib.swaprl_vmm_unlend.argtypes = [ctypes.c_uint64, ctypes.c_int]
        lib.swaprl_vmm_lent_stat.restype = ctypes.c_uint64
        lib.swaprl_vmm_lent_stat.argtypes = [ctypes.c_int]
        lib.swaprl_vmm_page_bytes.restype = ctypes.c_int64
        lib.swaprl_vmm_page_bytes.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]
        _state["lib"], _state["path"], _state["slots"] = lib, path, set()
        return lib


def _resume_fill() -> int:
    """The byte `SWAPRL_POOL_FILL` names (e.g. "0xff"), written over what a resume maps and the pause did not keep;
    -1 without it."""
    raw = os.environ.get("SWAPRL_POOL_FILL", "").strip()
    if not raw:
        return -1
    try:
        value = int(raw, 0)
    except ValueError:
        value = -1
    if not 0 <= value <= 255:
        raise ValueError(f"SWAPRL_POOL_FILL={raw!r} is not a byte: set it to 0-255 (e.g. 0xff, which reads as NaN "
                         "in bf16 and fp32) or unset it")
    return value


def available() -> bool:
    """Whether the pausable pool can be used here (a CUDA device, and the native library built and loaded)."""
    try:
        _load()
        return True
    except RuntimeError:
        return False


def unavailable() -> str | None:
    """Why the pool cannot be used here, or None when it can."""
    try:
        _load()
        return None
    except RuntimeError as exc:
        return str(exc)


class PausablePool:
    """A `torch.cuda.MemPool` on the current device whose segments live in pausable device memory.

    name: for messages and reports. keep: what a pause preserves ("allocated": the bytes of allocated blocks,
    copied to a page-locked host buffer of this pool's; "nothing"). Allocations reach the pool inside `use()` (this
    thread's) or through its `id` (a CUDA graph capture given `pool=pool.id`). At most 8 pools per process.
    """

    def __init__(self, name: str, *, keep: str = "allocated") -> None:
        if keep not in KEEP:
            raise ValueError(f"PausablePool keep={keep!r}; use one of {', '.join(KEEP)}")
        lib = _load()
        from .residency import HostBuffer

        with _lock:
            # A closed pool's slot is reused once torch has freed all of its segments.
            free = [k for k in range(lib.swaprl_vmm_slots())
                    if k not in _state["slots"] and lib.swaprl_vmm_stat(k, 2) == 0]
            if not free:
                raise RuntimeError(f"all {lib.swaprl_vmm_slots()} pausable pools of this process are in use: close() "
                                   "one you no longer need")
            self.slot = free[0]
            _state["slots"].add(self.slot)
        self.name, self.keep = name, keep
        self.device = torch.cuda.current_device()
        self._lib = lib
        allocator = torch.cuda.memory.CUDAPluggableAllocator(str(_state["path"]), f"swaprl_vmm_malloc_{self.slot}",
                                                             f"swaprl_vmm_free_{self.slot}")
        self._allocator = allocator  # the MemPool holds only a raw pointer to it: keep it alive as long
        self.pool = torch.cuda.MemPool(allocator.allocator())
        self.host = HostBuffer(f"pool {name}", pin=True, device=self.device)
        self.kept_bytes = 0  # what the last pause copied to the host
        self.sealed = False
        self._routing = 0  # use() contexts open
        self._mapped_before_pause = 0

    @property
    def id(self) -> tuple[int, int]:
        if self.sealed:
            raise RuntimeError(f"pool {self.name!r} is sealed: nothing may allocate in it (a capture given its id "
                               "would); use another pool")
        return self.pool.id

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Route this thread's allocations on the pool's device to the pool (innermost pool wins when nested)."""
        if self.paused:
            raise RuntimeError(f"pool {self.name!r} is paused: resume() it before allocating in it")
        if self.sealed:
            raise RuntimeError(f"pool {self.name!r} is sealed: it holds memory only under its live blocks, so "
                               "nothing may allocate in it; use another pool")
        self._routing += 1
        try:
            with torch.cuda.use_mem_pool(self.pool, device=self.device):
                yield
        finally:
            self._routing -= 1

    @contextlib.contextmanager
    def stepped_out(self) -> Iterator[None]:
        """Inside `use()`: this thread's allocations go where they would without the pool, until the context ends."""
        torch_compat.stop_routing(self.device, self.pool.id)
        try:
            yield
        finally:
            torch_compat.start_routing(self.device, self.pool.id)

    def stat(self, which: int) -> int:
        return int(self._lib.swaprl_vmm_stat(self.slot, which))

    @property
    def reserved_bytes(self) -> int:
        """Address space the pool holds (its segments' sizes, paused or not)."""
        return self.stat(0)

    @property
    def mapped_bytes(self) -> int:
        """Device memory the pool holds now: its segments' sizes while running, 0 while paused."""
        return self.stat(1)

    @property
    def paused(self) -> bool:
        return bool(self.stat(3))

    @property
    def resume_bytes(self) -> int:
        """Device memory the next `resume()` maps: what the pool held before its pause (0 while running)."""
        return self._mapped_before_pause if self.paused else 0

    def allocated_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) of the pool's allocated blocks, adjacent ones of one segment merged, from torch's
        allocator. Blocks of two segments are never merged, even where the segments' address ranges touch: the
        native side copies each range within one segment's mapping."""
        ranges: list[tuple[int, int]] = []
        for seg in torch.cuda.memory.memory_snapshot(self.pool.id, include_traces=False):
            if seg.get("device") != self.device:
                continue
            addr = int(seg["address"])
            first = len(ranges)  # ranges before this index belong to earlier segments
            for block in seg["blocks"]:
                if block["state"] != "inactive":  # active_allocated, or freed but still used by a stream
                    if len(ranges) > first and ranges[-1][0] + ranges[-1][1] == addr:
                        ranges[-1] = (ranges[-1][0], ranges[-1][1] + int(block["size"]))
                    else:
                        ranges.append((addr, int(block["size"])))
                addr += int(block["size"])
        return ranges

    def pause(self) -> int:
        """Release the pool's device memory (keeping what `keep` says); returns the bytes released."""
        if self.paused:
            return 0
        ranges = self.allocated_ranges() if self.keep == "allocated" else []
        total = sum(n for _, n in ranges)
        host = self.host.ensure(total) if total else None
        ptrs = (ctypes.c_uint64 * len(ranges))(*(a for a, _ in ranges))
        sizes = (ctypes.c_uint64 * len(ranges))(*(n for _, n in ranges))
        mapped = self.mapped_bytes
        if self._lib.swaprl_vmm_pause(self.slot, ptrs, sizes, len(ranges), host.data_ptr() if host is not None else 0,
                                      host.numel() if host is not None else 0, self.device) != 0:
            raise RuntimeError(f"pausing pool {self.name!r} failed: {self._lib.swaprl_vmm_error().decode()}")
        self.kept_bytes = total
        self._mapped_before_pause = mapped
        return mapped

    def resume(self) -> None:
        """Map device memory under the pool again and restore what the pause kept. On failure (the device is out
        of memory) nothing stays mapped, the pool stays paused and raises `torch.OutOfMemoryError`."""
        if not self.paused:
            return
        fill = _resume_fill()
        if self._lib.swaprl_vmm_resume(self.slot, self.device, self.sealed, fill) != 0:
            torch.cuda.empty_cache()  # as torch's allocator does when cudaMalloc fails: hand back its cache, retry
        if self.paused and self._lib.swaprl_vmm_resume(self.slot, self.device, self.sealed, fill) != 0:
            raise torch.OutOfMemoryError(
                f"resuming pool {self.name!r} ({self.resume_bytes} bytes) failed: "
                f"{self._lib.swaprl_vmm_error().decode()}; free device memory and resume again (nothing was lost)")

    def seal(self) -> int:
        """Allocate nothing more in this pool, and from now on back only the memory under its live blocks (the
        granules that hold them), releasing its free cached blocks' memory at once; returns the bytes released.
        Call it outside `use()`, once whatever allocated here has finished; the pool still pauses and resumes."""
        if self.sealed:
            return 0
        if self._routing:
            raise RuntimeError(f"pool {self.name!r} still receives allocations: seal() it after its use() ends")
        before = self.mapped_bytes
        paused = self.paused
        self.pause()
        self.sealed = True
        if not paused:
            self.resume()
        return before - self.mapped_bytes

    def close(self) -> None:
        """Give the slot back. Call once nothing allocated in the pool is alive (and nothing captured in it will
        replay): torch then frees its segments."""
        self.resume()
        self.pool = None
        torch.cuda.empty_cache()  # the pool's cached segments go back to the driver (through swaprl_vmm_free)
        self.host.release()
        with _lock:
            _state["slots"].discard(self.slot)


def page_bytes(ptr: int, limit: int, device: int) -> int:
    """The bytes of the physical allocation mapped at `ptr` (the start of one, such as a page of torch's expandable
    segments), at most `limit`; 0 where none is mapped (memory from `cudaMalloc`)."""
    got = _load().swaprl_vmm_page_bytes(ptr, limit, device)
    if got < 0:
        raise RuntimeError(f"reading the page at {ptr:#x} failed: {_load().swaprl_vmm_error().decode()}")
    return int(got)


def lend(dst: int, size: int, pages: list[int], page: int, device: int, *, fill: int | None = None) -> None:
    """Back the reserved range [dst, dst + size) with the physical pages of `page` bytes that start at `pages` (in
    memory torch holds; the caller keeps it allocated while the range is lent), in order, and the rest of the range
    with memory of its own; `fill` (a byte) is written over the whole range. Raises `torch.OutOfMemoryError` when
    that memory cannot be created, RuntimeError otherwise; nothing is mapped then."""
    lib = _load()
    addresses = (ctypes.c_uint64 * len(pages))(*pages)
    if lib.swaprl_vmm_lend(dst, size, addresses, len(pages), page, device, -1 if fill is None else fill) != 0:
        why = lib.swaprl_vmm_error().decode()
        error = torch.OutOfMemoryError if "out of memory" in why.lower() else RuntimeError
        raise error(f"lending {len(pages)} pages to the range at {dst:#x} ({size} bytes) failed: {why}; nothing "
                    "was mapped")


def unlend(dst: int, device: int) -> bool:
    """Unmap a range `lend` backed (torch keeps its pages) and release its own memory; False if none is lent there."""
    lib = _load()
    rc = lib.swaprl_vmm_unlend(dst, device)
    if rc < 0:
        raise RuntimeError(f"unmapping the lent range at {dst:#x} failed: {lib.swaprl_vmm_error().decode()}")
    return rc == 0


def lent_mapped_bytes() -> tuple[int, int]:
    """Bytes of torch's pages mapped at lent ranges, and bytes created for what those ranges hold past their last
    whole page; (0, 0) when the library is not loaded."""
    if "lib" not in _state:
        return 0, 0
    lib = _state["lib"]
    return int(lib.swaprl_vmm_lent_stat(0)), int(lib.swaprl_vmm_lent_stat(1))


def main(argv: list[str] | None = None) -> int:
    """`python -m swaprl.vmm`: build the native pool and say whether it loads here."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m swaprl.vmm", description=main.__doc__)
    parser.add_argument("--out", type=Path, help="directory to build into (default: the cache)")
    parser.add_argument("--force", action="store_true", help="rebuild even if built already")
    args = parser.parse_args(argv)
    try:
        path = build(args.out, force=args.force)
    except (RuntimeError, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"built {path}")
    why = unavailable()
    print("loads here: yes" if why is None else f"loads here: no ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
