"""fp32 master weights for a model trained in bf16 (`SwapConfig(master_weights=True)`).

RL fine-tuning updates at learning rates near 1e-6, and a bf16 parameter (8 bits of mantissa) loses most such
updates. The usual answer keeps an fp32 copy of each parameter, the master, which the optimizer updates, and casts
it to the model's bf16 parameter after each step; the forward, the backward and the gradients stay in bf16. This
module installs that on an optimizer: each bf16 parameter in its groups is replaced by an fp32 master (a
leaf of the parameter's shape; a DTensor of the same placements for an FSDP2 shard), its states become the
master's, `zero_grad` clears the model parameters' gradients too, and a step:

    master.grad = parameter.grad (cast to fp32); the optimizer's own update of the master; parameter = master

The masters start on the host: they are what the runtime keeps in host memory with their optimizer states (the
"host" home, `swaprl.streaming`), ZeRO-Offload's layout, so the device holds only the bf16 parameters and
gradients. The streamed step does the three parts above a chunk at a time, where the chunk's masters and states
are on the device; `MasterWeights.step` does them for all parameters at once, for an optimizer stepped without the
runtime (after `detach`, where the masters are back on the device).

`optimizer.state_dict()` carries the masters (under "master_weights", by parameter index) and `load_state_dict`
puts them back, with the model's parameters cast from them: a checkpoint of the model and the optimizer loses no
bit of either. Parameters already in fp32 are left as they are: they are their own masters.

The masters are the truth between steps: the model's bf16 parameters are their casts. Weights written into the
model after the masters were made (`model.load_state_dict`, an in-place edit) are overwritten by the next step;
load them before `attach`, or load the optimizer's state dict, which sets both. Gradient clipping goes over
`model.parameters()`, where the gradients are (the masters have none outside the step). fp16 is refused: its
GradScaler unscales and checks the optimizer's own gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from .compat.torch import local_tensor
from .optimizer_hooks import hooks_of, masters_of

LOW_PRECISION = (torch.bfloat16,)
KEY = "master_weights"
# The device temporary of a cast from host memory (`cast_into`): small beside any home, large enough that the
# pieces' copies run at the link's rate.
CAST_PIECE_BYTES = 64 * 2**20

logger = logging.getLogger(__name__)


class MasterWeights:
    """The fp32 masters of one optimizer's low-precision parameters, and the model parameters they update."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._param: dict[int, torch.Tensor] = {}  # id(master) -> the model's parameter
        self._masters: list[torch.Tensor] = []
        self._unfilled: dict[int, torch.Tensor] = {}  # id(a master's local tensor) -> the model's local tensor
        self._loading: dict | None = None  # the masters of a load in progress, checked

    # ---------------------------------------------------------------- what is what
    def __iter__(self):
        return iter(self._masters)

    def __len__(self) -> int:
        return len(self._masters)

    def is_master(self, t: torch.Tensor) -> bool:
        return id(t) in self._param

    def check(self) -> None:
        """Refuse a step over a bf16 parameter without a master (a group added after the masters were made): its
        updates would be rounded away in bf16, the very loss the masters are there to prevent."""
        added = [p for p in _parameters(self.optimizer) if p.dtype in LOW_PRECISION and not self.is_master(p)]
        if added:
            raise ValueError(f"{len(added)} bf16 parameter(s) of this optimizer have no fp32 master (a param group "
                             "added after swaprl.attach with master_weights=True); add every group before attach")

    def model_param(self, master: torch.Tensor) -> torch.Tensor:
        """The model's (low-precision) parameter that `master` updates."""
        return self._param[id(master)]

    def grad(self, master: torch.Tensor) -> torch.Tensor | None:
        """The model parameter's gradient: what the master steps on (None: it does not step)."""
        return self._param[id(master)].grad

    # ---------------------------------------------------------------- the step's parts
    def load_grad(self, master: torch.Tensor, grad: torch.Tensor) -> None:
        """Give `master` the model's gradient `grad`, cast to fp32, on the device the master is on now."""
        master.grad = grad.to(dtype=master.dtype)

    def initial(self, local: torch.Tensor) -> torch.Tensor | None:
        """For a master's local tensor not filled yet, what fills it (the model's parameter, cast by the copy);
        None for one that holds its values. `filled()` records the fill."""
        return self._unfilled.get(id(local))

    def filled(self, locals_: Iterable[torch.Tensor]) -> None:
        for t in locals_:
            self._unfilled.pop(id(t), None)

    def fill(self) -> None:
        """Fill every master not filled yet, where it is."""
        with torch.no_grad():
            for m in self._masters:
                source = self.initial(local_tensor(m))
                if source is not None:
                    local_tensor(m).copy_(source)
        self._unfilled.clear()

    def write_back(self, masters: Iterable[torch.Tensor]) -> None:
        """Cast each master's values into its model parameter (on the device; the copy is ordered on the current
        stream, before anything that moves the master away). A master not filled yet has nothing new."""
        with torch.no_grad():
            for m in masters:
                if self.initial(local_tensor(m)) is None:
                    cast_into(local_tensor(self._param[id(m)]), local_tensor(m))

    def step(self, plain: Callable, closure: Callable | None = None) -> object:
        """The whole step without the runtime: every gradient in, the optimizer's own step (`plain()`, its hooks
        included), every master out."""
        self.check()
        self.fill()
        loss = None
        if closure is not None:  # the backward first: the gradients it makes are what the masters step on
            with torch.enable_grad():
                loss = closure()
        stepping = [m for m in self._masters if self.grad(m) is not None]
        for m in stepping:
            self.load_grad(m, self.grad(m))
        try:
            plain()
        finally:
            for m in stepping:
                m.grad = None
        self.write_back(stepping)
        return loss

    def zero_grad(self, plain: Callable, set_to_none: bool = True) -> None:
        """The optimizer's own zero_grad (its masters'), and the model parameters' gradients, which are what the
        masters step on: left alone they would add up across steps."""
        plain(set_to_none)
        for m in self._masters:
            p = self._param[id(m)]
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def place(self, masters: Iterable[torch.Tensor], device: torch.device) -> int:
        """Put `masters` on `device` with their values (those whose states live on the device in 'train': the
        "device" and "swap" homes); returns the bytes placed. A master not filled yet is filled there, from its model
        parameter, without ever touching host memory."""
        placed = 0
        with torch.no_grad():
            for m in masters:
                local = local_tensor(m)
                source = self.initial(local)
                if local.device == device:  # a CPU trainer's "device" is the host: filled where it is
                    if source is not None:
                        local.copy_(source)
                else:
                    local.data = (source if source is not None else local).to(device=device, dtype=torch.float32,
                                                                               copy=True)
                    placed += local.numel() * local.element_size()
                self._unfilled.pop(id(local), None)
        return placed

    # ---------------------------------------------------------------- checkpoints
    def save_into(self, state_dict: dict) -> dict:
        """The optimizer's state dict with the masters in it (under `KEY`, by parameter index)."""
        self.fill()
        optimizer = self.optimizer
        index = {id(p): i for i, p in enumerate(_parameters(optimizer))}
        # This rank's part of each (its shard, for FSDP2), as a plain tensor: what it restores on the same ranks.
        state_dict[KEY] = {index[id(m)]: local_tensor(m).detach() for m in self._masters}
        return state_dict

    def take_from(self, state_dict: dict) -> dict:
        """Take the masters out of a state dict to be loaded and check them all; they are copied in only once
        torch's own load has accepted the rest (`finish_load`): a refused load changes nothing."""
        optimizer = self.optimizer
        state_dict = dict(state_dict)
        saved = state_dict.pop(KEY, None)
        params = _parameters(optimizer)
        if saved is not None:
            for i, value in saved.items():
                m = params[int(i)] if 0 <= int(i) < len(params) else None
                if m is None or not self.is_master(m):
                    raise ValueError(f"the state dict's master weights name parameter {i}, which keeps no master "
                                     "here: the optimizer's parameters differ from those it was saved with")
                if tuple(local_tensor(value).shape) != tuple(local_tensor(m).shape):
                    raise ValueError(f"the state dict's master weight of parameter {i} has shape "
                                     f"{tuple(local_tensor(value).shape)}, this optimizer's "
                                     f"{tuple(local_tensor(m).shape)}: it was saved with other parameters (or "
                                     "another order, or another sharding); nothing was loaded")
        self._loading = saved
        return state_dict

    def finish_load(self) -> None:
        """Once torch has loaded the rest: the masters take the saved values, and the model their casts."""
        optimizer = self.optimizer
        saved, self._loading = self._loading, None
        params = _parameters(optimizer)
        with torch.no_grad():
            # Each master gets new storage, as torch's load gives each state: a state dict taken before the load,
            # whose masters view the old storage, keeps its values.
            if saved is None:  # saved without masters: the model's parameters, as they are now, are the truth
                logger.warning("the optimizer state dict loaded has no fp32 master weights: the masters are set "
                               "from the model's parameters as they are now")
                for m in self._masters:
                    local = local_tensor(m)
                    local.data = local_tensor(self._param[id(m)]).to(device=local.device, dtype=local.dtype,
                                                                      copy=True)
                self._unfilled.clear()
                return
            for i, value in saved.items():
                local = local_tensor(params[int(i)])
                local.data = local_tensor(value).to(device=local.device, dtype=local.dtype, copy=True)
                self.filled([local])
        self.fill()  # any the state dict left out keep the model's values
        self.write_back(self._masters)


def cast_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src, non_blocking=True)`, a piece at a time where it casts across devices: torch casts such a copy
    on the destination's device, through a temporary of the source's dtype and whole size, which for a master in
    host memory (a load, a failed step's repair) would put one fp32 tensor of the largest parameter on the device."""
    if dst.device == src.device or dst.dtype == src.dtype or not (dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src, non_blocking=True)
        return
    step = max(1, CAST_PIECE_BYTES // src.element_size())
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    for start in range(0, flat_src.numel(), step):
        flat_dst[start:start + step].copy_(flat_src[start:start + step], non_blocking=True)


def install(optimizer: torch.optim.Optimizer) -> tuple[MasterWeights, Callable[[], None]]:
    """Give every low-precision parameter of `optimizer` an fp32 master in host memory, in its place in the groups
    (its states, if any, cast to fp32 and moved to the master), and make `optimizer.step()` the master step
    (`swaprl.optimizer_hooks`). Returns the masters and what undoes all of it (the model's parameters back in the
    groups, holding the masters' values cast). An optimizer that has masters already keeps them (nothing to undo).

    The groups and states change in one assignment each, so an interruption leaves the optimizer either as it was or
    with its masters recorded, which the returned undo takes off."""
    installed = masters_of(optimizer)
    if installed is not None:
        return installed, lambda: None
    if any(p.dtype == torch.float16 for p in _parameters(optimizer)):
        raise ValueError("SwapConfig(master_weights=True) with float16 parameters: fp16 training needs a GradScaler, "
                         "which unscales and checks the optimizer's own gradients, and the masters take theirs "
                         "from the model only inside the step; load the model in bfloat16")
    low = [p for p in _parameters(optimizer) if p.dtype in LOW_PRECISION]
    if low and any(optimizer.state.get(p) for p in low):
        logger.warning("the optimizer has states already (a step, or a state dict loaded before attach): the fp32 "
                       "masters are made from the bf16 parameters, and a checkpoint's masters are not in torch's "
                       "own load; load a checkpoint saved with master weights after swaprl.attach")
    if not low:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in _parameters(optimizer)})
        raise ValueError(f"SwapConfig(master_weights=True): the optimizer's parameters are {', '.join(dtypes)}, "
                         "so they are their own master weights; load the model in bfloat16 for bf16 compute with "
                         "fp32 masters, or drop master_weights")
    masters = MasterWeights(optimizer)
    with torch.no_grad():
        for p in low:
            m = _host_master(p)
            masters._param[id(m)] = p
            masters._masters.append(m)
            masters._unfilled[id(local_tensor(m))] = local_tensor(p)
    master_of = {id(masters.model_param(m)): m for m in masters}
    groups = [g["params"] for g in optimizer.param_groups]
    states = {p: optimizer.state[p] for p in low if p in optimizer.state}
    # Everything the swap needs is made first; the swap itself is one assignment per group and one for the states.
    swapped_groups = [[master_of.get(id(p), p) for p in params] for params in groups]
    swapped_state = {master_of.get(id(p), p): (
        {k: v.to(torch.float32) if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step" else v
         for k, v in state.items()} if p in states else state) for p, state in optimizer.state.items()}
    hooks = hooks_of(optimizer)

    def uninstall() -> None:
        hooks.masters = None
        hooks.uninstall_if_unused()
        masters.write_back(masters)
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        restored = {masters.model_param(p) if masters.is_master(p) else p: state
                    for p, state in optimizer.state.items()}
        restored.update(states)  # undone right after install (a failed attach): the states are those it found
        optimizer.state.clear()
        optimizer.state.update(restored)
        masters._masters.clear()
        masters._param.clear()
        masters._unfilled.clear()

    for group, params in zip(optimizer.param_groups, swapped_groups):
        group["params"] = params
    optimizer.state.clear()
    optimizer.state.update(swapped_state)
    hooks.masters = masters
    return masters, uninstall


def _host_master(p: torch.Tensor) -> torch.nn.Parameter:
    """An fp32 leaf of `p`'s shape in host memory, not filled yet (a DTensor of p's placements for a shard, whose
    local tensor is on the host while the DTensor keeps p's device, as the runtime keeps host-resident states).
    Untouched, its pages take no memory: the masters are filled where they are first put (`MasterWeights.initial`),
    so attach never holds them twice."""
    local = local_tensor(p).detach()
    host = torch.empty(local.shape, dtype=torch.float32, device="cpu")
    if local_tensor(p) is p:
        return torch.nn.Parameter(host)
    from torch.distributed.tensor import DTensor

    # Made on p's device and pointed at the host only once it is a Parameter: a DTensor whose local tensor is on
    # another device cannot be detached (Parameter() detaches), and from_local copies a host tensor to the device.
    m = torch.nn.Parameter(DTensor.from_local(torch.empty_like(local, dtype=torch.float32), p.device_mesh,
                                              p.placements, shape=p.shape, stride=p.stride(), run_check=False))
    local_tensor(m).data = host
    return m


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list(dict.fromkeys(p for group in optimizer.param_groups for p in group["params"]))
