"""Conformance suite for algorithms (entry-point group ``areal.algorithms``)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from areal_core.api.algorithm import Needs
from areal_core.testing.base import ComponentConformance, as_list, finite_number


class AlgorithmConformance(ComponentConformance):
    """Checks advantages and loss on a batch the subclass provides.

    Set on the subclass: ``component_name``; override :meth:`make_batch` (a
    packed batch with what the algorithm reads: ``input_ids``,
    ``cu_seqlens``, ``loss_mask``, ``logprobs``, rewards...) and, when the
    loss needs other inputs than the batch's own ``logprobs`` (a tensor with
    gradients, say), :meth:`loss_inputs`.
    """

    kind: ClassVar[str] = "algorithm"

    # -- for subclasses -----------------------------------------------------
    def make_batch(self) -> dict:
        pytest.fail(f"{type(self).__name__} must override make_batch() to return a packed batch")

    def loss_inputs(self, batch: dict) -> tuple[Any, Any]:
        """(logprobs, entropy) passed to ``loss``; by default the batch's own (a ratio of 1)."""
        if "logprobs" not in batch:
            pytest.fail(f"{type(self).__name__}.make_batch() has no 'logprobs'; add them or override "
                        f"loss_inputs() to return (logprobs, entropy)")
        return batch["logprobs"], batch.get("entropy")

    # -- helpers ------------------------------------------------------------
    def algorithm(self) -> Any:
        return self.make(self.component_class())

    def with_advantages(self, algorithm: Any) -> dict:
        batch = self.make_batch()
        keys = set(batch)
        out = algorithm.compute_advantages(batch)
        assert isinstance(out, dict), f"compute_advantages returned {type(out).__name__}, not the batch dict"
        lost = sorted(keys - set(out))
        assert not lost, f"compute_advantages dropped batch keys {lost}; it must only add keys"
        assert "advantages" in out, f"compute_advantages returned keys {sorted(out)} without 'advantages'"
        return out

    # -- tests --------------------------------------------------------------
    def test_needs_is_a_needs(self) -> None:
        needs = self.algorithm().needs
        assert isinstance(needs, Needs), (
            f"{self.component_name}.needs is {needs!r}; it must be an areal_core.api.Needs")

    def test_compute_advantages_adds_one_advantage_per_token(self) -> None:
        out = self.with_advantages(self.algorithm())
        advantages = as_list(out["advantages"])
        n = len(as_list(out["input_ids"]))
        assert len(advantages) == n, (f"{len(advantages)} advantages for {n} tokens; the trainer needs "
                                      f"one per token of the packed batch")
        for i, a in enumerate(advantages):
            finite_number(a, f"advantages[{i}]")

    def test_loss_returns_a_finite_scalar_and_stats(self) -> None:
        algorithm = self.algorithm()
        batch = self.with_advantages(algorithm)
        logprobs, entropy = self.loss_inputs(batch)
        result = algorithm.loss(logprobs, entropy, batch)
        assert isinstance(result, tuple) and len(result) == 2, (
            f"loss returned {type(result).__name__}; it must return (scalar loss, stats dict)")
        loss, stats = result
        assert isinstance(stats, dict), f"loss returned stats {stats!r}; the second item must be a dict"
        finite_number(loss, "the loss")
