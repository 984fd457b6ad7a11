"""Cross-key checks of this plugin's algorithms, run by ``areal check`` / ``areal run`` before anything starts.

Imported on every ``areal`` call: only :mod:`areal_core` and the torch-free
:mod:`areal_ppo.config` are imported here.
"""

from __future__ import annotations

from typing import Any

from areal_core import Problem, hookimpl
from areal_core.config.load import build

from areal_ppo.config import NAMES

CODE = "ppo.config"


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    name = config.algorithm.name
    if name not in NAMES:
        return []
    scratch: list[Problem] = []  # type and range problems: the core reports them already
    options = build(NAMES[name], dict(config.algorithm.extra), "algorithm.", scratch)
    return config_problems(name, options, group_size=config.rollout.group_size,
                           max_new_tokens=config.rollout.sampling.max_new_tokens)


def config_problems(name: str, o: Any, group_size: int, max_new_tokens: int = 0) -> list[Problem]:
    """Every combination of ``algorithm`` keys (and ``rollout.group_size`` / ``max_new_tokens``) that makes no
    sense for ``name``."""
    problems: list[Problem] = []

    def add(key: str, message: str, hint: str) -> None:
        problems.append(Problem(CODE, message, hint, key=key))

    if name != "cispo" and 0 < o.eps_clip_high < o.eps_clip:
        add("algorithm.eps_clip_high",
            f"eps_clip_high {o.eps_clip_high} is below eps_clip {o.eps_clip}: clip-higher widens the upper "
            f"bound of the ratio, it cannot make it tighter than the lower one",
            "set eps_clip_high >= eps_clip, or 0 for the symmetric range [1 - eps_clip, 1 + eps_clip]")
    if o.decoupled and o.behav_weight_mode != "none":
        if o.behav_weight_high <= 1:
            add("algorithm.behav_weight_high",
                f"behav_weight_high {o.behav_weight_high} is not above 1: an upper bound <= 1 on the ratio "
                f"pi_prox / pi_behav cuts every token the policy has since made more likely",
                "use an upper bound above 1 (AReaL uses 5.0)")
        if o.behav_weight_low >= 1:
            add("algorithm.behav_weight_low",
                f"behav_weight_low {o.behav_weight_low} is not below 1: a lower bound >= 1 on the ratio "
                f"pi_prox / pi_behav cuts every token the policy has since made less likely",
                "use a lower bound in [0, 1); 0 = no lower bound")
    if group_size < 2:
        if o.adv_norm == "group":
            add("algorithm.adv_norm",
                f"adv_norm 'group' normalises over each prompt's group, but rollout.group_size is {group_size}: "
                f"every advantage would be 0",
                "set rollout.group_size to 2 or more, or use adv_norm: batch")
        if o.adv_baseline != "none":
            add("algorithm.adv_baseline",
                f"adv_baseline '{o.adv_baseline}' is computed from the other members of each prompt's group, "
                f"but rollout.group_size is {group_size}",
                "set rollout.group_size to 2 or more, or use adv_baseline: none")
        if o.dynamic_sampling:
            add("algorithm.dynamic_sampling",
                f"dynamic_sampling rejects groups whose rewards are all equal, and with rollout.group_size "
                f"{group_size} every group is: no batch would ever fill",
                "set rollout.group_size to 2 or more, or dynamic_sampling: false")
    if o.adv_baseline != "none" and o.adv_norm == "group" and o.adv_norm_mean:
        add("algorithm.adv_baseline",
            f"adv_baseline '{o.adv_baseline}' and adv_norm 'group' (with adv_norm_mean) both subtract a group "
            f"baseline",
            "keep one: adv_baseline: none, or adv_norm: batch / none")
    if name == "ppo" and o.adv_baseline != "none":
        add("algorithm.adv_baseline",
            f"adv_baseline '{o.adv_baseline}' has no place in ppo, whose critic is the baseline (GAE)",
            "use adv_baseline: none, or an algorithm without a critic (grpo, rloo, ...)")
    if o.overlong_buffer_frac > 0 and max_new_tokens and o.max_response_len:
        start = o.max_response_len * (1 - o.overlong_buffer_frac)  # where the penalty begins
        if start >= max_new_tokens:
            add("algorithm.max_response_len",
                f"overlong shaping starts at {start:g} response tokens (max_response_len {o.max_response_len} "
                f"minus the buffer {o.overlong_buffer_frac:g}), but rollout.sampling.max_new_tokens is "
                f"{max_new_tokens}: no response is ever that long, so the shaping never applies",
                "leave max_response_len at 0 (= rollout.sampling.max_new_tokens), or set it to at most "
                "max_new_tokens; overlong_buffer_frac: 0 turns the shaping off")
    if o.kl_target > 0 and o.kl_coef == 0:
        add("algorithm.kl_target",
            f"kl_target {o.kl_target} adapts kl_coef, but kl_coef is 0, which adaptation cannot move",
            "set kl_coef to a starting value above 0, or kl_target: 0 for no KL")
    return problems
