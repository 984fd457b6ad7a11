"""pass@k as the trainer reports it: an item counts once one of its k samples reaches eval.success."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_core.trainer import eval_metrics


def samples(*rewards: float, tokens: int = 4) -> list:
    return [SimpleNamespace(reward=r, loss_mask=[1] * tokens) for r in rewards]


def test_pass_at_k_counts_an_item_once_any_sample_succeeds():
    items = [{"id": i} for i in range(4)]
    results = [samples(0.0, 1.0, 0.0),   # one of three right: counts
               samples(0.0, 0.0, 0.0),   # none: does not
               samples(1.0, 1.0, 1.0),   # all: counts once
               None]                     # rejected by the workflow: counted wrong
    m = eval_metrics(results, items, success=1.0, step=7, seconds=2.5)
    assert m["eval/accuracy"] == 2 / 4
    assert m["eval/items"] == 4 and m["eval/after_step"] == 7 and m["eval/seconds"] == 2.5
    assert m["eval/reward_mean"] == pytest.approx(4 / 9)
    assert m["eval/completion_tokens_mean"] == 4


def test_the_success_threshold_decides_what_counts():
    m = eval_metrics([samples(0.5), samples(0.9)], [{}, {}], success=0.8, step=0, seconds=0.0)
    assert m["eval/accuracy"] == 0.5


def test_a_failed_item_is_raised_with_the_item():
    with pytest.raises(RuntimeError, match="evaluation failed on validation item {'id': 3}: ValueError: bad"):
        eval_metrics([ValueError("bad")], [{"id": 3}], success=1.0, step=0, seconds=0.0)
