"""Attaching: a `Runtime` wired to its trainer and engine, and the one attached runtime of the process.

`attach` checks everything first (`swaprl.checks`), then wires the parts in the order that hides the slow ones:
the placement (the optimizer-state policy resolved once, `swaprl.placement`), the host buffers page-locked in the
background, the engine built meanwhile if `attach` builds it (`make_engine`), the engine's link (`swaprl.link`), the
optimizer's hooks and streamed step, and the attach steps (the host-resident states to their buffer, the engine
asleep). Each part records its undo: a failed attach leaves nothing behind, `detach()` reverts the rest.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch

from . import checks, fingerprint, master, regions
from .checkpoints import checkpoint_dir_of
from .compat.torch import LR_SCHEDULER_MARK
from .config import SwapConfig
from .engines import vllm_available
from .engines.base import Engine
from .errors import PhaseError
from .link import link, unmeasurable
from .placement import Placement, engine_reserve_bytes
from .runtime import Phase, PhaseMachine
from .residency import savable
from .streaming import install_step, override
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

    `engine`: an `Engine`; a function that builds one (`lambda: VLLMEngine(path, ...)`); "hf" (generate with the
    trainer's own module); "vllm" (a colocated vLLM engine built from the model's checkpoint directory); or None:
    vLLM when it is installed, a GPU is present and the model was loaded from a local checkpoint directory, else
    "hf". A function, or a name, builds the engine once the host memory the optimizer states will need has started
    to be page-locked in the background, so that the locking runs under the engine's start; if attach then fails,
    it closes the engine it built. Validates everything before moving any memory or building an engine.
    """
    check_none_attached()
    config = config if config is not None else SwapConfig()
    if not isinstance(engine, Engine) and not callable(engine):
        name = engine_name(engine, model)  # refused here, before anything is allocated
        engine = functools.partial(make_engine, name, model, config, optimizer)
    rt = Runtime(model, optimizer, engine, config)
    if config.profile is not None:  # the profile package is imported only when used
        from .profile import attach_configured

        attach_configured(rt)
    return rt


@contextlib.contextmanager
def phase(name: Phase) -> Iterator[Runtime]:
    """`with swaprl.phase("generate"):` / `with swaprl.phase("train"):` on the attached runtime."""
    with current().phase(name) as rt:
        yield rt


def detach() -> dict[str, int]:
    """Detach the attached runtime (its state becomes resident again; see `Runtime.detach`); {} when none is."""
    return _attached.detach() if _attached is not None else {}


class Runtime(PhaseMachine):
    """Owns the phase state of one trainer (model + optimizer) and one engine. `swaprl.attach` builds it (and
    builds the engine); building it directly checks and registers it the same way."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 engine: Engine | Callable[[], Engine], config: SwapConfig) -> None:
        check_none_attached()
        super().__init__(config)
        self._bind(model, optimizer, engine)

    @classmethod
    def _pending(cls, config: SwapConfig, *, until: str) -> Runtime:
        """A runtime registered now and bound to its trainer later, with `_bind`: for a trainer whose model and
        optimizer only take their final form once its training loop has started (TRL under FSDP2, where `train()`
        shards the model and re-points the optimizer at the shards). Until then it holds nothing and stays in
        "train"; listeners and detach callbacks can be added, and what needs the trainer raises a `PhaseError`
        saying `until` (when it will be bound)."""
        global _attached
        check_none_attached()
        if not isinstance(config, SwapConfig):
            raise TypeError(f"config must be a swaprl.SwapConfig, not {type(config).__name__}")
        rt = cls.__new__(cls)
        PhaseMachine.__init__(rt, config)
        rt._unbound = until
        _attached = rt
        return rt

    def _bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              engine: Engine | Callable[[], Engine]) -> None:
        """Take charge of `model`, `optimizer` and `engine` (checked first; a callable builds it once the host
        buffers are being locked); a failure leaves nothing behind."""
        global _attached
        if _attached is not None and _attached is not self:
            check_none_attached()
        self._check_open()
        checks.check_trainer(model, optimizer, self.config)
        if isinstance(engine, Engine) or not callable(engine):
            checks.check_engine(engine, self.config)
        try:
            self._wire(model, optimizer, engine)
        except BaseException:
            # What the attach steps did is undone already; a pending runtime must not keep half a trainer.
            self.model = self.optimizer = self.engine = self.device = None
            self._placement = self._link = None
            raise
        self._unbound = None
        _attached = self

    def _wire(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              engine: Engine | Callable[[], Engine]) -> None:
        """The attach proper: host buffers, the engine (built now if `engine` builds it), the optimizer's hooks, the
        engine asleep (undone on failure)."""
        self.model, self.optimizer = model, optimizer
        self.device = checks.model_device(model)
        why = unmeasurable(engine) if isinstance(engine, Engine) else \
            "attach builds the engine, which takes the memory the states leave when they go"
        installed = Undo("the fp32 master weights")  # undone last if attach fails (the step methods sit on theirs)
        with installed.on_error():
            if self.config.master_weights:  # before the placement, which homes the masters with the states
                installed.push(master.install(optimizer, override=_keep_installed)[1], "install")
            streamed = {"type": "step", "transition": "optimizer.step", "step": "stream optimizer states"}
            self._placement = place = Placement(model, optimizer, self.device, self.config, unmeasurable=why,
                                                on_streamed_step=lambda info: self._emit(streamed | info))
        self.config = config = place.config  # "auto" resolved
        built = Undo("the engine attach built")  # closed if attach then fails; kept (the caller's) once attached
        with installed.on_error(), self._restore.on_error(), built.on_error():
            self._restore.push(place.release)  # a failed attach leaves no host memory behind
            place.prepare_host()
            if config.verify_sync and not (isinstance(engine, Engine) and engine.shares_trainer_weights):
                fingerprint.warm_up(self.device)  # the first weight check's kernel, compiled under what follows
            if not isinstance(engine, Engine):
                # Built while the host buffers are being locked: the locking (tens of seconds for tens of GiB where
                # pages are faulted in slowly) runs under the engine's start instead of before the first step.
                engine = engine()
                if isinstance(engine, Engine):
                    built.push(engine.close)
                checks.check_engine(engine, config)
            self.engine = engine
            place.whole_segments = engine.lender is None
            self._link = link(engine, model, config, kept_on_device=lambda: place.home_bytes()["device"],
                              emit=self._emit)
            engine.bind(model)
            self._restore.push(optimizer.register_step_pre_hook(lambda *_: self._check_step()).remove)
            self._restore.push(optimizer.register_state_dict_pre_hook(lambda opt: self.wait_reload()).remove)
            # States carved out of one buffer or allocation: each its own storage, so torch.save takes any mix of
            # dtypes and writes each tensor's bytes, not the buffer's.
            self._restore.push(optimizer.register_state_dict_post_hook(lambda opt, sd: savable(sd)).remove)
            steps = []
            if place.streamer is not None:
                self._restore.push(install_step(place.streamer, detached=lambda: self._closed))
                steps.append(Step("optimizer states to host", place.states_to_host, place.states_to_device))
            self._run_steps("attach", steps + self._link.attach_steps())
            # What attach started in the background ends before it returns. Page-locking holds the CUDA driver's
            # lock: a large cudaHostRegister stalls every CUDA call of another thread while it runs, and under TRL,
            # whose engine exists before attach, locking during the first step stalled its rollout. The first steps
            # call CUDA without pause, so waiting here costs less; an engine built in between (tens of seconds) has
            # hidden both already.
            waited = place.finish_host() + fingerprint.finish_warm_up(self.device)
            if waited > 0.1:
                logger.info("attach waited %.2f s for host memory to be locked and the check's kernel compiled",
                            waited)

    def pausable(self, name: str, *, keep: str = "allocated"):
        """A region of device memory the runtime releases while the engine generates and maps again at the same
        addresses for training (a `swaprl.kernels.PausablePool`; `swaprl.regions` says what it is for and what
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


def _keep_installed(opt: torch.optim.Optimizer, name: str, body: Callable) -> Callable[[], None]:
    """An optimizer method that stays after detach (the master step: plain torch needs it as much)."""
    return override(opt, name, body, lambda: False, marks=(LR_SCHEDULER_MARK,))


# ---------------------------------------------------------------- the engine attach builds
def make_engine(engine: Engine | str | None, model: torch.nn.Module, config: SwapConfig,
                optimizer: torch.optim.Optimizer | None = None) -> Engine:
    """`engine` as given, or built from its name (`engine_name`). A vLLM engine sized from the free memory leaves
    room for the optimizer states that will stay on the device while it generates (the "device" home of
    `config.optimizer_states`)."""
    if isinstance(engine, Engine):
        return engine
    if engine_name(engine, model) == "hf":
        from .engines.hf import HFEngine

        return HFEngine()
    from .engines.vllm import VLLMEngine

    reserve = engine_reserve_bytes(optimizer, config) if optimizer is not None else None
    return VLLMEngine.for_model(model, config=config, reserve_bytes=reserve)


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
