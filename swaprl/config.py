"""`SwapConfig`: what moves where in each phase. One dataclass, validated on construction."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from .homes import HOMES

GradPolicy = Literal["free", "offload", "keep"]
ParamPolicy = Literal["keep", "offload"]
SleepLevel = Literal[1, 2, "auto"]
OptimizerStates = Literal["swap", "host"]

GRAD_POLICIES: tuple[str, ...] = get_args(GradPolicy)
PARAM_POLICIES: tuple[str, ...] = get_args(ParamPolicy)
SLEEP_LEVELS: tuple[int | str, ...] = get_args(SleepLevel)
OPTIMIZER_STATES: tuple[str, ...] = get_args(OptimizerStates)  # "swap" first: the planner tries it first
STATE_HOMES: tuple[str, ...] = HOMES  # the order a split assigns parameters in (`swaprl.homes`)

# Who holds device memory, in the order tables list them: the categories the profiler splits a measured device figure
# into (swaprl.profile.attribution) and the planner predicts (swaprl.plan). "unattributed" is what the measured
# categories do not explain; the planner has no measurement, so it is always 0 there.
MEMORY_CATEGORIES: tuple[str, ...] = ("params", "grads", "optimizer", "engine_weights", "kv_cache", "engine_other",
                                      "activations", "cuda_context", "unattributed")


STATES_PER_PARAMETER: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "lion": 1}
"""State tensors of a parameter's size an optimizer keeps per parameter (Adam and AdamW: the two moments; SGD with
momentum and Lion: one), by its lower-case class name. The planner prices the states with it; the placement sizes
ahead with it the states Adam and AdamW create at their first step."""

KV_WAVE_HEADROOM = 1.25
"""The KV cache worth keeping beyond the most an engine runs at once (one full wave of the rollout): the planner's
§Split leaves no more to the engine, and `VLLMEngine` says so when a cache exceeds it by far."""


def default_reserve_bytes(total: int) -> int:
    """What a self-sized engine leaves free on a GPU of `total` bytes for the trainer's transient needs: 2 GiB or
    3% of the GPU, the larger (`VLLMEngine` sizes itself, and `swaprl.plan` the `generate` phase, with this rule)."""
    return max(2 * 2**30, int(0.03 * total))


@dataclass(frozen=True, kw_only=True, slots=True)
class SwapConfig:
    """How the runtime moves memory between the `train` and `generate` phases.

    During `generate` the optimizer states whose room the engine needs leave the GPU. With
    `optimizer_states="host"` they never come back: they stay in host memory and only pass through the GPU, a
    chunk at a time, inside `optimizer.step()`.
    """

    optimizer_states: Literal["auto"] | OptimizerStates | Mapping[str, float] = "auto"
    """Where the optimizer states (and fp32 masters) live: each parameter's states have one home, "device" (on the
    GPU in both phases), "swap" (on the GPU in `train`, in host memory in `generate`) or "host" (in host memory in
    both phases, brought through the GPU `stream_chunk_bytes` at a time by `optimizer.step()`). `swaprl.homes` says
    how each home costs.
    "auto" (the default): homes decided by the room the run shows (`swaprl.homes.decide`): on the GPU in both
    phases what fits there beside the engine awake, swapped what fits beside training, streamed the rest; so
    nothing moves where everything fits. The room is measured at attach with the engine awake and holding all it
    holds while generating (less `default_reserve_bytes` and, with grads="keep", the gradients to come): only an
    engine that exists before attach, with weights of its own and awake, can be measured (TRL's, or one built by
    the caller). One that attach builds is sized to take what the states leave when they go, so for it, for an
    engine that generates with the trainer's weights, for states of unknown size (optimizers other than Adam and
    AdamW, before their first step) and without CUDA, "auto" swaps every state. Two measures follow on CUDA: at the
    first `optimizer.step()` of Adam or AdamW, once training has run beside all it holds, the states that would not
    fit beside training's peak and the step's temporaries are streamed ("host"); and a wake-up of the engine that
    lacks room swaps the states of as many more parameters as it lacks, and the switch goes again.
    `runtime.status()["optimizer_homes"]` says where they are.
    "swap": every state in host memory during `generate`, on the GPU during `train`.
    "host": every state in host memory in both phases: saves their whole size on the GPU in `train`; use it when
    parameters, gradients and states together do not fit.
    A split, e.g. {"device": 0.2, "swap": 0.5, "host": 0.3}: fractions of the states' bytes (per rank) by home.
    Parameters take their homes in the optimizer's order, the first ones "device", then "swap", then "host", each
    home taking whole parameters until it holds its fraction of the bytes (`swaprl.homes.by_fractions`). `swaprl
    plan` gives the split it predicts "auto" would choose on a cluster (docs/plan.md §Split)."""

    master_weights: bool = False
    """Train a bf16 model with fp32 master weights: the optimizer updates an fp32 copy of each bf16 parameter,
    which is cast into the parameter after each step (`swaprl.master`); the forward, backward and gradients stay in
    bf16. What RL fine-tuning at small learning rates needs, at 2 bytes per parameter on the device instead of fp32
    parameters' 4. Each master lives with its parameter's optimizer states, in their home
    (`optimizer_states`): on the device and updated in place, swapped, or in host memory and updated chunk by chunk
    by the streamed step (ZeRO-Offload's layout). They stay installed on the optimizer after `detach()`, back on the
    device; `optimizer.state_dict()` carries them."""

    stream_chunk_bytes: int = 2**30
    """With `optimizer_states="host"`: optimizer-state bytes per chunk of the streamed `optimizer.step()`. The GPU
    holds two chunks during the step (one updating, one copying). Adam, AdamW and SGD step a parameter whose states
    are larger than a chunk in pieces of a chunk; with other optimizers such a parameter's chunk is its states'
    size. The first step, which creates the states, steps each parameter whole and sizes its chunks as if each
    parameter's states were twice its own bytes (AdamW's two moments)."""

    grads: GradPolicy = "offload"
    """Gradients during `generate`: "offload" keeps them in host memory and brings them back (costs nothing when
    the loop zeroes them with `set_to_none=True` before generating, the usual case); "free" drops them (use only
    when no gradient is accumulated across a generate phase); "keep" leaves them on the GPU. Under DeepSpeed ZeRO-3
    "keep" also keeps ZeRO's gradient buffer, which the others release between its steps (docs/trl.md)."""

    params: ParamPolicy = "keep"
    """Trainer parameters during `generate`: "keep" leaves them on the GPU; "offload" moves them to host memory
    (only with an engine that holds its own copy of the weights, such as vLLM: the embedded HF engine generates
    with the trainer's parameters)."""

    sleep_level: SleepLevel = "auto"
    """Engine sleep during `train`: 1 offloads the engine's weights to host memory, 2 discards them (they are
    re-synced from the trainer at the next wake-up). "auto" picks 2 when the engine's weights are synced from the
    trainer at each wake-up anyway, which is always the case in on-policy RL."""

    host_budget_bytes: int | None = None
    """Most host memory the runtime may hold in offload buffers. None: what the OS reports available when the
    buffers are first sized, less `host_margin_bytes`."""

    host_margin_bytes: int = 4 * 2**30
    """Host memory left to everything else when `host_budget_bytes` is None."""

    pin_memory: bool = True
    """Page-lock the host buffers (needed for asynchronous copies at full PCIe speed). Ignored without CUDA."""

    sync_bucket_bytes: int = 512 * 2**20
    """Weight sync trainer -> engine moves parameters in buckets of about this many bytes."""

    gpu_memory_utilization: float | None = None
    """Fraction of the GPU a vLLM engine may use. None: computed from what is free when the engine is built (see
    `swaprl.engines.VLLMEngine`)."""

    overlap_optimizer_reload: bool = False
    """Let the optimizer states' copy back to the GPU run under the training step's forward and backward instead
    of before it; the compute stream waits for it at `optimizer.step()` and `optimizer.state_dict()`. Off by
    default because code that reads `optimizer.state` directly in `train` before the step would race the copy
    (call `runtime.wait_reload()` first). Saves the reload's time (its bytes over PCIe) per step."""

    overlap_offload: bool = True
    """Start the copies of the optimizer states (and offloaded gradients) to the host before the engine's weights
    are woken and synced, and finish them before its KV cache is mapped, so the copies run under that work. Used
    only when the device has room for the engine's weights next to the optimizer states (checked at each switch);
    otherwise the offload finishes first."""

    profile: str | os.PathLike | None = None
    """Write a memory profile (JSON Lines) to this path; None: no profiling."""

    verify_sync: bool = True
    """After every weight sync, prove that the engine holds the trainer's weights bit for bit (fingerprints of
    every tensor on both sides, no tolerance; `swaprl.verify`) and raise `EngineStateError` naming the tensors if it
    does not; then measure the rollout-training mismatch on a short probe the engine samples while awake and the
    trainer scores as training starts (`runtime.last_sync`, the memory profile, TRL's logs). Costs a read of both
    sides' weights on the device, one short generation and one short forward; turn it off only to measure without
    it."""

    mismatch_probe: bool = True
    """With `verify_sync`: measure the rollout-training mismatch on the short probe as well. False keeps the weight
    check and leaves out the probe's generation and forward from the phase switches: for a loop that measures the
    mismatch on its own rollouts from the engine's log-probabilities (examples/grpo.py does). `verify_tolerance`
    judges the probe's figures, so it needs the probe."""

    verify_tolerance: tuple[float, float] | None = None
    """(max, mean) bounds on |log p_trainer - log p_engine| over the probe's tokens, past which leaving `generate`
    raises `EngineStateError` (in `train`, before the loop trains on the rollouts).
    None (the default): the figures are reported, never judged. Two correct forward passes differ more the deeper
    the model (bf16 vLLM against the trainer, before any update: max 0.13 at Qwen2.5-1.5B, 0.25 at 14B, 0.38 at 20 of
    72B's layers), and stale weights are caught exactly by the weight check, so a bound is only for a run that
    must stop when the mismatch grows past what its importance-sampling correction is tuned for."""

    def __post_init__(self) -> None:
        # Every field's type first, naming the field: a wrong type must not surface later as a bare comparison error
        # (`'<' not supported`) or pass as something else (True is an int, NaN compares false with everything).
        _choice("grads", self.grads, GRAD_POLICIES)
        _choice("params", self.params, PARAM_POLICIES)
        if isinstance(self.optimizer_states, Mapping):
            object.__setattr__(self, "optimizer_states", _check_split(self.optimizer_states))
        elif not isinstance(self.optimizer_states, str) or self.optimizer_states not in ("auto", *OPTIMIZER_STATES):
            raise ValueError(f"SwapConfig.optimizer_states={self.optimizer_states!r}; use 'auto' (on the device what "
                             "fits beside the engine, the rest swapped), 'swap' (states on the device for 'train', in "
                             "host memory for 'generate'), 'host' (always in host memory, streamed through the device "
                             "by optimizer.step()) or a split such as {'device': 0.2, 'swap': 0.5, 'host': 0.3}")
        _byte_count("stream_chunk_bytes", self.stream_chunk_bytes, "e.g. 2**30")
        if self.stream_chunk_bytes < 2**20:
            raise ValueError(f"SwapConfig.stream_chunk_bytes={self.stream_chunk_bytes} is under 1 MiB; chunks that "
                             "small make the streamed step launch-bound: use 256 MiB or more")
        for name in ("master_weights", "pin_memory", "overlap_optimizer_reload", "overlap_offload", "verify_sync",
                     "mismatch_probe"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"SwapConfig.{name}={value!r}; give True or False")
        if self.optimizer_states != "auto" and self.state_split()["swap"] == 0 and self.overlap_optimizer_reload:
            raise ValueError(f"SwapConfig(optimizer_states={self.optimizer_states!r}, overlap_optimizer_reload=True): "
                             "no state is swapped, so there is no reload to overlap (host-resident states never "
                             "come back for 'train': the streamed optimizer.step() overlaps its own copies); drop "
                             "overlap_optimizer_reload")
        if not (self.sleep_level == "auto" and isinstance(self.sleep_level, str)
                or type(self.sleep_level) is int and self.sleep_level in (1, 2)):  # not 1.0, True or a tensor
            raise ValueError(f"SwapConfig.sleep_level={self.sleep_level!r}; use 1, 2 or 'auto'")
        if self.host_budget_bytes is not None:
            _byte_count("host_budget_bytes", self.host_budget_bytes,
                        "or None to use what the OS reports available")
        _byte_count("host_margin_bytes", self.host_margin_bytes, "e.g. 4 * 2**30")
        _byte_count("sync_bucket_bytes", self.sync_bucket_bytes, "e.g. 512 * 2**20")
        if self.sync_bucket_bytes < 2**20:
            raise ValueError(f"SwapConfig.sync_bucket_bytes={self.sync_bucket_bytes} is under 1 MiB; "
                             "buckets that small make the weight sync launch-bound: use 64 MiB or more")
        if self.profile is not None and (not isinstance(self.profile, str | os.PathLike) or not str(self.profile)):
            raise ValueError(f"SwapConfig.profile={self.profile!r}; give the path of the profile to write (a str or "
                             "a pathlib.Path), or None for no profile")
        if self.verify_tolerance is not None:
            bounds = self.verify_tolerance
            if (not isinstance(bounds, tuple | list) or len(bounds) != 2
                    or not all(_finite_number(b) and b > 0 for b in bounds)):
                raise ValueError(f"SwapConfig.verify_tolerance={bounds!r}; give (max, mean) as two positive "
                                 "numbers, e.g. (0.5, 0.12), or None for the defaults")
            object.__setattr__(self, "verify_tolerance", (float(bounds[0]), float(bounds[1])))
            if not self.mismatch_probe:
                raise ValueError(f"SwapConfig(verify_tolerance={self.verify_tolerance!r}) judges the mismatch the "
                                 "probe measures after each weight sync: keep mismatch_probe=True, or drop "
                                 "verify_tolerance")
        if self.gpu_memory_utilization is not None:
            value = self.gpu_memory_utilization
            if not _finite_number(value) or not 0.0 < value <= 1.0:
                raise ValueError(f"SwapConfig.gpu_memory_utilization={value!r} is outside (0, 1]; give a fraction, "
                                 "e.g. 0.5, or None to size the engine from the free memory")

    def state_split(self) -> dict[str, float]:
        """The fractions by home of a fixed `optimizer_states`, {"device": d, "swap": s, "host": h} ("swap" is
        {"swap": 1.0}). "auto" has none: its homes are decided while the run goes (`runtime.status()`)."""
        if self.optimizer_states == "auto":
            raise ValueError("SwapConfig(optimizer_states='auto') has no fixed split: the runtime decides the homes "
                             "as the run shows what fits; runtime.status()['optimizer_homes'] says where they are")
        if isinstance(self.optimizer_states, str):
            return {home: float(home == self.optimizer_states) for home in STATE_HOMES}
        return dict(self.optimizer_states)


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"SwapConfig.{name}={value!r}; use one of {choices}")


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _byte_count(name: str, value: object, example: str) -> None:
    """Refuse anything but a non-negative int (bools, floats, NaN and strings included), naming the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SwapConfig.{name}={value!r}; give a byte count as an int, {example}")
    if value < 0:
        raise ValueError(f"SwapConfig.{name}={value} is negative; give a byte count, {example}")


def _check_split(split: Mapping[str, float]) -> dict[str, float]:
    """A split's fractions for every home, or a ValueError that shows a valid one."""
    example = "e.g. {'device': 0.2, 'swap': 0.5, 'host': 0.3}"
    unknown = sorted(map(str, set(split) - set(STATE_HOMES)))
    if unknown:
        raise ValueError(f"SwapConfig.optimizer_states: unknown home(s) {unknown}; the homes are {STATE_HOMES}, "
                         f"{example}")
    out = {}
    for home in STATE_HOMES:
        value = split.get(home, 0.0)
        if not _finite_number(value) or not 0.0 <= value <= 1.0:
            raise ValueError(f"SwapConfig.optimizer_states[{home!r}]={value!r}; give a fraction in [0, 1] of the "
                             f"states' bytes, {example}")
        out[home] = float(value)
    if not math.isclose(sum(out.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"SwapConfig.optimizer_states={dict(split)!r} sums to {sum(out.values()):.6g}; the fractions "
                         f"share all of the states' bytes and must sum to 1, {example}")
    return out


def parse_optimizer_states(text: str) -> str | dict[str, float]:
    """A command line's `SwapConfig.optimizer_states`: "swap", "host", or a split "device=0.2,swap=0.5,host=0.3"
    (homes left out get 0). Raises ValueError naming the form."""
    text = text.strip()
    if text in OPTIMIZER_STATES:
        return text
    split = {}
    for part in filter(None, text.split(",")):
        home, sep, value = part.partition("=")
        try:
            split[home.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"optimizer states {text!r}: give 'swap', 'host' or a split of the states' bytes such as "
                             "'device=0.2,swap=0.5,host=0.3'")
    return _check_split(split)


def format_optimizer_states(value: str | Mapping[str, float]) -> str:
    """`value` in the command-line form `parse_optimizer_states` reads, homes holding nothing left out. Each
    fraction is written so that it reads back as the same float: a split the planner chose ends its homes at a
    parameter's edge, and a rounded fraction could move a small parameter there into the next home."""
    if isinstance(value, str):
        return value
    return ",".join(f"{home}={_exact(fraction)}" for home, fraction in value.items() if fraction)


def _exact(fraction: float) -> str:
    short = f"{fraction:g}"
    return short if float(short) == fraction else repr(float(fraction))
