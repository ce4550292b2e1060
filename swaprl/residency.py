"""Moving tensor storage between the device and reusable host buffers, keeping every tensor's identity.

A tensor is moved by copying its bytes into a slice of a host buffer and then pointing the *same* tensor object at
that slice (`tensor.data = host_view`); it comes back by the reverse. Parameters stay the same `nn.Parameter`
objects and optimizer state tensors the same entries of `optimizer.state`, so optimizers, hooks and user code keep
their references. While a tensor lives on the host it still holds correct data: `optimizer.state_dict()` or
`model.state_dict()` taken in the `generate` phase is complete (its offloaded tensors are host tensors). Like any
state dict it aliases live state: save it (or copy it) before the next `generate` phase reuses the host buffer.

Why `.data` and not `untyped_storage().resize_(0)` (what FSDP and torch_memory_saver do): a tensor whose storage
was resized to zero crashes the process on its next access (a segmentation fault on CPU), while a tensor whose data
sits on the host stays safe to read, save and even modify.

Host buffers are allocated once per resource and reused, and locked ahead where their size is known (`prepare`, in
a background thread from attach): locking fresh memory costs faulting its pages in, ten times faster the way it is done
here than through torch's pinned allocator (bench_host_lock), while copies into locked pages run at PCIe speed. On a
host with several NUMA nodes the pages are asked for on the GPU's own node (`memory.gpu_numa_node`) before they are
first touched.
Copies run on a side CUDA stream; the offload waits for its copies once
(the device memory is released only when the bytes are safe) and can be started early and finished later, so
that its copies run under other work; the reload does not block the host at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import interrupts, memory
from .compat import cuda as cuda_compat
from .compat import torch as torch_compat

logger = logging.getLogger(__name__)

_ALIGN = 512  # host slices start on 512-byte boundaries: any dtype views them, and DMA runs at full speed
# torch's caching allocator rounds a large segment (a request of 10 MiB or more) up to 2 MiB, and smaller large
# requests share 20 MiB segments (CUDACachingAllocator's kLargeBuffer, kRoundLarge)
_WHOLE_SEGMENT_MIN, _LARGE_ROUND = 10 * 2**20, 2 * 2**20


def align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_dense(t: torch.Tensor) -> bool:
    """True when `t` covers exactly numel elements of its storage span (any dimension order, no gaps)."""
    if t.numel() <= 1:
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def check_dense(tensors: list[torch.Tensor], action: str, fix: str) -> None:
    """Refuse to `action` ("offload a tensor") one with gaps in its storage: its bytes are copied as one run, which
    for such a tensor would include (and later overwrite) memory that is not its own."""
    for t in tensors:
        if t.layout != torch.strided:
            raise ValueError(f"cannot {action} of layout {t.layout} (shape {tuple(t.shape)}): only dense tensors have "
                             f"bytes of their own to move; {fix}")
        if not is_dense(t):
            raise ValueError(f"cannot {action} with gaps in its storage (shape {tuple(t.shape)}, stride "
                             f"{t.stride()}); {fix}")


class HostBuffer:
    """One host byte buffer, allocated on first use and grown only when a larger set of tensors arrives.

    `prepare(size)` allocates and page-locks it in a background thread (at attach, while the engine starts); attach
    waits for it before returning (`settle`, `attach_waited_seconds`), and whatever needs the bytes before that
    (`ensure`, `span`) waits for the thread, the time it waited kept in `waited_seconds`.
    """

    def __init__(self, name: str, *, pin: bool, device: int | None = None) -> None:
        self.name = name
        self.pin = pin and torch.cuda.is_available()
        self._device = device  # the GPU it copies to and from (None: the current one when it allocates)
        self._buf: torch.Tensor | None = None
        self._registered = False
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._made: tuple[torch.Tensor, bool] | BaseException | None = None
        self.lock_seconds: float | None = None  # the last allocation's (and locking's) wall time
        self.lock_span: tuple[float, float] | None = None  # ... and when it ran (time.time()), for the report
        self.background = False  # whether it ran in a background thread
        self.waited_seconds = 0.0  # what moves spent waiting for a background preparation
        self.attach_waited_seconds = 0.0  # what attach spent waiting for it before returning (`settle`)
        self.numa_node: int | None = None  # the NUMA node its pages were asked for (None: the kernel's choice)

    @property
    def capacity(self) -> int:
        """Bytes held, or being prepared in the background."""
        if self._thread is not None:
            return self._pending
        return 0 if self._buf is None else self._buf.numel()

    @property
    def locked_bytes(self) -> int:
        return self._buf.numel() if self._buf is not None and (self._registered or self._buf.is_pinned()) else 0

    def prepare(self, size: int) -> None:
        """Start allocating (and page-locking) `size` bytes in a background thread, unless it holds that many."""
        if size <= 0 or self.capacity >= size:
            return
        self.release()
        self.numa_node = self._node()
        self._in_background(lambda: _host_empty(size, pin=self.pin, node=self.numa_node), size)

    def _in_background(self, make: Callable[[], tuple[torch.Tensor, bool]], size: int) -> None:
        """Run `make` (which returns the buffer and whether it registered it) in a thread on the buffer's GPU;
        `_settle` takes its result."""
        self._pending, self._made = size, None
        device = self._gpu() if self.pin else None

        def run() -> None:
            start, wall = time.perf_counter(), time.time()
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # a new thread starts on device 0
                    cuda_compat.allow_calls_during_capture()  # it may lock while vLLM captures its graphs
                self._made = make()
            except BaseException as exc:  # handed to the thread that waits for the buffer
                self._made = exc
            self.lock_seconds = time.perf_counter() - start
            self.lock_span, self.background = (wall, wall + self.lock_seconds), True

        # Held: a thread recorded but not started (a Ctrl-C inside start()) would fail every later join.
        with interrupts.held(f"starting the preparation of host buffer {self.name!r}"):
            self._thread = threading.Thread(target=run, name=f"swaprl-host-{self.name}", daemon=True)
            self._thread.start()

    def settle(self) -> float:
        """Wait for a background preparation to finish and take its buffer; returns the seconds waited. Attach
        calls it before returning; the time is `attach_waited_seconds`, apart from what a move waited later."""
        start = time.perf_counter()
        self._settle(count=False)
        waited = time.perf_counter() - start
        self.attach_waited_seconds += waited
        return waited

    def _settle(self, *, count: bool = True) -> None:
        """Wait for a background preparation and take its buffer (`count`: the wait goes to `waited_seconds`)."""
        if self._thread is None:
            return
        start = time.perf_counter()
        self._thread.join()
        if count:
            self.waited_seconds += time.perf_counter() - start
        made, self._thread, self._made = self._made, None, None
        if isinstance(made, BaseException):
            logger.warning("preparing host buffer %r in the background failed (%s); it is allocated when first "
                           "needed", self.name, made)
            return
        self._buf, self._registered = made
        logger.info("host buffer %r: %.2f GiB%s prepared in the background in %.2f s", self.name,
                    self._buf.numel() / 2**30, " pinned" if self.locked_bytes else "", self.lock_seconds)

    def ensure(self, size: int, *, lock: bool = True) -> torch.Tensor:
        """The buffer, reallocated (contents lost) if it holds fewer than `size` bytes.

        `lock=False` leaves a new allocation pageable until `lock()`: filled from other host memory, a buffer
        locked first would commit all of its pages while its sources still hold as much again.
        """
        self._settle()
        if self._buf is not None and self._buf.numel() >= size:
            return self._buf
        self.release()
        self.numa_node = self._node()
        start, wall = time.perf_counter(), time.time()
        if lock:
            self._buf, self._registered = _host_empty(size, pin=self.pin, node=self.numa_node)
        else:
            self._buf, self._registered = torch.empty(max(size, 1), dtype=torch.uint8), False
            _advise_huge_pages(self._buf)  # filled by copies: fewer, larger pages to fault in
            _prefer_node(self._buf, self.numa_node)
        self.lock_seconds = time.perf_counter() - start
        self.lock_span, self.background = (wall, wall + self.lock_seconds), False
        logger.info("host buffer %r: allocated %.2f GiB%s in %.2f s", self.name, size / 2**30,
                    " pinned" if self.pin and lock else "", self.lock_seconds)
        return self._buf

    def _gpu(self) -> int:
        return torch.cuda.current_device() if self._device is None else self._device

    def _node(self) -> int | None:
        """The NUMA node this buffer's pages belong on: its GPU's, the one it copies to and from (which need not be
        the current device of the thread that allocates it)."""
        return memory.gpu_numa_node(self._gpu()) if self.pin else None

    def lock(self, *, background: bool = False) -> None:
        """Page-lock a buffer that `ensure(..., lock=False)` allocated; nothing to do if it is locked already.
        `background`: in a thread, so the caller goes on at once; whatever needs the buffer next waits for it."""
        self._settle()
        if not self.pin or self._buf is None or self._registered or self._buf.is_pinned():
            return
        buf = self._buf
        if background:
            self._buf = None  # held by the thread until `_settle`
            self._in_background(lambda: (buf, _register(buf, self.name)), buf.numel())
            return
        self._registered = _register(buf, self.name)

    def holds(self, m: Moved) -> bool:
        """Whether `m` still sits at its own offset of this buffer."""
        self._settle()
        return self._buf is not None and m.host_ptr == self._buf.data_ptr() + m.offset == m.tensor.data_ptr()

    def span(self, end: int) -> torch.Tensor:
        """The first `end` bytes of the buffer."""
        self._settle()
        if self._buf is None or end > self._buf.numel():
            raise ValueError(f"host buffer {self.name!r} holds {self.capacity} bytes, not {end}")
        return self._buf[:end]

    def release(self) -> None:
        """Drop the buffer (after a background preparation finishes: it cannot be stopped halfway). Tensors still
        viewing it keep its memory alive (no longer page-locked) until they go."""
        if self._thread is not None:
            self._thread.join()
            self._settle()
        if self._buf is not None and self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._buf.data_ptr())
        self._buf, self._registered = None, False

    def __del__(self) -> None:
        # Registered pages must be unregistered before the allocation is freed: the driver otherwise keeps the
        # range registered and a later allocation reusing those addresses fails with "resource already mapped".
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _whole_pages(buf: torch.Tensor, page: int) -> tuple[int, int]:
    """The addresses [start, end) of the whole `page`-sized pages inside `buf` (start >= end when there are none):
    the kernel's memory-policy calls take page-aligned ranges, and the pages at either edge may hold other data."""
    return (buf.data_ptr() + page - 1) // page * page, (buf.data_ptr() + buf.numel()) // page * page


def _advise_huge_pages(buf: torch.Tensor) -> None:
    """Ask the kernel for transparent huge pages over `buf` (Linux; a no-op where THP is off or unknown): a 2 MiB page
    is faulted in at once instead of 512 small ones, faster to touch (bench_host_lock measures both)."""
    if not sys.platform.startswith("linux") or buf.numel() < 2 * _HUGE_PAGE:
        return
    start, end = _whole_pages(buf, _HUGE_PAGE)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def _host_empty(size: int, *, pin: bool, node: int | None = None) -> tuple[torch.Tensor, bool]:
    """An uninitialised host byte tensor of exactly `size` bytes, page-locked when `pin`, its pages on NUMA node
    `node` where the kernel can (`_prefer_node`).

    torch's `pin_memory=True` goes through its caching host allocator, which rounds every request up to a power of
    two (a 12 GiB optimizer would take 16 GiB of locked host memory) and locks slowly. Locking costs faulting
    every page in (the kernel zeroes each) more than pinning it, and one thread faults slowly. So the pages are asked
    to be huge, written by all of torch's threads at once (`zero_`), then registered with `cudaHostRegister` as one
    range (a copy that straddles two registrations is refused by the driver); bench_host_lock measures each way.
    The caching allocator is the fallback.
    """
    buf = torch.empty(max(size, 1), dtype=torch.uint8)
    if not pin:
        return buf, False
    _advise_huge_pages(buf)
    _prefer_node(buf, node)  # before the pages are touched: a page's node is chosen when it is first faulted in
    buf.zero_()
    if _register(buf, "new", quiet=True) and buf.is_pinned():
        return buf, True
    logger.warning("cudaHostRegister failed; falling back to torch's pinned allocator")
    return torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True), False


_MPOL_PREFERRED = 1
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}  # the mbind system call's number (glibc has no wrapper)


def _prefer_node(buf: torch.Tensor, node: int | None) -> bool:
    """Ask the kernel to place the pages of `buf` not yet touched on NUMA node `node` (mbind, MPOL_PREFERRED, over
    the whole pages inside it); True if it agreed. Preferred, not bound: when that node runs out the kernel takes
    pages from another rather than failing the fault. A no-op (False) for `node` None or off Linux."""
    number = _SYS_MBIND.get(os.uname().machine) if sys.platform.startswith("linux") else None
    start, end = _whole_pages(buf, os.sysconf("SC_PAGE_SIZE")) if number else (0, 0)
    if node is None or number is None or end <= start or not 0 <= node < 64:
        return False
    mask = ctypes.c_ulong(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    err = libc.syscall(number, ctypes.c_void_p(start), ctypes.c_ulong(end - start), _MPOL_PREFERRED,
                       ctypes.byref(mask), ctypes.c_ulong(64 + 1), 0)
    if err != 0:  # the buffer still works, its pages wherever the kernel puts them
        logger.warning("could not ask for host memory on NUMA node %d (mbind: %s); copies to and from it may cross "
                       "the link between sockets", node, os.strerror(ctypes.get_errno()))
        return False
    return True


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context, whichever device registered it


def _register(buf: torch.Tensor, name: str, *, quiet: bool = False) -> bool:
    """Page-lock `buf` where it is (`cudaHostRegister`, one range: a copy straddling two registrations is refused)."""
    start = time.perf_counter()
    torch.cuda.init()  # register with the context torch's copies will use, not one the runtime creates implicitly
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), _HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        if not quiet:
            # Copying into torch's pinned allocator instead would take twice the memory for a moment; stay pageable.
            logger.warning("cudaHostRegister of host buffer %r failed (%s); its copies run at pageable speed",
                           name, err)
        return False
    if not quiet:
        logger.info("host buffer %r: page-locked %.2f GiB in %.2f s", name, buf.numel() / 2**30,
                    time.perf_counter() - start)
    return True


@dataclass(slots=True)
class Moved:
    """A tensor now living in a host slice: enough to put it back exactly as it was."""

    tensor: torch.Tensor
    offset: int
    device: torch.device
    host_ptr: int


def layout_bytes(tensors: list[torch.Tensor]) -> int:
    """Host bytes needed to hold `tensors` back to back with the buffer's alignment."""
    return sum(align(nbytes(t)) for t in tensors)


def host_view(buf: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
    """`t`'s dtype, shape and strides over the bytes of `buf` starting at `offset` (host or device)."""
    return buf[offset:offset + nbytes(t)].view(t.dtype).as_strided(t.shape, t.stride())


@dataclass(slots=True)
class PendingOffload:
    """An offload whose copies were queued but whose tensors still point at the device."""

    plan: list[tuple[torch.Tensor, int, torch.Tensor]]
    event: torch.cuda.Event | None

    @property
    def bytes(self) -> int:
        return sum(nbytes(t) for t, _, _ in self.plan)


class Mover:
    """Copies sets of tensors device <-> host buffer on one side stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start_offload(self, tensors: list[torch.Tensor], buffer: HostBuffer) -> PendingOffload:
        """Queue the copies of `tensors` into `buffer` on the side stream and return at once.

        The tensors keep their device data until `finish`; they must not be written in between (the runtime only
        starts an offload of state that nothing touches until it is back). `cancel` drops the copies instead.
        """
        check_dense(tensors, "offload a tensor", "make it contiguous before attaching")
        plan: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        if not tensors:  # nothing to move (an optimizer before its first step): allocate nothing
            return PendingOffload(plan, None)
        buf = buffer.ensure(layout_bytes(tensors))
        offset = 0
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for t in tensors:
                host = host_view(buf, offset, t)
                host.copy_(t.data, non_blocking=self.stream is not None)
                plan.append((t, offset, host))
                offset += align(nbytes(t))
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        return PendingOffload(plan, event)

    def finish(self, pending: PendingOffload) -> list[Moved]:
        """Wait for a started offload and re-point its tensors at their host copies.

        Nothing is re-pointed until every copy has finished, and an interruption while re-pointing puts back what
        was already switched: either all of the tensors end on the host or none does.
        """
        if pending.event is not None:
            pending.event.synchronize()  # the device copies may be freed only once the bytes are on the host
        moved: list[Moved] = []
        originals: list[torch.Tensor] = []
        try:
            for t, off, host in pending.plan:
                originals.append(t.data)
                t.data = host
                moved.append(Moved(t, off, self.device, host.data_ptr()))
        except BaseException:
            for m, original in zip(moved, originals):
                m.tensor.data = original
            raise
        return moved

    @staticmethod
    def cancel(pending: PendingOffload) -> None:
        """Drop a started offload: the tensors never left the device; wait so the buffer can be reused."""
        if pending.event is not None:
            pending.event.synchronize()

    def reload(self, moved: list[Moved], *, wait: bool = True, buffer: HostBuffer | None = None,
               one_segment: bool = False) -> torch.cuda.Event | None:
        """Bring `moved` back to the device. All allocations happen before any tensor is re-pointed, so an
        out-of-memory error leaves every tensor on the host, intact.

        With `wait=False` the compute stream is not made to wait for the copies: the returned event marks their
        end, and whoever reads the tensors first must wait on it (the runtime does, at `optimizer.step()`).
        `one_segment`: the device memory is one segment of its own even under expandable segments
        (`compat.torch.whole_segments`), for tensors that stay until the next offload, after which the runtime hands
        the cache back. Not for tensors whose memory may be freed before (gradients, at `zero_grad`): the segment's
        free space would be cut up by the next backward, and strand."""
        todo = []
        for m in moved:
            if m.tensor.data_ptr() != m.host_ptr:
                # The user replaced this tensor's data while it was on the host (e.g. load_state_dict): theirs wins.
                logger.warning("tensor of shape %s was replaced while offloaded; keeping the replacement",
                               tuple(m.tensor.shape))
                continue
            todo.append(m)
        # One allocation for the whole set, carved like the host buffer: after the runtime hands torch's cache back
        # to the driver, a few hundred separate cudaMallocs would cost more than the copies themselves.
        end = max((m.offset + align(nbytes(m.tensor)) for m in todo), default=0)
        if one_segment and end >= _WHOLE_SEGMENT_MIN:
            # Asked in whole units of torch's large segments, the block fills its segment: no free tail that another
            # allocation could take and keep, which would keep the whole segment from going back to the driver.
            with torch_compat.whole_segments(self.device):
                flat = torch.empty(-(-end // _LARGE_ROUND) * _LARGE_ROUND, dtype=torch.uint8, device=self.device)
        else:
            flat = torch.empty(end, dtype=torch.uint8, device=self.device)
        fresh = [host_view(flat, m.offset, m.tensor) for m in todo]
        in_one_span = bool(todo) and buffer is not None and len(todo) == len(moved) and all(map(buffer.holds, todo))
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            if in_one_span:
                flat[:end].copy_(buffer.span(end), non_blocking=self.stream is not None)
            else:
                for m, dev in zip(todo, fresh):
                    dev.copy_(m.tensor.data, non_blocking=self.stream is not None)
        done_event = None
        if self.stream is not None:
            flat.record_stream(self.stream)
            if wait:  # later work on the compute stream sees the copied bytes; the host is not blocked
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            else:
                done_event = torch.cuda.Event()
                done_event.record(self.stream)
        hosts = [m.tensor.data for m in todo]
        done = 0
        try:
            for m, dev in zip(todo, fresh):
                m.tensor.data = dev
                done += 1
        except BaseException:
            for m, host in zip(todo[:done], hosts):
                m.tensor.data = host
            raise
        return done_event


def savable(state_dict: dict) -> dict:
    """`optimizer.state_dict()` with each tensor that shares its storage with others (states carved out of one host
    buffer or one reload allocation) given a storage of its own, so `torch.save` writes each tensor's bytes only,
    whatever their dtypes (it refuses views of one storage as different types, and writes a shared storage whole).
    Host tensors only, and no copy: a second storage object over the same bytes. Device tensors are left as they
    are (copying them here would put every state on the host at each call). Nested dicts and lists are walked;
    everything else is kept as it is."""
    def own(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or t.untyped_storage().nbytes() == t.numel() * t.element_size():
            return t
        raw = t.detach().view(_SAME_SIZE_INT[t.element_size()]) if t.dtype not in _NUMPY else t.detach()
        alias = torch.from_numpy(raw.numpy())
        return alias.view(t.dtype) if alias.dtype != t.dtype else alias

    def walk(x):
        if isinstance(x, torch.Tensor):
            return own(x) if type(x) is torch.Tensor else x
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(state_dict)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY = (torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
          torch.bool)
