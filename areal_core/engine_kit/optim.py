"""What every train engine builds the same way from ``actor.optimizer``: the AdamW parameter groups and the
learning-rate schedule (the formula itself is :func:`areal_core.lr_schedule.lr_factor`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from areal_core.lr_schedule import lr_factor


def parameter_groups(parameters: Iterable[Any], weight_decay: float) -> list[dict]:
    """AdamW groups of the trainable ``parameters``: matrices decay by ``weight_decay``, vectors (norms,
    biases) do not. Empty groups are left out (torch refuses them)."""
    decay, no_decay = [], []
    for p in parameters:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def adamw_kwargs(optimizer: Any) -> dict[str, Any]:
    """``torch.optim.AdamW``'s arguments from ``actor.optimizer`` (besides the groups)."""
    return {"lr": optimizer.lr, "betas": (optimizer.beta1, optimizer.beta2), "eps": optimizer.eps}


@dataclass
class Schedule:
    """Learning rate of optimizer step ``s`` (0-based) under ``actor.optimizer``: ``lr`` times
    :func:`~areal_core.lr_schedule.lr_factor`. ``step`` is the engine's count of steps taken (saved and
    restored with it)."""

    lr: float
    warmup_steps: int
    total_steps: int
    kind: str
    step: int = 0

    @classmethod
    def of(cls, config: Any) -> "Schedule":
        """The schedule of a run config (``actor.optimizer`` and ``trainer.total_steps``)."""
        o = config.actor.optimizer
        return cls(lr=float(o.lr), warmup_steps=int(o.warmup_steps), total_steps=int(config.trainer.total_steps),
                   kind=o.lr_schedule)

    def factor(self, s: int) -> float:
        return lr_factor(s, warmup_steps=self.warmup_steps, total_steps=self.total_steps, schedule=self.kind)

    def lr_at(self, s: int) -> float:
        return self.lr * self.factor(s)
