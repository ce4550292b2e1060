"""Integrations with RL training libraries. Each lives in its own module and imports its library only when used:

    from swaprl.integrations.trl import wrap          # TRL's GRPOTrainer (docs/trl.md)
    rt = wrap(grpo_trainer)
"""
