"""The keys of every name in this plugin (``algorithm.<key>``), one dataclass per name.

Torch-free: the hook module imports it on every ``areal`` call. Every name
shares :class:`PPOFamilyConfig`; a name changes defaults (``grpo`` normalises
per group) or adds its own keys (``ppo``: ``lam``, ``value_clip``). The
formulas behind each key are in docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_core.config.schema import spec

LOSS_AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


@dataclass
class PPOFamilyConfig:
    # -- policy objective ----------------------------------------------------
    eps_clip: float = spec(0.2, gt=0.0, le=1.0, help="ratio clip: lower bound 1 - eps_clip")
    eps_clip_high: float = spec(0.0, ge=0.0, help="upper bound 1 + eps_clip_high (clip-higher); 0 = eps_clip")
    entropy_coef: float = spec(0.0, ge=0.0, help="entropy bonus: loss -= entropy_coef * H")
    loss_agg_mode: str = spec("token-mean", choices=LOSS_AGG_MODES,
                              help="token-mean over the batch, seq-mean-token-mean, or seq-mean-token-sum "
                                   "divided by loss_agg_norm")
    loss_agg_norm: int = spec(0, ge=0, help="constant length normaliser of seq-mean-token-sum; "
                                            "0 = rollout.sampling.max_new_tokens")
    # -- rewards -------------------------------------------------------------
    reward_scale: float = spec(1.0, help="r <- (r + reward_bias) * reward_scale")
    reward_bias: float = spec(0.0, help="added to every reward before reward_scale")
    reward_clip: float = spec(0.0, ge=0.0, help="clip shaped rewards to [-reward_clip, reward_clip]; 0 = off")
    overlong_buffer_frac: float = spec(0.0, ge=0.0, lt=1.0,
                                       help="DAPO overlong shaping: the last fraction of max_response_len "
                                            "where a linear penalty grows to -overlong_penalty; 0 = off")
    overlong_penalty: float = spec(1.0, ge=0.0, help="DAPO overlong penalty at max_response_len")
    max_response_len: int = spec(0, ge=0, help="L_max of overlong shaping; 0 = rollout.sampling.max_new_tokens")
    gamma: float = spec(1.0, ge=0.0, le=1.0, help="discount of per-token returns (and of GAE)")
    # -- advantages ----------------------------------------------------------
    adv_baseline: str = spec("none", choices=["none", "group_mean", "leave_one_out"],
                             help="subtracted from each sequence's score before the per-token returns: its "
                                  "group's mean score, or the mean of the other members (RLOO)")
    adv_norm: str = spec("group", choices=["none", "group", "batch"],
                         help="group: normalise each sequence's score over its prompt's group before the "
                              "per-token returns; batch: normalise the advantages over the batch's loss tokens")
    adv_norm_mean: bool = spec(True, help="adv_norm subtracts the mean")
    adv_norm_std: bool = spec(True, help="adv_norm divides by the standard deviation")
    dynamic_sampling: bool = spec(False, help="reject groups whose rewards are all equal (DAPO); "
                                              "the controller samples more")
    # -- KL to the reference model -------------------------------------------
    kl_coef: float = spec(0.0, ge=0.0, help="KL coefficient beta; > 0 runs the reference model")
    kl_estimator: str = spec("k3", choices=["k1", "k2", "k3"], help="k1 = x, k2 = x^2/2, k3 = e^-x - 1 + x, "
                                                                     "x = log pi - log pi_ref")
    kl_in_reward: bool = spec(False, help="KL as a per-token reward penalty (true) or a loss term (false)")
    kl_target: float = spec(0.0, ge=0.0, help="adaptive KL: the per-token KL kl_coef is steered to; 0 = fixed")
    kl_horizon: int = spec(10000, ge=1, help="adaptive KL horizon (sequences)")
    # -- decoupled PPO (asynchronous data) -------------------------------------
    decoupled: bool = spec(True, help="clip against the proximal policy, weight by pi_prox / pi_behav")
    prox_approx: str = spec("loglinear", choices=["recompute", "loglinear"],
                            help="proximal logprobs: a forward pass before the update (exact), or the current "
                                 "policy's in an update's first optimizer step (exact) and AReaL's log-linear "
                                 "interpolation by per-token version after it (actor.ppo_minibatches / ppo_epochs)")
    behav_weight_mode: str = spec("mask", choices=["none", "truncate", "mask"],
                                  help="outside [behav_weight_low, behav_weight_high] the behaviour weight is "
                                       "truncated to the bound (TIS) or the token / sequence dropped (MIS)")
    behav_weight_level: str = spec("token", choices=["token", "sequence"],
                                   help="bound each token's weight, or each sequence's (product of its tokens')")
    behav_weight_low: float = spec(0.0, ge=0.0, help="lower bound of pi_prox / pi_behav; 0 = none")
    behav_weight_high: float = spec(5.0, gt=0.0, help="upper bound of pi_prox / pi_behav")


@dataclass
class PPOConfig(PPOFamilyConfig):
    adv_norm: str = spec("batch", choices=["none", "group", "batch"], help="as in PPOFamilyConfig")
    lam: float = spec(0.95, ge=0.0, le=1.0, help="GAE lambda")
    value_clip: float = spec(0.2, ge=0.0, help="clip V - V_old to [-value_clip, value_clip]; 0 = off")


@dataclass
class GRPOConfig(PPOFamilyConfig):
    loss_agg_mode: str = spec("seq-mean-token-mean", choices=LOSS_AGG_MODES, help="as in PPOFamilyConfig")


@dataclass
class DrGRPOConfig(PPOFamilyConfig):
    adv_norm_std: bool = spec(False, help="Dr. GRPO: no division by the group's std")
    loss_agg_mode: str = spec("seq-mean-token-sum", choices=LOSS_AGG_MODES, help="as in PPOFamilyConfig")


@dataclass
class DAPOConfig(PPOFamilyConfig):
    eps_clip_high: float = spec(0.28, ge=0.0, help="clip-higher upper bound 1 + eps_clip_high")
    dynamic_sampling: bool = spec(True, help="reject groups whose rewards are all equal")
    overlong_buffer_frac: float = spec(0.2, ge=0.0, lt=1.0, help="as in PPOFamilyConfig")


@dataclass
class RLOOConfig(PPOFamilyConfig):
    adv_baseline: str = spec("leave_one_out", choices=["none", "group_mean", "leave_one_out"],
                             help="as in PPOFamilyConfig")
    adv_norm: str = spec("none", choices=["none", "group", "batch"], help="as in PPOFamilyConfig")


@dataclass
class ReinforcePPConfig(PPOFamilyConfig):
    adv_norm: str = spec("batch", choices=["none", "group", "batch"], help="as in PPOFamilyConfig")
    kl_coef: float = spec(0.01, ge=0.0, help="KL coefficient beta; > 0 runs the reference model")
    kl_estimator: str = spec("k1", choices=["k1", "k2", "k3"], help="as in PPOFamilyConfig")
    kl_in_reward: bool = spec(True, help="REINFORCE++: KL as a per-token reward penalty")


@dataclass
class ReinforcePPBaselineConfig(ReinforcePPConfig):
    adv_baseline: str = spec("group_mean", choices=["none", "group_mean", "leave_one_out"],
                             help="as in PPOFamilyConfig")


@dataclass
class GSPOConfig(PPOFamilyConfig):
    eps_clip: float = spec(3e-4, gt=0.0, le=1.0, help="sequence-ratio clip: lower bound 1 - eps_clip")
    eps_clip_high: float = spec(4e-4, ge=0.0, help="upper bound 1 + eps_clip_high")
    loss_agg_mode: str = spec("seq-mean-token-mean", choices=LOSS_AGG_MODES, help="as in PPOFamilyConfig")


@dataclass
class SAPOConfig(PPOFamilyConfig):
    loss_agg_mode: str = spec("seq-mean-token-mean", choices=LOSS_AGG_MODES, help="as in PPOFamilyConfig")
    tau_pos: float = spec(1.0, gt=0.0, help="gate temperature for positive advantages")
    tau_neg: float = spec(1.05, gt=0.0, help="gate temperature for negative advantages")


@dataclass
class CISPOConfig(PPOFamilyConfig):
    eps_clip: float = spec(1.0, gt=0.0, le=1.0, help="IS weight lower bound 1 - eps_clip (1 = none)")
    eps_clip_high: float = spec(0.28, ge=0.0, help="IS weight upper bound 1 + eps_clip_high")


@dataclass
class M2POConfig(PPOFamilyConfig):
    m2_threshold: float = spec(0.04, gt=0.0, help="tau_M2: the largest (log r)^2 tokens are masked until "
                                                  "the mean of the rest is at most this")


# Each entry-point name of this plugin and the dataclass of its keys.
NAMES: dict[str, type] = {
    "ppo": PPOConfig, "grpo": GRPOConfig, "dr_grpo": DrGRPOConfig, "dapo": DAPOConfig, "rloo": RLOOConfig,
    "reinforce_pp": ReinforcePPConfig, "reinforce_pp_baseline": ReinforcePPBaselineConfig,
    "gspo": GSPOConfig, "sapo": SAPOConfig, "cispo": CISPOConfig, "m2po": M2POConfig,
}
