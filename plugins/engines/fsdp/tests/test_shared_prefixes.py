"""Shared prefixes (areal_fsdp.prefix): a micro-batch run as a prefix tree gives what separate sequences give."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from areal_core.config.schema import RunConfig  # noqa: E402
from areal_fsdp import attention  # noqa: E402
from areal_fsdp import engine as engine_module  # noqa: E402
from areal_fsdp.prefix import attention_plan, share_prefixes  # noqa: E402
from areal_core.testing import tiny_model  # noqa: E402

# The engine tests' helpers (config, engine, worst), loaded as test_fsdp_lora.py does.
_spec = importlib.util.spec_from_file_location("areal_fsdp_engine_tests",
                                               Path(__file__).with_name("test_fsdp_engine.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

VOCAB = 512


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-prefix-models")
    return {"llama": tiny_model(root / "llama", arch="llama", seed=0),
            "qwen2": tiny_model(root / "qwen2", arch="qwen2", seed=1)}


def grpo_batch(seed: int = 0) -> dict:
    """Three groups of four samples under a common few-shot header, one sample repeated word for word, one
    sample that stops inside its prompt's tokens, and a sequence of its own: every case the tree has."""
    rng = random.Random(seed)
    keys = ("input_ids", "position_ids", "loss_mask", "advantages", "logprobs", "group_index", "seq_lens")
    out: dict = {k: [] for k in keys}
    header = [rng.randrange(3, VOCAB) for _ in range(12)]
    sequences = []
    for g in range(3):
        prompt = header + [rng.randrange(3, VOCAB) for _ in range(6 + 2 * g)]
        completions = [[rng.randrange(3, VOCAB) for _ in range(3 + 2 * j)] for j in range(3)]
        completions.append(list(completions[1]))  # two samples alike
        for c in completions:
            sequences.append((g, prompt, c))
    sequences.append((3, header[:5], [rng.randrange(3, VOCAB) for _ in range(4)]))  # leaves the header early
    sequences.append((4, [rng.randrange(3, VOCAB) for _ in range(3)], [rng.randrange(3, VOCAB) for _ in range(6)]))
    cu = [0]
    for g, prompt, completion in sequences:
        seq = prompt + completion
        out["input_ids"] += seq
        out["position_ids"] += list(range(len(seq)))
        out["loss_mask"] += [0] * len(prompt) + [1] * len(completion)
        out["advantages"] += [rng.uniform(-1, 1)] * len(seq)
        out["logprobs"] += [-rng.random() for _ in seq]
        out["group_index"].append(g)
        out["seq_lens"].append(len(seq))
        cu.append(cu[-1] + len(seq))
    out["cu_seqlens"] = cu
    return out


def config(path, *, dtype="float32", mb_max_tokens=8192) -> RunConfig:
    # lr 1, eps 1: AdamW's first step moves each weight by about its gradient, so weights compare gradients.
    return base.config(path, dtype=dtype, mb_max_tokens=mb_max_tokens, lr=1.0, eps=1.0, grad_clip=0.0)


engine, worst = base.engine, base.worst


def policy_loss(logprobs, entropy, mb):
    """A PPO-like token loss: the ratio to the behaviour logprobs times the advantage, plus an entropy term, so
    the gradient flows through logprobs and entropy both."""
    mask = mb["loss_mask"]
    ratio = torch.exp(logprobs - mb["logprobs"])
    loss = -(ratio * mb["advantages"] * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
    return loss, {"ratio": (ratio * mask).sum() / mask.sum()}


def rows_run(monkeypatch) -> list[int]:
    """Record the length of every row the engine's model runs."""
    seen: list[int] = []
    original = engine_module._LogprobModel.hidden

    def spy(self, input_ids, *args, **kwargs):
        seen.append(input_ids.shape[-1])
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(engine_module._LogprobModel, "hidden", spy)
    return seen


# ---------------------------------------------------------------------- the layout
def test_the_tree_runs_each_shared_token_once_and_scores_every_token_from_its_predecessor():
    batch = grpo_batch()
    ids, pos = torch.tensor(batch["input_ids"]), torch.tensor(batch["position_ids"])
    row = share_prefixes(ids, pos, batch["seq_lens"], min_saved=1)
    # The header once, each group's prompt remainder once, each distinct completion once; the repeated sample
    # costs nothing, the early leaver and the loner only their own tokens.
    expected = 12 + sum((6 + 2 * g) + (3 + 5 + 7) for g in range(3)) + 4 + 9
    assert row.input_ids.numel() == expected and row.saved == len(batch["input_ids"]) - expected
    starts = set(batch["cu_seqlens"][:-1])
    for t in range(len(ids)):
        if t in starts:
            continue
        assert row.input_ids[row.scorer[t]] == ids[t - 1] and row.position_ids[row.scorer[t]] == pos[t - 1], t


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(3, 5), min_size=1, max_size=9), min_size=1, max_size=10),
       st.integers(1, 20))
def test_any_batch_keeps_each_tokens_history(seqs, min_saved):
    """Over a 3-letter alphabet sequences share prefixes by chance: each token's keys must be exactly the row
    positions of its own sequence's tokens up to it (what it attends when alone)."""
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.tensor([p for s in seqs for p in range(len(s))])
    row = share_prefixes(ids, pos, [len(s) for s in seqs], min_saved=min_saved)
    if row is None:
        return
    # Where each token of each sequence sits in the row: its scorer entry is where its predecessor sits, and
    # the last token's place is the last key of the unit whose keys end there.
    at = 0
    for s in seqs:
        places = [int(row.scorer[at + j + 1]) for j in range(len(s) - 1)]
        for j, place in enumerate(places):
            assert int(row.input_ids[place]) == s[j] and int(row.position_ids[place]) == j
        history = {tuple(k.tolist()[:i + 1]) for k in row.keys for i in range(len(k))}
        assert tuple(places) in history or not places  # the predecessors lie on one path of the tree
        at += len(s)
    assert row.input_ids.numel() + row.saved == len(ids)


def test_tree_attention_equals_each_sequence_alone():
    torch.manual_seed(0)
    batch = grpo_batch(1)
    ids, pos = torch.tensor(batch["input_ids"]), torch.tensor(batch["position_ids"])
    row = share_prefixes(ids, pos, batch["seq_lens"], min_saved=1)
    # q / k / v of a token depend on the token and its position only (as a layer's projections of embeddings do).
    table = torch.randn(VOCAB, 64, 3, 4, 8, dtype=torch.float64)

    def qkv(ids_, pos_):
        x = table[ids_, pos_]  # [T, 3, heads, D]
        return (x[:, i].transpose(0, 1)[None] for i in range(3))  # [1, heads, T, D] each

    q, k, v = qkv(ids, pos)
    alone, _ = attention.packed_sdpa(torch.nn.Module().eval(), q, k, v, None,
                                     **{attention.CU_SEQLENS: batch["cu_seqlens"]})
    rq, rk, rv = qkv(row.input_ids, row.position_ids)
    shared, _ = attention.packed_sdpa(torch.nn.Module().eval(), rq, rk, rv, None,
                                      **{attention.PLAN: attention_plan(row)})
    # Token t's output sits at the row place of token t, i.e. where token t + 1's scorer points.
    ends = set(batch["cu_seqlens"][1:])
    for t in range(len(ids)):
        if t + 1 in ends:
            continue
        assert torch.allclose(shared[0, row.scorer[t + 1]], alone[0, t], atol=1e-12), t


# ---------------------------------------------------------------------- the engine
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_forward_and_train_equal_separate_sequences(models, arch, monkeypatch):
    batch = grpo_batch()
    results = {}
    for share in (False, True):
        seen = rows_run(monkeypatch)
        e = engine(config(models[arch]), share_prefixes=share, logits_chunk_tokens=16)
        before = {k: v.detach().clone() for k, v in e.lm.state_dict().items()}
        lp = e.forward_logprobs(batch)
        stats = e.train_batch(batch, policy_loss)
        after = {k: v.detach().clone() for k, v in e.lm.state_dict().items()}
        results[share] = (lp, stats, after, list(seen))
        e.close()
    assert max(results[False][3]) == len(batch["input_ids"])
    assert max(results[True][3]) < 0.6 * len(batch["input_ids"]), "the shared layout was not used"
    (lp0, stats0, w0, _), (lp1, stats1, w1, _) = results[False], results[True]
    assert worst(lp0["logprobs"], lp1["logprobs"]) < 1e-5
    assert worst(lp0["entropy"], lp1["entropy"]) < 1e-5
    hf = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32)
    with torch.no_grad():
        for a, b in zip(batch["cu_seqlens"][:-1], batch["cu_seqlens"][1:]):
            x = torch.tensor(batch["input_ids"][a:b])[None]
            ref = hf(x).logits[0].log_softmax(-1)[:-1].gather(-1, x[0, 1:, None]).squeeze(-1)
            assert worst(lp1["logprobs"][a + 1:b], ref) < 1e-5
    assert stats1["loss"] == pytest.approx(stats0["loss"], rel=1e-5)
    assert stats1["grad_norm"] == pytest.approx(stats0["grad_norm"], rel=1e-5)
    assert stats1["ratio"] == pytest.approx(stats0["ratio"], rel=1e-5)
    moved = max(worst(before[k], w0[k]) for k in before)
    assert moved > 1e-5, "the step barely moved the weights: the comparison below would prove nothing"
    assert max(worst(w0[k], w1[k]) for k in w0) < 1e-3 * moved


def test_bfloat16_training_stays_close_to_separate_sequences(models):
    batch = grpo_batch(2)
    losses, norms = [], []
    for share in (False, True):
        e = engine(config(models["llama"], dtype="bfloat16"), share_prefixes=share)
        stats = e.train_batch(batch, policy_loss)
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        e.close()
    assert losses[1] == pytest.approx(losses[0], rel=2e-2, abs=2e-2)
    assert norms[1] == pytest.approx(norms[0], rel=5e-2)


def test_the_critic_reads_values_through_the_tree(models):
    batch = grpo_batch(3)
    values = []
    for share in (False, True):
        e = engine(config(models["llama"]), role="critic", share_prefixes=share)
        values.append(e.forward_values(batch)["values"])
        e.close()
    assert worst(values[0], values[1]) < 1e-5
    assert max(abs(v) for v in values[0]) > 0.0


def test_a_groups_samples_share_a_micro_batch(models):
    batch = grpo_batch()
    e = engine(config(models["llama"], mb_max_tokens=96))
    plan = e._plan(batch)
    groups = batch["group_index"]
    for g in set(groups):
        members = {i for i, x in enumerate(groups) if x == g}
        holding = [mb for mb in plan if members & set(mb)]
        assert len(holding) == 1, f"group {g} is split over {len(holding)} micro-batches: {plan}"
    assert sorted(i for mb in plan for i in mb) == list(range(len(groups)))
    # The budget counts the tokens the model runs: a group of 4 x ~30 tokens fits 96 with its prompt once.
    e.options.share_prefixes = False
    separate = e._plan(batch)
    assert len(separate) > len(plan)
    e.close()
