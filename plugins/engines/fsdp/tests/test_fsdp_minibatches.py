"""One policy update in several optimizer steps (actor.ppo_minibatches / ppo_epochs): each mini-batch is a step
of its own, the update is one version, and from the second step on the PPO clip acts against the proximal policy
(the weights the update started from), checked against a hand computation on a second engine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from areal_core.train_batches import MINIBATCH_KEY, UPDATE_STEP_KEY, assign_minibatches, select_sequences, update_plan  # noqa: E402

_spec = importlib.util.spec_from_file_location("areal_fsdp_engine_tests", Path(__file__).with_name("test_fsdp_engine.py"))
engine_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_tests)
config, engine, make_batch, models, weights, worst = (engine_tests.config, engine_tests.engine, engine_tests.make_batch,
                                                      engine_tests.models, engine_tests.weights, engine_tests.worst)

EPS = 0.02


def clipped(seen: list):
    """The PPO clipped surrogate against the batch's ``prox_logprobs`` (sliced with it into mini- and
    micro-batches); records (update_step, tokens, loss, clip fraction) of every call."""

    def loss_fn(logprobs, entropy, mb):
        mask = mb["loss_mask"]
        u = torch.exp(logprobs - mb["prox_logprobs"])
        adv = mb["advantages"]
        pg = -torch.minimum(u * adv, u.clamp(1 - EPS, 1 + EPS) * adv)
        n = mask.sum()
        loss = (pg * mask).sum() / n
        clip = (((u < 1 - EPS) | (u > 1 + EPS)) & mask).sum() / n
        seen.append((int(mb[UPDATE_STEP_KEY]), len(mb["token_index"]), float(loss.detach()), float(clip)))
        return loss, {"clip_frac": clip}
    return loss_fn


def hand_loss(logp: list[float], prox: list[float], adv: list[float], mask: list[int]) -> tuple[float, float]:
    """The same objective in plain Python floats: token mean of -min(u A, clip(u) A), and the clip fraction."""
    total, clipped_n, n = 0.0, 0, 0
    for lp, pp, a, m in zip(logp, prox, adv, mask):
        if not m:
            continue
        u = torch.tensor(lp - pp, dtype=torch.float64).exp().item()
        total += -min(u * a, min(max(u, 1 - EPS), 1 + EPS) * a)
        clipped_n += u < 1 - EPS or u > 1 + EPS
        n += 1
    return total / n, clipped_n / n


def test_an_update_of_two_minibatches_is_two_steps_and_one_version_and_the_clip_acts(models):
    batch = make_batch()
    batch[MINIBATCH_KEY] = assign_minibatches(batch["seq_lens"], batch["group_index"], 2)
    plan = update_plan(batch)
    assert len(plan) == 2 and sorted(sum(plan, [])) == list(range(6))
    a = engine(config(models["llama"], lr=5e-2))
    b = engine(config(models["llama"], lr=5e-2))  # the reference: the same steps taken one call at a time
    prox = a.forward_logprobs(batch)["logprobs"]  # algorithm.prox_approx=recompute: before the update
    batch["prox_logprobs"] = prox
    seen: list = []
    stats = a.train_batch(batch, clipped(seen))
    assert a.version == 1 and stats["n_optimizer_steps"] == 2
    assert {s[0] for s in seen} == {0, 1}
    first, second = [[s for s in seen if s[0] == j] for j in (0, 1)]
    assert all(clip == 0.0 for *_, clip in first), "in the first step the policy is the proximal one: u = 1"

    sub = [select_sequences(batch, seqs) for seqs in plan]
    b.train_batch(sub[0], clipped([]))  # b's weights now are a's at its second step
    logp = b.forward_logprobs(sub[1])["logprobs"]
    tokens = [t for s in plan[1] for t in range(batch["cu_seqlens"][s], batch["cu_seqlens"][s + 1])]
    expected, clip_frac = hand_loss(logp, [prox[t] for t in tokens], sub[1]["advantages"], sub[1]["loss_mask"])
    assert clip_frac > 0, "the batch did not move the policy past the clip: the test proves nothing"
    (_, n_tokens, loss, clip), = second  # one micro-batch per step here
    assert n_tokens == len(tokens) and loss == pytest.approx(expected, abs=1e-5)
    assert clip == pytest.approx(clip_frac) and stats["clip_frac"] == pytest.approx(clip_frac / 2)

    b.train_batch(sub[1], clipped([]))
    wa, wb = weights(a), weights(b)
    assert max(worst(wa[k], wb[k]) for k in wa) < 1e-6, "the update differs from its steps taken one at a time"
    a.close()
    b.close()


def test_epochs_pass_over_the_minibatches_again_and_the_schedule_steps_once(models):
    batch = make_batch()
    batch[MINIBATCH_KEY] = assign_minibatches(batch["seq_lens"], batch["group_index"], 3)
    cfg = config(models["llama"], lr=1e-2)
    cfg.actor.optimizer.warmup_steps = 2
    e = engine(cfg)
    batch["prox_logprobs"] = e.forward_logprobs(batch)["logprobs"]
    seen: list = []
    stats = e.train_batch(batch, clipped(seen), epochs=2)
    assert stats["n_optimizer_steps"] == 6 and e.version == 1
    assert [s[0] for s in seen] == list(range(6))
    assert stats["n_tokens"] == len(batch["input_ids"]) and stats["n_loss_tokens"] == sum(batch["loss_mask"])
    assert stats["lr"] == pytest.approx(0.5e-2)  # every step of the update at the first warmup rate
    later = make_batch(seed=1)
    later["prox_logprobs"] = e.forward_logprobs(later)["logprobs"]
    assert e.train_batch(later, clipped([]))["lr"] == pytest.approx(1e-2)
    e.close()


def test_one_minibatch_and_one_epoch_is_the_single_step_update(models):
    """k = 1, 1 epoch: the same weights and stats whether or not the batch carries the mini-batch key."""
    batch = make_batch()
    a, b = engine(config(models["llama"])), engine(config(models["llama"]))
    batch["prox_logprobs"] = a.forward_logprobs(batch)["logprobs"]
    plain = a.train_batch(batch, clipped([]))
    keyed = b.train_batch({**batch, MINIBATCH_KEY: [0] * 6}, clipped([]))
    assert plain == keyed and plain["n_optimizer_steps"] == 1
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    a.close()
    b.close()
