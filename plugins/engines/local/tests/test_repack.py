"""areal_local.packed.repack: after a weight load the packed copies hold oneDNN's own packing of the new weights,
bit for bit and in the packed layout (not a plain copy that every matmul would reorder again), in place."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from areal_local import packed as packed_module
from areal_local.generator import Generator
from areal_local.packed import _layout, _layout_plan, _memory_of, _Plan, _plan_holds, onednn_bf16_supported, repack

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

DTYPES = [torch.float32] + ([torch.bfloat16] if onednn_bf16_supported() else [])


def fresh(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The packed tensor's memory as it is laid out (``to_dense`` would hide the layout)."""
    return _memory_of(packed).clone()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def weights(shape, dtype, n=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(192, 128), (128, 64), (100, 37), (32, 64)], ids=str)  # the last two: padded blocks
@pytest.mark.parametrize("path", ["planned", "fresh-then-copied"])
def test_repack_writes_onednns_own_packing_into_the_packed_copy(dtype, shape, path, monkeypatch):
    if path == "fresh-then-copied":
        monkeypatch.setattr(packed_module, "_layout_plan", lambda layout, dtype: None)
    old, new, x = weights(shape, dtype) + weights((5, shape[1]), dtype, n=1, seed=1)
    bias = weights((shape[0],), dtype, n=1, seed=2)[0]
    packed = fresh(old)
    memory = torch.ops.mkldnn.data_ptr(packed)
    assert repack(packed, new) is packed and torch.ops.mkldnn.data_ptr(packed) == memory
    want = fresh(new)
    assert torch.equal(packed_bytes(packed), packed_bytes(want))
    assert torch.equal(linear(x, packed, bias), linear(x, want, bias))
    assert torch.equal(packed.to_dense(), new)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_multiples_take_the_planned_copy(dtype):
    """Shapes that are whole numbers of oneDNN's blocks (every linear of SmolLM2) are written by the strided copy."""
    assert _layout_plan(_layout(fresh(weights((192, 128), dtype, n=1)[0])), dtype) is not None


def test_a_plan_that_misplaces_elements_is_refused():
    layout = _layout(fresh(weights((128, 64), torch.float32, n=1)[0]))
    good = _layout_plan(layout, torch.float32)
    assert good is not None and _plan_holds(good, layout, torch.float32)
    swapped = len(good.order) - 1, len(good.order) - 2
    order = list(good.order)
    order[swapped[0]], order[swapped[1]] = order[swapped[1]], order[swapped[0]]
    bad = _Plan(good.split, tuple(order), tuple(good.split[a] for a in order), False)
    assert not _plan_holds(bad, layout, torch.float32)


def test_repack_of_another_shape_or_dtype_is_a_fresh_packing():
    (old,), (new,) = weights((64, 64), torch.float32, n=1), weights((128, 64), torch.float32, n=1)
    packed = fresh(old)
    got = repack(packed, new)
    assert got is not packed and torch.equal(packed_bytes(got), packed_bytes(fresh(new)))
    assert torch.equal(packed.to_dense(), old)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-thread", "two-load-workers"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_weight_load_leaves_every_derived_copy_as_fresh_packing_would(dtype, workers):
    """Byte for byte (layout included) the packed linears and the lean decoder's fused q/k/v after a load are a
    new generator's on the new weights, rebuilt on the loading thread or spread over two (``load_workers``);
    tiny Llama: q 64 rows, k / v 32 (padded blocks), fused 128."""
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    torch.manual_seed(1)
    new = LlamaForCausalLM(config).to(dtype).eval()
    gen = Generator(model, eos_token_ids=[], load_workers=workers)
    assert gen._packed is not None and gen._lean is not None and gen._lean.packed
    before = {key: (t, torch.ops.mkldnn.data_ptr(t)) for key, t in gen._packed._packed.items()}
    gen.load_state_dict(new.state_dict())
    assert all(gen._packed._packed[k] is t and torch.ops.mkldnn.data_ptr(t) == p for k, (t, p) in before.items())
    want = Generator(new, eos_token_ids=[])
    for mine, theirs in zip(gen._packed.modules, want._packed.modules, strict=True):
        assert torch.equal(packed_bytes(gen._packed.weight_of(mine)), packed_bytes(want._packed.weight_of(theirs)))
    for (mine, _), (theirs, _) in zip(gen._lean._qkv, want._lean._qkv, strict=True):
        assert torch.equal(packed_bytes(mine), packed_bytes(theirs))
