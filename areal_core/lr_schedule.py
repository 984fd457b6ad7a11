"""The learning-rate factor of optimizer step ``s`` (0-based): linear warmup, then constant, linear or cosine decay.

    warmup (s < W):  (s + 1) / W
    then p = (s - W) / max(1, S - W)  clamped to [0, 1]  (S = total steps)
        constant: 1     linear: 1 - p     cosine: (1 + cos(pi p)) / 2

The last of ``S`` steps still has a positive rate for linear and cosine. The formula behind
``actor.optimizer.lr_schedule``, shared by every train engine.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    if schedule not in SCHEDULES:
        raise ValueError(f"actor.optimizer.lr_schedule {schedule!r} is not constant, linear or cosine")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    p = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    return 1.0
