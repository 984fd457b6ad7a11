"""The vLLM worker extension's digests without a server: the same strings as areal_core's, and vLLM's fused,
padded, tied and repacked parameters mapped back to the trainer's names (synthetic modules shaped like vLLM's)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from areal_core.testing import scaled
from areal_core.weight_check import NOT_CHECKABLE, compare_digests, digest_named, not_checkable, tensor_digest
from areal_vllm.engine import merge_worker_digests
from areal_vllm.server_path import areal_vllm_worker as ext


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (257, 129), (64, 1024)])  # (64, 1024) > 64 KiB: sampled
def test_the_extension_digests_exactly_as_areal_core(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape) + 1)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    for mode in ("on", "sample"):
        assert ext.tensor_digest(t, mode) == tensor_digest(t, mode)
    # a non-contiguous view (a slice of a fused tensor is one) hashes its elements in row-major order
    if len(shape) == 2:
        assert ext.tensor_digest(t.t(), "on") == tensor_digest(t.t().contiguous(), "on")


def test_the_extension_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="'everything'.*'on' or 'sample'"):
        ext.model_digests(nn.Module(), "everything")


class FusedLinear(nn.Module):
    """Shaped like vLLM's QKVParallelLinear / MergedColumnParallelLinear (tensor parallel 1)."""

    def __init__(self, parts: list[torch.Tensor], bias: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.output_partition_sizes = [p.shape[0] for p in parts]
        self.tp_size = 1
        self.weight = nn.Parameter(torch.cat(parts), requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(torch.cat(bias), requires_grad=False)


class Embedding(nn.Module):
    """Shaped like vLLM's VocabParallelEmbedding: rows padded past the vocabulary."""

    def __init__(self, weight: torch.Tensor, padded: int) -> None:
        super().__init__()
        self.org_vocab_size = weight.shape[0]
        self.weight = nn.Parameter(torch.cat([weight, torch.zeros(padded - weight.shape[0], weight.shape[1],
                                                                  dtype=weight.dtype)]), requires_grad=False)


def hf_tensors(seed: int = 0, bias: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    p = "model.layers.0."
    out = {"model.embed_tokens.weight": r(100, 16), f"{p}self_attn.q_proj.weight": r(16, 16),
           f"{p}self_attn.k_proj.weight": r(8, 16), f"{p}self_attn.v_proj.weight": r(8, 16),
           f"{p}self_attn.o_proj.weight": r(16, 16), f"{p}mlp.gate_proj.weight": r(32, 16),
           f"{p}mlp.up_proj.weight": r(32, 16), f"{p}mlp.down_proj.weight": r(16, 32),
           f"{p}input_layernorm.weight": r(16), "model.norm.weight": r(16)}
    if bias:
        out.update({f"{p}self_attn.{x}_proj.bias": r(16 if x == "q" else 8) for x in "qkv"})
    return out


class Model(nn.Module):
    """A vLLM-shaped model holding ``hf``: q/k/v and gate/up fused, vocabulary padded to 128, lm_head tied."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, hf: dict[str, torch.Tensor]) -> None:
        super().__init__()
        p = "model.layers.0."
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(hf["model.embed_tokens.weight"], 128)
        layer = nn.Module()
        layer.self_attn = nn.Module()
        biases = [hf[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"] if f"{p}self_attn.q_proj.bias" in hf else None
        layer.self_attn.qkv_proj = FusedLinear([hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"], biases)
        layer.self_attn.o_proj = FusedLinear([hf[f"{p}self_attn.o_proj.weight"]])
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = FusedLinear([hf[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")])
        layer.mlp.down_proj = FusedLinear([hf[f"{p}mlp.down_proj.weight"]])
        layer.input_layernorm = nn.Module()
        layer.input_layernorm.weight = nn.Parameter(hf[f"{p}input_layernorm.weight"].clone(), requires_grad=False)
        self.model.layers = nn.ModuleList([layer])
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(hf["model.norm.weight"].clone(), requires_grad=False)
        self.lm_head = nn.Module()
        self.lm_head.org_vocab_size = 100
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, as vLLM's tie_weights does


@pytest.mark.parametrize("mode", ["on", "sample"])
def test_fused_padded_and_tied_parameters_map_back_to_the_trainers_names(mode):
    hf = hf_tensors()
    held = ext.model_digests(Model(hf), mode, loaded={})
    sent = digest_named([*hf.items(), ("lm_head.weight", hf["model.embed_tokens.weight"])], mode)
    assert compare_digests(sent, held) == []
    assert not not_checkable(sent, held)
    assert set(held) == set(sent)


def test_a_tied_head_the_trainer_sent_untied_fails_the_check():
    """vLLM ignores an lm_head.weight it is sent for a tied model: a head other than the embeddings is not served."""
    hf = hf_tensors()
    held = ext.model_digests(Model(hf), "on", loaded={})
    sent = digest_named([*hf.items(), ("lm_head.weight", torch.ones_like(hf["model.embed_tokens.weight"]))])
    assert [d.split(":")[0] for d in compare_digests(sent, held)] == ["lm_head.weight"]


def test_swapped_key_and_value_rows_are_named():
    hf = hf_tensors(bias=False)
    model = Model(hf)
    w = model.model.layers[0].self_attn.qkv_proj.weight.data
    w[16:24], w[24:32] = w[24:32].clone(), w[16:24].clone()  # a loader that puts v where k belongs
    differences = compare_digests(digest_named(hf.items()), ext.model_digests(model, "on", loaded={}))
    assert sorted(d.split(":")[0] for d in differences) == ["model.layers.0.self_attn.k_proj.weight",
                                                           "model.layers.0.self_attn.v_proj.weight"]


def test_a_repacked_linear_layer_is_digested_as_the_load_hook_saw_it():
    """vLLM's CPU kernels repack a linear weight and empty the parameter; the load hook digested it just before
    (and the SGL kernel casts the bias to float32: the hook's digest of the loaded bias stands)."""
    hf = hf_tensors()
    model = Model(hf)
    qkv = model.model.layers[0].self_attn.qkv_proj
    ext.record_loaded(qkv)  # as process_weights_after_loading would, before repacking
    loaded = {qkv: ext.LOADED[qkv]}
    qkv.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    qkv.bias.data = qkv.bias.data.float()
    held = ext.model_digests(model, "on", loaded=loaded)
    assert compare_digests(digest_named(hf.items()), held) == []


def test_the_load_hook_digests_in_the_modes_it_is_told_only(monkeypatch):
    hf = hf_tensors()
    model = Model(hf)
    qkv = model.model.layers[0].self_attn.qkv_proj
    monkeypatch.setenv(ext.LOAD_MODES_ENV, "sample")
    ext.record_loaded(qkv)
    loaded = {qkv: ext.LOADED[qkv]}
    assert set(loaded[qkv]["weight"]["digests"]) == {"sample"}
    qkv.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    assert compare_digests(digest_named(hf.items(), "sample"), ext.model_digests(model, "sample", loaded=loaded)) == []
    held = ext.model_digests(model, "on", loaded=loaded)
    skipped = not_checkable(digest_named(hf.items()), held)
    fused = sorted(f"model.layers.0.self_attn.{x}_proj.{a}" for a in ("bias", "weight") for x in "qkv")
    assert sorted(skipped) == fused
    assert "mode sample only" in skipped["model.layers.0.self_attn.q_proj.weight"]


def test_what_cannot_be_mapped_back_is_reported_not_checkable_and_skipped():
    hf = hf_tensors(bias=False)
    model = Model(hf)
    model.model.layers[0].mlp.down_proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # no hook seen
    model.model.layers[0].self_attn.o_proj.tp_size = 2
    held = ext.model_digests(model, "on", loaded={})
    sent = digest_named(hf.items())
    skipped = not_checkable(sent, held)
    assert sorted(skipped) == ["model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
    assert "repacked" in skipped["model.layers.0.mlp.down_proj.weight"]
    assert "tensor-parallel" in skipped["model.layers.0.self_attn.o_proj.weight"]  # a layout not known
    assert compare_digests(sent, held) == []  # skipped, not passed as equal nor failed
    assert all(held[n].startswith(NOT_CHECKABLE) for n in skipped)


def test_the_workers_answers_merge_into_one_digest_per_name():
    a, b = "bfloat16[2]:" + "0" * 16, "bfloat16[2]:" + "1" * 16
    merged = merge_worker_digests([{"x": a, "y": f"{NOT_CHECKABLE}: shard", "z": a},
                                   {"x": a, "y": b, "z": b}])
    assert merged["x"] == a and merged["y"] == b
    assert merged["z"] == f"rank 0 {a}, rank 1 {b}"  # ranks disagree: equal to nothing sent
    assert compare_digests({"z": a}, merged)


# ------------------------------------------------------------------ tensor parallel (tp > 1)
class ThreadGatherDouble:
    """Test double of the worker's GroupGather: the ranks of a tensor-parallel group are threads of this process,
    and a gather hands every rank's tensor to rank 0 (as the real one does over gloo)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list = [None] * size
        self.timeout_s = scaled(30)
        self.barrier = threading.Barrier(size, timeout=self.timeout_s)

    def rank(self, rank: int) -> "ThreadGatherDouble.Rank":
        return ThreadGatherDouble.Rank(self, rank)

    class Rank:
        def __init__(self, group: "ThreadGatherDouble", rank: int) -> None:
            self.group, self.rank, self.size = group, rank, group.size

        def __call__(self, tensor):
            g = self.group
            g.slots[self.rank] = tensor.detach().clone()
            try:
                g.barrier.wait()  # every rank's shard is in
                out = list(g.slots) if self.rank == 0 else None
                g.barrier.wait()  # rank 0 has them: the slots may be reused
            except threading.BrokenBarrierError:
                raise TimeoutError(f"tensor-parallel rank {self.rank} waited {g.timeout_s:.0f} s for the other ranks' "
                                   f"shards of a {tuple(tensor.shape)} tensor: the ranks gathered in different "
                                   f"orders") from None
            return out


def on_ranks(size: int, work) -> list:
    """``work(rank, gather)`` on ``size`` threads at once (one tensor-parallel group); their results in rank order."""
    group = ThreadGatherDouble(size)
    results, errors = [None] * size, []

    def run(rank):
        try:
            results[rank] = work(rank, group.rank(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below in the test's thread
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(60))
    assert not any(t.is_alive() for t in threads), f"a tensor-parallel rank thread still runs after {scaled(60):.0f} s"
    if errors:
        raise errors[0]
    return results


class ColumnShard(FusedLinear):
    """Shaped like vLLM's ColumnParallelLinear / QKVParallelLinear / MergedColumnParallelLinear on one rank."""

    def __init__(self, parts: list[torch.Tensor], tp: int, replicas: int = 1, bias: list | None = None) -> None:
        super().__init__(parts, bias)
        self.tp_size, self.gather_output = tp, False
        if replicas > 1:
            self.num_kv_head_replicas = replicas


class RowShard(nn.Module):
    """Shaped like vLLM's RowParallelLinear on one rank: its weight's columns."""

    def __init__(self, weight: torch.Tensor, tp: int) -> None:
        super().__init__()
        self.tp_size, self.input_is_parallel = tp, True
        self.output_partition_sizes = [weight.shape[0]]
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)


class VocabShard(nn.Module):
    """Shaped like vLLM's VocabParallelEmbedding on one rank: a range of the padded vocabulary's rows."""

    def __init__(self, weight: torch.Tensor, rank: int, tp: int, padded: int) -> None:
        super().__init__()
        per = padded // tp
        rows = weight[rank * per:(rank + 1) * per]
        self.tp_size, self.org_vocab_size = tp, weight.shape[0]
        self.shard_indices = SimpleNamespace(num_org_elements=rows.shape[0])
        pad = torch.zeros(per - rows.shape[0], weight.shape[1], dtype=weight.dtype)
        self.weight = nn.Parameter(torch.cat([rows, pad]), requires_grad=False)


def rank_model(hf: dict[str, torch.Tensor], rank: int, tp: int, head: int) -> nn.Module:
    """What tensor-parallel rank ``rank`` of ``tp`` holds of ``hf`` (heads of ``head`` rows), split as vLLM
    splits it: q/k/v and gate/up rows (k/v heads replicated when tp exceeds them), o/down columns, the
    vocabulary's rows (padded to 128), norms whole; lm_head tied."""
    p = "model.layers.0."

    def rows(t, shard, of):
        n = t.shape[0] // of
        return t[shard * n:(shard + 1) * n]

    kv_heads = hf[f"{p}self_attn.k_proj.weight"].shape[0] // head
    replicas = max(1, tp // kv_heads)
    shard_of = {"q": (rank, tp), "k": (rank // replicas, min(tp, kv_heads)), "v": (rank // replicas, min(tp, kv_heads))}
    model = Model(hf)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    biases = None
    if f"{p}self_attn.q_proj.bias" in hf:
        biases = [rows(hf[f"{p}self_attn.{x}_proj.bias"], *shard_of[x]) for x in "qkv"]
    attn.qkv_proj = ColumnShard([rows(hf[f"{p}self_attn.{x}_proj.weight"], *shard_of[x]) for x in "qkv"], tp,
                                replicas, biases)
    attn.o_proj = RowShard(rows(hf[f"{p}self_attn.o_proj.weight"].t(), rank, tp).t(), tp)
    mlp.gate_up_proj = ColumnShard([rows(hf[f"{p}mlp.{x}_proj.weight"], rank, tp) for x in ("gate", "up")], tp)
    mlp.down_proj = RowShard(rows(hf[f"{p}mlp.down_proj.weight"].t(), rank, tp).t(), tp)
    model.model.embed_tokens = VocabShard(hf["model.embed_tokens.weight"], rank, tp, 128)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("mode", ["on", "sample"])
@pytest.mark.parametrize("tp,head", [(2, 8), (2, 4), (4, 4)])  # 1 kv head on 2 ranks; 2 on 2; 2 on 4
def test_tensor_parallel_shards_are_put_back_together_under_the_trainers_names(tp, head, mode):
    hf = hf_tensors()
    models = [rank_model(hf, r, tp, head) for r in range(tp)]
    answers = on_ranks(tp, lambda r, gather: ext.model_digests(models[r], mode, loaded={}, gather=gather))
    sent = digest_named([*hf.items(), ("lm_head.weight", hf["model.embed_tokens.weight"])], mode)
    assert set(answers[0]) == set(sent)
    assert set(answers[1]) == {n for n in sent if "norm" in n}  # the split ones come from rank 0 only
    held = merge_worker_digests(answers)
    assert compare_digests(sent, held) == []
    assert not not_checkable(sent, held)


def test_a_replicated_kv_head_that_differs_between_ranks_is_named():
    hf = hf_tensors(bias=False)
    models = [rank_model(hf, r, 2, 8) for r in range(2)]  # 1 kv head: both ranks hold k and v whole
    models[1].model.layers[0].self_attn.qkv_proj.weight.data[8:16] *= 2  # rank 1's copy of k (after its 8 q rows)
    held = merge_worker_digests(on_ranks(2, lambda r, g: ext.model_digests(models[r], "on", loaded={}, gather=g)))
    differences = compare_digests(digest_named(hf.items()), held)
    assert [d.split(":")[0] for d in differences] == ["model.layers.0.self_attn.k_proj.weight"]
    assert "tensor-parallel rank 1 holds" in differences[0]


def test_the_load_hook_gathers_split_layers_and_the_first_rank_reports_them():
    """On CPU vLLM empties linear weights after loading: each rank's hook gathers the shards of each layer as it
    loads (same order on every rank); rank 0 keeps the digests of the whole tensors, the others report nothing."""
    hf = hf_tensors()
    models = [rank_model(hf, r, 2, 8) for r in range(2)]
    linear = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj",
              "model.layers.0.mlp.down_proj"]

    def load(rank, gather):
        layers = [models[rank].get_submodule(n) for n in linear]
        for layer in layers:
            ext.record_loaded(layer, gather=gather)
            layer.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)  # repacked
        return {layer: ext.LOADED[layer] for layer in layers}

    loaded = on_ranks(2, load)
    assert all(e["weight"]["digests"]["on"] is None for e in loaded[1].values())  # rank 0 holds them
    answers = on_ranks(2, lambda r, g: ext.model_digests(models[r], "on", loaded=loaded[r], gather=g))
    held = merge_worker_digests(answers)
    sent = digest_named(hf.items())
    assert compare_digests(sent, held) == []
    assert not not_checkable(sent, held)


def test_a_split_layer_without_a_group_to_gather_over_is_not_checkable():
    hf = hf_tensors(bias=False)
    held = ext.model_digests(rank_model(hf, 0, 2, 8), "on", loaded={})  # no vLLM here: no tensor-parallel group
    skipped = not_checkable(digest_named(hf.items()), held)
    assert sorted(skipped) == sorted(n for n in hf if "norm" not in n)
    assert "no tensor-parallel group" in skipped["model.layers.0.mlp.down_proj.weight"]


def test_an_embedding_split_over_a_group_of_its_own_is_not_checkable():
    hf = hf_tensors(bias=False)
    models = [rank_model(hf, r, 2, 8) for r in range(2)]
    for m in models:
        m.model.embed_tokens.parallel_group = object()  # not vLLM's tensor-parallel group: not gathered over it
    held = merge_worker_digests(on_ranks(2, lambda r, g: ext.model_digests(models[r], "on", loaded={}, gather=g)))
    sent = digest_named([*hf.items(), ("lm_head.weight", hf["model.embed_tokens.weight"])])
    skipped = not_checkable(sent, held)
    assert sorted(skipped) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert "over a group of its own" in skipped["model.embed_tokens.weight"]
    assert compare_digests(sent, held) == []
