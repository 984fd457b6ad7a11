"""The workflow contract: one episode from one dataset item."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from areal_core.api.component import Component
from areal_core.api.inference import InferenceEngine


@dataclass
class Trajectory:
    """One sampled sequence as the trainer will see it.

    ``loss_mask`` marks the tokens the policy produced (1) versus prompt or
    tool / environment tokens (0); ``versions`` is -1 where no policy produced
    the token. All per-token lists have one entry per token of
    ``input_ids + output_ids`` flattened in ``tokens``.
    """

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory: {n} tokens but {len(getattr(self, name))} entries in {name}; "
                    "every per-token list needs one entry per token"
                )


class Workflow(Component):
    """Runs episodes against an inference engine (entry-point group ``areal.workflows``)."""

    @abstractmethod
    async def arun_episode(self, engine: InferenceEngine, item: Any) -> list[Trajectory] | None:
        """Trajectories for ``item`` (a group of them for group-relative methods), or None to reject.

        Token-in / token-out: send token ids to the engine and keep the ids it
        returns; never re-tokenize a model's output.
        """
