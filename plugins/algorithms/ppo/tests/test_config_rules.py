"""Config values that make no sense are rejected before the run, naming the key and the reason."""

from __future__ import annotations

import pytest

from areal_core.api import Context
from areal_core.config.validate import validate_run
from areal_core.rollout import EpisodeGroup
from areal_core.api.workflow import Trajectory

from areal_ppo import algorithm as algos


def ppo_problems(*overrides: str) -> list[tuple[str, str, str]]:
    run = validate_run(None, list(overrides))
    return [(p.key, p.message, p.hint) for p in run.problems if p.code == "ppo.config"]


def test_the_defaults_of_every_name_pass():
    for name in ("ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "sapo",
                 "cispo", "m2po"):
        assert ppo_problems(f"algorithm.name={name}") == [], name


def test_eps_high_below_eps_low():
    assert ppo_problems("algorithm.name=dapo", "algorithm.eps_clip=0.3", "algorithm.eps_clip_high=0.2") == [(
        "algorithm.eps_clip_high",
        "eps_clip_high 0.2 is below eps_clip 0.3: clip-higher widens the upper bound of the ratio, it cannot make "
        "it tighter than the lower one",
        "set eps_clip_high >= eps_clip, or 0 for the symmetric range [1 - eps_clip, 1 + eps_clip]")]


def test_ratio_bounds():
    assert ppo_problems("algorithm.name=grpo", "algorithm.behav_weight_high=1.0", "algorithm.behav_weight_low=1.2") == [
        ("algorithm.behav_weight_high",
         "behav_weight_high 1.0 is not above 1: an upper bound <= 1 on the ratio pi_prox / pi_behav cuts every token "
         "the policy has since made more likely",
         "use an upper bound above 1 (AReaL uses 5.0)"),
        ("algorithm.behav_weight_low",
         "behav_weight_low 1.2 is not below 1: a lower bound >= 1 on the ratio pi_prox / pi_behav cuts every token "
         "the policy has since made less likely",
         "use a lower bound in [0, 1); 0 = no lower bound")]
    # Bounds are not checked when nothing bounds the weight.
    assert ppo_problems("algorithm.name=grpo", "algorithm.behav_weight_high=1.0", "algorithm.decoupled=false") == []


def test_group_normalisation_needs_groups():
    assert ppo_problems("algorithm.name=dapo", "rollout.group_size=1") == [
        ("algorithm.adv_norm",
         "adv_norm 'group' normalises over each prompt's group, but rollout.group_size is 1: every advantage "
         "would be 0",
         "set rollout.group_size to 2 or more, or use adv_norm: batch"),
        ("algorithm.dynamic_sampling",
         "dynamic_sampling rejects groups whose rewards are all equal, and with rollout.group_size 1 every group "
         "is: no batch would ever fill",
         "set rollout.group_size to 2 or more, or dynamic_sampling: false")]
    assert ppo_problems("algorithm.name=rloo", "rollout.group_size=1") == [
        ("algorithm.adv_baseline",
         "adv_baseline 'leave_one_out' is computed from the other members of each prompt's group, but "
         "rollout.group_size is 1",
         "set rollout.group_size to 2 or more, or use adv_baseline: none")]
    assert ppo_problems("algorithm.name=reinforce_pp", "rollout.group_size=1") == []  # batch-level: fine


def test_two_baselines_and_a_critic_baseline():
    assert ppo_problems("algorithm.name=grpo", "algorithm.adv_baseline=group_mean") == [(
        "algorithm.adv_baseline",
        "adv_baseline 'group_mean' and adv_norm 'group' (with adv_norm_mean) both subtract a group baseline",
        "keep one: adv_baseline: none, or adv_norm: batch / none")]
    assert ppo_problems("algorithm.name=ppo", "algorithm.adv_baseline=group_mean") == [(
        "algorithm.adv_baseline",
        "adv_baseline 'group_mean' has no place in ppo, whose critic is the baseline (GAE)",
        "use adv_baseline: none, or an algorithm without a critic (grpo, rloo, ...)")]


def test_adaptive_kl_without_a_coefficient():
    assert ppo_problems("algorithm.name=grpo", "algorithm.kl_target=0.1") == [(
        "algorithm.kl_target",
        "kl_target 0.1 adapts kl_coef, but kl_coef is 0, which adaptation cannot move",
        "set kl_coef to a starting value above 0, or kl_target: 0 for no KL")]


def test_overlong_shaping_that_can_never_apply():
    # L_max 1000 with a 0.2 buffer: the penalty starts at 800 tokens, but generation stops at 256.
    assert ppo_problems("algorithm.name=dapo", "algorithm.max_response_len=1000",
                        "rollout.sampling.max_new_tokens=256") == [(
        "algorithm.max_response_len",
        "overlong shaping starts at 800 response tokens (max_response_len 1000 minus the buffer 0.2), but "
        "rollout.sampling.max_new_tokens is 256: no response is ever that long, so the shaping never applies",
        "leave max_response_len at 0 (= rollout.sampling.max_new_tokens), or set it to at most max_new_tokens; "
        "overlong_buffer_frac: 0 turns the shaping off")]
    assert ppo_problems("algorithm.name=dapo", "algorithm.max_response_len=300",
                        "rollout.sampling.max_new_tokens=256") == []  # starts at 240: reachable


def test_gae_lambda_out_of_range_is_a_range_problem():
    run = validate_run(None, ["algorithm.name=ppo", "algorithm.lam=1.5"])
    assert [p.key for p in run.problems if p.key == "algorithm.lam"] == ["algorithm.lam"]


def group(rewards):
    return EpisodeGroup(seq=0, item=None, start_version=0, admitted_at=0.0, finished_at=0.0, trajectories=[
        Trajectory(tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], versions=[-1, 0], reward=r)
        for r in rewards])


@pytest.mark.parametrize("cls, dynamic", [(algos.DAPO, True), (algos.GRPO, False)])
def test_dynamic_sampling_rejects_groups_without_signal(cls, dynamic):
    algo = cls(Context(options=cls.config_class()))
    assert algo.should_accept(group([1.0, 0.0]))
    assert algo.should_accept(group([1.0, 1.0])) is (not dynamic)
