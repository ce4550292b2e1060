"""`optimizer.step()` with optimizer states in host memory (the "host" home of `SwapConfig.optimizer_states`).

The states of the parameters the streamer owns live in its host buffer in both phases and pass through the device
only inside the step, a chunk of parameters at a time (about `stream_chunk_bytes` of states). The other parameters
(states homed on the device, or swapped and so on the device in 'train') are stepped first, in one call, where
their states are: their update runs under the first chunk's copy in. With two device staging buffers
and a side stream for each direction, chunk i's update overlaps the copies on both sides of it:

    H2D stream:      chunk i+1: host -> staging[(i+1) % 2]     (once chunk i-1's D2H has emptied that buffer)
    compute stream:  chunk i:   states -> staging[i % 2], the optimizer's own step on chunk i's parameters only
    D2H stream:      chunk i:   staging[i % 2] -> host         (once chunk i's update is done)

A state tensor moves the way `swaprl.residency` moves any tensor: its bytes are copied and the *same* tensor object
is pointed at them (`tensor.data = ...`), so `optimizer.state` keeps its entries. Between steps every state tensor
is a complete host tensor: `optimizer.state_dict()` is a checkpoint as it stands.

Stepping one chunk: torch's optimizers skip parameters whose `.grad` is None, so the other parameters' gradients
are hidden during the chunk's call and put back afterwards (in a `finally`); the call also sees only the parameter
groups (the same dicts) that have a parameter in the chunk, so a group's own checks run when its parameters are
stepped, as they do without streaming, and not once per chunk for every group. Each parameter is in exactly one chunk,
so it is stepped once per `optimizer.step()` and its `state["step"]` counts as it would without streaming; the
foreach and fused implementations only batch the parameters they are given, so a chunk's update is bit for bit
what the whole step computes for those parameters. This needs an optimizer whose update of a parameter reads only
that parameter's gradient and state: all of `torch.optim` except LBFGS (which `swaprl.attach` refuses).

A parameter whose states are larger than a chunk (an embedding's, with fp32 masters) is stepped in pieces of about
`stream_chunk_bytes`, for the optimizers whose update of an element reads only that element's gradient and states
(`SLICEABLE`): each piece is a slice of the flattened tensors, stepped as a parameter of its own with its states'
slices, so the staging buffers stay two chunks whatever the largest parameter. Its scalar states (AdamW's step) are
copied for each piece and written once after the last; elementwise arithmetic makes the result bit for bit the
whole parameter's step. Where the optimizer's states start as zeros (`ZERO_START`), such a parameter's first
step finds them made already, at their host home, so the first step's device peak is the others'. Pieces are whole
multiples of `PIECE_ALIGN` elements of contiguous tensors; other parameters, and other optimizers, step whole, in
one chunk of their size. A step that fails inside a sliced parameter
leaves its earlier pieces updated and its step counter as it was, and logs so.

Sharded parameters (FSDP2's DTensors) stream the same way: each rank moves its own shards' states, as their local
tensors, and the optimizer's update goes through DTensor as it does without streaming.

fp32 master weights (`swaprl.master`) stream as one more state of their model parameter: the optimizer's
parameter is the master, staged with its states; the chunk's step gives it its model parameter's gradient cast to
fp32 (a chunk-sized transient), and once the chunk is updated the master is cast into the model parameter, on the
device, before the copies out.

Without CUDA the same code runs with plain copies and no streams, so the CPU tests exercise every path.
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .compat import torch as compat
from .compat.torch import local_tensor
from .master import MasterWeights
from .residency import HostBuffer, Moved, align, check_dense, host_view, is_dense, layout_bytes, nbytes
from .undo import Undo

logger = logging.getLogger(__name__)

SLICEABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Optimizers (these exact classes) whose step of one element reads only that element's gradient and states and the
parameter's scalar states: a parameter may be stepped in pieces."""
PIECE_ALIGN = 4096
"""Elements a piece's length is a multiple of."""
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


@dataclass(slots=True)
class _Chunk:
    """Consecutive parameters stepped together, and the copies that bring their states in and out."""

    params: list[tuple[torch.nn.Parameter, dict]]
    """(parameter, its group)."""
    groups: list[dict] = field(default_factory=list)
    """The optimizer's parameter groups with a parameter in this chunk."""
    staged: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    """(state tensor, its host home, its offset in the staging buffer) for the states at home before the step."""
    runs: list[list[int]] = field(default_factory=list)
    """[buffer offset, staging offset, bytes]: slices of the host buffer copied whole (neighbouring states)."""
    loose: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    """(home, staging offset) for homes outside the buffer, copied one by one."""
    bytes: int = 0
    """Staging bytes."""
    slot: int = 0
    """Which of the two staging buffers its states pass through."""
    piece: tuple[int, int] | None = None
    """For a parameter whose states are larger than a chunk: the elements [start, end) of its (local, flattened)
    tensor that this chunk steps; its only parameter is that one."""
    slices: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    """With `piece`: (state key, the piece of its host home, staging offset); "master" for an fp32 master."""


class StateStreamer:
    """Keeps the states of one optimizer's parameters that `owns(p)` in a host buffer and runs its step a chunk at a
    time through `device`.

    `check_budget(growth, releasing, context)` is asked before the buffer grows by `growth` bytes while `releasing`
    bytes of ordinary host memory are about to be freed; it raises `HostBufferError` to refuse (the placement's
    host-budget check), with `context` saying what state things are left in. `on_step(info)` gets the figures of
    each streamed step. `stepping` is True while `install_step`'s step method runs.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, buffer: HostBuffer, *,
                 chunk_bytes: int, check_budget: Callable[[int, int, str], None],
                 owns: Callable[[torch.Tensor], bool] = lambda p: True,
                 on_step: Callable[[dict], None] | None = None, masters: MasterWeights | None = None) -> None:
        self.optimizer, self.device, self.buffer, self.owns = optimizer, device, buffer, owns
        self.masters = masters
        self.chunk_bytes = chunk_bytes
        self.stepping = False
        self._check_budget, self._on_step = check_budget, on_step
        self._homes: dict[int, _Home] = {}  # id(state tensor) -> its home; holding the tensor keeps the id unique
        self._end: int | None = None  # `_buffer_end()`, while known
        # Tensors outside the optimizer that view the buffer: a state_dict()'s (`lend`) and states the optimizer let
        # go of (load_state_dict replaced them). Plain torch leaves a state_dict's tensors as they were when the
        # optimizer moves on to others, so their space is not written while they live: (tensor, offset, end).
        self._lent: list[tuple[weakref.ref, int, int]] = []
        # Earlier buffers that such tensors keep alive after a new layout: (their tensors, the buffer's bytes).
        self._orphans: list[tuple[list[weakref.ref], int]] = []
        cuda = device.type == "cuda"
        self._h2d = torch.cuda.Stream(device) if cuda else None
        self._d2h = torch.cuda.Stream(device) if cuda else None

    # ---------------------------------------------------------------- what is where
    def moved(self) -> list[Moved]:
        """Every state tensor at its host home, as `Mover.reload` takes them: buffer slices at their offsets, the
        others after the buffer's end (there the offsets only carve the device allocation a reload makes)."""
        out, extra = [], self.buffer.capacity
        for h in self._homes.values():
            if not self._at_home(h.tensor):
                continue
            offset = h.offset
            if not self._in_buffer(h):
                offset, extra = extra, extra + align(nbytes(h.tensor))
            out.append(Moved(h.tensor, offset, self.device, h.view.data_ptr()))
        return out

    def forget(self) -> None:
        """Drop every record (the states went back to the device for good)."""
        self._homes.clear()
        self._end = None

    def owned(self) -> list[tuple[torch.nn.Parameter, dict]]:
        """The parameters whose states this streamer keeps, in order, each with its group."""
        return [(p, g) for p, g in self.params() if self.owns(p)]

    def params(self) -> list[tuple[torch.nn.Parameter, dict]]:
        """The optimizer's parameters in order, each with its group."""
        seen: set[int] = set()
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((p, group))
        return out

    def _at_home(self, t: torch.Tensor) -> bool:
        h = self._homes.get(id(t))
        return h is not None and h.tensor is t and t.data_ptr() == h.view.data_ptr()

    def _in_buffer(self, h: _Home) -> bool:
        return h.offset is not None and self.buffer.holds(Moved(h.tensor, h.offset, self.device, h.view.data_ptr()))

    def _states(self, p: torch.Tensor, group: dict) -> list[torch.Tensor]:
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
            if not (self._at_home(v) or v.device == self.device):
                # torch's placement rule for loaded states (Optimizer._process_value_according_to_param_policy)
                if v.device.type != "cpu" or (key == "step" and not (group.get("fused") or group.get("capturable"))):
                    continue
                self._homes[id(v)] = _Home(v, v.data, None)
            out.append(v)
        return out

    # ---------------------------------------------------------------- the step
    def step(self, raw_step: Callable[[], object], closure: Callable[[], object] | None = None) -> object:
        """One `optimizer.step(closure)`: the closure once, then `raw_step()` (the optimizer's own algorithm, without
        its hooks) once per chunk. Returns the closure's loss."""
        loss = None
        if closure is not None:  # torch's optimizers call it first; called per chunk it would redo the backward
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        self._end = None
        if self.masters is not None:
            self.masters.check()
        stepping = [(p, g) for p, g in self.params() if self._grad(p) is not None]
        had = list(self.optimizer.state)
        made = self._start_at_home(stepping)
        chunks = self._plan(stepping)
        grads = {p: self._grad(p) for p, _ in stepping}
        figures = {"h2d_bytes": 0, "d2h_bytes": 0}
        try:
            for p in grads:
                p.grad = None
            self._run(chunks, grads, raw_step, figures)
        finally:
            for p, g in grads.items():  # after an error too: a hidden gradient must come back
                if not self._is_master(p):  # a master's gradient is its model parameter's, never hidden
                    p.grad = g
            if made:  # torch's order (the state dict's): the states a step makes follow the parameters'
                self._reorder_state(had)
        self.move_into_buffer("This optimizer.step() itself completed; the states it created are intact in ordinary "
                              "host memory.")
        seconds = time.perf_counter() - start
        info = {"bytes": figures["h2d_bytes"] + figures["d2h_bytes"], "seconds": seconds, "chunks": len(chunks),
                **figures}
        logger.debug("streamed optimizer step: %d chunk(s), %.2f GiB in, %.2f GiB out, %.3f s", len(chunks),
                     figures["h2d_bytes"] / 2**30, figures["d2h_bytes"] / 2**30, seconds)
        # A step that owned nothing ("auto" before any state was homed in host memory) was torch's own: no event.
        if self._on_step is not None and any(self.owns(p) for p, _ in stepping):
            self._on_step(info)
        return loss

    def _is_master(self, p: torch.Tensor) -> bool:
        return self.masters is not None and self.masters.is_master(p)

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """What `p` steps on: its gradient, or a master's model parameter's."""
        return self.masters.grad(p) if self._is_master(p) else p.grad

    def _plan(self, stepping: list[tuple[torch.nn.Parameter, dict]]) -> list[_Chunk]:
        """The parameters not owned first, in one chunk without copies; then the owned ones, consecutive, in chunks of
        about `chunk_bytes` of states, and each chunk's copies."""
        others = [(p, g) for p, g in stepping if not self.owns(p)]
        chunks: list[_Chunk] = [_Chunk(others)] if others else []
        first = len(chunks)
        size = 0
        for p, group in stepping:
            if not self.owns(p):
                continue
            pieces = self._pieces(p, group)
            if pieces:
                chunks.extend(_Chunk([(p, group)], piece=piece) for piece in pieces)
                size = self.chunk_bytes  # the next parameter starts a chunk of its own
                continue
            states = self._states(p, group)
            # No state yet (the first step): the step creates it on the device; AdamW makes two of p's size.
            b = layout_bytes(states) + (0 if self.optimizer.state.get(p) else 2 * align(nbytes(local_tensor(p))))
            if len(chunks) == first or size + b > self.chunk_bytes:
                chunks.append(_Chunk([]))
                size = 0
            chunks[-1].params.append((p, group))
            size += b
        seen: set[int] = set()
        for chunk in chunks:
            mine = {id(g) for _, g in chunk.params}
            chunk.groups = [g for g in self.optimizer.param_groups if id(g) in mine]
            if chunk.piece is not None:
                self._add_slices(chunk)
                continue
            for p, group in chunk.params:
                for t in self._states(p, group):
                    if not self._at_home(t):
                        continue  # on the device already: the step uses it where it is
                    if id(t) in seen:
                        raise ValueError(f"an optimizer state tensor of shape {tuple(t.shape)} is shared between "
                                         "parameters; host-resident states are streamed parameter by parameter: "
                                         "give these parameters the 'swap' home (SwapConfig.optimizer_states)")
                    check_dense([t], "stream an optimizer state", "give it the 'swap' home "
                                "(SwapConfig.optimizer_states='swap')")
                    seen.add(id(t))
                    self._add_copy(chunk, t)
        for k, chunk in enumerate(c for c in chunks if c.bytes):  # alternate the staging buffers
            chunk.slot = k % 2
        return chunks

    def _start_at_home(self, stepping: list[tuple[torch.nn.Parameter, dict]]) -> bool:
        """Give each owned parameter without states that will be stepped in pieces the states torch would make at
        its first step, made at their host home: zeros, and the scalars as torch makes them. True if any were."""
        if type(self.optimizer) not in ZERO_START:
            return False
        any_made = False
        for p, group in stepping:
            grad = self._grad(p)
            # A shard's states are DTensors, pieces need contiguous tensors, and torch refuses sparse gradients and
            # differentiable steps of leaves itself: those are left to the step, as before.
            if (not self.owns(p) or self.optimizer.state.get(p) or local_tensor(p) is not p
                    or not p.is_contiguous() or grad.is_sparse or group.get("differentiable")):
                continue
            master = align(nbytes(p)) if self._is_master(p) else 0
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
                view, offset = self._slot(like)
                if v.dim():
                    view.zero_()
                else:
                    view.copy_(v)
                state[key] = t = view.detach()  # its own object: a step points it at the staging buffer
                self._homes[id(t)] = _Home(t, view, offset)
            self.optimizer.state[p] = state
            any_made = True
        return any_made

    def _reorder_state(self, had: list) -> None:
        """`optimizer.state` in the order torch's own step leaves it: the entries there before, then the new ones in
        parameter order (the state dict lists states in this order)."""
        state, before = self.optimizer.state, set(had)
        new = [p for p, _ in self.params() if p in state and p not in before]
        placed = before | set(new)
        items = [(p, state[p]) for p in [*had, *new, *(p for p in state if p not in placed)] if p in state]
        state.clear()
        state.update(items)

    def _pieces(self, p: torch.Tensor, group: dict) -> list[tuple[int, int]]:
        """The element ranges to step `p` in, when its states at home are larger than a chunk and may be sliced
        (`SLICEABLE`); else none. Every state of `p` must be at home and either the parameter's size or a scalar."""
        if type(self.optimizer) not in SLICEABLE or not self.optimizer.state.get(p):
            return []
        numel = local_tensor(p).numel()
        staged = self._states(p, group)
        if not staged or not all(self._at_home(t) for t in staged) or layout_bytes(staged) <= self.chunk_bytes:
            return []
        if self._is_master(p) and self.masters.initial(local_tensor(p)) is not None:
            return []  # not filled yet: it is filled whole, where it is placed
        for v in self.optimizer.state[p].values():
            if isinstance(v, torch.Tensor) and local_tensor(v).numel() not in (numel, 1):
                return []
        # Pieces are slices of flattened views: a tensor whose elements are not in order would flatten to a copy,
        # and the step would update the copy.
        model = [local_tensor(self.masters.model_param(p))] if self._is_master(p) else []
        if not all(t.is_contiguous() and t.numel() == numel for t in [local_tensor(p), *model, *staged]
                   if t.dim() > 0):
            return []
        per_element = sum(t.element_size() for t in staged if t.dim() > 0)
        # Whole multiples of PIECE_ALIGN elements: vectorized kernels (torch's fused CPU Adam) round a piece's
        # unaligned tail unlike its body, so a piece must start where the whole tensor's vectors start.
        step = max(PIECE_ALIGN, self.chunk_bytes // per_element // PIECE_ALIGN * PIECE_ALIGN)
        return [(a, min(a + step, numel)) for a in range(0, numel, step)]

    def _add_slices(self, chunk: _Chunk) -> None:
        """A piece's copies: the slice of each state's host home (the master's too) that holds its elements."""
        (p, _), (a, e) = chunk.params[0], chunk.piece
        master = [("master", p)] if self._is_master(p) else []
        for key, v in [*master, *self.optimizer.state[p].items()]:
            if not isinstance(v, torch.Tensor) or local_tensor(v).dim() == 0:
                continue
            home = self._homes[id(local_tensor(v))].view.reshape(-1)[a:e]
            chunk.slices.append((key, home, chunk.bytes))
            chunk.loose.append((home, chunk.bytes))
            chunk.bytes += align(nbytes(home))

    def _step_piece(self, chunk: _Chunk, buf: torch.Tensor, grad: torch.Tensor, raw_step: Callable[[], object],
                    carried: dict) -> None:
        """Step the elements of one piece as a parameter of their own: views of the staging buffer for its states
        (and its master), of the model's tensors for the rest. `carried` keeps, from a parameter's first piece to
        its last, its scalar states (their values before the step; written back after the last piece) and its
        gradient flattened (a copy, once, where the gradient's elements are out of order)."""
        (p, group), (a, e) = chunk.params[0], chunk.piece
        staged = {key: host_view(buf, offset, home) for key, home, offset in chunk.slices}
        if a == 0:
            carried.clear()
            carried["grad"] = local_tensor(grad).detach().reshape(-1)
            carried["scalars"] = {k: v for k, v in self.optimizer.state[p].items()
                                  if isinstance(v, torch.Tensor) and local_tensor(v).dim() == 0}
        grad, scalars = carried["grad"][a:e], carried["scalars"]
        if self._is_master(p):
            q, model = staged.pop("master"), local_tensor(self.masters.model_param(p)).detach().reshape(-1)[a:e]
            self.masters.load_grad(q, grad)
        else:
            q, model = local_tensor(p).detach().reshape(-1)[a:e], None
            q.grad = grad
        state = {k: v for k, v in self.optimizer.state[p].items() if not isinstance(v, torch.Tensor)}
        # A scalar at home in host memory (a fused step's counter) is the device's while it steps.
        state.update({k: local_tensor(v).to(self.device if self._at_home(local_tensor(v)) else v.device, copy=True)
                      for k, v in scalars.items()})
        state.update(staged)
        groups, self.optimizer.param_groups = self.optimizer.param_groups, [{**group, "params": [q]}]
        self.optimizer.state[q] = state
        try:
            raw_step()
        finally:
            self.optimizer.param_groups = groups
            self.optimizer.state.pop(q, None)
            q.grad = None
        if model is not None:  # cast into the model's parameter while the master's piece is on the device
            model.copy_(q, non_blocking=True)
        if e == local_tensor(p).numel():
            for k, v in scalars.items():
                local_tensor(v).copy_(state[k])
            carried.clear()

    def _add_copy(self, chunk: _Chunk, t: torch.Tensor) -> None:
        h = self._homes[id(t)]
        offset, size = chunk.bytes, align(nbytes(t))
        chunk.staged.append((t, h.view, offset))
        chunk.bytes += size
        if not self._in_buffer(h):
            chunk.loose.append((h.view, offset))
            return
        # Staging is laid out with the buffer's alignment, so neighbours in the buffer stay neighbours: one copy.
        run = chunk.runs[-1] if chunk.runs else None
        if run is not None and run[0] + run[2] == h.offset and run[1] + run[2] == offset:
            run[2] += size
        else:
            chunk.runs.append([h.offset, offset, size])

    def _run(self, chunks: list[_Chunk], grads: dict, raw_step: Callable[[], object], figures: dict) -> None:
        cuda = self._h2d is not None
        compute = torch.cuda.current_stream(self.device) if cuda else None
        size = max((c.bytes for c in chunks), default=0)
        staging = [torch.empty(size, dtype=torch.uint8, device=self.device)
                   for _ in range(min(sum(1 for c in chunks if c.bytes), 2))]
        copied_in: list[torch.cuda.Event | None] = [None] * len(chunks)
        carried: dict = {}  # a sliced parameter's scalar states and flattened gradient, from its first piece on
        emptied: list[torch.cuda.Event | None] = [None, None]  # per staging buffer: its last copy out is done
        if cuda:  # the staging memory may have been freed by work still queued on the compute stream
            self._h2d.wait_stream(compute)
            self._d2h.wait_stream(compute)
        i = 0
        try:
            if chunks:
                copied_in[0] = self._copy_in(chunks[0], staging, emptied)
            for i, chunk in enumerate(chunks):
                if i + 1 < len(chunks):  # the next chunk's copy runs under this chunk's update
                    copied_in[i + 1] = self._copy_in(chunks[i + 1], staging, emptied)
                if copied_in[i] is not None:
                    compute.wait_event(copied_in[i])
                buf = staging[chunk.slot] if chunk.bytes else None
                if chunk.piece is not None:
                    self._step_piece(chunk, buf, grads[chunk.params[0][0]], raw_step, carried)
                    moved = sum(nbytes(home) for _, home, _ in chunk.slices)
                    self._copy_out(chunk, buf, emptied)
                    figures["h2d_bytes"] += moved
                    figures["d2h_bytes"] += moved
                    continue
                for t, _, offset in chunk.staged:
                    t.data = host_view(buf, offset, t)
                masters = [p for p, _ in chunk.params if self._is_master(p)]
                for p, _ in chunk.params:
                    if self._is_master(p):  # the model's gradient in fp32, the chunk's transient
                        self.masters.load_grad(p, grads[p])
                    else:
                        p.grad = grads[p]
                groups, self.optimizer.param_groups = self.optimizer.param_groups, chunk.groups
                try:
                    raw_step()
                finally:
                    self.optimizer.param_groups = groups
                    for p, _ in chunk.params:
                        p.grad = None
                if masters:  # cast into the model's parameters while the masters are on the device
                    self.masters.write_back(masters)
                figures["h2d_bytes"] += sum(nbytes(t) for t, _, _ in chunk.staged)
                figures["d2h_bytes"] += self._copy_out(chunk, buf, emptied)
                figures["d2h_bytes"] += sum(self._send_home(t) for p, g in chunk.params for t in self._states(p, g)
                                            if not self._at_home(t))  # states this step created
            if cuda:  # the states are complete host tensors when step() returns
                self._d2h.synchronize()
        except BaseException:
            if chunks and chunks[i].piece is not None and chunks[i].piece[0] > 0:
                logger.error("the step failed inside a parameter of shape %s stepped in pieces: its elements before "
                             "%d are updated, the rest and its step counter are not",
                             tuple(chunks[i].params[0][0].shape), chunks[i].piece[0])
            self._rescue([pg for c in chunks for pg in c.params])
            raise

    def _copy_in(self, chunk: _Chunk, staging: list[torch.Tensor], emptied: list) -> torch.cuda.Event | None:
        if not chunk.bytes:
            return None
        buf = staging[chunk.slot]
        if self._h2d is None:
            self._copy(chunk, buf, inward=True)
            return None
        if emptied[chunk.slot] is not None:  # the states of the chunk before last have left this staging buffer
            self._h2d.wait_event(emptied[chunk.slot])
        with torch.cuda.stream(self._h2d):
            self._copy(chunk, buf, inward=True)
        done = torch.cuda.Event()
        done.record(self._h2d)
        return done

    def _copy_out(self, chunk: _Chunk, buf: torch.Tensor | None, emptied: list) -> int:
        if chunk.bytes:
            if self._d2h is None:
                self._copy(chunk, buf, inward=False)
            else:
                updated = torch.cuda.Event()
                updated.record(torch.cuda.current_stream(self.device))
                self._d2h.wait_event(updated)
                with torch.cuda.stream(self._d2h):
                    self._copy(chunk, buf, inward=False)
                emptied[chunk.slot] = torch.cuda.Event()
                emptied[chunk.slot].record(self._d2h)
        # Pointed home before the copy lands: nothing reads them until step() has waited for the copies.
        for t, home, _ in chunk.staged:
            t.data = home
        return sum(nbytes(t) for t, _, _ in chunk.staged)

    def _copy(self, chunk: _Chunk, buf: torch.Tensor, *, inward: bool) -> None:
        non_blocking = self._h2d is not None
        host = self.buffer.span(max(b + n for b, _, n in chunk.runs)) if chunk.runs else None
        for b, s, n in chunk.runs:
            dst, src = (buf[s:s + n], host[b:b + n]) if inward else (host[b:b + n], buf[s:s + n])
            dst.copy_(src, non_blocking=non_blocking)
        for home, s in chunk.loose:
            dev = host_view(buf, s, home)
            dst, src = (dev, home) if inward else (home, dev)
            dst.copy_(src, non_blocking=non_blocking)

    def _send_home(self, t: torch.Tensor) -> int:
        """Copy a state tensor on the device to its old home if it still fits there, else to the next free slot of
        the buffer (laid out ahead for the states the first step creates: `Placement.expected_host_bytes`), else
        to new ordinary host memory (moved into the buffer by `move_into_buffer`), and point it there. Waits for
        the copy."""
        h = self._homes.get(id(t))
        if h is not None and h.tensor is t and (h.view.dtype, h.view.shape, h.view.stride()) == (
                t.dtype, t.shape, t.stride()):
            home = h.view
        else:
            home, offset = self._slot(t)
            h = _Home(t, home, offset)
        home.copy_(t.data)
        t.data = home
        self._homes[id(t)] = h
        return nbytes(t)

    def _slot(self, like: torch.Tensor) -> tuple[torch.Tensor, int | None]:
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
            self._end = max([*(h.offset + align(nbytes(h.tensor)) for h in self._homes.values()
                               if self._at_home(h.tensor) and self._in_buffer(h)),
                             *(end for _, _, end in self._lent_now())], default=0)
        return self._end

    def lend(self, state_dict: dict) -> None:
        """Note the tensors of a `state_dict()` that view the buffer (`residency.savable`'s aliases: not the
        optimizer's own tensor objects), so that their space is kept while they live (see `_lent`)."""
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
                self._lent.append((weakref.ref(x), offset, offset + align(nbytes(x))))

        self._lent_now()  # forget the dead first: every `torch.save(opt.state_dict())` lends for a moment
        walk(state_dict)

    def _buffer_span(self) -> tuple[int, int]:
        """The buffer's first byte's address and its size (0, 0 with none)."""
        size = self.buffer.capacity
        return (self.buffer.span(size).data_ptr(), size) if size else (0, 0)

    def _lent_now(self) -> list[tuple[weakref.ref, int, int]]:
        """`_lent`, less the tensors gone or no longer viewing the buffer where they did."""
        self._lent = [(ref, start, end) for ref, start, end in self._lent if (t := ref()) is not None
                      and self.buffer.holds(Moved(t, start, self.device, t.data_ptr()))]
        return self._lent

    def _shared_masters(self) -> list[torch.Tensor]:
        """The fp32 masters at their home whose bytes a held state_dict views."""
        if self.masters is None:
            return []
        held = {(start, end) for _, start, end in self._lent_now()}
        return [t for t in map(local_tensor, self.masters) if (h := self._homes.get(id(t))) is not None
                and self._at_home(t) and self._in_buffer(h) and (h.offset, h.offset + align(nbytes(t))) in held]

    def check_unshare(self, context: str) -> None:
        """Before a load: refuse it if the masters `unshare_masters` will copy do not fit the host budget."""
        shared = self._shared_masters()
        if shared:
            self._check_budget(sum(nbytes(t) for t in shared), 0, f"{context} A state_dict() taken earlier views "
                               "the fp32 masters the load replaces, and keeps them: drop it, or keep a copy.deepcopy "
                               "of it, before loading.")

    def unshare_masters(self) -> None:
        """Once torch has accepted a load, before the masters' own hook copies the saved values into them in place:
        each master a held state_dict views moves to host memory of its own (the next `move_into_buffer` gives it
        a home again), so the held dict keeps its values as it keeps its states'."""
        for t in self._shared_masters():
            t.data = t.data.clone()

    def orphaned_bytes(self) -> int:
        """Host memory of earlier buffers that a state_dict's tensors keep alive (see `_orphans`)."""
        self._orphans = [(refs, n) for refs, n in self._orphans if any(r() is not None for r in refs)]
        return sum(n for _, n in self._orphans)

    def _rescue(self, params: list[tuple[torch.nn.Parameter, dict]]) -> None:
        """After an error inside the step: every state back home, holding what the optimizer last wrote to it."""
        try:
            if self._h2d is not None:
                for stream in (self._h2d, self._d2h, torch.cuda.current_stream(self.device)):
                    stream.synchronize()
            # A chunk's masters may hold its update already: the model gets them, so the two agree whatever the
            # step left done (the chunks before were written back; the step is not atomic).
            masters = [p for p, _ in params if self._is_master(p)]
            if masters:
                self.masters.write_back(masters)
                if self._h2d is not None:
                    torch.cuda.current_stream(self.device).synchronize()
            for p, group in params:
                for t in self._states(p, group):
                    if not self._at_home(t):
                        self._send_home(t)
        except Exception:  # keep the first error: it is the one that explains what went wrong
            logger.exception("bringing the optimizer states home after a failed step also failed")

    # ---------------------------------------------------------------- the buffer
    def _retire(self, h: _Home) -> None:
        """A state the optimizer let go of: its space stays taken while something else holds it (see `_lent`)."""
        if self._in_buffer(h):
            self._lent.append((weakref.ref(h.tensor), h.offset, h.offset + align(nbytes(h.tensor))))

    def move_into_buffer(self, context: str = "Nothing was moved.") -> int:
        """Move every state tensor not yet in the host buffer (made by a step, loaded by `load_state_dict`, or on
        the device from before `attach`) into it; returns the bytes moved.

        New states go after those already in the buffer when they fit; otherwise the buffer is laid out afresh,
        in parameter order, so that each chunk's states are one run of it.
        """
        self._end = None
        managed = [t for p, g in self.owned() for t in self._states(p, g)]
        live = {id(t) for t in managed}
        for key in [k for k in self._homes if k not in live]:  # replaced or dropped by the optimizer: let them go
            self._retire(self._homes.pop(key))

        def in_buffer(t: torch.Tensor) -> bool:
            return self._at_home(t) and self._in_buffer(self._homes[id(t)])

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
            loose = sum(nbytes(t) for t in managed if self._at_home(t) and self._homes[id(t)].offset is None)
            # Those the optimizer holds again (a state_dict of its own loaded back) move to the new buffer below:
            # they keep nothing of the old one.
            lent = [ref for ref, _, _ in self._lent_now() if id(ref()) not in live]
            if lent:  # they keep the old buffer alive beside the new one
                self._check_budget(total, loose, f"{context} A state_dict() taken earlier still views the states' "
                                   f"host buffer ({self.buffer.capacity} bytes), which stays allocated while it "
                                   "lives: drop it, or keep a copy.deepcopy of it, before this.")
                self._orphans.append((lent, self.buffer.capacity))
            else:
                self._check_budget(total - self.buffer.capacity, loose, context)
            # The tensors in the old buffer keep its memory alive until they are pointed at the new one.
            self.buffer.release()
            self._lent = []  # what they view is the old buffer now
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
                source, record, from_home = t.data, self._homes.get(id(t)), self._at_home(t)
                # A master not filled yet is filled here, from its model parameter: its own pages were never touched.
                initial = self.masters.initial(t) if self.masters is not None else None
                view.copy_(source if initial is None else initial)
                t.data = view  # a host temporary it came from is freed here, before the next one is copied
                self._homes[id(t)] = _Home(t, view, offset)
                if not from_home:
                    undo.append((t, source, record))
                offset += align(nbytes(t))
                moved += nbytes(t)
        except BaseException:
            for t, source, record in reversed(undo):
                t.data = source
                if record is None:
                    self._homes.pop(id(t), None)
                else:
                    self._homes[id(t)] = record
            raise
        if self.masters is not None:
            self.masters.filled(tensors)
        return moved


# ---------------------------------------------------------------- the optimizer's methods
def install_step(streamer: StateStreamer, *, detached: Callable[[], bool]) -> Callable[[], None]:
    """Make `optimizer.step()` the streamed step, and `optimizer.load_state_dict()` load into host memory (then into
    the buffer), for `streamer`'s optimizer object only; returns what restores them. Once `detached()` is True, a
    method still reached through a wrapper made meanwhile passes straight through to what it replaced.

    Instance attributes take precedence over the class's methods, so every caller (user code, accelerate's
    AcceleratedOptimizer, an LR scheduler's wrapper made after attach) reaches them.
    """
    opt, algorithm = streamer.optimizer, compat.unhooked_step(streamer.optimizer)

    def streamed(opt, closure=None):
        return streamer.step(lambda: algorithm(opt), closure)

    # Torch's own hook wrapper, once around all chunks: step hooks see the whole step, every gradient in place.
    hooked = compat.with_step_hooks(streamed)

    def step(plain, *args, **kwargs):
        compat.record_step_for_scheduler(opt, plain)
        streamer.stepping = True
        try:
            return hooked(opt, *args, **kwargs)
        finally:
            streamer.stepping = False

    def load_state_dict(plain, state_dict):
        # torch casts each loaded state to its parameter's device, all at once: the very memory this mode saves.
        # For the length of the load each owned parameter's data is an empty host tensor of its dtype, so the
        # states land in host memory, and the load's post-hook moves them into the buffer from there. A DTensor
        # shard's device is the DTensor's own: its states load onto the device (a shard's worth) and move from there.
        # A parameter in host memory already (an fp32 master, `swaprl.master`) is left as it is: the masters' own
        # load hook reads and writes it.
        params = [p for p, _ in streamer.owned() if local_tensor(p) is p and not streamer._is_master(p)]
        data = [p.data for p in params]
        streamer.check_unshare("Nothing was loaded.")
        try:
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype)
            return plain(state_dict)
        finally:
            for p, d in zip(params, data):
                p.data = d

    undo = Undo("the streamed optimizer step")
    with undo.on_error():
        # An LR scheduler built before attach wrapped the step and marked the wrapper: keep the mark.
        undo.push(override(opt, "step", step, detached, marks=(compat.LR_SCHEDULER_MARK,)), "step")
        undo.push(override(opt, "load_state_dict", load_state_dict, detached), "load_state_dict")
        # Loaded states belong in the buffer (with a load_state_dict captured before attach, torch put them on the
        # device).
        undo.push(opt.register_load_state_dict_post_hook(
            lambda opt: streamer.move_into_buffer("The loaded states are intact where the load put them.")).remove,
            "load_state_dict post-hook")
        # First of the load's post-hooks: before the masters' own copies the loaded values in.
        undo.push(opt.register_load_state_dict_post_hook(lambda opt: streamer.unshare_masters(), prepend=True).remove,
                  "load_state_dict post-hook (masters)")
        # After attach's `savable` hook: what it hands out views the buffer.
        undo.push(opt.register_state_dict_post_hook(lambda opt, sd: streamer.lend(sd)).remove,
                  "state_dict post-hook")
    return undo.run


def override(opt: torch.optim.Optimizer, name: str, body: Callable, detached: Callable[[], bool],
              marks: tuple[str, ...] = ()) -> Callable[[], None]:
    """Set `opt.<name>` on the instance to call `body(plain, *args, **kwargs)`, where `plain` is what was there
    before; returns what puts it back."""
    previous = vars(opt).get(name)  # an instance-level wrapper made earlier, e.g. by an LR scheduler
    plain = previous if previous is not None else types.MethodType(getattr(type(opt), name), opt)

    def method(opt, *args, **kwargs):
        if detached():  # reached through a wrapper made after attach
            return plain(*args, **kwargs)
        return body(plain, *args, **kwargs)

    for mark in marks:
        if getattr(previous, mark, False):
            setattr(method, mark, getattr(previous, mark))
    installed = types.MethodType(method, opt)
    setattr(opt, name, installed)

    def restore() -> None:
        if vars(opt).get(name) is installed:
            if previous is None:
                delattr(opt, name)
            else:
                setattr(opt, name, previous)
        # else a wrapper made after attach holds `installed`, which passes through to `plain` from now on

    return restore
