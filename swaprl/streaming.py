"""`optimizer.step()` with optimizer states in host memory (the "host" home of `SwapConfig.optimizer_states`).

The states of the parameters the streamer owns live in its host buffer in both phases and pass through the device
only inside the step, a chunk of parameters at a time (about `stream_chunk_bytes` of states). The other parameters
(states homed on the device, or swapped and so on the device in 'train') are stepped first, in one call, where
their states are: their update runs under the first chunk's copy in. With two device staging buffers
and a side stream for each direction, chunk i's update overlaps the copies on both sides of it:

    H2D stream:      chunk i+1: host -> staging[(i+1) % 2]     (once chunk i-1's D2H has emptied that buffer)
    compute stream:  chunk i:   states -> staging[i % 2], the optimizer's own step on chunk i's parameters only
    D2H stream:      chunk i:   staging[i % 2] -> host         (once chunk i's update is done)

Where the states live between steps, and how they get there, is `swaprl.host_states`: this module is the step.

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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .compat.torch import local_tensor
from .host_states import HostStates
from .master import MasterWeights
from .partitions import PartitionCopies
from .residency import HostBuffer, align, check_dense, host_view, layout_bytes, nbytes

logger = logging.getLogger(__name__)

SLICEABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Optimizers (these exact classes) whose step of one element reads only that element's gradient and states and the
parameter's scalar states: a parameter may be stepped in pieces."""
PIECE_ALIGN = 4096
"""Elements a piece's length is a multiple of."""
SENDS_IN_FLIGHT = 1
"""Chunks whose created states may be on their way home while the next chunk steps, in a first step
(`StateStreamer._send_created`): one keeps the copy-out stream busy (the next copy is queued behind it), and the
device holds at most two chunks of states, as the steady steps' two staging buffers do."""


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
    fresh: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    """(home, staging offset) for homes of states made at home and not written yet (`HostStates.unwritten`): their
    staging is zeroed instead of copied in, and copied out one by one."""
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
    """Runs one optimizer's step a chunk at a time through `device`, for the parameters whose states `layout` keeps
    in host memory (`swaprl.host_states`). `on_step(info)` gets the figures of each streamed step. `stepping` is
    True while the streamed step runs (`swaprl.optimizer_hooks` sets it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, buffer: HostBuffer, *,
                 chunk_bytes: int, check_budget: Callable[[int, int, str], None],
                 owns: Callable[[torch.Tensor], bool] = lambda p: True,
                 on_step: Callable[[dict], None] | None = None,
                 masters: MasterWeights | PartitionCopies | None = None,
                 params: Callable[[], list[tuple[torch.Tensor, dict]]] | None = None) -> None:
        self.optimizer, self.device, self.masters = optimizer, device, masters
        self.layout = HostStates(optimizer, device, buffer, chunk_bytes=chunk_bytes, check_budget=check_budget,
                                 owns=owns, masters=masters, params=params)
        self.chunk_bytes = chunk_bytes
        self.stepping = False
        self._on_step = on_step
        cuda = device.type == "cuda"
        self._h2d = torch.cuda.Stream(device) if cuda else None
        self._d2h = torch.cuda.Stream(device) if cuda else None

    @property
    def buffer(self) -> HostBuffer:
        return self.layout.buffer

    def owns(self, p: torch.Tensor) -> bool:
        return self.layout.owns(p)

    def step(self, raw_step: Callable[[], object], closure: Callable[[], object] | None = None) -> object:
        """One `optimizer.step(closure)`: the closure once, then `raw_step()` (the optimizer's own algorithm, without
        its hooks) once per chunk. Returns the closure's loss."""
        loss = None
        if closure is not None:  # torch's optimizers call it first; called per chunk it would redo the backward
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        self.layout.recount()
        if self.masters is not None:
            self.masters.check()
        stepping = [(p, g) for p, g in self.layout.params() if self.layout.grad(p) is not None]
        had = list(self.optimizer.state)
        made = self.layout.start_at_home(stepping)
        grads = {p: self.layout.grad(p) for p, _ in stepping}
        figures = {"h2d_bytes": 0, "d2h_bytes": 0}
        try:
            chunks = self._plan(stepping)
            for p in grads:
                p.grad = None
            self._run(chunks, grads, raw_step, figures)
        except BaseException:
            # A refused plan, or a run stopped before its rescue could zero them: the states made at home are zeros.
            if self.layout.unwritten:
                self.layout.zero_unwritten()
            raise
        finally:
            for p, g in grads.items():  # after an error too: a hidden gradient must come back
                if not self.layout.is_master(p):  # a master's gradient is its model parameter's, never hidden
                    p.grad = g
            if made:  # torch's order (the state dict's): the states a step makes follow the parameters'
                self._reorder_state(had)
        self.layout.move_into_buffer("This optimizer.step() itself completed; the states it created are intact in ordinary "
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

    def _plan(self, stepping: list[tuple[torch.nn.Parameter, dict]]) -> list[_Chunk]:
        """The parameters not owned first, in one chunk without copies; then the owned ones, consecutive, in chunks of
        about `chunk_bytes` of states, and each chunk's copies."""
        others = [(p, g) for p, g in stepping if not self.owns(p)]
        chunks: list[_Chunk] = []
        for p, group in others:
            # In chunks of their own where they are fp32 masters: each one's gradient is cast to fp32 for its step,
            # and all of them at once would be a transient of every device-resident master's size.
            size = 4 * local_tensor(p).numel() if self.layout.is_master(p) else 0
            if not chunks or size and chunks[-1].bytes + size > self.chunk_bytes:
                chunks.append(_Chunk([]))
            chunks[-1].params.append((p, group))
            chunks[-1].bytes += size
        for chunk in chunks:
            chunk.bytes = 0  # no staging: their states are on the device
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
            states = self.layout.states(p, group)
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
                for t in self.layout.states(p, group):
                    if not self.layout.at_home(t):
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

    def _reorder_state(self, had: list) -> None:
        """`optimizer.state` in the order torch's own step leaves it: the entries there before, then the new ones in
        parameter order (the state dict lists states in this order)."""
        state, before = self.optimizer.state, set(had)
        new = [p for p, _ in self.layout.params() if p in state and p not in before]
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
        staged = self.layout.states(p, group)
        if not staged or not all(self.layout.at_home(t) for t in staged) or layout_bytes(staged) <= self.chunk_bytes:
            return []
        if self.layout.is_master(p) and self.masters.initial(local_tensor(p)) is not None:
            return []  # not filled yet: it is filled whole, where it is placed
        for v in self.optimizer.state[p].values():
            if isinstance(v, torch.Tensor) and local_tensor(v).numel() not in (numel, 1):
                return []
        # Pieces are slices of flattened views: a tensor whose elements are not in order would flatten to a copy,
        # and the step would update the copy.
        model = [local_tensor(self.masters.model_param(p))] if self.layout.is_master(p) else []
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
        master = [("master", p)] if self.layout.is_master(p) else []
        for key, v in [*master, *self.optimizer.state[p].items()]:
            if not isinstance(v, torch.Tensor) or local_tensor(v).dim() == 0:
                continue
            home = self.layout.record(local_tensor(v)).view.reshape(-1)[a:e]
            chunk.slices.append((key, home, chunk.bytes))
            (chunk.fresh if self.layout.is_unwritten(local_tensor(v)) else chunk.loose).append((home, chunk.bytes))
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
        if self.layout.is_master(p):
            q, model = staged.pop("master"), local_tensor(self.masters.model_param(p)).detach().reshape(-1)[a:e]
            self.masters.load_grad(q, grad)
        else:
            q, model = local_tensor(p).detach().reshape(-1)[a:e], None
            q.grad = grad
        state = {k: v for k, v in self.optimizer.state[p].items() if not isinstance(v, torch.Tensor)}
        # A scalar at home in host memory (a fused step's counter) is the device's while it steps.
        state.update({k: local_tensor(v).to(self.device if self.layout.at_home(local_tensor(v)) else v.device, copy=True)
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
        h = self.layout.record(t)
        offset, size = chunk.bytes, align(nbytes(t))
        chunk.staged.append((t, h.view, offset))
        chunk.bytes += size
        if self.layout.is_unwritten(t):
            chunk.fresh.append((h.view, offset))
            return
        if not self.layout.in_buffer(h):
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
        sending: deque[torch.cuda.Event] = deque()  # the copies home of the states the chunks before created
        if cuda:  # the staging memory may have been freed by work still queued on the compute stream
            self._h2d.wait_stream(compute)
            self._d2h.wait_stream(compute)
        i = out = 0  # `out`: the chunks whose copies out are queued
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
                    out = i + 1
                    figures["h2d_bytes"] += moved - sum(nbytes(home) for home, _ in chunk.fresh)
                    figures["d2h_bytes"] += moved
                    continue
                for t, _, offset in chunk.staged:
                    t.data = host_view(buf, offset, t)
                masters = [p for p, _ in chunk.params if self.layout.is_master(p)]
                for p, _ in chunk.params:
                    if self.layout.is_master(p):  # the model's gradient in fp32, the chunk's transient
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
                figures["h2d_bytes"] += sum(nbytes(t) for t, _, _ in chunk.staged) - sum(
                    nbytes(home) for home, _ in chunk.fresh)
                figures["d2h_bytes"] += self._copy_out(chunk, buf, emptied)
                out = i + 1
                figures["d2h_bytes"] += self._send_created(chunk, sending)
            if cuda:  # the states are complete host tensors when step() returns
                self._d2h.synchronize()
            self.layout.unwritten.clear()  # every copy out is done: the homes hold their states
        except BaseException:
            if chunks and chunks[i].piece is not None and chunks[i].piece[0] > 0:
                logger.error("the step failed inside a parameter of shape %s stepped in pieces: its elements before "
                             "%d are updated, the rest and its step counter are not",
                             tuple(chunks[i].params[0][0].shape), chunks[i].piece[0])
            self._rescue([pg for c in chunks for pg in c.params], [home for c in chunks[out:] for home, _ in c.fresh])
            raise

    def _send_created(self, chunk: _Chunk, sending: deque) -> int:
        """Send home the states the chunk's step created (a parameter's first step makes them on the device) and
        return their bytes. On CUDA the copies queue behind the update on the copy-out stream, so they overlap the
        next chunks' work; at most `SENDS_IN_FLIGHT` chunks' worth are queued, each one's device memory held until
        its copy is done, so a step that creates every state holds two chunks of them at once, not all."""
        created = [t for p, g in chunk.params for t in self.layout.states(p, g) if not self.layout.at_home(t)]
        if not created:
            return 0
        if self._d2h is None:
            return sum(self.layout.send_home(t) for t in created)
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        moved = sum(self.layout.send_home(t, self._d2h) for t in created)
        done = torch.cuda.Event()
        done.record(self._d2h)
        sending.append(done)
        while len(sending) > SENDS_IN_FLIGHT:
            sending.popleft().synchronize()
        return moved

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
        host = self.layout.buffer.span(max(b + n for b, _, n in chunk.runs)) if chunk.runs else None
        for b, s, n in chunk.runs:
            dst, src = (buf[s:s + n], host[b:b + n]) if inward else (host[b:b + n], buf[s:s + n])
            dst.copy_(src, non_blocking=non_blocking)
        for home, s in chunk.loose:
            dev = host_view(buf, s, home)
            dst, src = (dev, home) if inward else (home, dev)
            dst.copy_(src, non_blocking=non_blocking)
        for home, s in chunk.fresh:
            dev = host_view(buf, s, home)
            if inward:
                dev.zero_()
            else:
                home.copy_(dev, non_blocking=non_blocking)

    def _rescue(self, params: list[tuple[torch.nn.Parameter, dict]], unfilled: list[torch.Tensor]) -> None:
        """After an error inside the step: every state back home, holding what the optimizer last wrote to it, and
        the `unfilled` homes of unwritten states (chunks that never copied out) their zeros."""
        try:
            if self._h2d is not None:
                for stream in (self._h2d, self._d2h, torch.cuda.current_stream(self.device)):
                    stream.synchronize()
            self.layout.zero_unwritten(unfilled)  # before the sends below: a state on the device goes home over it
            # A chunk's masters may hold its update already: the model gets them, so the two agree whatever the
            # step left done (the chunks before were written back; the step is not atomic).
            masters = [p for p, _ in params if self.layout.is_master(p)]
            if masters:
                self.masters.write_back(masters)
                if self._h2d is not None:
                    torch.cuda.current_stream(self.device).synchronize()
            for p, group in params:
                for t in self.layout.states(p, group):
                    if not self.layout.at_home(t):
                        self.layout.send_home(t)
        except Exception:  # keep the first error: it is the one that explains what went wrong
            logger.exception("bringing the optimizer states home after a failed step also failed")


    def load_state_dict(self, plain: Callable[[dict], object], state_dict: dict) -> object:
        """`optimizer.load_state_dict` with the owned parameters' states loaded into host memory. torch casts each
        loaded state to its parameter's device, all at once: the very memory this mode saves. For the length of the
        load each owned parameter's data is an empty host tensor of its dtype, so the states land in host memory,
        and the load's post-hook moves them into the buffer from there. A DTensor shard's device is the DTensor's
        own, which no data of its steers: each of its states given in host memory is handed to torch as a DTensor
        of the parameter's device and dtype over the same host rows (`_kept_on_host`), which torch's cast keeps as
        it is; one given on the device moves from there. A parameter in host memory already (an fp32 master) is
        left as it is: the masters' own load gives it the saved values."""
        layout = self.layout
        params = [p for p, _ in layout.owned() if local_tensor(p) is p and not layout.is_master(p)]
        data = [p.data for p in params]
        state_dict = self._kept_on_host(state_dict)
        try:
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype)
            return plain(state_dict)
        finally:
            for p, d in zip(params, data):
                p.data = d

    def _kept_on_host(self, state_dict: dict) -> dict:
        """`state_dict` with each state of an owned DTensor parameter whose rows are in host memory given as a
        DTensor of the parameter's device and dtype over those rows: torch's cast, `value.to(dtype=param.dtype,
        device=param.device)`, then returns it as it is. The saved parameters map to the optimizer's in group order,
        as torch maps them (`Optimizer.load_state_dict`); a dict that does not fit is left to torch to refuse."""
        from itertools import chain

        from torch.distributed.tensor import DTensor

        sharded = {id(p) for p, _ in self.layout.owned() if local_tensor(p) is not p and p.device.type != "cpu"}
        state, groups = state_dict.get("state"), state_dict.get("param_groups")
        if not sharded or not isinstance(state, dict) or not isinstance(groups, list):
            return state_dict
        current = chain.from_iterable(g["params"] for g in self.optimizer.param_groups)
        to = {i: p for i, p in zip(chain.from_iterable(g["params"] for g in groups), current) if id(p) in sharded}
        kept = dict(state)
        for i, p in to.items():
            if not isinstance(state.get(i), dict):
                continue
            entry = dict(state[i])
            for key, v in entry.items():
                if key == "step" or not isinstance(v, DTensor) or local_tensor(v).device.type != "cpu":
                    continue
                dtype = p.dtype if p.is_floating_point() else v.dtype
                # Made over an empty tensor of the device (no memory), then pointed at the host rows: from_local
                # would copy host rows to the mesh's device.
                over = DTensor.from_local(torch.empty(0, dtype=dtype, device=p.device), v.device_mesh, v.placements,
                                          shape=v.shape, stride=v.stride(), run_check=False)
                local_tensor(over).data = local_tensor(v).detach().to(dtype=dtype)
                entry[key] = over
            kept[i] = entry
        return {**state_dict, "state": kept}
