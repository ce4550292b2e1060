"""Everything swaprl puts on the user's optimizer object, in one declared order, and what takes it off.

swaprl keeps the user's optimizer object (user code, accelerate's `AcceleratedOptimizer` and an LR scheduler hold
references to it), so what it changes is set on that instance: three methods and four of torch's hooks, installed
once per optimizer by `hooks_of` and shared by the two parts that use them.

- The fp32 masters (`swaprl.master`), installed by an attach with `master_weights=True` and kept after `detach()`:
  plain torch needs the master step as much as the runtime does.
- The runtime's part (`attach_runtime`), while a runtime is attached: the step's check and, with states in host
  memory, the streamed step and the load into host memory (`swaprl.streaming`).

The methods, each set once, dispatch on what is there now:

    step(closure)       the streamed step if a runtime streams states; else the master step; else torch's own
    zero_grad()         the masters' (the model parameters' gradients too); else torch's own
    load_state_dict()   into host memory if a runtime streams states; else torch's own

The hooks, each registered once, run their parts in this order:

    step pre-hook            the runtime's check (it fires however `step` is reached, so a step through a reference
                             taken before attach is caught)
    state_dict pre-hook      the runtime's wait for a reload in flight
    state_dict post-hook     the masters into the dict; each tensor its own storage (`residency.savable`); the
                             streamer notes the dict's views of its host buffer
    load_state_dict pre-hook the masters out of the dict, checked before torch loads anything
    load_state_dict post     the masters take the loaded values (in new tensors, as torch's load gives states:
                             a dict held from before keeps its own); the streamer moves the loaded states, and
                             masters, into its host buffer

An instance attribute takes precedence over the class's method, so every caller reaches them; a wrapper made while
they were installed (an LR scheduler built after attach) keeps calling them, and they pass straight through to what
they replaced once everything is taken off.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Protocol

import torch

from . import interrupts
from .compat import torch as compat
from .residency import savable


class Masters(Protocol):
    """What the hooks call of the fp32 masters (`swaprl.master.MasterWeights`)."""

    def step(self, plain: Callable, closure: Callable | None = None) -> object: ...
    def zero_grad(self, plain: Callable, set_to_none: bool = True) -> None: ...
    def save_into(self, state_dict: dict) -> dict: ...
    def take_from(self, state_dict: dict) -> dict: ...
    def finish_load(self) -> None: ...


class HostStateLayout(Protocol):
    def note_views(self, state_dict: dict) -> None: ...
    def move_into_buffer(self, context: str = ...) -> int: ...


class Streamer(Protocol):
    """What the hooks call of the streamed step (`swaprl.streaming.StateStreamer`)."""

    stepping: bool
    layout: HostStateLayout

    def step(self, raw_step: Callable[[], object], closure: Callable | None = None) -> object: ...
    def load_state_dict(self, plain: Callable[[dict], object], state_dict: dict) -> object: ...

_ATTRIBUTE = "_swaprl_hooks"  # the one attribute swaprl sets on an optimizer besides the methods below
_METHODS = ("step", "zero_grad", "load_state_dict")


class OptimizerHooks:
    """What swaprl has put on one optimizer: the masters (kept after detach), the runtime's part (while attached)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.masters: Masters | None = None
        self.streamer: Streamer | None = None
        self.check_step: Callable[[], None] | None = None  # the runtime's, before every step
        self.before_streamed_step: Callable[[], None] | None = None  # the runtime's, before a streamed step
        self.wait_reload: Callable[[], None] | None = None
        self._installed = False
        self._plain: dict[str, Callable] = {}
        self._previous: dict[str, Callable | None] = {}
        self._methods: dict[str, Callable] = {}  # what install() set, to take off only what is still its own
        self._handles: list = []

    # ---------------------------------------------------------------- the methods
    def _step(self, closure=None):
        # A step stands whole or is undone (the streamed one brings every state home, the masters' gives gradients
        # back): an interrupt that arrives inside it is raised once it has done either.
        with interrupts.held("an optimizer step"):
            return self._step_now(closure)

    def _step_now(self, closure):
        streamer = self.streamer
        if streamer is not None:
            compat.record_step_for_scheduler(self.optimizer, self._previous["step"])
            if self.before_streamed_step is not None:
                self.before_streamed_step()
            algorithm = compat.unhooked_step(self.optimizer)
            # torch's own hook wrapper, once around all chunks: the hooks see the whole step, every gradient in place
            streamed = compat.with_step_hooks(lambda opt, closure=None: streamer.step(lambda: algorithm(opt), closure))
            streamer.stepping = True
            try:
                return streamed(self.optimizer, closure)
            finally:
                streamer.stepping = False
        if self.masters is not None:
            return self.masters.step(self._plain["step"], closure)
        return self._plain["step"](closure)

    def _zero_grad(self, set_to_none: bool = True):
        if self.masters is not None:
            return self.masters.zero_grad(self._plain["zero_grad"], set_to_none)
        return self._plain["zero_grad"](set_to_none)

    def _load_state_dict(self, state_dict: dict):
        # Held as a step is: the streamed load points each parameter's data at an empty host tensor for its length,
        # and the masters and the host buffer take the loaded values after torch's load; an interrupt in between
        # would leave the model without its weights, or the masters and states apart.
        with interrupts.held("loading the optimizer's state dict"):
            if self.streamer is not None:
                return self.streamer.load_state_dict(self._plain["load_state_dict"], state_dict)
            return self._plain["load_state_dict"](state_dict)

    # ---------------------------------------------------------------- the hooks
    def _step_pre_hook(self, optimizer, args, kwargs) -> None:
        if self.check_step is not None:
            self.check_step()

    def _state_dict_pre_hook(self, optimizer) -> None:
        if self.wait_reload is not None:
            self.wait_reload()

    def _state_dict_post_hook(self, optimizer, state_dict: dict) -> dict:
        if self.masters is not None:
            state_dict = self.masters.save_into(state_dict)
        if self.streamer is None and self.masters is None:
            return state_dict
        state_dict = savable(state_dict)  # states carved out of one buffer: each its own storage for torch.save
        if self.streamer is not None:
            self.streamer.layout.note_views(state_dict)
        return state_dict

    def _load_pre_hook(self, optimizer, state_dict: dict) -> dict:
        return self.masters.take_from(state_dict) if self.masters is not None else state_dict

    def _load_post_hook(self, optimizer) -> None:
        if self.masters is not None:
            self.masters.finish_load()
        if self.streamer is not None:
            self.streamer.layout.move_into_buffer("The loaded states are intact where the load put them.")

    # ---------------------------------------------------------------- on and off
    def install(self) -> None:
        if self._installed:
            return
        opt = self.optimizer
        for name in _METHODS:
            previous = vars(opt).get(name)  # an instance-level wrapper made earlier, e.g. by an LR scheduler
            self._previous[name] = previous
            self._plain[name] = previous if previous is not None else types.MethodType(getattr(type(opt), name), opt)
            body = getattr(self, f"_{name}")

            def method(opt, *args, _body=body, _name=name, **kwargs):
                if not self._installed:  # reached through a wrapper made while installed
                    return self._plain[_name](*args, **kwargs)
                return _body(*args, **kwargs)

            if getattr(previous, compat.LR_SCHEDULER_MARK, False):  # a scheduler built before: keep its mark
                setattr(method, compat.LR_SCHEDULER_MARK, getattr(previous, compat.LR_SCHEDULER_MARK))
            self._methods[name] = types.MethodType(method, opt)
            setattr(opt, name, self._methods[name])
        self._handles = [opt.register_step_pre_hook(self._step_pre_hook),
                         opt.register_state_dict_pre_hook(self._state_dict_pre_hook),
                         opt.register_state_dict_post_hook(self._state_dict_post_hook),
                         opt.register_load_state_dict_pre_hook(self._load_pre_hook),
                         opt.register_load_state_dict_post_hook(self._load_post_hook)]
        self._installed = True
        setattr(opt, _ATTRIBUTE, self)

    def uninstall_if_unused(self) -> None:
        """Take everything off once neither the masters nor a runtime use it."""
        if not self._installed or self.masters is not None or self.streamer is not None or \
                self.check_step is not None:
            return
        opt = self.optimizer
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        for name in reversed(_METHODS):
            if vars(opt).get(name) is self._methods[name]:  # else a wrapper made since holds it: it passes through
                if self._previous[name] is None:
                    delattr(opt, name)
                else:
                    setattr(opt, name, self._previous[name])
        self._installed = False
        vars(opt).pop(_ATTRIBUTE, None)


def hooks_of(optimizer: torch.optim.Optimizer) -> OptimizerHooks:
    """The optimizer's hooks, installed now if they were not."""
    hooks = vars(optimizer).get(_ATTRIBUTE)
    if hooks is None:
        hooks = OptimizerHooks(optimizer)
        hooks.install()
    return hooks


def masters_of(optimizer: torch.optim.Optimizer) -> Masters | None:
    """The fp32 masters an earlier attach installed on `optimizer`, if any."""
    hooks = vars(optimizer).get(_ATTRIBUTE)
    return hooks.masters if hooks is not None else None


def attach_runtime(optimizer: torch.optim.Optimizer, *, check_step: Callable[[], None],
                   wait_reload: Callable[[], None], streamer: Streamer | None,
                   before_streamed_step: Callable[[], None] | None) -> Callable[[], None]:
    """Give the runtime its part of the optimizer's methods and hooks; returns what takes it off again."""
    hooks = hooks_of(optimizer)
    hooks.check_step, hooks.wait_reload = check_step, wait_reload
    hooks.streamer, hooks.before_streamed_step = streamer, before_streamed_step

    def detach() -> None:
        hooks.check_step = hooks.wait_reload = hooks.streamer = hooks.before_streamed_step = None
        hooks.uninstall_if_unused()

    return detach
