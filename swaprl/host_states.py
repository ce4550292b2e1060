"""The host buffer of the optimizer states that live in host memory (the "host" home), and the views of it that are
handed out.

`HostStates` keeps the states of the parameters it `owns` in one page-locked host buffer, laid out in parameter
order so that a chunk of consecutive parameters is one run of it (`swaprl.streaming` copies those runs through the
device inside `optimizer.step()`). A state tensor moves the way `swaprl.residency` moves any tensor: its bytes are
copied and the *same* tensor object is pointed at them (`tensor.data = ...`), so `optimizer.state` keeps its
entries. Between steps every state tensor is a complete host tensor: `optimizer.state_dict()` is a checkpoint as it
stands. An fp32 master (`swaprl.master`) is one more state of its parameter here, made in host memory and filled
where it is first placed.

A `state_dict()` taken by the user views the buffer (`residency.savable` gives each tensor its own storage object,
not its own bytes); plain torch leaves such a dict's tensors as they were when the optimizer moves on, so their
space is not written while they live (`note_views`), and a new layout leaves the old buffer to them.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .compat import torch as compat
from .compat.torch import local_tensor
from .master import MasterWeights
from .partitions import PartitionCopies
from .residency import HostBuffer, Moved, align, check_dense, host_view, is_dense, layout_bytes, nbytes

logger = logging.getLogger(__name__)

ZERO_START = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose states start as zeros: a parameter to be stepped in pieces gets them made at their host home
before its first step, so that step too takes it in pieces instead of making them whole on the device."""


@dataclass(slots=True)
class _Home:
    """Where a state tensor's data lives between steps: a slice of the host buffer, or (`offset` None) ordinary host
    memory, for states made by a step and not yet moved into the buffer."""

    tensor: torch.Tensor
    view: torch.Tensor
    offset: int | None


class HostStates:
    """The host-resident states of one optimizer's parameters that `owns(p)`, in `buffer`.

    `check_budget(growth, releasing, context)` is asked before the buffer grows by `growth` bytes while `releasing`
    bytes of ordinary host memory are about to be freed; it raises `HostBufferError` to refuse (the runtime's host
    budget), with `context` saying what state things are left in. `chunk_bytes`: the streamed step's chunk, which
    decides which parameters' first states are made here (`start_at_home`). `masters`: the fp32 masters, or the
    flat partitions that are copies (`swaprl.partitions.PartitionCopies`), each of which lives with its states.
    `params`: what lists the parameters with their groups, for an optimizer whose groups list them only inside its
    owner's step (`swaprl.partitions.FlatPartitions.with_groups`); by default, the groups as they are."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, buffer: HostBuffer, *,
                 chunk_bytes: int, check_budget: Callable[[int, int, str], None],
                 owns: Callable[[torch.Tensor], bool] = lambda p: True,
                 masters: MasterWeights | PartitionCopies | None = None,
                 params: Callable[[], list[tuple[torch.Tensor, dict]]] | None = None) -> None:
        self.optimizer, self.device, self.buffer, self.owns = optimizer, device, buffer, owns
        self.masters = masters
        self._listed = params
        self.chunk_bytes = chunk_bytes
        self._check_budget = check_budget
        self._records: dict[int, _Home] = {}  # id(state tensor) -> its home; holding the tensor keeps the id unique
        # States `start_at_home` made without writing their zeros: their homes hold nothing yet, and the step that
        # follows fills their staging with zeros instead of copying them in.
        self.unwritten: dict[int, torch.Tensor] = {}  # id -> the tensor: holding it keeps the id unique
        self._end: int | None = None  # `_buffer_end()`, while known
        # Tensors outside the optimizer that view the buffer: a state_dict()'s (`note_views`) and states the
        # optimizer let go of (load_state_dict replaced them): (tensor, offset, end).
        self._views: list[tuple[weakref.ref, int, int]] = []
        # Earlier buffers that such tensors keep alive after a new layout: (their tensors, the buffer's bytes).
        self._orphans: list[tuple[list[weakref.ref], int]] = []

    def recount(self) -> None:
        """Forget where the buffer's states end (a step starts: something may have moved states since)."""
        self._end = None

    def record(self, t: torch.Tensor) -> _Home | None:
        """Where state `t` lives between steps, if it is at a home of this buffer's."""
        return self._records.get(id(t))

    def moved(self) -> list[Moved]:
        """Every state tensor at its host home, as `Mover.reload` takes them: buffer slices at their offsets, the
        others after the buffer's end (there the offsets only carve the device allocation a reload makes)."""
        out, extra = [], self.buffer.capacity
        for h in self._records.values():
            if not self.at_home(h.tensor):
                continue
            offset = h.offset
            if not self.in_buffer(h):
                offset, extra = extra, extra + align(nbytes(h.tensor))
            out.append(Moved(h.tensor, offset, self.device, h.view.data_ptr()))
        return out

    def forget(self) -> None:
        """Drop every record (the states went back to the device for good)."""
        self._records.clear()
        self.unwritten.clear()
        self._end = None

    def owned(self) -> list[tuple[torch.nn.Parameter, dict]]:
        """The parameters whose states this streamer keeps, in order, each with its group."""
        return [(p, g) for p, g in self.params() if self.owns(p)]

    def params(self) -> list[tuple[torch.nn.Parameter, dict]]:
        """The optimizer's parameters in order, each with its group."""
        if self._listed is not None:
            return self._listed()
        seen: set[int] = set()
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((p, group))
        return out

    def at_home(self, t: torch.Tensor) -> bool:
        h = self._records.get(id(t))
        return h is not None and h.tensor is t and t.data_ptr() == h.view.data_ptr()

    def in_buffer(self, h: _Home) -> bool:
        return h.offset is not None and self.buffer.holds(Moved(h.tensor, h.offset, self.device, h.view.data_ptr()))

    def states(self, p: torch.Tensor, group: dict) -> list[torch.Tensor]:
        """The (local) state tensors of an owned `p` that belong on the device: at their host home, on the device now
        (created by a step, or loaded there), or in other host memory where torch would have put them on the device
        (loaded while the parameters were on the host): those are taken as at home where they are. On CUDA the CPU
        `step` counters of non-fused optimizers are none of these, and stay where torch keeps them."""
        if not self.owns(p):
            return []
        # An fp32 master (`swaprl.master`) moves with its states: it is made in host memory, taken as at home there.
        master = [("master", p)] if self.masters is not None and self.masters.is_master(p) else []
        out = []
        for key, v in [*master, *self.optimizer.state.get(p, {}).items()]:
            if not isinstance(v, torch.Tensor):
                continue
            v = local_tensor(v)  # a shard's states move as its local tensors
            if v.numel() == 0:
                continue
            if not (self.at_home(v) or v.device == self.device):
                # torch's placement rule for loaded states (Optimizer._process_value_according_to_param_policy)
                if v.device.type != "cpu" or (key == "step" and not (group.get("fused") or group.get("capturable"))):
                    continue
                self._records[id(v)] = _Home(v, v.data, None)
            out.append(v)
        return out

    def is_master(self, p: torch.Tensor) -> bool:
        return self.masters is not None and self.masters.is_master(p)

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """What `p` steps on: its gradient, or a master's model parameter's."""
        return self.masters.grad(p) if self.is_master(p) else p.grad

    def start_at_home(self, stepping: list[tuple[torch.nn.Parameter, dict]]) -> bool:
        """Give each owned parameter without states that will be stepped in pieces the states torch would make at
        its first step, made at their host home: zeros, and the scalars as torch makes them. True if any were.

        The zeros of a home in the buffer are not written here (the host writing every byte of them was most of a
        first step's cost over a steady one): the home is listed in `unwritten`, the step fills its staging with
        zeros where it runs, and its copies out, or `zero_unwritten` after a failure, fill the home."""
        if type(self.optimizer) not in ZERO_START:
            return False
        any_made = False
        for p, group in stepping:
            grad = self.grad(p)
            # A shard's states are DTensors, pieces need contiguous tensors, and torch refuses sparse gradients and
            # differentiable steps of leaves itself: those are left to the step, as before.
            if (not self.owns(p) or self.optimizer.state.get(p) or local_tensor(p) is not p
                    or not p.is_contiguous() or grad.is_sparse or group.get("differentiable")):
                continue
            master = align(nbytes(p)) if self.is_master(p) else 0
            if master + 3 * align(nbytes(p)) <= self.chunk_bytes:
                continue  # whole even with amsgrad's third state: not worth asking torch for its states' layout
            made = compat.first_state(self.optimizer, group, p.dtype, self.device)
            if made is None:
                return any_made
            big = sum(align(p.numel() * v.element_size()) for v in made.values() if v.dim() > 0)
            if big + master <= self.chunk_bytes:
                continue  # stepped whole: its states are made where it steps
            state = {}
            for key, v in made.items():
                if v.device != self.device:  # a counter torch keeps on the CPU, off the device (`_states`)
                    state[key] = v
                    continue
                # zeros_like(p) keeps p's strides
                like = torch.empty_strided(p.shape, p.stride(), dtype=v.dtype, device="meta") if v.dim() else \
                    torch.empty((), dtype=v.dtype, device="meta")
                view, offset = self.slot(like)
                state[key] = t = view.detach()  # its own object: a step points it at the staging buffer
                if not v.dim():
                    view.copy_(v)
                elif offset is None:  # a home outside the buffer: written here, as it is copied in whole
                    view.zero_()
                else:
                    self.unwritten[id(t)] = t
                self._records[id(t)] = _Home(t, view, offset)
            self.optimizer.state[p] = state
            any_made = True
        return any_made

    def is_unwritten(self, t: torch.Tensor) -> bool:
        return self.unwritten.get(id(t)) is t and self.at_home(t)

    def zero_unwritten(self, homes: list[torch.Tensor] | None = None) -> None:
        """Write the zeros of `homes` (views of unwritten states' homes a step did not fill; None: every unwritten
        state's whole home), then forget which states were unwritten: every home holds its state."""
        if homes is None:
            homes = [h.view for h in self._records.values() if self.is_unwritten(h.tensor)]
        for home in homes:
            home.zero_()
        self.unwritten.clear()

    def send_home(self, t: torch.Tensor, stream: torch.cuda.Stream | None = None) -> int:
        """Copy a state tensor on the device to its old home if it still fits there, else to the next free slot of
        the buffer (laid out ahead for the states the first step creates: `Placement.expected_host_bytes`), else
        to new ordinary host memory (moved into the buffer by `move_into_buffer`), and point it there. Waits for
        the copy, or with `stream` queues it there: the device memory it leaves is then not reused before the copy
        is done, and the caller waits for `stream` before anything reads the home."""
        h = self._records.get(id(t))
        if h is not None and h.tensor is t and (h.view.dtype, h.view.shape, h.view.stride()) == (
                t.dtype, t.shape, t.stride()):
            home = h.view
        else:
            home, offset = self.slot(t)
            h = _Home(t, home, offset)
        if stream is None or t.device.type != "cuda":
            home.copy_(t.data)
        else:
            source = t.data
            with torch.cuda.stream(stream):
                home.copy_(source, non_blocking=True)
            source.record_stream(stream)
        t.data = home
        self._records[id(t)] = h
        return nbytes(t)

    def slot(self, like: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """A new home of `like`'s dtype, shape and strides: the next free slot of the buffer, or (offset None) new
        ordinary host memory when the buffer has no room left."""
        end, size = self._buffer_end(), align(nbytes(like))
        if is_dense(like) and end + size <= self.buffer.capacity:
            self._end = end + size
            return host_view(self.buffer.span(end + size), end, like), end
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="cpu"), None

    def _buffer_end(self) -> int:
        """Where the states in the buffer end: new ones go after it. Kept between calls within a step (a step that
        creates its states asks once per state); anything else that moves states forgets it."""
        if self._end is None:
            self._end = max([*(h.offset + align(nbytes(h.tensor)) for h in self._records.values()
                               if self.at_home(h.tensor) and self.in_buffer(h)),
                             *(end for _, _, end in self._views_now())], default=0)
        return self._end

    def note_views(self, state_dict: dict) -> None:
        """Note the tensors of a `state_dict()` that view the buffer (`residency.savable`'s aliases: not the
        optimizer's own tensor objects), so that their space is kept while they live (see `_views`)."""
        base, size = self._buffer_span()
        if size == 0:
            return

        def walk(x) -> None:  # the states, and the fp32 masters (`swaprl.master`) saved beside them
            if isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)
            elif isinstance(x, torch.Tensor) and x.device.type == "cpu" and 0 <= x.data_ptr() - base < size:
                offset = x.data_ptr() - base
                self._views.append((weakref.ref(x), offset, offset + align(nbytes(x))))

        self._views_now()  # forget the dead first: every `torch.save(opt.state_dict())` views the buffer for a moment
        walk(state_dict)

    def _buffer_span(self) -> tuple[int, int]:
        """The buffer's first byte's address and its size (0, 0 with none)."""
        size = self.buffer.capacity
        return (self.buffer.span(size).data_ptr(), size) if size else (0, 0)

    def _views_now(self) -> list[tuple[weakref.ref, int, int]]:
        """`_views`, less the tensors gone or no longer viewing the buffer where they did."""
        self._views = [(ref, start, end) for ref, start, end in self._views if (t := ref()) is not None
                      and self.buffer.holds(Moved(t, start, self.device, t.data_ptr()))]
        return self._views

    def orphaned_bytes(self) -> int:
        """Host memory of earlier buffers that a state_dict's tensors keep alive (see `_orphans`)."""
        self._orphans = [(refs, n) for refs, n in self._orphans if any(r() is not None for r in refs)]
        return sum(n for _, n in self._orphans)

    def _retire(self, h: _Home) -> None:
        """A state the optimizer let go of: its space stays taken while something else holds it (see `_views`)."""
        if self.in_buffer(h):
            self._views.append((weakref.ref(h.tensor), h.offset, h.offset + align(nbytes(h.tensor))))

    def move_into_buffer(self, context: str = "Nothing was moved.") -> int:
        """Move every state tensor not yet in the host buffer (made by a step, loaded by `load_state_dict`, or on
        the device from before `attach`) into it; returns the bytes moved.

        New states go after those already in the buffer when they fit; otherwise the buffer is laid out afresh,
        in parameter order, so that each chunk's states are one run of it.
        """
        self._end = None
        managed = [t for p, g in self.owned() for t in self.states(p, g)]
        live = {id(t) for t in managed}
        for key in [k for k in self._records if k not in live]:  # replaced or dropped by the optimizer: let them go
            self._retire(self._records.pop(key))
            self.unwritten.pop(key, None)

        def in_buffer(t: torch.Tensor) -> bool:
            return self.at_home(t) and self.in_buffer(self._records[id(t)])

        outside = [t for t in managed if not in_buffer(t)]
        if not outside:
            return 0
        check_dense(outside, "keep an optimizer state in host memory", "give it the 'swap' home "
                    "(SwapConfig.optimizer_states='swap')")
        start = time.perf_counter()
        end = self._buffer_end()
        if end + layout_bytes(outside) <= self.buffer.capacity:
            moved = self._place(outside, end)
        else:
            total = layout_bytes(managed)
            loose = sum(nbytes(t) for t in managed if self.at_home(t) and self._records[id(t)].offset is None)
            # Those the optimizer holds again (a state_dict of its own loaded back) move to the new buffer below:
            # they keep nothing of the old one.
            viewing = [ref for ref, _, _ in self._views_now() if id(ref()) not in live]
            if viewing:  # they keep the old buffer alive beside the new one
                self._check_budget(total, loose, f"{context} A state_dict() taken earlier still views the states' "
                                   f"host buffer ({self.buffer.capacity} bytes), which stays allocated while it "
                                   "lives: drop it, or keep a copy.deepcopy of it, before this.")
                self._orphans.append((viewing, self.buffer.capacity))
            else:
                self._check_budget(total - self.buffer.capacity, loose, context)
            # The tensors in the old buffer keep its memory alive until they are pointed at the new one.
            self.buffer.release()
            self._views = []  # what they view is the old buffer now
            self.buffer.ensure(total, lock=False)
            moved = self._place(managed, 0)
            self.buffer.lock(background=True)  # the next step waits for it, if it comes that soon
        logger.info("optimizer states: %.2f GiB moved into host buffer %r (%d tensors, %.2f GiB held) in %.2f s",
                    moved / 2**30, self.buffer.name, len(outside), self.buffer.capacity / 2**30,
                    time.perf_counter() - start)
        return moved

    def _place(self, tensors: list[torch.Tensor], offset: int) -> int:
        """Copy `tensors` into the buffer from `offset` on and point them there. An interruption puts back those that
        came from the device; those that came from a host home of their own stay in the buffer, as valid a home."""
        buf = self.buffer.span(offset + layout_bytes(tensors))
        self._end = None  # the buffer's fill changes
        moved = 0
        undo: list[tuple[torch.Tensor, torch.Tensor, _Home | None]] = []
        try:
            for t in tensors:
                view = host_view(buf, offset, t)
                source, record, from_home = t.data, self._records.get(id(t)), self.at_home(t)
                # A master not filled yet is filled here, from its model parameter: its own pages were never touched.
                initial = self.masters.initial(t) if self.masters is not None else None
                view.copy_(source if initial is None else initial)
                t.data = view  # a host temporary it came from is freed here, before the next one is copied
                self._records[id(t)] = _Home(t, view, offset)
                if not from_home:
                    undo.append((t, source, record))
                offset += align(nbytes(t))
                moved += nbytes(t)
        except BaseException:
            for t, source, record in reversed(undo):
                t.data = source
                if record is None:
                    self._records.pop(id(t), None)
                else:
                    self._records[id(t)] = record
            raise
        if self.masters is not None:
            self.masters.filled(tensors)
        return moved

