"""transformers' checkpointing entry point, under the name each release gives it."""

from __future__ import annotations


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward (only in training mode).

    transformers 5.25 renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable` and warns on the
    old name until v6 removes it; earlier releases have only the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
