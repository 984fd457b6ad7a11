"""Context-parallel attention alone, the cp ranks simulated in one process: equal to the unsplit masked attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402

from areal_fsdp import context  # noqa: E402
from areal_fsdp.logprobs import packed_attention_mask, sequence_ids  # noqa: E402

LENS = [5, 1, 9, 3, 8]  # 26 tokens: not a multiple of 2c for c = 2 or 3


def test_each_rank_holds_chunks_r_and_2c_minus_1_minus_r():
    assert context.padded_length(26, 2) == 28 and context.padded_length(24, 3) == 24
    assert context.local_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.local_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    shares = [context.local_index(12, 3, r).tolist() for r in range(3)]
    assert shares == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="12 tokens cannot be cut into 2 x 4 equal chunks"):
        context.local_index(12, 4, 0)


@pytest.mark.parametrize(("size", "kv_heads"), [(2, 4), (2, 2), (3, 2)])  # plain and grouped-query attention
def test_cp_attention_equals_the_unsplit_masked_attention_in_values_and_gradients(size, kv_heads):
    g = torch.Generator().manual_seed(size * 10 + kv_heads)
    T = sum(LENS)
    length = context.padded_length(T, size)
    q = torch.randn(1, 4, length, 8, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, length, 8, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, length, 8, generator=g, requires_grad=True)
    seq = torch.cat([sequence_ids(LENS), torch.full((length - T,), len(LENS))])
    ranks = range(size)

    shards = [context.ContextShard(seq, size, r) for r in ranks]
    outs = []
    for r in ranks:
        # Rank r's "all-gather": every rank's share of k, then of v, in rank order, cut from the full tensors, so
        # gradients flow back to each token's owner as the collective's backward (a reduce-scatter) sends them.
        calls = iter([torch.cat([shards[s].split(t, 2) for s in ranks], 2) for t in (k, v)])
        shard = context.ContextShard(seq, size, r, gather=lambda x, dim, calls=calls: next(calls))
        out, _ = context.cp_sdpa(torch.nn.Module().eval(), shard.split(q, 2), shard.split(k, 2),
                                 shard.split(v, 2), None, **{context.SHARD: shard})
        outs.append((shard.index, out))
    ours = torch.zeros(1, length, 4, 8)
    for index, out in outs:
        ours = ours.index_copy(1, index, out)
    mask = packed_attention_mask(LENS + [length - T])  # padding as its own sequence
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(ours[:, :T], ref[:, :T], rtol=1e-5, atol=1e-6)
    w = torch.randn(ref.shape, generator=g)
    w[:, T:] = 0.0  # padding is never scored
    grads = torch.autograd.grad((ours * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gather_row_puts_every_ranks_share_back_in_row_order():
    length, size = 12, 3
    row = torch.arange(length * 2.0).view(2, length)
    pieces = torch.cat([context.local_index(length, size, r) for r in range(size)])
    shard = context.ContextShard(torch.zeros(length, dtype=torch.long), size, 1, gather=lambda x, dim: row[:, pieces])
    assert torch.equal(shard.gather_row(shard.split(row, 1), 1), row)


def test_cp_attention_refuses_a_call_without_its_shard():
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="called without areal_cp_shard"):
        context.cp_sdpa(torch.nn.Module(), q, q, q, None)
