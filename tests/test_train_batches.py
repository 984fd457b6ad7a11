"""The train engines' shared batch helpers: statistics that do not depend on how a batch was split."""

from __future__ import annotations

import pytest

from areal_core.train_batches import combine_stats, cumsum, scalar_stats, to_tensor


def test_loss_and_stats_are_weighted_by_loss_tokens():
    # micro-batches of 1 and 3 loss tokens; "clip" reported by the second only
    out = combine_stats([(1, 2.0, {"ratio": 1.0}), (3, 6.0, {"ratio": 2.0, "clip": 0.5})], total_loss_tokens=4)
    assert out == {"loss": (2.0 + 18.0) / 4, "ratio": (1.0 + 6.0) / 4, "clip": 0.5}


def test_scalar_stats_keep_numbers_and_drop_the_rest():
    torch = pytest.importorskip("torch")
    assert scalar_stats({"a": torch.tensor(1.5), "b": 2, "c": "text", "d": torch.ones(3)}) == {"a": 1.5, "b": 2.0}


def test_to_tensor_types_and_cumsum():
    torch = pytest.importorskip("torch")
    assert to_tensor("loss_mask", [0, 1]).dtype == torch.bool
    assert to_tensor("logprobs", [0.5, 1]).dtype == torch.float32
    assert to_tensor("input_ids", [3, 4]).dtype == torch.int64
    assert to_tensor("name", "x") == "x"
    assert list(cumsum([3, 4, 2])) == [3, 7, 9]
