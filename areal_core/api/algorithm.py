"""The algorithm contract: rewards -> advantages -> loss (entry-point group ``areal.algorithms``)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from areal_core.api.component import Component


@dataclass(frozen=True)
class Needs:
    """Extra passes the trainer runs only when the algorithm asks for them."""

    reference_logprobs: bool = False
    proximal_logprobs: bool = False
    values: bool = False


class Algorithm(Component):
    """Turns a batch of trajectories into advantages and a loss."""

    @property
    def needs(self) -> Needs:
        return Needs()

    def should_accept(self, group: Any) -> bool:
        """Keep this finished group (an :class:`~areal_core.rollout.EpisodeGroup`) for training?

        Runs on the rollout loop for every group; a rejected group frees its
        slot and another item is sampled (dynamic sampling). Default: keep all.
        """
        return True

    @abstractmethod
    def compute_advantages(self, batch: dict) -> dict:
        """Return ``batch`` (a :class:`~areal_core.api.batch.PackedBatch`) with per-token ``advantages`` (and
        ``returns`` for a critic) added, lists or CPU tensors; the trainer checks each column's length."""

    @abstractmethod
    def loss(self, logprobs: Any, entropy: Any, batch: dict) -> tuple[Any, dict]:
        """The scalar loss for one micro-batch and stats to log."""

    def value_loss(self, values: Any, batch: dict) -> tuple[Any, dict]:
        """The critic's loss for one micro-batch (only when ``needs.values``)."""
        raise NotImplementedError(f"{type(self).__name__} asks for values but defines no value_loss")
