"""Per-sequence attention and loss-token-only logprobs: the same numbers as the masked, all-token computation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402

from areal_fsdp import attention  # noqa: E402
from areal_fsdp.logprobs import packed_attention_mask, token_logprobs  # noqa: E402

LENS = [5, 1, 9, 3, 8, 9]


def masked_reference(q, k, v, lens):
    mask = packed_attention_mask(lens)  # [1, 1, T, T] block-diagonal causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain and grouped-query attention
def test_packed_sdpa_equals_the_block_diagonal_mask_in_values_and_gradients(kv_heads):
    g = torch.Generator().manual_seed(0)
    T = sum(LENS)
    q = torch.randn(1, 4, T, 8, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, T, 8, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, T, 8, generator=g, requires_grad=True)
    cu = [0, 5, 6, 15, 18, 26, 35]
    module = torch.nn.Module().eval()
    ours, _ = attention.packed_sdpa(module, q, k, v, None, **{attention.CU_SEQLENS: cu})
    ref = masked_reference(q, k, v, LENS)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    w = torch.randn(ref.shape, generator=g)
    grads = torch.autograd.grad((ours * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_packed_sdpa_refuses_a_call_without_boundaries():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="called without areal_cu_seqlens"):
        attention.packed_sdpa(torch.nn.Module(), q, q, q, None)


def test_models_with_sliding_windows_or_softcapping_keep_the_mask():
    from transformers import LlamaConfig, Qwen2Config

    assert attention.supports(LlamaConfig())
    assert not attention.supports(Qwen2Config(use_sliding_window=True, layer_types=["sliding_attention"] * 2,
                                              num_hidden_layers=2))
    capped = LlamaConfig()
    capped.attn_logit_softcapping = 50.0
    assert not attention.supports(capped)


def test_logprobs_of_loss_tokens_only_equal_the_full_computation_there_and_zero_elsewhere():
    g = torch.Generator().manual_seed(1)
    T, H, V = 18, 6, 11
    hidden = torch.randn(T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (T,), generator=g)
    is_start = torch.zeros(T, dtype=torch.bool)
    is_start[[0, 5, 6, 15]] = True
    only = torch.zeros(T, dtype=torch.bool)
    only[[2, 3, 4, 6, 12, 13, 14, 17]] = True  # 6 is a sequence start: stays 0.0
    full_lp, full_ent = token_logprobs(hidden, weight, None, ids, is_start, temperature=0.7, chunk=4)
    lp, ent = token_logprobs(hidden, weight, None, ids, is_start, temperature=0.7, chunk=4, only=only)
    keep = only & ~is_start
    torch.testing.assert_close(lp[keep], full_lp[keep])
    torch.testing.assert_close(ent[keep], full_ent[keep])
    assert not lp[~keep].any() and not ent[~keep].any()
    adv = torch.randn(T, generator=g)
    grads = torch.autograd.grad((lp * adv * keep).sum(), (hidden, weight))
    ref = torch.autograd.grad((full_lp * adv * keep).sum(), (hidden, weight))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)


def test_nothing_to_compute_gives_zeros():
    hidden = torch.randn(4, 3, requires_grad=True)
    lp, ent = token_logprobs(hidden, torch.randn(5, 3), None, torch.tensor([1, 2, 3, 4]),
                             torch.tensor([True, False, False, False]), only=torch.zeros(4, dtype=torch.bool))
    assert lp.tolist() == [0.0] * 4 and ent.tolist() == [0.0] * 4


def test_the_engine_attends_per_sequence_with_sdpa_and_trains_like_the_masked_path(tmp_path):
    from areal_core.api import Context
    from areal_core.config.schema import RunConfig
    from areal_fsdp.engine import FSDPEngine, FSDPEngineConfig
    from areal_core.testing import tiny_model

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(tiny_model(tmp_path / "llama", seed=3)), "float32"
    cfg.actor.optimizer.lr, cfg.trainer.total_steps = 1e-2, 4
    lens = [6, 9, 4]
    batch = {"input_ids": [(7 * i) % 500 + 3 for i in range(sum(lens))],
             "position_ids": [p for n in lens for p in range(n)], "seq_lens": lens,
             "cu_seqlens": [0, 6, 15, 19], "loss_mask": [int(p >= 2) for n in lens for p in range(n)],
             "advantages": [((i % 5) - 2) / 2 for i in range(sum(lens))]}

    def loss_fn(logp, entropy, mb):
        mask = mb["loss_mask"].float()
        return -(logp * mb["advantages"] * mask).sum() / mask.sum(), {}

    results = {}
    for impl in ("sdpa", "eager"):
        e = FSDPEngine.create(Context(config=cfg, options=FSDPEngineConfig(attn_implementation=impl),
                                      extras={"role": "actor"}))
        e.initialize()
        results[impl] = (e.lm.config._attn_implementation, e.train_batch(dict(batch), loss_fn)["loss"],
                         e.forward_logprobs(batch)["logprobs"])
        e.close()
    assert results["sdpa"][0] == attention.PACKED_SDPA and results["eager"][0] == "eager"
    assert results["sdpa"][1] == pytest.approx(results["eager"][1], abs=1e-5)
    torch.testing.assert_close(torch.tensor(results["sdpa"][2]), torch.tensor(results["eager"][2]), atol=1e-5, rtol=0)


def test_buckets_cover_every_sequence_once_and_bound_the_padding():
    lens = [50, 48, 3, 52, 47, 900, 2, 5, 49]
    groups = attention.buckets(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        longest = max(lens[i] for i in g)
        assert lens[g[0]] == longest
        assert len(g) * longest ** 2 <= attention.PADDING_SLACK * sum(lens[i] ** 2 for i in g)
    assert [lens[i] for i in groups[0]] == [900]  # the long one is not padded against the short ones
    assert {50, 48, 52, 47, 49} <= {lens[i] for g in groups for i in g if len(g) > 1}


def _graph_names(tensor) -> set[str]:
    seen, todo, names = set(), [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("autocast", [False, True])
def test_short_low_precision_sequences_take_the_math_kernel_under_autocast_too(autocast):
    # Under bf16 autocast q and k arrive in float32 (HF's rotary tables follow the float32 embeddings); the
    # kernel still runs in bf16, where the CPU flash backward is ~3x slower than the math path on short rows.
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    q, k, v = (torch.randn(1, 4, 26, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    cu = [0, 9, 26]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, _ = attention.packed_sdpa(torch.nn.Module().eval(), q, k, v, None, **{attention.CU_SEQLENS: cu})
    names = _graph_names(out)
    assert not any("Flash" in n for n in names), names
    # float32 without autocast keeps the flash kernel (faster there)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out32, _ = attention.packed_sdpa(torch.nn.Module().eval(), q32, k32, v32, None, **{attention.CU_SEQLENS: cu})
    assert any("Flash" in n for n in _graph_names(out32))
