"""Attaching: a `Runtime` wired to its trainer and engine, and the one attached runtime of the process.

`attach` checks everything first (`swaprl.checks`), then wires the parts in the order that hides the slow ones:
the fp32 masters if asked for (`swaprl.master`), the placement (the homes of the optimizer states decided from the
room measured now, `swaprl.state_homes`), the host buffers page-locked in the background, the engine built
meanwhile if `attach` builds it (`make_engine`), the engine's link (`swaprl.engine_link`), the runtime's part of the
optimizer's methods and hooks (`swaprl.optimizer_hooks`), and the attach steps (the host-resident states to their
buffer, the engine asleep). Each part records its undo: a failed attach leaves nothing behind, `detach()` reverts
the rest. `attach_later` registers a runtime that `Runtime.bind` wires when its trainer is ready.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable

import torch

from . import checks, fingerprint, interrupts, master, memory, optimizer_hooks, regions
from .checkpoints import checkpoint_dir_of
from .config import SwapConfig, default_reserve_bytes
from .engines import vllm_available
from .engines.base import Engine
from .errors import PhaseError
from .engine_link import link, unmeasurable
from .optimizer_hooks import masters_of
from .partitions import FlatPartitions
from .placement import Placement
from .runtime import Phase, PhaseBlock, PhaseMachine
from .undo import Step, Undo

logger = logging.getLogger(__name__)

_attached: Runtime | None = None  # one runtime per process: `swaprl.phase()` and the TRL wrapper find it here


def current() -> Runtime:
    """The attached runtime; raises if there is none."""
    if _attached is None:
        raise PhaseError("no swaprl runtime is attached: call swaprl.attach(model, optimizer) first")
    return _attached


def check_none_attached() -> None:
    if _attached is not None:
        raise PhaseError("swaprl.attach() was already called and its runtime is still attached; call "
                         "swaprl.detach() first (or keep the Runtime that attach() returned)")


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           engine: Engine | Callable[[], Engine] | str | None = None, *, config: SwapConfig | None = None) -> Runtime:
    """Register the default runtime for `model` trained by `optimizer`, generating with `engine`.

    `engine`: an `Engine`; a function that builds one (`lambda: VLLMEngine(path, ...)`; one that takes a
    `reserve_bytes` argument gets what an engine sized from the free memory must leave free for the optimizer states
    that stay on the device, or None: `lambda reserve_bytes: VLLMEngine(path, reserve_bytes=reserve_bytes)`); "hf"
    (generate with the trainer's own module); "vllm" (a colocated vLLM engine built from the model's checkpoint
    directory); or None: vLLM when it is installed, a GPU is present and the model was loaded from a local
    checkpoint directory, else "hf". A function, or a name, builds the engine once the host memory the optimizer
    states will need has started to be page-locked in the background, so that the locking runs under the engine's
    start; if attach then fails, it closes the engine it built. Validates everything before moving any memory or
    building an engine.
    """
    rt = Runtime(config)
    rt.bind(model, optimizer, engine)
    return rt


def attach_later(*, config: SwapConfig | None = None, until: str) -> Runtime:
    """Register a runtime now and bind it to its trainer later (`Runtime.bind`): for a trainer whose model and
    optimizer only take their final form once its training loop has started (TRL under FSDP2, where `train()` shards
    the model and points the optimizer at the shards). Until it is bound it holds nothing and stays in "train";
    listeners and detach callbacks can be added, and what needs the trainer raises a `PhaseError` saying `until`
    (when it will be bound)."""
    rt = Runtime(config)
    rt._unbound = until
    rt._register()
    return rt


def phase(name: Phase) -> PhaseBlock:
    """`with swaprl.phase("generate"):` / `with swaprl.phase("train"):` on the attached runtime."""
    return current().phase(name)


def detach() -> dict[str, int]:
    """Detach the attached runtime (its state becomes resident again; see `Runtime.detach`); {} when none is."""
    return _attached.detach() if _attached is not None else {}


class Runtime(PhaseMachine):
    """Owns the phase state of one trainer (model + optimizer) and one engine, and what lives as long as one attach:
    its placement, the engine's link, its peaks of device memory (`peaks`, shared by its first step's rule and its
    profile). `swaprl.attach` builds and binds it; `swaprl.attach_later` registers it unbound."""

    def __init__(self, config: SwapConfig | None = None) -> None:
        check_none_attached()
        config = config if config is not None else SwapConfig()
        if not isinstance(config, SwapConfig):
            raise TypeError(f"config must be a swaprl.SwapConfig, not {type(config).__name__}")
        super().__init__(config)
        self._unbound = "it is not bound to a trainer yet (Runtime.bind)"
        self.peaks: memory.TorchPeaks | None = None
        """torch's peak counters of the device since attach (CUDA only)."""

    def bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             engine: Engine | Callable[[], Engine] | str | None = None, *,
             partitions: FlatPartitions | None = None) -> Runtime:
        """Take charge of `model`, `optimizer` and `engine` (as `swaprl.attach` takes them; checked first, and a
        function or a name builds the engine once the host buffers are being locked); registers this runtime as the
        process's. A failure leaves nothing behind. Returns the runtime. `partitions`: when `optimizer` steps flat
        partitions of the model's parameters that another library made (DeepSpeed's ZeRO), their declaration
        (`swaprl.partitions`): those, not the model's parameters, are what the states' homes place."""
        if _attached is not None and _attached is not self:
            check_none_attached()
        self._check_open()
        if self.model is not None:
            raise PhaseError("this runtime is bound to a trainer already; detach() it and attach a new one")
        checks.check_trainer(model, optimizer, self.config, partitions=partitions)
        if isinstance(engine, Engine):
            checks.check_engine(engine, self.config)
        elif not callable(engine):
            engine_name(engine, model)  # refused here, before anything is allocated
        grad_mode = torch.is_grad_enabled()
        try:
            self._wire(model, optimizer, engine, partitions)  # registers this runtime as its last, held, change
        except BaseException:
            if self._unbound is not None:
                # What the attach steps did is undone already; a pending runtime must not keep half a trainer. A
                # Ctrl-C inside a `torch.no_grad()` entry (its mode set, the block not begun) leaves the mode off.
                interrupts.finish("undoing the attach", self._unwire)
                torch.set_grad_enabled(grad_mode)
                if _attached is not self:
                    interrupts.unguard()
            raise  # attached whole if the signal came after the commit: the caller sees it, the runtime is true
        if self.config.profile is not None:  # the profile package is imported only when used
            from .profile import attach_configured

            attach_configured(self)
        return self

    def _unwire(self) -> None:
        self.model = self.optimizer = self.engine = self.device = None
        self._placement = self._link = None

    def _register(self) -> None:
        global _attached
        _attached = self

    def _wire(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              engine: Engine | Callable[[], Engine] | str | None, partitions: FlatPartitions | None) -> None:
        """The attach proper: the masters, the placement, host buffers, the engine (built now if `engine` builds it),
        the optimizer's hooks, the engine asleep (each undone on failure)."""
        config = self.config
        self.model, self.optimizer = model, optimizer
        self.device = device = checks.model_device(model)
        cuda = device.type == "cuda"
        why = unmeasurable(engine) if isinstance(engine, Engine) else \
            "attach builds the engine, which takes the memory the states leave when they go"
        # Each change is recorded in one of these as it is made and reverted, newest first, if attach fails; all are
        # kept, or handed to what detach() reverts, in the one held section that registers the runtime.
        installed = Undo("the fp32 master weights")  # undone last (the step method sits on them); kept at detach
        wired = Undo("the attach")  # the host buffers, the hooks: detach() reverts them
        built = Undo("the engine attach built")  # closed if attach then fails; kept (the caller's) once attached
        moved = Undo("the attach's moves")  # the states and the engine put back as they were
        with installed.on_error(), wired.on_error(), built.on_error(), moved.on_error():
            masters = masters_of(optimizer)
            if config.master_weights and masters is None:  # before the placement, which homes them with the states
                with interrupts.held("installing the fp32 master weights"):
                    masters, uninstall = master.install(optimizer)
                    installed.push(uninstall, "install")
            self.peaks = memory.TorchPeaks(device) if cuda else None
            streamed = {"type": "step", "transition": "optimizer.step", "step": "stream optimizer states"}
            room = memory.measure_room(device) if cuda and why is None else None
            self._placement = place = Placement(model, optimizer, device, config, masters=masters, room=room,
                                                unmeasurable=why, peaks=self.peaks,
                                                on_streamed_step=lambda info: self._emit(streamed | info),
                                                partitions=partitions)
            place.masters_to_device(("device",))  # before an engine sized from the free memory is built
            wired.push(place.release)  # a failed attach leaves no host memory behind
            place.prepare_host()
            warming = None
            if config.verify_sync and not (isinstance(engine, Engine) and engine.shares_trainer_weights):
                warming = fingerprint.warm_up(device)  # the first weight check's kernel, compiled under what follows
            if not isinstance(engine, Engine):
                # Built while the host buffers are being locked: the locking (tens of seconds for tens of GiB where
                # pages are faulted in slowly) runs under the engine's start instead of before the first step.
                reserve = engine_reserve_bytes(device, place.homes.device_growth())
                with interrupts.held("building the engine"):  # recorded for closing as it returns
                    engine = make_engine(engine, model, config, reserve_bytes=reserve) if not callable(engine) \
                        else engine(reserve_bytes=reserve) if _takes_reserve(engine) else engine()
                    if isinstance(engine, Engine):
                        built.push(engine.close)
                checks.check_engine(engine, config)
            self.engine = engine
            place.whole_segments = engine.lender is None
            self._link = link(engine, model, config, kept_on_device=lambda: place.home_bytes()["device"],
                              emit=self._emit)
            engine.bind(model)
            with interrupts.held("hooking the parameters"):
                handles = [p.register_post_accumulate_grad_hook(self._check_backward) for p in model.parameters()
                           if p.requires_grad]
                wired.push(lambda: [h.remove() for h in handles], "the parameters' gradient hooks")
            with interrupts.held("hooking the optimizer"):
                wired.push(optimizer_hooks.attach_runtime(
                    optimizer, check_step=self._check_step, wait_reload=self.wait_reload, streamer=place.streamer,
                    before_streamed_step=place.home_new_states), "the optimizer's hooks")
                if place.streamer is not None and partitions is not None and partitions.prepare_streaming:
                    wired.push(partitions.prepare_streaming(place.streamer.layout.at_home,
                                                            place.streamer.masters.take_written),
                               f"{partitions.owner}'s step over partitions at their host home")
            steps = [Step("optimizer states to host", place.states_to_host, place.states_to_device)] \
                if place.streamer is not None else []
            steps += self._link.attach_steps()
            if place.masters is not None:  # once the engine sleeps: the swapped masters 'train' holds
                steps.append(Step("fp32 masters to the device", lambda: place.masters_to_device(("swap",))))
            with interrupts.held("the attach's moves"):
                self._run_steps("attach", steps)
                for step in steps:
                    if step.undo is not None:
                        moved.push(step.undo, step.name)
            # What attach started in the background ends before it returns. Page-locking holds the CUDA driver's
            # lock: a large cudaHostRegister stalls every CUDA call of another thread while it runs, and under TRL,
            # whose engine exists before attach, locking during the first step stalled its rollout. The first steps
            # call CUDA without pause, so waiting here costs less; an engine built in between (tens of seconds) has
            # hidden both already.
            start = time.perf_counter()
            if warming is not None:
                warming.join()
            waited = place.finish_host() + time.perf_counter() - start
            if waited > 0.1:
                logger.info("attach waited %.2f s for host memory to be locked and the check's kernel compiled",
                            waited)
            with interrupts.held("registering the runtime"):  # a signal now is raised once all of it is kept
                self._restore.take(wired)
                for kept in (installed, built, moved):
                    kept.clear()
                self._unbound = None
                self._register()

    def pausable(self, name: str, *, keep: str = "allocated"):
        """A region of device memory the runtime releases while the engine generates and maps again at the same
        addresses for training (a `swaprl.vmm.PausablePool`; `swaprl.regions` says what it is for and what
        must stay out of it). keep: what a pause preserves, "allocated" (live tensors' bytes) or "nothing" (a
        CUDA graph's private pool)."""
        self._check_bound()
        region = regions.new(name, keep=keep, device=self.device, taken={r.name for r in self._regions})
        self._regions.append(region)
        return region

    def _close(self) -> None:
        global _attached
        super()._close()
        if _attached is self:
            _attached = None


# ---------------------------------------------------------------- the engine attach builds
def make_engine(engine: Engine | str | None, model: torch.nn.Module, config: SwapConfig, *,
                reserve_bytes: int | None = None) -> Engine:
    """`engine` as given, or built from its name (`engine_name`); a vLLM engine sized from the free memory leaves
    `reserve_bytes` free (`engine_reserve_bytes`; None: its default reserve)."""
    if isinstance(engine, Engine):
        return engine
    if engine_name(engine, model) == "hf":
        from .engines.hf import HFEngine

        return HFEngine()
    from .engines.vllm import VLLMEngine

    return VLLMEngine.for_model(model, config=config, reserve_bytes=reserve_bytes)


def engine_reserve_bytes(device: torch.device, kept_bytes: int) -> int | None:
    """What an engine sized now from the free memory must leave free: the default reserve and the `kept_bytes` of
    optimizer states that stay on the device while it generates (the "device" home, made by the first optimizer
    step). None when nothing is kept: the engine's own default."""
    if not kept_bytes or device.type != "cuda":
        return None
    return default_reserve_bytes(torch.cuda.mem_get_info(device)[1]) + kept_bytes


def _takes_reserve(build: Callable) -> bool:
    """Whether an engine-building function takes `reserve_bytes` (see `attach`)."""
    try:
        return "reserve_bytes" in inspect.signature(build).parameters
    except (TypeError, ValueError):  # a builtin or C callable: called without it
        return False


def engine_name(engine: str | None, model: torch.nn.Module) -> str:
    """The engine `engine` names: "hf", "vllm" (from the model's checkpoint directory), or for None vLLM when it is
    installed, a GPU is present and the model was loaded from a local checkpoint directory, else "hf". Anything else
    is refused, naming every form `attach` accepts."""
    accepted = "an Engine instance, a function that builds one, 'hf', 'vllm' or None"
    if engine is not None and not isinstance(engine, str):
        raise TypeError(f"engine must be a swaprl.Engine, {accepted.removeprefix('an Engine instance, ')}, not "
                        f"{type(engine).__name__}")
    if engine is None:
        local = checkpoint_dir_of(model) is not None
        engine = "vllm" if vllm_available() and torch.cuda.is_available() and local else "hf"
        logger.info("engine: %s", engine)
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine={engine!r}; pass {accepted}")
    return engine
