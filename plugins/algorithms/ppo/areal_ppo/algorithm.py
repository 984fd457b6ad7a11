"""The PPO family: one algorithm class, one subclass (defaults + objective) per entry-point name.

How a step's aggregate stays independent of the micro-batch split: the
train engine weights each micro-batch's token-mean loss by its share of the
batch's loss tokens, so the step minimises sum_t l_t / N (N loss tokens in
the batch). :meth:`PPOFamily.compute_advantages` therefore stores a weight
c_t per token, computed over the *whole* batch, such that sum_t c_t l_t / N
is the wanted aggregate:

- token-mean: c_t = 1;
- seq-mean-token-mean: c_t = N / (S |o_i|) (S sequences with loss tokens);
- seq-mean-token-sum: c_t = N / (S C) (C the constant normaliser).

Everything else a token's loss depends on (GSPO's sequence ratio, a
sequence-level behaviour weight) lives inside its own sequence, which the
engine never splits, or is computed over the whole batch up front (M2PO's mask).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from areal_core.api import Algorithm, Needs, PackedBatch
from areal_core.rollout import has_reward_variance
from areal_core.train_batches import MINIBATCH_KEY, POLICY_VERSION_KEY, UPDATE_STEP_KEY

from areal_ppo import advantages as adv_fn
from areal_ppo import config as cfg
from areal_ppo import losses


def _floats(value: Any) -> torch.Tensor:
    """A per-token or per-sequence list (or tensor, keeping its graph) as float32."""
    if isinstance(value, torch.Tensor):
        return value.float()
    return torch.as_tensor(value, dtype=torch.float32)


def _longs(value: Any) -> torch.Tensor:
    return value.long() if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.long)


def _seq_lens(batch: dict) -> torch.Tensor:
    if "seq_lens" in batch:
        return _longs(batch["seq_lens"])
    cu = _longs(batch["cu_seqlens"])
    return cu[1:] - cu[:-1]


class PPOFamily(Algorithm):
    """Advantages and loss of every name in this plugin; see docs/algorithms.md for each formula."""

    config_class: ClassVar[type] = cfg.PPOFamilyConfig
    objective: ClassVar[str] = "clip"  # clip | gspo | sapo | cispo | m2po
    critic: ClassVar[bool] = False

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        self.options = self.context.options or self.config_class()
        self.kl_coef = float(self.options.kl_coef)  # moves when kl_target > 0 (adaptive KL)

    # ---------------------------------------------------------------- contract
    @property
    def needs(self) -> Needs:
        o = self.options
        return Needs(
            reference_logprobs=o.kl_coef > 0,
            proximal_logprobs=self.objective == "m2po" or (o.decoupled and o.prox_approx == "recompute"),
            values=self.critic,
        )

    def should_accept(self, group: Any) -> bool:
        return has_reward_variance(group) if self.options.dynamic_sampling else True

    def _max_new_tokens(self) -> int:
        from areal_core.config.schema import SamplingConfig

        run = self.context.config
        return run.rollout.sampling.max_new_tokens if run is not None else SamplingConfig().max_new_tokens

    def _require(self, batch: dict, key: str, why: str) -> None:
        if key not in batch:
            raise KeyError(f"{type(self).__name__}: the batch has no {key!r}, which {why} needs; the trainer "
                           f"adds it when needs asks ({self.needs}); a caller outside the trainer must too")

    # ---------------------------------------------------------------- advantages
    def compute_advantages(self, batch: dict) -> PackedBatch:
        """Adds ``advantages``, ``loss_weights`` (and ``returns``, ``m2_mask``, ``kl_coef`` where they apply) as
        CPU tensors; the columns it reads are taken with ``batch.tensor`` so the engines reuse them."""
        o = self.options
        batch = PackedBatch.of(batch)
        cu = batch.cu_seqlens
        total = cu[-1]
        n = len(cu) - 1
        mask = batch.tensor("loss_mask").bool()
        grid = adv_fn.ResponseGrid.from_batch(cu, mask)
        group_index = _longs(batch["group_index"]) if "group_index" in batch else torch.arange(n)

        # Sequence scores: outcome reward, DAPO's overlong penalty, then scale / bias / clip.
        scores = torch.as_tensor(batch["rewards"], dtype=torch.float64)
        max_len = o.max_response_len or self._max_new_tokens()
        scores = scores + adv_fn.overlong_penalty(grid.lengths, max_len, o.overlong_buffer_frac,
                                                  o.overlong_penalty).double()
        scores = adv_fn.shape_rewards(scores, o.reward_scale, o.reward_bias, o.reward_clip)
        # Group baseline and group normalisation compare a prompt's completions by their scores, so they act on
        # the scores, before the discount and the KL penalty make per-token returns of them: the statistics
        # are those of the normalised numbers, and a group of equal scores gives 0 (plus its KL penalty).
        if o.adv_baseline != "none" and not self.critic:  # ppo: the critic is the baseline
            scores = scores - adv_fn.group_baseline(scores, group_index, o.adv_baseline)
        if o.adv_norm == "group":
            scores = adv_fn.normalise_groups(scores, group_index, o.adv_norm_mean, o.adv_norm_std)

        # Per-token rewards on the response grid: the score on each sequence's last loss token.
        token_rewards = torch.zeros(grid.valid.shape, dtype=torch.float64)
        token_rewards[grid.last()] = scores[grid.lengths > 0]
        if o.kl_coef > 0:
            self._require(batch, "ref_logprobs", "kl_coef > 0")
            old = batch.tensor("prox_logprobs" if "prox_logprobs" in batch else "logprobs")
            kl = losses.kl_estimate(_floats(old).double(), _floats(batch.tensor("ref_logprobs")).double(),
                                    o.kl_estimator)
            beta = self.kl_coef
            if o.kl_in_reward:
                token_rewards = token_rewards - beta * grid.gather(kl)
            batch["kl_coef"] = beta
            batch["kl_behaviour"] = float(kl[mask].mean()) if mask.any() else 0.0
            self._adapt_kl(batch["kl_behaviour"], n)

        if self.critic:
            self._require(batch, "values", "ppo's GAE")
            values = grid.gather(torch.as_tensor(batch["values"], dtype=torch.float64))
            advantages, returns = adv_fn.gae(token_rewards, values, grid.valid, o.gamma, o.lam)
            batch["returns"] = grid.scatter(returns, total).float()
        else:
            advantages = adv_fn.discounted_returns(token_rewards, grid.valid, o.gamma)

        if o.adv_norm == "batch":
            advantages = adv_fn.normalise_batch(advantages, grid.valid, o.adv_norm_mean, o.adv_norm_std)
        advantages = torch.where(grid.valid, advantages, torch.zeros_like(advantages))
        batch["advantages"] = grid.scatter(advantages, total).float()
        parts = _longs(batch[MINIBATCH_KEY]) if MINIBATCH_KEY in batch else torch.zeros(n, dtype=torch.long)
        batch["loss_weights"] = self._loss_weights(grid, total, parts).float()
        if self.objective == "m2po":
            self._require(batch, "prox_logprobs", "m2po's second-moment mask")
            log_r = (_floats(batch.tensor("prox_logprobs")) - _floats(batch.tensor("logprobs")))[mask]
            kept = torch.zeros(total)
            kept[mask] = losses.m2_mask(log_r, self.options.m2_threshold).float()
            batch["m2_mask"] = kept
        return batch

    def _loss_weights(self, grid: adv_fn.ResponseGrid, total: int, parts: torch.Tensor) -> torch.Tensor:
        """c_t of the module docstring, per mini-batch (``parts``: each sequence's; the engine takes one
        optimizer step per mini-batch, weighting its micro-batches by the mini-batch's loss tokens): the
        token-mean of c_t * l_t over a mini-batch is the wanted aggregate over that mini-batch."""
        o = self.options
        per_seq = torch.ones(len(grid.lengths), dtype=torch.float64)
        for part in parts.unique().tolist():
            mine = parts == part
            lengths = grid.lengths[mine]
            n_tokens = lengths.sum().double()
            seqs = (lengths > 0).sum().double()
            if o.loss_agg_mode == "token-mean" or n_tokens == 0:
                continue
            if o.loss_agg_mode == "seq-mean-token-mean":
                per_seq[mine] = n_tokens / (seqs * lengths.clamp(min=1).double())
            else:  # seq-mean-token-sum
                per_seq[mine] = float(n_tokens / (seqs * (o.loss_agg_norm or self._max_new_tokens())))
        return grid.scatter(per_seq[:, None].expand(grid.valid.shape).float(), total)

    def _adapt_kl(self, kl: float, n_sequences: int) -> None:
        """Adaptive KL controller (Ziegler et al. 2019): beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / H."""
        o = self.options
        if o.kl_target > 0:
            error = min(max(kl / o.kl_target - 1.0, -0.2), 0.2)
            self.kl_coef *= 1.0 + error * n_sequences / o.kl_horizon

    # ---------------------------------------------------------------- loss
    def loss(self, logprobs: Any, entropy: Any, batch: dict) -> tuple[torch.Tensor, dict]:
        o = self.options
        logp = _floats(logprobs)
        mask = torch.as_tensor(batch["loss_mask"]).bool()
        behav = _floats(batch["logprobs"])
        adv = _floats(batch["advantages"])
        weights = _floats(batch["loss_weights"]) if "loss_weights" in batch else torch.ones_like(logp)
        seq_lens = _seq_lens(batch)
        if o.decoupled:
            if o.prox_approx == "recompute" or "prox_logprobs" in batch:
                self._require(batch, "prox_logprobs", "decoupled PPO with prox_approx: recompute")
                prox = _floats(batch["prox_logprobs"])
            else:
                prox = self._loglinear_prox(logp.detach(), behav, batch)
            old = prox
            w, kept = losses.behaviour_weight(prox - behav, mask, seq_lens, o.behav_weight_mode,
                                              o.behav_weight_level, o.behav_weight_low, o.behav_weight_high)
        else:
            old, w, kept = behav, torch.ones_like(logp), torch.ones_like(mask)
        log_u = losses.clamp_log_ratio(logp - old)
        u = torch.exp(log_u)
        high = o.eps_clip_high or o.eps_clip
        if self.objective == "gspo":
            u = losses.sequence_ratio(log_u, mask, seq_lens)
            pg, clipped = losses.clipped_surrogate(u, adv, o.eps_clip, high)
        elif self.objective == "sapo":
            pg, clipped = losses.soft_gate(u, adv, o.tau_pos, o.tau_neg), torch.zeros_like(mask)
        elif self.objective == "cispo":
            pg, clipped = losses.clipped_is_weight(logp, u, adv, o.eps_clip, high)
        elif self.objective == "m2po":
            m2 = _floats(batch["m2_mask"]) > 0
            pg, clipped = -torch.where(m2, u * adv, torch.zeros_like(u)), ~m2
        else:
            pg, clipped = losses.clipped_surrogate(u, adv, o.eps_clip, high)
        token_loss = w * pg
        n = mask.sum().clamp(min=1)
        stats: dict[str, Any] = {}
        if o.kl_coef > 0 and not o.kl_in_reward:
            self._require(batch, "ref_logprobs", "kl_coef > 0")
            kl = losses.kl_estimate(logp, _floats(batch["ref_logprobs"]), o.kl_estimator)
            beta = float(batch["kl_coef"]) if "kl_coef" in batch else self.kl_coef
            token_loss = token_loss + beta * kl
            stats["kl"] = (kl.detach() * mask).sum() / n
        if entropy is not None:
            ent = _floats(entropy)
            if o.entropy_coef > 0:
                token_loss = token_loss - o.entropy_coef * ent
            stats["entropy"] = (ent.detach() * mask).sum() / n
        loss = (token_loss * weights * mask).sum() / n

        def mean(x: torch.Tensor) -> torch.Tensor:
            return (x.detach().float() * mask).sum() / n

        stats.update(pg_loss=mean(pg), ratio_mean=mean(u), clip_frac=mean(clipped), behav_weight_mean=mean(w),
                     behav_kept_frac=mean(kept), advantage_mean=mean(adv))
        return loss, {k: float(v) for k, v in stats.items()}

    def _loglinear_prox(self, current: torch.Tensor, behav: torch.Tensor, batch: dict) -> torch.Tensor:
        """``prox_approx: loglinear``: log pi_prox without a forward pass (AReaL's interpolation by version).

        In the update's first optimizer step (``update_step`` 0) the weights computing this loss *are* the
        proximal policy (those the update started from): pi_prox = sg(pi_theta), exact. After it, the log-linear
        interpolation between behaviour and current policy, log pi_prox = log pi_behav + alpha (log pi_theta -
        log pi_behav), with alpha = (v_prox - v_behav) / (v_theta - v_behav), v_prox the version trained at
        (``policy_version``), v_theta = v_prox + 1 (the version the update makes), v_behav each token's: alpha = 0
        for a token sampled at v_prox (then pi_prox = pi_behav, exact), approaching 1 as the token ages.
        """
        if int(batch.get(UPDATE_STEP_KEY, 0)) == 0:
            return current
        self._require(batch, POLICY_VERSION_KEY, "prox_approx 'loglinear' after an update's first optimizer step")
        v_prox = float(batch[POLICY_VERSION_KEY])
        v_behav = _floats(batch["versions"]).to(behav.device)
        span = v_prox + 1.0 - v_behav
        alpha = torch.where(span > 0, (v_prox - v_behav) / span.clamp(min=1.0), torch.zeros_like(span))
        return behav + alpha.clamp(0.0, 1.0) * (current - behav)

    def value_loss(self, values: Any, batch: dict) -> tuple[torch.Tensor, dict]:
        if not self.critic:
            return super().value_loss(values, batch)
        v = _floats(values)
        mask = torch.as_tensor(batch["loss_mask"]).bool()
        n = mask.sum().clamp(min=1)
        per_token = losses.clipped_value_loss(v, _floats(batch["values"]), _floats(batch["returns"]),
                                              self.options.value_clip)
        loss = (per_token * mask).sum() / n
        return loss, {"value_loss": float(loss.detach()), "value_mean": float((v.detach() * mask).sum() / n)}


def _variant(name: str, config_class: type, doc: str, objective: str = "clip", critic: bool = False) -> type:
    """One entry-point name: the family with its own defaults (config_class) and objective."""
    return type(name, (PPOFamily,), {"__doc__": doc, "__module__": __name__, "__qualname__": name,
                                     "config_class": config_class, "objective": objective, "critic": critic})


PPO = _variant("PPO", cfg.PPOConfig, "PPO with a critic: GAE advantages, clipped value loss.", critic=True)
GRPO = _variant("GRPO", cfg.GRPOConfig,
                "Group-relative advantages (A = (r - mean_g) / std_g), token-level clipped surrogate.")
DrGRPO = _variant("DrGRPO", cfg.DrGRPOConfig, "GRPO without std normalisation, with a constant length normaliser.")
DAPO = _variant("DAPO", cfg.DAPOConfig,
                "Clip-higher, token-mean over the batch, dynamic sampling, overlong reward shaping.")
RLOO = _variant("RLOO", cfg.RLOOConfig, "REINFORCE leave-one-out: A = r_i - mean of the other members of its group.")
ReinforcePP = _variant("ReinforcePP", cfg.ReinforcePPConfig,
                       "REINFORCE++: KL in the per-token reward, returns, batch-level normalisation.")
ReinforcePPBaseline = _variant("ReinforcePPBaseline", cfg.ReinforcePPBaselineConfig,
                               "REINFORCE++ with a group-mean baseline before the batch normalisation.")
GSPO = _variant("GSPO", cfg.GSPOConfig, "Sequence-level importance ratio (geometric mean of the token ratios), "
                "clipped.", objective="gspo")
SAPO = _variant("SAPO", cfg.SAPOConfig, "Soft, temperature-controlled gate instead of the hard clip.",
                objective="sapo")
CISPO = _variant("CISPO", cfg.CISPOConfig, "Clipped importance-sampling weight (stop-gradient) times the policy "
                 "gradient of every token.", objective="cispo")
M2PO = _variant("M2PO", cfg.M2POConfig, "Unclipped ratio with the tokens of largest second moment masked "
                "batch-wide.", objective="m2po")
