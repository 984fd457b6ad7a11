"""Hand-computed cases, one per formula; the arithmetic is in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from areal_core.api import Context

from areal_ppo import algorithm as algos
from areal_ppo import losses
from areal_ppo.advantages import ResponseGrid, gae, overlong_penalty

approx = pytest.approx


def make(cls, **keys):
    return cls(Context(options=cls.config_class(**keys)))


def batch(rewards, lens, prompt=1, groups=None, logprobs=None):
    """Sequences of `prompt` prompt tokens then lens[i] response tokens; behaviour logprobs default -1."""
    out = {k: [] for k in ("input_ids", "position_ids", "loss_mask", "logprobs", "versions")}
    cu = [0]
    for n in lens:
        size = prompt + n
        out["input_ids"] += list(range(3, 3 + size))
        out["position_ids"] += list(range(size))
        out["loss_mask"] += [0] * prompt + [1] * n
        out["logprobs"] += [0.0] + [-1.0] * (size - 1)
        out["versions"] += [-1] * prompt + [0] * n
        cu.append(cu[-1] + size)
    if logprobs is not None:
        out["logprobs"] = logprobs
    out.update(rewards=list(rewards), group_index=groups or [0] * len(lens), seq_lens=[prompt + n for n in lens],
               cu_seqlens=cu)
    return out


def response_advantages(out):
    return [a for a, m in zip(out["advantages"], out["loss_mask"]) if m]


# ---------------------------------------------------------------- advantages
def test_grpo_normalises_by_group_mean_and_std():
    # Rewards 1, 0, 0, 1 in one group: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.57735.
    # A = (r - 0.5) / 0.57735 = +-0.86603 on every response token.
    out = make(algos.GRPO).compute_advantages(batch([1, 0, 0, 1], [1, 1, 1, 1]))
    assert response_advantages(out) == approx([0.86603, -0.86603, -0.86603, 0.86603], abs=1e-4)
    assert [a for a, m in zip(out["advantages"], out["loss_mask"]) if not m] == [0.0] * 4  # prompts: 0


def test_groups_are_normalised_separately():
    # Group 0: rewards 2, 0 -> mean 1, std sqrt(2) -> +-0.70711; group 1: 5, 5 -> 0 (std 0: 0 / 1).
    out = make(algos.GRPO).compute_advantages(batch([2, 0, 5, 5], [1, 1, 1, 1], groups=[0, 0, 1, 1]))
    assert response_advantages(out) == approx([0.70711, -0.70711, 0.0, 0.0], abs=1e-4)


def test_dr_grpo_subtracts_the_mean_only():
    # Rewards 1, 0, 0 -> mean 1/3: A = 2/3, -1/3, -1/3, no division by the std.
    out = make(algos.DrGRPO).compute_advantages(batch([1, 0, 0], [1, 1, 1]))
    assert response_advantages(out) == approx([2 / 3, -1 / 3, -1 / 3], abs=1e-6)


def test_rloo_leave_one_out_baseline():
    # Rewards 1, 0, 0: baselines (0 + 0) / 2 = 0, (1 + 0) / 2 = 0.5, 0.5 -> A = 1, -0.5, -0.5.
    out = make(algos.RLOO).compute_advantages(batch([1, 0, 0], [1, 1, 1]))
    assert response_advantages(out) == approx([1.0, -0.5, -0.5])


def test_reinforce_pp_kl_in_the_reward_and_returns():
    # One sequence, 2 response tokens, reward 1, k1 KL with beta 0.5: behaviour - ref = 0.1, 0.2.
    # Token rewards: -0.05, 1 - 0.1 = 0.9; returns (gamma 1): 0.85, 0.9 (no normalisation asked).
    b = batch([1.0], [2])
    b["ref_logprobs"] = [0.0, -1.1, -1.2]
    algo = make(algos.ReinforcePP, kl_coef=0.5, adv_norm="none")
    assert algo.needs.reference_logprobs
    assert response_advantages(algo.compute_advantages(b)) == approx([0.85, 0.9], abs=1e-6)


def test_reinforce_pp_batch_normalisation_over_tokens():
    # No KL: returns are the rewards on every token: seq 0 (2 tokens) 1, seq 1 (2 tokens) 0.
    # Batch of 4 token advantages 1, 1, 0, 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735.
    out = make(algos.ReinforcePP, kl_coef=0.0).compute_advantages(batch([1, 0], [2, 2]))
    assert response_advantages(out) == approx([0.86603, 0.86603, -0.86603, -0.86603], abs=1e-4)


def test_reinforce_pp_baseline_subtracts_the_group_mean_before_the_batch_std():
    # Group 0: 3, 1 -> minus mean 2: 1, -1. Group 1: 10, 10 -> 0, 0. One token each.
    # Batch: 1, -1, 0, 0: mean 0, unbiased std sqrt(2 / 3) = 0.81650 -> 1.22474, -1.22474, 0, 0.
    out = make(algos.ReinforcePPBaseline, kl_coef=0.0).compute_advantages(
        batch([3, 1, 10, 10], [1, 1, 1, 1], groups=[0, 0, 1, 1]))
    assert response_advantages(out) == approx([1.22474, -1.22474, 0.0, 0.0], abs=1e-4)


def test_gae_two_tokens():
    # Values 0.5, 0.8, reward 1 on the last token, gamma 1, lambda 0.5:
    # delta_1 = 1 + 0 - 0.8 = 0.2 -> A_1 = 0.2; delta_0 = 0 + 0.8 - 0.5 = 0.3 -> A_0 = 0.3 + 0.5 * 0.2 = 0.4.
    # Returns = A + V = 0.9, 1.0.
    b = batch([1.0], [2])
    b["values"] = [0.0, 0.5, 0.8]
    algo = make(algos.PPO, adv_norm="none", lam=0.5)
    assert algo.needs.values
    out = algo.compute_advantages(b)
    assert response_advantages(out) == approx([0.4, 0.2])
    assert out["returns"] == approx([0.0, 0.9, 1.0])


def test_gae_discounts():
    # Rewards [0, 1], values [0, 0], gamma 0.5, lambda 1: A_1 = 1; A_0 = 0 + 0.5 * 0 - 0 + 0.5 * 1 * 1 = 0.5.
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.5, 1.0)
    assert adv.tolist() == [[0.5, 1.0]] and ret.tolist() == [[0.5, 1.0]]


def test_clipped_value_loss():
    # value_clip 0.2, three response tokens (V, V_old, R), per token 1/2 max((V - R)^2, (V_clip - R)^2) with
    # V_clip = V_old + clip(V - V_old, -0.2, 0.2):
    #   (1.0, 0.5, 0.0): plain 1.0; V_clip 0.7 -> 0.49; max 1.0 -> 0.5; the plain term binds: d/dV = V - R = 1.0
    #   (0.65, 0.5, 1.0): inside the clip range V_clip = V: 0.1225 -> 0.06125; d/dV = -0.35
    #   (0.0, 0.5, 0.0): plain 0; V_clip 0.3 -> 0.09; max 0.09 -> 0.045; the clipped term binds: d/dV = 0
    # Token mean over the 3 response tokens: (0.5 + 0.06125 + 0.045) / 3 = 0.2020833; gradients / 3.
    b = batch([0.0], [3])
    b["values"], b["returns"] = [0.0, 0.5, 0.5, 0.5], [0.0, 0.0, 1.0, 0.0]
    algo = make(algos.PPO, value_clip=0.2)
    values = torch.tensor([9.0, 1.0, 0.65, 0.0], requires_grad=True)  # the prompt token is masked out
    loss, stats = algo.value_loss(values, b)
    loss.backward()
    assert float(loss) == approx(0.2020833, abs=1e-6) and stats["value_loss"] == approx(0.2020833, abs=1e-6)
    assert values.grad.tolist() == approx([0.0, 1.0 / 3, -0.35 / 3, 0.0], abs=1e-6)
    # value_clip 0: plain 1/2 (V - R)^2: (0.5 + 0.06125 + 0) / 3.
    assert float(make(algos.PPO, value_clip=0.0).value_loss(values, b)[0]) == approx(0.1870833, abs=1e-6)


def test_dapo_overlong_penalty():
    # L_max 10, buffer 0.2 -> L_cache 2: no penalty up to 8; 9 -> (8 - 9) / 2 = -0.5; 10 -> -1; 12 -> -1.
    assert overlong_penalty(torch.tensor([5, 8, 9, 10, 12]), 10, 0.2, 1.0).tolist() == approx([0, 0, -0.5, -1, -1])
    # Through the algorithm: rewards 1, 1 with 9 and 3 response tokens, L_max 10 -> scores 0.5, 1;
    # group mean 0.75, std sqrt(2 * 0.0625) = 0.35355 -> A = -0.70711, 0.70711.
    out = make(algos.DAPO, max_response_len=10).compute_advantages(batch([1, 1], [9, 3]))
    assert response_advantages(out)[0] == approx(-0.70711, abs=1e-4)
    assert response_advantages(out)[-1] == approx(0.70711, abs=1e-4)


def test_reward_shaping_scale_bias_clip():
    # (r + 1) * 2 clipped to 3: r = 0 -> 2, r = 1 -> 4 -> 3. adv_norm none, no baseline: A = score.
    out = make(algos.GRPO, reward_bias=1.0, reward_scale=2.0, reward_clip=3.0, adv_norm="none").compute_advantages(
        batch([0, 1], [1, 1]))
    assert response_advantages(out) == approx([2.0, 3.0])


# ---------------------------------------------------------------- loss aggregation
def aggregate(cls, mode, adv, lens, **keys):
    """The loss at ratio 1 (logprobs = behaviour) for given per-response-token advantages."""
    algo = make(cls, loss_agg_mode=mode, adv_norm="none", **keys)
    b = algo.compute_advantages(batch([0.0] * len(lens), lens))
    it = iter(adv)
    b["advantages"] = [next(it) if m else 0.0 for m in b["loss_mask"]]
    return float(algo.loss(torch.tensor(b["logprobs"]), None, b)[0])


def test_loss_aggregation_modes():
    # Two sequences with 1 and 3 response tokens, A = 4 | 1, 2, 3; at ratio 1 the loss per token is -A.
    adv, lens = [4.0, 1.0, 2.0, 3.0], [1, 3]
    # token-mean: -(4 + 1 + 2 + 3) / 4 = -2.5
    assert aggregate(algos.GRPO, "token-mean", adv, lens) == approx(-2.5)
    # seq-mean-token-mean: -(4 / 1 + 6 / 3) / 2 = -3
    assert aggregate(algos.GRPO, "seq-mean-token-mean", adv, lens) == approx(-3.0)
    # seq-mean-token-sum / 8: -(4 + 6) / (2 * 8) = -0.625
    assert aggregate(algos.GRPO, "seq-mean-token-sum", adv, lens, loss_agg_norm=8) == approx(-0.625)


# ---------------------------------------------------------------- objectives
def grad_of(fn, logp):
    logp = torch.tensor(logp, requires_grad=True)
    out = fn(logp)
    out.sum().backward()
    return out.detach(), logp.grad


def test_clipped_surrogate_values_and_gradients():
    # u = 1.5, A = 1, eps 0.2: -min(1.5, 1.2) = -1.2, clipped: no gradient.
    # u = 0.5, A = 1: -min(0.5, 0.8) = -0.5, gradient -u A = -0.5.
    # u = 1.5, A = -1: -min(-1.5, -1.2) = 1.5, gradient -u A = 1.5.
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -1.0])
    value, grad = grad_of(lambda lp: losses.clipped_surrogate(torch.exp(lp - old), adv, 0.2, 0.2)[0],
                          [math.log(1.5), math.log(0.5), math.log(1.5)])
    assert value.tolist() == approx([-1.2, -0.5, 1.5])
    assert grad.tolist() == approx([0.0, -0.5, 1.5])


def test_clip_higher_bounds():
    # eps_low 0.2, eps_high 0.28: u = 1.25 (A > 0) is inside [0.8, 1.28]: -1.25; u = 1.3 is clipped: -1.28.
    value, _ = losses.clipped_surrogate(torch.tensor([1.25, 1.3]), torch.ones(2), 0.2, 0.28)
    assert value.tolist() == approx([-1.25, -1.28])


def test_gspo_sequence_ratio():
    # One sequence of 2 loss tokens with log u = 0.1, 0.3: s = exp(0.2) = 1.22140 on both tokens.
    # clip to [0.9, 1.1] with A = 1: -min(1.2214, 1.1) = -1.1 per token.
    s = losses.sequence_ratio(torch.tensor([0.0, 0.1, 0.3]), torch.tensor([False, True, True]), torch.tensor([3]))
    assert s.tolist()[1:] == approx([1.22140, 1.22140], abs=1e-5)
    value, _ = losses.clipped_surrogate(s, torch.ones(3), 0.1, 0.1)
    assert value.tolist()[1:] == approx([-1.1, -1.1])


def test_sapo_soft_gate():
    # u = 1.5, A = 1, tau_pos 1: f = 4 sigmoid(0.5) = 4 * 0.622459 = 2.489837; shifted by 1 - 2 = -1: 1.489837.
    # d/dlogp: 4 sigmoid(0.5) (1 - sigmoid(0.5)) * u, with sigmoid(0.5) (1 - sigmoid(0.5)) = 0.235004:
    # 4 * 0.235004 * 1.5 = 1.410022.
    value, grad = grad_of(lambda lp: losses.soft_gate(torch.exp(lp), torch.ones(1), 1.0, 1.05), [math.log(1.5)])
    assert value.item() == approx(-1.489837, abs=1e-5)
    assert grad.item() == approx(-1.410022, abs=1e-5)
    # At u = 1 the loss is -A and its gradient the plain policy gradient -A, whatever tau (A < 0: tau_neg 1.05).
    value, grad = grad_of(lambda lp: losses.soft_gate(torch.exp(lp), -torch.ones(1), 1.0, 1.05), [0.0])
    assert value.item() == approx(1.0) and grad.item() == approx(1.0)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # u = 1.5, A = 1, bounds [0, 1.28]: c = 1.28; value -1.28, gradient -1.28 (a PPO clip would give 0).
    value, grad = grad_of(lambda lp: losses.clipped_is_weight(lp, torch.exp(lp), torch.ones(1), 1.0, 0.28)[0],
                          [math.log(1.5)])
    assert value.item() == approx(-1.28) and grad.item() == approx(-1.28)


def test_m2po_mask():
    # log r = 0.1, -0.1, 0.5, 0: (log r)^2 = .01, .01, .25, 0; sorted 0, .01, .01, .25 with running means
    # 0, .005, .00667, .0675: at threshold 0.04 the first three stay: only the 0.5 token is masked.
    assert losses.m2_mask(torch.tensor([0.1, -0.1, 0.5, 0.0]), 0.04).tolist() == [True, True, False, True]


def test_m2po_loss_uses_the_mask():
    # Prox - behaviour: 0, 0.5 on the two response tokens -> (log r)^2 = 0, 0.25 -> mean 0.125 > 0.04:
    # the second token is masked. A = 1 on both (adv_norm none, reward 1); loss at u = 1, w = 1 on token 1:
    # -(1 * 1 + 0) / 2 = -0.5.
    algo = make(algos.M2PO, adv_norm="none", decoupled=False)
    assert algo.needs.proximal_logprobs
    b = batch([1.0], [2])
    b["prox_logprobs"] = [0.0, -1.0, -0.5]
    out = algo.compute_advantages(b)
    assert out["m2_mask"].tolist() == [0.0, 1.0, 0.0]
    assert float(algo.loss(torch.tensor(out["logprobs"]), None, out)[0]) == approx(-0.5)


def test_kl_estimators():
    # x = log pi - log pi_ref = 0.5: k1 = 0.5, k2 = 0.125, k3 = e^-0.5 - 1 + 0.5 = 0.106531.
    lp, ref = torch.tensor([0.0]), torch.tensor([-0.5])
    assert losses.kl_estimate(lp, ref, "k1").item() == approx(0.5)
    assert losses.kl_estimate(lp, ref, "k2").item() == approx(0.125)
    assert losses.kl_estimate(lp, ref, "k3").item() == approx(0.106531, abs=1e-6)


def test_kl_as_a_loss_term():
    # GRPO, one token, A = 0 (adv_norm none, reward 0), k2 with beta 0.1, logp - ref = 0.5: loss 0.1 * 0.125.
    algo = make(algos.GRPO, kl_coef=0.1, kl_estimator="k2", adv_norm="none")
    b = batch([0.0], [1])
    b["ref_logprobs"] = [0.0, -1.5]
    out = algo.compute_advantages(b)
    assert float(algo.loss(torch.tensor(out["logprobs"]), None, out)[0]) == approx(0.0125)


def test_adaptive_kl_coefficient():
    # target 0.1, measured k1 KL 0.2 -> error clip(0.2 / 0.1 - 1, -0.2, 0.2) = 0.2; 2 sequences, horizon 10:
    # beta = 0.5 * (1 + 0.2 * 2 / 10) = 0.52 for the next step (this step used 0.5).
    algo = make(algos.GRPO, kl_coef=0.5, kl_estimator="k1", kl_target=0.1, kl_horizon=10)
    b = batch([1.0, 0.0], [1, 1])
    b["ref_logprobs"] = [0.0, -1.2, 0.0, -1.2]
    out = algo.compute_advantages(b)
    assert out["kl_coef"] == 0.5 and algo.kl_coef == approx(0.52)


# ---------------------------------------------------------------- decoupled PPO
def test_behaviour_weight_truncation_and_masking():
    # Token level, log w = ln 2, ln 0.5, ln 8 with bounds [0, 5]: mask -> 2, 0.5, 0; truncate -> 2, 0.5, 5.
    log_w = torch.log(torch.tensor([2.0, 0.5, 8.0]))
    mask, lens = torch.ones(3, dtype=torch.bool), torch.tensor([3])
    assert losses.behaviour_weight(log_w, mask, lens, "mask", "token", 0.0, 5.0)[0].tolist() == approx([2, 0.5, 0])
    assert losses.behaviour_weight(log_w, mask, lens, "truncate", "token", 0.0, 5.0)[0].tolist() == approx([2, .5, 5])
    # Lower bound 0.6 masks the 0.5 token.
    assert losses.behaviour_weight(log_w, mask, lens, "mask", "token", 0.6, 5.0)[1].tolist() == [True, False, False]
    # Sequence level: sequences (2, 4) and (0.5): W = 8 and 0.5 -> mask: 0, 0 | 0.5; truncate: 5, 5 | 0.5.
    log_w = torch.log(torch.tensor([2.0, 4.0, 0.5]))
    lens = torch.tensor([2, 1])
    assert losses.behaviour_weight(log_w, mask, lens, "mask", "sequence", 0.0, 5.0)[0].tolist() == approx([0, 0, .5])
    assert losses.behaviour_weight(log_w, mask, lens, "truncate", "sequence", 0, 5)[0].tolist() == approx([5, 5, .5])


def test_decoupled_loss_multiplies_by_the_behaviour_weight():
    # Behaviour -1, proximal -1 + ln 2 (w = 2) and logp = proximal (u = 1), A = 1: loss -2 (decoupled);
    # without decoupling the ratio against behaviour is 2 > 1.2: clipped to -1.2.
    b = batch([1.0], [1])
    b["prox_logprobs"] = [0.0, -1.0 + math.log(2.0)]
    b["advantages"] = [0.0, 1.0]
    logp = torch.tensor(b["prox_logprobs"])
    on = make(algos.GRPO, prox_approx="recompute")
    assert on.needs.proximal_logprobs
    assert float(on.loss(logp, None, b)[0]) == approx(-2.0)
    assert float(make(algos.GRPO, decoupled=False).loss(logp, None, b)[0]) == approx(-1.2)
    # loglinear: the proximal policy is the training policy itself (one optimizer step per batch): same -2.
    loglinear = make(algos.GRPO)
    assert not loglinear.needs.proximal_logprobs
    del b["prox_logprobs"]
    assert float(loglinear.loss(logp, None, b)[0]) == approx(-2.0)


def test_response_grid_round_trip():
    # Tokens: seq 0 = [p, r, r], seq 1 = [p, p, r, x(masked), r]: loss tokens at 1, 2 | 5, 7.
    grid = ResponseGrid.from_batch([0, 3, 8], torch.tensor([0, 1, 1, 0, 0, 1, 0, 1]))
    assert grid.index.tolist() == [[1, 2], [5, 7]] and grid.lengths.tolist() == [2, 2]
    per_token = torch.arange(8.0)
    assert grid.scatter(grid.gather(per_token), 8).tolist() == [0, 1, 2, 0, 0, 5, 0, 7]


# ---------------------------------------------------------------- bounded advantages (issue 20, item 4)
def test_group_normalisation_acts_on_the_scores_before_discounting():
    # gamma 0.9, rewards 1, 0 in one group, 2 response tokens each. The scores are normalised first: mean 0.5,
    # unbiased std sqrt(2 * 0.25 / 1) = 0.70711 -> +-0.70711 on each last token; returns 0.9 * 0.70711 = 0.63640.
    out = make(algos.GRPO, gamma=0.9).compute_advantages(batch([1, 0], [2, 2]))
    assert response_advantages(out) == approx([0.63640, 0.70711, -0.63640, -0.70711], abs=1e-4)


def test_equal_rewards_with_a_discount_give_zero_advantages():
    # Group 0: rewards 1, 1, 1 (std 0), gamma 0.9, 3 response tokens each: s - mean = 0 on every score, so every
    # return is 0 (before: returns 0.81, 0.9, 1 minus the mean score 1, over 0 + 1e-6: -1.9e5, -1e5, 0).
    # Group 1 (rewards 2, 0, 1 tokens each) is normalised on its own: mean 1, std sqrt(2) -> +-0.70711.
    out = make(algos.GRPO, gamma=0.9).compute_advantages(batch([1, 1, 1, 2, 0], [3, 3, 3, 1, 1],
                                                               groups=[0, 0, 0, 1, 1]))
    assert response_advantages(out) == approx([0.0] * 9 + [0.70711, -0.70711], abs=1e-4)
    assert max(abs(a) for a in response_advantages(out)[:9]) == 0.0


def test_equal_rewards_with_kl_in_the_reward_give_only_the_kl_penalty():
    # grpo, kl_in_reward, k1 with beta 0.01; behaviour - ref = 0.1, 0.2 | 0.3, 0.0 on the response tokens.
    # Rewards 1, 1: normalised scores 0; token rewards -0.001, -0.002 | -0.003, 0; returns (gamma 1):
    # -0.003, -0.002 | -0.003, 0 (before: 1 - 0.003 etc. minus the mean score 1, over 1e-6: -3000, -2000, ...).
    keys = dict(kl_coef=0.01, kl_in_reward=True, kl_estimator="k1")
    b = batch([1, 1], [2, 2])
    b["ref_logprobs"] = [0.0, -1.1, -1.2, 0.0, -1.3, -1.0]
    assert response_advantages(make(algos.GRPO, **keys).compute_advantages(b)) == approx(
        [-0.003, -0.002, -0.003, 0.0], abs=1e-7)
    # Rewards 1, 0: normalised scores +-0.70711 (as above), then the same KL penalty on top.
    b = batch([1, 0], [2, 2])
    b["ref_logprobs"] = [0.0, -1.1, -1.2, 0.0, -1.3, -1.0]
    assert response_advantages(make(algos.GRPO, **keys).compute_advantages(b)) == approx(
        [0.70711 - 0.003, 0.70711 - 0.002, -0.70711 - 0.003, -0.70711], abs=1e-5)


def test_a_group_or_batch_without_spread_is_not_divided_by_eps():
    # adv_norm_mean off, std on: scores 2, 2 (std 0) are divided by 1, not by 0 + 1e-6 (before: 2e6).
    out = make(algos.GRPO, adv_norm_mean=False).compute_advantages(batch([2, 2], [1, 1]))
    assert response_advantages(out) == approx([2.0, 2.0])
    # Batch normalisation likewise: every token's return is 3 -> std 0 -> 3 / 1 (before: 3e6).
    out = make(algos.ReinforcePP, kl_coef=0.0, adv_norm_mean=False).compute_advantages(batch([3, 3], [2, 1]))
    assert response_advantages(out) == approx([3.0, 3.0, 3.0])


def test_ppo_group_normalisation_normalises_the_rewards_before_gae():
    # ppo with adv_norm group, one group of two sequences with reward 1 each: normalised scores 0. Values 0.5, 0.8
    # on both, gamma 1, lambda 0.5: delta_1 = 0 - 0.8 -> A_1 = -0.8; delta_0 = 0 + 0.8 - 0.5 = 0.3 ->
    # A_0 = 0.3 + 0.5 * -0.8 = -0.1; returns A + V = 0.4, 0.0 (before: GAE's 0.4, 0.2 minus 1, over 1e-6).
    b = batch([1.0, 1.0], [2, 2])
    b["values"] = [0.0, 0.5, 0.8] * 2
    out = make(algos.PPO, adv_norm="group", lam=0.5).compute_advantages(b)
    assert response_advantages(out) == approx([-0.1, -0.8, -0.1, -0.8])
    assert out["returns"] == approx([0.0, 0.4, 0.0] * 2, abs=1e-7)


def test_the_group_baseline_is_subtracted_from_the_scores_before_discounting():
    # rloo, gamma 0.5, 2 response tokens each. Rewards 1, 1: leave-one-out baselines 1, 1 -> scores 0 -> all 0
    # (before: returns 0.5, 1 minus 1 = -0.5, 0). Rewards 1, 0: scores 1 - 0 = 1, 0 - 1 = -1 -> 0.5, 1 | -0.5, -1.
    algo = make(algos.RLOO, gamma=0.5)
    assert response_advantages(algo.compute_advantages(batch([1, 1], [2, 2]))) == [0.0] * 4
    assert response_advantages(algo.compute_advantages(batch([1, 0], [2, 2]))) == approx([0.5, 1.0, -0.5, -1.0])


# ---------------------------------------------------------------- bounded log-ratios
def one_token_loss(cls, log_ratio, adv, **keys):
    """The loss and its gradient for one response token whose log pi_theta - log pi_behav is ``log_ratio``."""
    algo = make(cls, decoupled=False, **keys)
    b = batch([0.0], [1], logprobs=[0.0, -100.0])
    b["advantages"] = [0.0, adv]
    b["m2_mask"] = [0.0, 1.0]
    logp = torch.tensor([0.0, -100.0 + log_ratio], requires_grad=True)
    loss, stats = algo.loss(logp, None, b)
    loss.backward()
    return loss.detach(), logp.grad, stats


@pytest.mark.parametrize("cls", [algos.GRPO, algos.GSPO, algos.SAPO, algos.CISPO, algos.M2PO])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient(cls, adv):
    # log-ratio 94: e^94 overflows float32 (max ~ e^88.7); clamped to 20 the ratio is e^20 = 4.85e8.
    loss, grad, stats = one_token_loss(cls, 94.0, adv)
    assert math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())
    assert all(math.isfinite(v) for v in stats.values())
    assert stats["ratio_mean"] == approx(math.exp(20.0), rel=1e-5)


def test_the_clamped_ratio_of_the_clipped_objective():
    # A = -1, log-ratio 94 -> u = e^20: -min(-e^20, -0.8) = e^20 = 485165195.4 (before: inf); beyond the clamp
    # the ratio has no gradient. A = +1: clipped to -1.2, gradient 0 (before: 0 * inf = NaN).
    loss, grad, _ = one_token_loss(algos.GRPO, 94.0, -1.0)
    assert float(loss) == approx(485165195.4, rel=1e-6) and grad.tolist() == [0.0, 0.0]
    loss, grad, _ = one_token_loss(algos.GRPO, 94.0, 1.0)
    assert float(loss) == approx(-1.2) and grad.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("log_ratio, adv, value, slope", [
    # Unclipped tokens keep the policy gradient d(-u A)/d log pi = -u A:
    (0.1, 1.0, -1.105171, -1.105171),  # u = e^0.1 = 1.105171 < 1.2
    (0.1, -1.0, 1.105171, 1.105171),  # u > 0.8: -min(-u, -0.8) = u
    (-0.3, 1.0, -0.740818, -0.740818),  # u = e^-0.3 = 0.740818: min(u, 0.8) = u
    (19.5, -1.0, math.exp(19.5), math.exp(19.5)),  # inside the clamp: the gradient is still -u A
])
def test_the_clamp_keeps_the_gradient_of_ordinary_ratios(log_ratio, adv, value, slope):
    loss, grad, _ = one_token_loss(algos.GRPO, log_ratio, adv)
    assert float(loss) == approx(value, rel=1e-5) and grad[1].item() == approx(slope, rel=1e-5)


def test_other_exponentiated_log_ratios_are_clamped():
    # k3 at x = log pi - log pi_ref = -94: e^20 - 1 - 20 (before: e^94 = inf in float32); gradient 0 beyond the
    # clamp. Inside it the gradient is 1 - e^-x: at x = 0.5, 1 - 0.606531 = 0.393469.
    x = torch.tensor([-94.0, 0.5], requires_grad=True)
    kl = losses.kl_estimate(x, torch.zeros(2), "k3")
    kl.sum().backward()
    assert kl[0].item() == approx(math.exp(20.0) - 21.0, rel=1e-6) and kl[1].item() == approx(0.106531, abs=1e-6)
    assert x.grad.tolist() == approx([0.0, 0.393469], abs=1e-6)
    # As a loss term (beta 0.1): finite loss and gradient.
    algo = make(algos.GRPO, kl_coef=0.1, kl_estimator="k3", adv_norm="none", decoupled=False)
    b = algo.compute_advantages(dict(batch([0.0], [1]), ref_logprobs=[0.0, -1.0]))
    b["ref_logprobs"] = [0.0, -6.0]
    logp = torch.tensor([0.0, -100.0], requires_grad=True)
    loss, _ = algo.loss(logp, None, b)
    loss.backward()
    assert math.isfinite(float(loss)) and bool(torch.isfinite(logp.grad).all())
    # Sequence-level behaviour weight without bounds: log W = 50 + 44 = 94 -> e^20 on both tokens (before: inf).
    w, _ = losses.behaviour_weight(torch.tensor([50.0, 44.0]), torch.ones(2, dtype=torch.bool), torch.tensor([2]),
                                   "none", "sequence", 0.0, 5.0)
    assert w.tolist() == approx([math.exp(20.0)] * 2, rel=1e-6)
    # GSPO's sequence ratio: exp(mean log u) with mean 94 -> e^20 (before: inf).
    s = losses.sequence_ratio(torch.tensor([94.0, 94.0]), torch.ones(2, dtype=torch.bool), torch.tensor([2]))
    assert s.tolist() == approx([math.exp(20.0)] * 2, rel=1e-6)
