"""Properties from the issue, over random batches (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_core.api import Context
from areal_core.train_batches import Packed

from areal_ppo import algorithm as algos
from areal_ppo.config import NAMES

FAST = settings(max_examples=40, deadline=None)
CLASSES = {name: getattr(algos, cls.__name__.removesuffix("Config")) for name, cls in NAMES.items()}


@st.composite
def packed(draw, max_groups: int = 3):
    """A packed batch: groups of 2-3 sequences, each a prompt then a response with the odd masked token."""
    groups = draw(st.integers(1, max_groups))
    out = {k: [] for k in ("input_ids", "position_ids", "loss_mask", "logprobs", "prox_logprobs", "ref_logprobs",
                           "values", "versions", "rewards", "group_index", "seq_lens")}
    cu = [0]
    logp = st.floats(-3.0, -0.05)
    for g in range(groups):
        for _ in range(draw(st.integers(2, 3))):
            prompt, response = draw(st.integers(1, 3)), draw(st.integers(1, 6))
            mask = [0] * prompt + [1] + draw(st.lists(st.sampled_from([0, 1, 1, 1]), min_size=response - 1,
                                                      max_size=response - 1))
            n = len(mask)
            out["input_ids"] += list(range(n))
            out["position_ids"] += list(range(n))
            out["loss_mask"] += mask
            for key in ("logprobs", "prox_logprobs", "ref_logprobs"):
                out[key] += [0.0] + draw(st.lists(logp, min_size=n - 1, max_size=n - 1))
            out["values"] += [0.0] + draw(st.lists(st.floats(-1, 1), min_size=n - 1, max_size=n - 1))
            out["versions"] += [-1] * prompt + [0] * (n - prompt)
            out["rewards"].append(draw(st.sampled_from([0.0, 0.5, 1.0])))
            out["group_index"].append(g)
            out["seq_lens"].append(n)
            cu.append(cu[-1] + n)
    out["cu_seqlens"] = cu
    return out


def make(name: str, **keys):
    cls = CLASSES[name]
    return cls(Context(options=cls.config_class(**keys)))


def loss_and_grad(algo, logp: torch.Tensor, mb: dict) -> tuple[float, torch.Tensor]:
    leaf = logp.clone().requires_grad_(True)
    loss, _ = algo.loss(leaf, None, mb)
    loss.backward()
    return float(loss.detach()), leaf.grad


def micro_batch(batch: dict, seqs: list[int]) -> dict:
    """What a train engine hands loss_fn for sequences ``seqs``: the core's own slicing
    (:class:`areal_core.train_batches.Packed`, which the fsdp and megatron engines use)."""
    return Packed(batch, "the test").micro_batch(list(seqs))


# ---------------------------------------------------------------- ratio 1
@FAST
@given(batch=packed(), name=st.sampled_from(sorted(NAMES)), decoupled=st.booleans())
def test_ratio_one_gives_minus_the_mean_advantage(batch, name, decoupled):
    """Policy = behaviour = proximal (ratio 1, weight 1), token-mean, no KL or entropy: loss = -mean A."""
    batch["prox_logprobs"] = list(batch["logprobs"])
    algo = make(name, loss_agg_mode="token-mean", kl_coef=0.0, decoupled=decoupled, prox_approx="recompute")
    out = algo.compute_advantages(batch)
    mask = torch.tensor(out["loss_mask"]).bool()
    adv = torch.tensor(out["advantages"])
    if name == "m2po":  # ratio 1 everywhere: (log r)^2 = 0, nothing is masked
        assert all(out["m2_mask"][t] == 1.0 for t in range(len(mask)) if mask[t])
    loss, _ = algo.loss(torch.tensor(out["logprobs"]), None, out)
    assert abs(float(loss) + float(adv[mask].mean())) < 1e-5


# ---------------------------------------------------------------- group normalisation
@FAST
@given(batch=packed(), name=st.sampled_from(["grpo", "dr_grpo", "gspo", "sapo", "cispo"]))
def test_outcome_rewards_without_discount_or_kl_give_grpo_advantages(batch, name):
    """gamma 1, no KL in the reward: every response token of sequence i carries (s_i - mean_g) / (std_g + 1e-6)
    (unbiased std; no division by the std for dr_grpo, and a group of equal rewards gives 0), the reference
    computed here with :mod:`statistics`."""
    import statistics

    algo = make(name, kl_coef=0.0)
    out = algo.compute_advantages(batch)
    cu, rewards, groups = out["cu_seqlens"], out["rewards"], out["group_index"]
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        expected = r - statistics.mean(members)
        if name != "dr_grpo" and len(set(members)) > 1:
            expected /= statistics.stdev(members) + 1e-6
        got = [a for a, m in zip(out["advantages"][cu[i]:cu[i + 1]], out["loss_mask"][cu[i]:cu[i + 1]]) if m]
        assert got == pytest.approx([expected] * len(got), abs=1e-5)


# ---------------------------------------------------------------- clipping
@FAST
@given(batch=packed(), eps=st.floats(0.05, 0.5), extra=st.floats(0.0, 0.3),
       shift=st.lists(st.floats(-1.0, 1.0), min_size=80, max_size=80))
def test_clipping_blocks_the_gradient_outside_the_trust_region(batch, eps, extra, shift):
    """Token-level clip: zero gradient exactly where (A > 0 and u > 1 + eps_high) or (A < 0 and u < 1 - eps)."""
    algo = make("grpo", decoupled=False, eps_clip=eps, eps_clip_high=eps + extra, loss_agg_mode="token-mean")
    out = algo.compute_advantages(batch)
    behav = torch.tensor(out["logprobs"])
    logp = behav + torch.tensor(shift[:len(behav)] + [0.0] * max(0, len(behav) - len(shift)))
    _, grad = loss_and_grad(algo, logp, out)
    u, adv = torch.exp(logp - behav), torch.tensor(out["advantages"])
    mask = torch.tensor(out["loss_mask"]).bool()
    outside = ((adv > 0) & (u > 1 + eps + extra + 1e-4)) | ((adv < 0) & (u < 1 - eps - 1e-4))
    inside = ((adv > 0) & (u < 1 + eps + extra - 1e-4)) | ((adv < 0) & (u > 1 - eps + 1e-4))
    assert torch.all(grad[mask & outside] == 0)
    assert torch.all(grad[mask & inside & (adv.abs() > 1e-3)] != 0)


# ---------------------------------------------------------------- micro-batches
SPLIT_CASES = [
    ("grpo", {}), ("dr_grpo", {}), ("dapo", {}), ("rloo", {"loss_agg_mode": "seq-mean-token-mean"}),
    ("reinforce_pp", {"kl_in_reward": False, "kl_estimator": "k3"}), ("reinforce_pp_baseline", {}),
    ("gspo", {"behav_weight_level": "sequence", "behav_weight_mode": "truncate"}), ("sapo", {}),
    ("cispo", {"loss_agg_mode": "seq-mean-token-sum"}), ("m2po", {}), ("ppo", {"entropy_coef": 0.01}),
    ("grpo", {"prox_approx": "recompute", "behav_weight_low": 0.5, "behav_weight_high": 1.5}),
]


@FAST
@given(batch=packed(), case=st.sampled_from(SPLIT_CASES), data=st.data())
def test_micro_batches_give_the_whole_batch_loss_and_gradient(batch, case, data):
    """Split the sequences into random micro-batches and weight each by its loss-token share, as the engine
    does: the loss and the gradient equal those of the whole batch."""
    name, keys = case
    algo = make(name, **keys)
    out = algo.compute_advantages(batch)
    total = len(out["input_ids"])
    logp = torch.tensor(out["logprobs"]) + torch.tensor(
        data.draw(st.lists(st.floats(-0.3, 0.3), min_size=total, max_size=total)))
    entropy = torch.rand(total)
    whole = micro_batch(out, list(range(len(out["seq_lens"]))))
    leaf = logp.clone().requires_grad_(True)
    whole_loss, _ = algo.loss(leaf, entropy, whole)
    whole_loss.backward()
    whole_grad = leaf.grad

    order = data.draw(st.permutations(range(len(out["seq_lens"]))))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(order) - 1), max_size=3))) if len(order) > 1 else []
    parts = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]
    n_total = sum(out["loss_mask"])
    leaf = logp.clone().requires_grad_(True)
    summed = 0.0
    for seqs in parts:
        mb = micro_batch(out, list(seqs))
        n_mb = int(mb["loss_mask"].sum())
        if n_mb == 0:
            continue
        loss, _ = algo.loss(leaf[mb["token_index"]], entropy[mb["token_index"]], mb)
        (loss * (n_mb / n_total)).backward()
        summed += float(loss.detach()) * n_mb / n_total
    assert abs(summed - float(whole_loss)) < 1e-5
    torch.testing.assert_close(leaf.grad, whole_grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- behaviour weight
@FAST
@given(batch=packed(), name=st.sampled_from(sorted(NAMES)), level=st.sampled_from(["token", "sequence"]),
       mode=st.sampled_from(["none", "truncate", "mask"]))
def test_the_behaviour_weight_is_applied_whenever_decoupled_is_on(batch, name, level, mode):
    """Same policy and proximal logprobs, behaviour moved: the policy-gradient part of every token's
    gradient is multiplied by its (bounded) behaviour weight pi_prox / pi_behav (for GSPO, whose ratio is
    per sequence, by the mean weight of the token's sequence)."""
    keys = dict(decoupled=True, prox_approx="recompute", kl_coef=0.0, behav_weight_level=level,
                behav_weight_mode=mode, behav_weight_low=0.2, behav_weight_high=4.0)
    algo = make(name, **keys)
    out = algo.compute_advantages(batch)
    if name == "m2po":
        out["m2_mask"] = [1.0] * len(out["m2_mask"])  # the mask is tested on its own; here only w matters
    logp = torch.tensor(out["logprobs"]) + 0.1
    on_policy = dict(out, logprobs=list(out["prox_logprobs"]))  # behaviour = proximal: w = 1
    _, grad_w = loss_and_grad(algo, logp, out)
    _, grad_1 = loss_and_grad(algo, logp, on_policy)
    mask = torch.tensor(out["loss_mask"]).bool()
    log_w = torch.where(mask, torch.tensor(out["prox_logprobs"]) - torch.tensor(out["logprobs"]), torch.zeros(1))
    if level == "sequence":
        lens = torch.tensor(out["seq_lens"])
        seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
        log_w = torch.zeros(len(lens)).index_add(0, seq, log_w)[seq]
    w = torch.exp(log_w)
    if mode == "truncate":
        w = w.clamp(0.2, 4.0)
    elif mode == "mask":
        w = torch.where((w >= 0.2) & (w <= 4.0), w, torch.zeros_like(w))
    if name == "gspo":
        # GSPO's ratio s_i is one number per sequence, so d loss / d log pi_t = -A s_i / |o_i| * sum over the
        # sequence's loss tokens t' of w_t' c_t'; c is constant inside a sequence under every aggregation mode,
        # so each token's gradient carries the mean of its sequence's weights (its own w_t only when all are equal).
        lens = torch.tensor(out["seq_lens"])
        seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
        total = torch.zeros(len(lens)).index_add(0, seq, torch.where(mask, w, torch.zeros_like(w)))
        count = torch.zeros(len(lens)).index_add(0, seq, mask.float()).clamp(min=1.0)
        w = (total / count)[seq]
    torch.testing.assert_close(grad_w[mask], (w * grad_1)[mask], rtol=1e-4, atol=1e-7)
