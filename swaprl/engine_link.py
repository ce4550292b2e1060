"""The runtime's side of its engine: what each phase switch asks of the engine, by the kind of engine it is.

An engine that generates with the trainer's own module (`HFEngine`) holds nothing of its own: `SharedWeights` asks
nothing of it at a switch. An engine with weights of its own (vLLM) sleeps in `train`; entering `generate` it is
woken in two stages (its weights first, synced from the trainer and proved equal to them by `swaprl.verify`, then
its KV cache once the trainer's state has left) and samples the on-policy probe, which the trainer scores as
training starts: `OwnWeights`. The runtime composes these steps with the placement's and never asks which kind of
engine it drives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from . import distributed, sync
from .config import SwapConfig
from .engines.base import Engine
from .undo import Step
from .verify import SyncReport, Verifier, raise_if_failed

logger = logging.getLogger(__name__)


class EngineLink:
    """What each switch asks of an engine, for the kind of engine it is: nothing, in this base (an engine that
    holds nothing of its own)."""

    def __init__(self, engine: Engine, model: torch.nn.Module, config: SwapConfig) -> None:
        self.engine, self.model, self.config = engine, model, config
        self.sleep_level = 1 if config.sleep_level == "auto" else int(config.sleep_level)
        self.verifier: Verifier | None = None
        self.room_bytes = 0
        """Device bytes the engine's weights take when woken while the optimizer states are still on the device."""
        self.judged: SyncReport | None = None  # the report the switch under way completed, judged once it stands

    @property
    def last_sync(self) -> SyncReport | None:
        return self.verifier.last if self.verifier is not None else None

    def attach_steps(self) -> list[Step]:
        return []

    def wake_steps(self, cycle: int) -> list[Step]:
        """Entering `generate`, while the trainer's state may still be on the device."""
        return []

    def ready_steps(self) -> list[Step]:
        """Entering `generate`, once the trainer's state has left the device."""
        return []

    def sleep_steps(self) -> list[Step]:
        """Entering `train`, before the trainer's state comes back."""
        return []

    def train_steps(self) -> list[Step]:
        """Entering `train`, once the trainer's state is back."""
        return []

    def sync_weights(self) -> int:
        return 0

    def verify_sync(self, cycle: int, prompts: list[list[int]] | None) -> SyncReport:
        """Check the engine now (`Runtime.verify_sync`)."""
        if self.verifier is None:
            self.verifier = Verifier(self.model, self.engine, bounds=self.config.verify_tolerance)
        self.verifier.check_weights(cycle)
        return self.verifier.add_mismatch(prompts)


class SharedWeights(EngineLink):
    """An engine that generates with the trainer's own parameters: nothing to wake, sync or prove at a switch."""


class OwnWeights(EngineLink):
    """An engine holding a copy of the weights of its own: asleep in `train`, woken, synced and proved in
    `generate`. `kept_on_device()`: the optimizer states' bytes the placement keeps on the device while generating
    (an out-of-memory wake-up names them); `emit(event)` reports the check to the runtime's listeners."""

    def __init__(self, engine: Engine, model: torch.nn.Module, config: SwapConfig, *,
                 kept_on_device: Callable[[], int], emit: Callable[[dict], None]) -> None:
        super().__init__(engine, model, config)
        # Level 2 by default: the weights are synced from the trainer at every wake-up anyway.
        self.sleep_level = 2 if config.sleep_level == "auto" else int(config.sleep_level)
        self.verifier = Verifier(model, engine, bounds=config.verify_tolerance)
        # The sync's largest bucket beside the weights: an embedding larger than the bucket size is sent whole.
        self.room_bytes = engine.weights_bytes + sync.largest_bucket_bytes(model, config.sync_bucket_bytes,
                                                                           sync.engine_dtypes(engine))
        self._kept_on_device, self._emit = kept_on_device, emit
        self._stale = True  # the engine does not hold the trainer's current weights
        self._synced: tuple[float, int] | None = None  # the last sync's seconds and bytes, for its report

    def attach_steps(self) -> list[Step]:
        return [Step("engine sleep", self.sleep, lambda: self.wake(None))]

    def wake_steps(self, cycle: int) -> list[Step]:
        # Staged: the weights first, synced while the trainer's parameters are still on the device; the KV cache
        # last (`ready_steps`), once the trainer's state has left, so old + new weights + KV never coexist.
        # The sync copies on the device, trainer to engine: its bytes are in its step's event, not in the switch's
        # total of what crossed between the device and host memory.
        steps = [Step("engine wake weights", lambda: self.wake(["weights"]), self.sleep),
                 Step("sync weights", self.sync_weights, moves=False)]
        if self.config.verify_sync:  # while the trainer's parameters are surely on the device
            steps.append(Step("verify weights", lambda: self._verify_weights(cycle)))
        return steps

    def ready_steps(self) -> list[Step]:
        steps = [Step("engine wake kv_cache", lambda: self.wake(["kv_cache"]), self.sleep)]
        # the mismatch's engine half; the trainer scores it when training starts
        if self.config.verify_sync and self.config.mismatch_probe:
            steps.append(Step("sample probe", self.verifier.sample_mismatch, self.verifier.drop_probe))
        elif self.config.verify_sync:  # no probe to wait for: reported once the switch stands, the last step
            steps.append(Step("report sync", lambda: self._emit({"type": "sync", **self.verifier.last.as_dict()})))
        return steps

    def sleep_steps(self) -> list[Step]:
        return [Step("engine sleep", self.sleep, self.rewake)]

    def train_steps(self) -> list[Step]:
        if not self.verifier.probe_pending:
            return []
        # Last, with the engine asleep: the trainer's forward (under FSDP it gathers the root's parameters and two
        # layers) takes room training has anyway rather than the KV cache's; its parameters are back even when they
        # left for generate; and a model whose forward replays graphs from a paused region finds them resumed.
        return [Step("score probe", self._score_probe)]

    # ---------------------------------------------------------------- the engine's memory
    def sleep(self) -> None:
        self.engine.sleep(self.sleep_level)
        if self.sleep_level == 2:
            self._stale = True

    def wake(self, tags: list[str] | None) -> None:
        try:
            self.engine.wake(tags)
        except torch.OutOfMemoryError as exc:
            kept = self._kept_on_device()
            if not kept:
                raise
            # The engine's KV cache was sized when it was built; the states a split keeps on the device came later.
            named = type(exc)(
                f"{exc} Of what is not free, {kept / 2**30:.2f} GiB are optimizer states kept on the device while "
                "generating (the 'device' home of SwapConfig.optimizer_states): build the engine with room for "
                f"them (VLLMEngine(reserve_bytes=...) of at least {kept / 2**30:.2f} GiB more than the default "
                "reserve), or give the 'device' home a smaller share")
            named.short_bytes = getattr(exc, "short_bytes", 0)  # what the placement swaps more of, under "auto"
            raise named from exc
        if tags is None or "kv_cache" in tags:
            self.engine.reset_prefix_cache()

    def rewake(self) -> None:
        self.wake(None)
        if self._stale:
            self.sync_weights()

    # ---------------------------------------------------------------- the weights and their check
    def sync_weights(self) -> int:
        start = time.perf_counter()
        sent = sync.push_weights(self.model, self.engine, bucket_bytes=self.config.sync_bucket_bytes)
        self._synced = (time.perf_counter() - start, sent)
        self._stale = False
        return sent

    def _verify_weights(self, cycle: int) -> None:
        seconds, sent = self._synced or (None, None)
        report = self.verifier.check_weights(cycle, sync_seconds=seconds, sync_bytes=sent)
        if not report.ok:  # nothing is generated: the report is complete without its mismatch
            self._emit({"type": "sync", **report.as_dict()})
        raise_if_failed(report)

    def _score_probe(self) -> None:
        try:
            report = self.verifier.score_mismatch()
        except torch.OutOfMemoryError as exc:
            fix = ("The trainer scores 8 short sequences as training starts, a forward smaller than a training micro "
                   "batch's: leave training more room (a smaller micro batch, more of the optimizer states swapped), "
                   "or SwapConfig(verify_sync=False) skips the check")
            if distributed.is_distributed():
                # The other ranks may wait in this forward's collectives: going on would pair them with training's.
                raise type(exc)(f"{exc} This was the on-policy check's probe. {fix}") from exc
            # A figure, not a proof (the weights were proved before generating): the switch goes on without it.
            self.verifier.drop_probe()
            report = self.verifier.last
            logger.warning("the on-policy check's probe ran out of memory (%s); this sync's mismatch is not measured. "
                           "%s", exc, fix)
        self._emit({"type": "sync", **report.as_dict()})
        self.judged = report  # bounds set by the user are applied once the switch to train stands


def unmeasurable(engine: Engine) -> str | None:
    """Why what `engine` holds while it generates cannot be measured at attach (`placement.resolve_auto`), or None."""
    if engine.shares_trainer_weights:
        return "the engine generates with the trainer's weights, taking memory as it goes"
    if engine.memory().get("location") != "device":
        return "the engine is asleep, so what it holds awake cannot be measured"
    return None


def link(engine: Engine, model: torch.nn.Module, config: SwapConfig, *, kept_on_device: Callable[[], int],
         emit: Callable[[dict], None]) -> EngineLink:
    """The link for `engine`'s kind."""
    if engine.shares_trainer_weights:
        return SharedWeights(engine, model, config)
    return OwnWeights(engine, model, config, kept_on_device=kept_on_device, emit=emit)
