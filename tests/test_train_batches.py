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


# ---------------------------------------------------------------------- mini-batches of one update
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from areal_core.train_batches import (MINIBATCH_KEY, assign_minibatches, merge_update_stats,  # noqa: E402
                                      select_sequences, update_plan)


@given(groups=st.lists(st.lists(st.integers(2, 40), min_size=1, max_size=4), min_size=1, max_size=12),
       count=st.integers(1, 6))
def test_minibatches_keep_groups_whole_and_are_balanced_by_tokens(groups, count):
    lengths = [n for g in groups for n in g]
    group_index = [i for i, g in enumerate(groups) for _ in g]
    if count > len(groups):
        with pytest.raises(ValueError, match=f"actor.ppo_minibatches is {count} but the batch holds {len(groups)}"):
            assign_minibatches(lengths, group_index, count)
        return
    parts = assign_minibatches(lengths, group_index, count)
    assert set(parts) == set(range(count)), "every mini-batch gets a group"
    for g in range(len(groups)):
        assert len({p for p, gi in zip(parts, group_index) if gi == g}) == 1, "a group was split"
    load = [sum(n for n, p in zip(lengths, parts) if p == k) for k in range(count)]
    # greedy largest-first: no mini-batch exceeds another by more than the largest group
    assert max(load) - min(load) <= max(sum(g) for g in groups)
    assert assign_minibatches(lengths, group_index, count) == parts  # the same on every rank


def test_the_update_plan_runs_each_minibatch_once_per_epoch_in_order():
    batch = {"cu_seqlens": [0, 3, 5, 9, 10], MINIBATCH_KEY: [1, 0, 1, 0]}
    assert update_plan(batch, epochs=2) == [[1, 3], [0, 2], [1, 3], [0, 2]]
    assert update_plan({"cu_seqlens": [0, 3, 5]}, epochs=3) == [[0, 1]] * 3
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        update_plan(batch, epochs=0)
    with pytest.raises(ValueError, match=r"batch\['minibatch'\] has 3 entries for 4 sequences"):
        update_plan({**batch, MINIBATCH_KEY: [0, 0, 1]})


def test_select_sequences_slices_per_token_and_per_sequence_values():
    batch = {"input_ids": [1, 2, 3, 4, 5, 6, 7], "cu_seqlens": [0, 3, 5, 7], "rewards": [0.5, 1.0, 0.0],
             "seq_lens": [3, 2, 2], "kl_coef": 0.1, "policy_version": 4}
    sub = select_sequences(batch, [2, 0])
    assert sub == {"input_ids": [6, 7, 1, 2, 3], "cu_seqlens": [0, 2, 5], "rewards": [0.0, 0.5], "seq_lens": [2, 3],
                   "kl_coef": 0.1, "policy_version": 4}
    torch = pytest.importorskip("torch")
    as_tensors = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in batch.items()}
    assert select_sequences(as_tensors, [1])["input_ids"].tolist() == [4, 5]


def test_update_stats_are_means_over_steps_with_the_batch_counts():
    steps = [{"loss": 1.0, "grad_norm": 2.0, "n_tokens": 10.0, "update_skipped": 0.0},
             {"loss": 3.0, "grad_norm": 4.0, "n_tokens": 6.0, "update_skipped": 1.0}] * 2
    out = merge_update_stats(steps, epochs=2)
    assert out == {"loss": 2.0, "grad_norm": 3.0, "grad_norm_max": 4.0, "n_tokens": 16.0, "update_skipped": 2.0,
                   "n_optimizer_steps": 4.0}
    assert merge_update_stats(steps[:1]) == {**steps[0], "n_optimizer_steps": 1.0}


def test_update_batches_select_each_minibatch_once_and_reuse_it_every_epoch():
    from areal_core.train_batches import update_batches

    batch = {"input_ids": [1, 2, 3, 4, 5, 6, 7], "cu_seqlens": [0, 3, 5, 7], MINIBATCH_KEY: [1, 0, 1]}
    steps = update_batches(batch, epochs=2)
    assert [s["input_ids"] for s in steps] == [[4, 5], [1, 2, 3, 6, 7]] * 2
    assert steps[0] is steps[2] and steps[1] is steps[3]  # selected once, taken by both passes
    plain = {"input_ids": [1, 2, 3], "cu_seqlens": [0, 1, 3]}
    assert update_batches(plain, epochs=3) == [plain] * 3 and update_batches(plain)[0] is plain
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        update_batches(plain, epochs=0)
