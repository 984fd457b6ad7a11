"""VocabLogprobs: the hand-written backward of logp / entropy over the vocabulary equals autograd's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from areal_fsdp.logprobs import VocabLogprobs, _chunk_logprobs, next_token_logprobs  # noqa: E402


def inputs(n: int, hidden: int, vocab: int, seed: int, dtype=torch.float64, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(vocab, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (n,), generator=g)
    return h, w, b, labels


def test_gradcheck_in_float64_with_bias_and_temperature():
    h, w, b, labels = inputs(5, 6, 11, seed=0)
    # Both outputs feed the check (gradcheck weights each output with its own random cotangent).
    assert torch.autograd.gradcheck(lambda h, w, b: VocabLogprobs.apply(h, w, b, labels, 1 / 0.7), (h, w, b))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 7), vocab=st.integers(2, 40), temperature=st.sampled_from([0.5, 1.0, 1.3]),
       use=st.sampled_from(["both", "logp", "entropy"]), bias=st.booleans(), seed=st.integers(0, 10_000))
def test_values_and_gradients_equal_autograd(n, vocab, temperature, use, bias, seed):
    h, w, b, labels = inputs(n, 8, vocab, seed, bias=bias)
    g = torch.Generator().manual_seed(seed + 1)
    a, c = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    def loss(lp, ent):
        # "logp" / "entropy": the other output takes no part in the loss (its gradient arrives as None)
        return (a * lp).sum() * (use != "entropy") + (c * ent).sum() * (use != "logp")

    params = [x for x in (h, w, b) if x is not None]
    lp, ent = VocabLogprobs.apply(h, w, b, labels, 1 / temperature)
    ours = torch.autograd.grad(loss(lp, ent), params)
    ref_lp, ref_ent = _chunk_logprobs(h, w, b, labels, temperature, None)
    ref = torch.autograd.grad(loss(ref_lp, ref_ent), params)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine, theirs)


def test_under_bf16_autocast_gradients_stay_in_the_parameters_dtypes_and_match_autograd():
    h, w, b, labels = inputs(16, 32, 300, seed=3, dtype=torch.float32)
    a = torch.randn(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = next_token_logprobs(h, w, b, labels, torch.ones(16, dtype=torch.bool), chunk=5)
    assert lp.dtype == ent.dtype == torch.float32
    ours = torch.autograd.grad((a * lp).sum() + 0.1 * ent.sum(), (h, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_lp, ref_ent = _chunk_logprobs(h, w, b, labels, 1.0, None)
    ref = torch.autograd.grad((a * ref_lp).sum() + 0.1 * ref_ent.sum(), (h, w, b))
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    for mine, theirs, param in zip(ours, ref, (h, w, b)):
        assert mine.dtype == param.dtype
        # The same bf16 matmuls in a different order of float32 work: bf16's rounding, not a wrong formula.
        torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=2e-3)


def test_without_grad_the_values_are_the_same():
    h, w, b, labels = inputs(9, 8, 50, seed=4, dtype=torch.float32)
    wanted = torch.tensor([True, False, True, True, False, True, True, True, False])
    with torch.no_grad():
        lp, ent = next_token_logprobs(h, w, b, labels, wanted, temperature=0.8, chunk=4)
    ref_lp, ref_ent = _chunk_logprobs(h[wanted], w, b, labels[wanted], 0.8, None)
    torch.testing.assert_close(lp[wanted], ref_lp.detach())
    torch.testing.assert_close(ent[wanted], ref_ent.detach())
    assert (lp[~wanted] == 0).all() and (ent[~wanted] == 0).all()
