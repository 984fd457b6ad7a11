"""pass@k as the trainer reports it: an item counts once one of its k samples reaches eval.success."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_core.trainer import eval_metrics
from areal_core.trainer_eval import pass_at_k


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


def test_mean_at_k_is_the_share_of_right_samples_per_item_averaged_over_items():
    results = [samples(0.0, 1.0, 0.0), samples(0.0, 0.0, 0.0), samples(1.0, 1.0, 1.0), None]
    m = eval_metrics(results, [{}] * 4, success=1.0, step=0, seconds=0.0)
    assert m["eval/mean_at_k"] == pytest.approx((1 / 3 + 0 + 1 + 0) / 4)  # the rejected item counts 0
    assert m["eval/accuracy"] == 0.5  # pass@3: items 1 and 3
    one = eval_metrics([samples(1.0), samples(0.0), samples(1.0)], [{}] * 3, success=1.0, step=0, seconds=0.0)
    assert one["eval/accuracy"] == one["eval/mean_at_k"] == 2 / 3  # k = 1: both are the share of right items


@pytest.mark.parametrize("n, c, k, expected", [
    (3, 0, 3, 0.0),                 # no right sample
    (3, 1, 3, 1.0),                 # k = n: any right sample
    (4, 1, 1, 1 / 4),               # pass@1 = c / n
    (5, 2, 2, 1 - 3 / 10),          # 1 - C(3, 2) / C(5, 2)
    (10, 3, 5, 1 - 21 / 252),       # 1 - C(7, 5) / C(10, 5)
    (10, 8, 3, 1.0),                # fewer than k wrong samples: every draw of k holds a right one
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_agrees_with_the_binomial_formula_at_the_codex_papers_n():
    from math import comb

    for c in range(0, 201, 7):
        for k in (1, 10, 100):
            assert pass_at_k(200, c, k) == pytest.approx(1 - comb(200 - c, k) / comb(200, k), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_refuses_counts_that_cannot_be(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs 0 <= c <= n and 1 <= k <= n"):
        pass_at_k(n, c, k)
