"""The TRL internals swaprl's wrapper replaces or reads, in one place, behind a version gate.

`swaprl.integrations.trl.wrap` routes a `GRPOTrainer`'s generation through the runtime's phases. GRPOTrainer has no
public hook for that, so the wrapper changes a few private names on the trainer instance (never on TRL's classes),
each listed in `PATCHED` with why; all were checked against TRL 1.16 (`SUPPORTED`). A name that is gone is an error
naming it when the wrapper needs it (`require`), never a change that silently does nothing.

Importing this module does not import TRL.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from . import in_range

SUPPORTED = ">=1.16,<1.17"
"""TRL versions `wrap` knows (PEP 440 specifier; development builds of these count as these)."""

PATCHED: dict[str, str] = {
    "GRPOTrainer._generate": "the one method through which GRPOTrainer produces completions: run inside "
                             "phase('generate')",
    "GRPOTrainer.log": "add swaprl's figures to every log record (to the user's report_to)",
    "VLLMGeneration.sync_weights": "made a no-op: swaprl syncs (and proves) the weights on entering 'generate'",
    "VLLMGeneration.generate": "ask vLLM for no log-probabilities the trainer does not read (lean rollouts)",
    "VLLMGeneration.enable_sleep_mode": "off while wrapped: swaprl puts the engine to sleep and wakes it",
    "VLLMGeneration._llm_weights_sleeping": "TRL's record of its engine's weights asleep, kept true to swaprl's",
    "VLLMGeneration.generation_kwargs": "detokenize=False unless stop strings need the text",
    "VLLMGeneration.logprobs": "None when nothing reads the sampled tokens' log-probabilities",
    "GRPOTrainer._last_loaded_step": "reset at unwrap so TRL syncs its engine again",
}
"""Every private TRL name the wrapper changes or reads, and why."""


def check_version(version: str) -> None:
    """Raise if `version` (a TRL version string) is outside `SUPPORTED`."""
    if not in_range(version, SUPPORTED):
        raise RuntimeError(
            f"swaprl.integrations.trl supports trl{SUPPORTED}, found trl {version}. It hooks GRPOTrainer's "
            f"private generation method, whose behaviour changes between releases, so other versions are refused "
            f"rather than silently mis-wrapped. Install a supported one (pip install 'trl{SUPPORTED}'), or drive "
            "the phases yourself: swaprl.attach(model, optimizer) and `with swaprl.phase('generate'):` around "
            "generation.")


def require(obj, *names: str, owner: str) -> None:
    """Raise naming the fix if `obj` (a trainer or its `vllm_generation`) lacks any of `names` (see `PATCHED`)."""
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise RuntimeError(f"this TRL's {owner} has no {', '.join(missing)}, which swaprl's wrapper replaces "
                           f"(checked against trl{SUPPORTED}); the wrapper would do nothing there. Install a "
                           f"supported TRL (pip install 'trl{SUPPORTED}'), or drive the phases yourself around "
                           "generation")


def route_generation(trainer, around: Callable[[], object]) -> Callable[[], None]:
    """Run every call of `trainer._generate` inside the context `around()` makes; returns the undo."""
    require(trainer, "_generate", owner="GRPOTrainer")
    generate = trainer._generate

    @functools.wraps(generate)
    def _generate(*args, **kwargs):
        with around():
            return generate(*args, **kwargs)

    trainer._generate = _generate
    return lambda: vars(trainer).pop("_generate", None)


def add_to_logs(trainer, figures: Callable[[dict], dict]) -> Callable[[], None]:
    """Make `trainer.log(logs)` log `figures(logs)` instead; returns the undo."""
    log = trainer.log

    @functools.wraps(log)
    def log_with_swaprl(logs: dict, *args, **kwargs):
        return log(figures(logs), *args, **kwargs)

    trainer.log = log_with_swaprl
    return lambda: vars(trainer).pop("log", None)


def take_over_vllm(trainer, wake: Callable[[], None]) -> Callable[[], None]:
    """Make TRL's own sleep, wake-up and weight sync of its LLM no-ops; returns the function that restores them.
    `wake()` wakes the engine, for a TRL without sleep mode, which expects an awake engine back.

    The runtime wakes the engine and syncs the trainer's weights on entering "generate" (which encloses every
    call TRL makes to the engine) and puts it to sleep on leaving it, so TRL doing the same would do it twice.
    """
    vg = trainer.vllm_generation
    require(vg, "sync_weights", "enable_sleep_mode", "_llm_weights_sleeping", owner="VLLMGeneration")
    sleep_mode = vg.enable_sleep_mode

    def sync_weights() -> None:
        """Done by swaprl on entering phase('generate'), with the trainer's current weights."""

    vg.sync_weights = sync_weights
    vg.enable_sleep_mode = False  # TRL's generate() then neither wakes nor sleeps nor re-syncs the engine
    vg._llm_weights_sleeping = False

    def restore() -> None:
        vars(vg).pop("sync_weights", None)
        vg.enable_sleep_mode = sleep_mode
        if sleep_mode:
            vg._llm_weights_sleeping = True  # asleep (detach leaves it so): TRL re-syncs before generating
        else:
            wake()
        trainer._last_loaded_step = -1  # the engine's weights may be stale or discarded: TRL syncs next time

    return restore


def lean_rollouts(trainer) -> Callable[[], None]:
    """Ask vLLM for token ids, not text, and for log-probabilities only when the trainer reads them; returns the undo.

    GRPOTrainer 1.16 decodes the completions' text itself from their ids (`processing_class.batch_decode`) and reads
    the sampled tokens' log-probabilities only for `vllm_importance_sampling_correction`, yet asks vLLM for both.
    vLLM makes them per token in Python, in the same loop that schedules the GPU, at a large cost in rollout
    throughput (benchmarks/results/grpo_trl_w1_h100/grpo_trl_w1_b_lean_h100.md). Stop strings need the text, so a
    `generation_kwargs["stop"]` keeps detokenization on. Tokens not scored get TRL's own mark for "vLLM gave no
    log-probability" (None, read as NaN and excluded).
    """
    vg = trainer.vllm_generation
    require(vg, "generation_kwargs", "logprobs", "generate", owner="VLLMGeneration")
    kwargs, logprobs, generate = vg.generation_kwargs, vg.logprobs, vg.generate
    own_generate = "generate" in vars(vg)  # set on the instance already (by another wrapper): put that one back
    if not (kwargs or {}).get("stop"):
        vg.generation_kwargs = {"detokenize": False, **(kwargs or {})}
    if not getattr(trainer, "vllm_importance_sampling_correction", True):
        vg.logprobs = None

        @functools.wraps(generate)
        def generate_without_logprobs(*args, **kw):
            prompt_ids, completion_ids, scores, score_ids = generate(*args, **kw)
            if scores is None:  # the shape TRL indexes: one [sampled token's log-probability] per token
                scores = [[[None]] * len(ids) for ids in completion_ids]
            return prompt_ids, completion_ids, scores, score_ids

        vg.generate = generate_without_logprobs

    def restore() -> None:
        vg.generation_kwargs, vg.logprobs = kwargs, logprobs
        if own_generate:
            vg.generate = generate
        else:
            vars(vg).pop("generate", None)

    return restore
