"""The PPO family across the optimizer steps of one update (actor.ppo_minibatches / ppo_epochs): loss weights per
mini-batch and the proximal policy of ``prox_approx: loglinear``; every expected value is worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from areal_core.api import Context

from areal_ppo import algorithm as algos

approx = pytest.approx


def make(cls, **keys):
    return cls(Context(options=cls.config_class(**keys)))


def tokens(*values):
    return torch.tensor(values, dtype=torch.float32)


def one_sequence(behav, versions, adv, policy_version, step):
    """One sequence, a prompt token then len(behav) response tokens."""
    n = len(behav)
    return {"loss_mask": torch.tensor([False] + [True] * n), "logprobs": tokens(0.0, *behav),
            "versions": torch.tensor([-1, *versions]), "advantages": tokens(0.0, *adv),
            "loss_weights": tokens(*([1.0] * (n + 1))), "seq_lens": torch.tensor([n + 1]),
            "policy_version": policy_version, "update_step": step}


def test_loglinear_uses_the_current_policy_in_the_first_step_and_the_papers_alpha_after():
    # Trained at v_prox = 5; tokens sampled at versions 5, 4 and 2; behaviour logprobs -1, -2, -3; the current
    # policy gives -1.5 for each. v_theta = 6: alpha = (5 - v) / (6 - v) = 0, 1/2, 3/4, so
    # log pi_prox = behav + alpha (current - behav) = -1, -2 + 0.25, -3 + 1.125 = -1, -1.75, -1.875.
    algo = make(algos.GRPO, behav_weight_mode="none")
    current = tokens(0.0, -1.5, -1.5, -1.5)
    later = one_sequence([-1.0, -2.0, -3.0], [5, 4, 2], [1.0, 1.0, 1.0], policy_version=5, step=1)
    prox = algo._loglinear_prox(current, later["logprobs"], later)
    assert prox[1:].tolist() == approx([-1.0, -1.75, -1.875])
    first = {**later, "update_step": 0}
    assert algo._loglinear_prox(current, first["logprobs"], first) is current  # exact: theta is the proximal policy


def test_the_loss_after_the_first_step_clips_against_the_interpolated_proximal_policy():
    # Same tokens, advantages +1, eps 0.2. Ratios u = pi_theta / pi_prox = exp(-1.5 - prox):
    #   exp(-0.5) = 0.60653, exp(0.25) = 1.28403, exp(0.375) = 1.45499
    # clipped surrogate -min(u A, clip(u, 0.8, 1.2) A) = -0.60653, -1.2, -1.2 (two clipped);
    # behaviour weights w = exp(prox - behav) = exp(0) = 1, exp(0.25) = 1.28403, exp(1.125) = 3.08022.
    # loss = mean(w * pg) = (-0.60653 - 1.54084 - 3.69626) / 3 = -1.94788; clip fraction 2/3.
    algo = make(algos.GRPO, behav_weight_mode="none", eps_clip=0.2)
    later = one_sequence([-1.0, -2.0, -3.0], [5, 4, 2], [1.0, 1.0, 1.0], policy_version=5, step=1)
    loss, stats = algo.loss(tokens(0.0, -1.5, -1.5, -1.5), None, later)
    u = [math.exp(-0.5), math.exp(0.25), math.exp(0.375)]
    w = [1.0, math.exp(0.25), math.exp(1.125)]
    pg = [-min(x, min(max(x, 0.8), 1.2)) for x in u]
    assert float(loss) == approx(sum(a * b for a, b in zip(w, pg)) / 3, abs=1e-5)
    assert float(loss) == approx(-1.94788, abs=1e-4)
    assert stats["clip_frac"] == approx(2 / 3)
    # In the first step the same tokens are not clipped at all: pi_prox = pi_theta, u = 1.
    _, first = algo.loss(tokens(0.0, -1.5, -1.5, -1.5), None, {**later, "update_step": 0})
    assert first["clip_frac"] == 0.0 and first["ratio_mean"] == approx(1.0)


def test_loglinear_after_the_first_step_needs_the_version_trained_at():
    algo = make(algos.GRPO)
    later = one_sequence([-1.0], [0], [1.0], policy_version=0, step=1)
    del later["policy_version"]
    with pytest.raises(KeyError, match="policy_version"):
        algo.loss(tokens(0.0, -1.0), None, later)


def test_loss_weights_aggregate_over_each_minibatch():
    # seq-mean-token-mean, c = N / (S |o_i|) over the step's N loss tokens and S sequences. Response lengths
    # 1 | 3, 2, 2 (mini-batch 0 | 1): step 0 has N = 1, S = 1 -> c = 1; step 1 has N = 7, S = 3 -> c = 7 / 9
    # and 7 / 6. Over the whole batch (one step): N = 8, S = 4 -> c = 8 / (4 |o|) = 2, 2/3, 1, 1.
    lens = [1, 3, 2, 2]
    prompt = 1
    b = {"input_ids": [], "loss_mask": [], "logprobs": [], "versions": []}
    cu = [0]
    for n in lens:
        b["input_ids"] += list(range(3, 4 + n))
        b["loss_mask"] += [0] + [1] * n
        b["logprobs"] += [0.0] + [-1.0] * n
        b["versions"] += [-1] + [0] * n
        cu.append(cu[-1] + prompt + n)
    b.update(rewards=[1.0, 0.0, 1.0, 0.0], group_index=[0, 1, 2, 3], cu_seqlens=cu, seq_lens=[1 + n for n in lens],
             minibatch=[0, 1, 1, 1])
    out = make(algos.GRPO, adv_norm="none").compute_advantages(b)
    per_seq = [out["loss_weights"][cu[i] + 1] for i in range(4)]
    assert per_seq == approx([1.0, 7 / 9, 7 / 6, 7 / 6], abs=1e-6)
    whole = make(algos.GRPO, adv_norm="none").compute_advantages({k: v for k, v in b.items() if k != "minibatch"})
    assert [whole["loss_weights"][cu[i] + 1] for i in range(4)] == approx([2.0, 2 / 3, 1.0, 1.0], abs=1e-6)
