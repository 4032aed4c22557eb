"""The run-control constants that the command line and the trainer share, defined once here.

The command line checks and shows them without importing torch. The trainer (``trainer.loop``,
``trainer.checkpoint_policy``) runs with them. memplan never imports trainer, so the planner side owns them.
"""

LIMITS = ("max_steps", "max_tokens", "max_minutes")  # the settings that decide when a run stops
SEED_MAX = 2**32 - 1  # the largest --seed: seeds are mixed with steps and epochs into torch's and numpy's 64-bit seeds
