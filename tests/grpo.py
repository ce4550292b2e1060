"""A small GRPO-style loop shared by tests: generate -> verifiable reward -> policy-gradient step.

The reward is the fraction of even token ids in a completion: cheap, verifiable, and it pushes a random-weight
model somewhere measurable, which is all a memory runtime's tests need.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import swaprl


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
        max_tokens: int = 6) -> list[float]:
    """`steps` GRPO steps; with `runtime`, generation and training run in their phases."""
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    phase = runtime.phase if runtime is not None else (lambda name: contextlib.nullcontext())
    losses = []
    for step in range(steps):
        with phase("generate"):
            completions = engine.generate(prompts, swaprl.Sampling(max_tokens=max_tokens, n=n, seed=step))
        with phase("train"):
            loss = policy_loss(model, prompts, completions, n)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses


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
