"""The fsdp train engine over several ranks on CPU (gloo): data, tensor and context parallel, each training,
saving, loading and exporting as one process does. The helpers are test_fsdp_engine.py's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

_spec = importlib.util.spec_from_file_location("areal_fsdp_engine_tests",
                                               Path(__file__).with_name("test_fsdp_engine.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

LENGTHS, bucket_bytes_of, fresh_from_tensors, hf_logprobs, make_batch, models, run_ranks, worker, worst = (
    base.LENGTHS, base.bucket_bytes_of, base.fresh_from_tensors, base.hf_logprobs, base.make_batch, base.models,
    base.run_ranks, base.worker, base.worst)


# ---------------------------------------------------------------------- data parallel
def test_two_ranks_train_save_and_export_like_one(models, tmp_path):
    # 7 sequences over 2 ranks, 16-token micro-batches: uneven shares and micro-batch counts.
    batch = make_batch(LENGTHS + [4])
    spec = {"model": str(models["llama"]), "batch": batch, "mb_max_tokens": 16, "lr": 1.0, "eps": 1.0,
            "grad_clip": 0.0}
    two = run_ranks(spec, tmp_path / "world2")
    one = worker.scenario(worker.make_engine(spec), batch, str(tmp_path / "world1"))
    assert worst(two["lp0"]["logprobs"], one["lp0"]["logprobs"]) < 1e-5
    assert worst(two["lp0"]["entropy"], one["lp0"]["entropy"]) < 1e-5
    assert two["stats1"]["loss"] == pytest.approx(one["stats1"]["loss"], rel=1e-6)
    assert two["stats1"]["grad_norm"] == pytest.approx(one["stats1"]["grad_norm"], rel=1e-5)
    for key in ("lp1", "lp2"):
        assert worst(two[key], one[key]) < 1e-5, key
    exported = [load_file(tmp_path / w / "export" / "model.safetensors") for w in ("world2", "world1")]
    assert sorted(exported[0]) == sorted(exported[1])
    initial = load_file(Path(models["llama"]) / "model.safetensors")
    assert max(worst(exported[1][k], initial[k]) for k in initial) > 1e-3
    assert max(worst(exported[0][k], exported[1][k]) for k in exported[1]) < 1e-5
    # Save / load at world size 2: exact weights, version, and optimizer state.
    assert two["loaded_version"] == 1
    assert worst(two["lp_loaded"], two["lp1"]) == 0.0
    assert worst(two["lp2_after_load"], two["lp2"]) < 1e-6
    # A world-size-2 checkpoint resumes at world size 1 (the optimizer state is resharded).
    resumed = worker.scenario(worker.make_engine(spec), batch, str(tmp_path / "resume"),
                              resume_from=str(tmp_path / "world2" / "ckpt"))
    assert resumed["resumed_version"] == 1
    assert worst(resumed["after_resume"], two["lp2"]) < 1e-4


def test_two_ranks_with_fewer_sequences_than_ranks(models, tmp_path):
    batch = make_batch([9])
    spec = {"model": str(models["qwen2"]), "batch": batch, "mb_max_tokens": 16, "lr": 1.0, "eps": 1.0,
            "grad_clip": 0.0, "scenario": "short"}
    two = run_ranks(spec, tmp_path / "world2")
    one = worker.short_scenario(worker.make_engine(spec), batch)
    assert worst(two["lp0"], one["lp0"]) < 1e-5
    assert worst(two["lp1"], one["lp1"]) < 1e-4
    assert two["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=1e-6)


@pytest.mark.parametrize(("allocation", "world"), [
    pytest.param(None, 2, id="d2"), pytest.param("fsdp:d2t2@cpu", 4, id="d2t2"),
    # Checkpointed layers recompute their key / value all-gathers in backward.
    pytest.param("fsdp:c2@cpu", 2, id="c2", marks=pytest.mark.slow),
    # bf16 compute under FSDP over the cp ranks beside tp, the local heads' gathers recomputed in backward.
    pytest.param("fsdp:c2t2@cpu", 4, id="c2t2", marks=pytest.mark.slow)])
def test_sharded_ranks_in_bfloat16_with_activation_checkpointing(models, tmp_path, allocation, world):
    """FSDP2 mixed precision (bf16 compute, fp32 reduce; over tensor-parallel layers too) against autocast at
    world size 1: bf16-close."""
    batch = make_batch(LENGTHS + [4])
    spec = {"model": str(models["llama"]), "batch": batch, "mb_max_tokens": 16, "dtype": "bfloat16",
            "gradient_checkpointing": True, "scenario": "short", "allocation": allocation}
    two = run_ranks(spec, tmp_path / "world2", world=world)
    one = worker.short_scenario(worker.make_engine({**spec, "allocation": None}), batch)
    assert worst(two["lp0"], one["lp0"]) < 0.05
    assert two["stats"]["loss"] == pytest.approx(one["stats"]["loss"], abs=0.01)
    assert worst(two["lp1"], one["lp1"]) < 0.05
    assert worst(two["lp1"], two["lp0"]) > 1e-2  # it trained


# ---------------------------------------------------------------------- weight export as tensors
def test_two_ranks_export_tensors_like_one(models, tmp_path):
    batch = make_batch(LENGTHS + [4])
    limit = 50_000
    spec = {"model": str(models["llama"]), "batch": batch, "mb_max_tokens": 16, "lr": 1.0, "eps": 1.0,
            "grad_clip": 0.0, "scenario": "tensors", "bucket_bytes": limit, "repeats": 40}
    two = run_ranks(spec, tmp_path / "world2")  # 40 exports: async gathers over gloo crashed within ~30
    one = worker.tensors_scenario(worker.make_engine(spec), batch, str(tmp_path / "world1"), limit)
    assert two["n_buckets_per_rank"] == [two["n_buckets"]] * 2 and two["n_buckets"] == one["n_buckets"] > 2
    assert all(bucket_bytes_of(b) <= limit or len(b) == 1 for b in two["buckets"])
    state2 = {n: t for b in two["buckets"] for n, t in b}
    state1 = {n: t for b in one["buckets"] for n, t in b}
    assert sorted(state2) == sorted(state1)
    assert max(worst(state2[k], state1[k]) for k in state1) < 1e-5
    # Rank 0's gathered tensors are exactly what it wrote to disk, and a fresh model gets its logits.
    on_disk = load_file(tmp_path / "world2" / "export" / "model.safetensors")
    assert max(worst(state2[k], on_disk[k]) for k in on_disk) == 0.0
    lm = fresh_from_tensors(tmp_path / "world2" / "export", two["buckets"])
    assert worst(hf_logprobs(lm, batch), two["lp1"]) < 1e-5


# ---------------------------------------------------------------------- tensor and context parallel
def train_on_ranks_and_in_one_process(models, tmp_path, allocation: str, world: int,
                                      arch: str = "llama") -> tuple[dict, dict, dict]:
    """The full scenario on ``world`` ranks placed as ``allocation`` (in ``tmp_path / "many"``) and in one
    process (``tmp_path / "world1"``): what each saw, and the spec."""
    batch = make_batch(LENGTHS + [4])
    spec = {"model": str(models[arch]), "batch": batch, "mb_max_tokens": 16, "lr": 1.0, "eps": 1.0,
            "grad_clip": 1.0, "allocation": allocation}
    many = run_ranks(spec, tmp_path / "many", world=world)
    one = worker.scenario(worker.make_engine({**spec, "allocation": None}), batch, str(tmp_path / "world1"))
    return many, one, spec


def assert_trained_like_one(many: dict, one: dict, tmp_path) -> None:
    """Losses, clipped grad norm, logprobs, exported weights (after one and two steps) and a save / load as in
    one process."""
    assert many["stats1"]["grad_norm"] > 1.0  # grad_clip 1.0 acted
    assert worst(many["lp0"]["logprobs"], one["lp0"]["logprobs"]) < 1e-5
    assert worst(many["lp0"]["entropy"], one["lp0"]["entropy"]) < 1e-5
    assert many["stats1"]["loss"] == pytest.approx(one["stats1"]["loss"], rel=1e-6)
    assert many["stats1"]["entropy"] == pytest.approx(one["stats1"]["entropy"], rel=1e-6)
    assert many["stats1"]["grad_norm"] == pytest.approx(one["stats1"]["grad_norm"], rel=1e-5)
    for key in ("lp1", "lp2"):
        assert worst(many[key], one[key]) < 1e-4, key
    for folder in ("export", "export2"):
        exported = [load_file(tmp_path / w / folder / "model.safetensors") for w in ("many", "world1")]
        assert sorted(exported[0]) == sorted(exported[1])
        assert max(worst(exported[0][k], exported[1][k]) for k in exported[1]) < 1e-5, folder
    assert many["loaded_version"] == 1 and worst(many["lp_loaded"], many["lp1"]) == 0.0
    assert worst(many["lp2_after_load"], many["lp2"]) < 1e-6


@pytest.mark.slow
def test_two_ranks_of_tensor_parallel_train_save_and_export_like_one(models, tmp_path):
    """t2 over gloo: heads and MLP columns split (DTensor), the same losses, weights and checkpoints as one process."""
    two, one, _ = train_on_ranks_and_in_one_process(models, tmp_path, "fsdp:t2@cpu", world=2)
    # Column-parallel q, row-parallel o, the embedding whole (not FSDP-sharded).
    assert two["layout"] == {"q_proj": "(Shard(dim=0),)", "o_proj": "(Shard(dim=1),)", "embed": "None"}
    assert_trained_like_one(two, one, tmp_path)


def test_four_ranks_of_tensor_x_data_parallel_train_save_and_export_like_one(models, tmp_path):
    """d2t2 over gloo: heads split over tp, then FSDP over dp (tp groups share micro-batches); the same losses,
    weights and checkpoints as one process, and the checkpoint resumes in one process."""
    four, one, spec = train_on_ranks_and_in_one_process(models, tmp_path, "fsdp:d2t2@cpu", world=4)
    # (dp, tp) placements: q split over tp (dim 0), then FSDP-sharded over dp; the embedding FSDP-sharded only.
    layout = four["layout"]
    assert layout["q_proj"].startswith("(_StridedShard(dim=0") and layout["q_proj"].endswith(", Shard(dim=0))")
    assert (layout["o_proj"], layout["embed"]) == ("(Shard(dim=0), Shard(dim=1))", "(Shard(dim=0),)")
    assert_trained_like_one(four, one, tmp_path)
    saved = load_file(tmp_path / "many" / "ckpt" / "model.safetensors")
    exported = load_file(tmp_path / "many" / "export" / "model.safetensors")
    assert max(worst(saved[k], exported[k]) for k in exported) == 0.0  # float32 both: the same full tensors
    resumed = worker.scenario(worker.make_engine({**spec, "allocation": None}), spec["batch"],
                              str(tmp_path / "resume"), resume_from=str(tmp_path / "many" / "ckpt"))
    assert resumed["resumed_version"] == 1
    assert worst(resumed["after_resume"], four["lp2"]) < 1e-4


@pytest.mark.parametrize(("allocation", "world", "arch"), [("fsdp:c2@cpu", 2, "llama"), ("fsdp:d2c2@cpu", 4, "qwen2")],
                         ids=["c2-llama", "d2c2-qwen2"])
def test_context_parallel_ranks_train_save_and_export_like_one(models, tmp_path, allocation, world, arch):
    """c2 and d2c2 over gloo: each cp rank holds half of every packed row and attends to all-gathered keys and
    values; the same logprobs, entropy, losses, clipped grad norm, weights and checkpoints as one process.
    Qwen2 brings q/k/v biases; both models have grouped-query attention (4 heads, 2 key-value heads)."""
    many, one, spec = train_on_ranks_and_in_one_process(models, tmp_path, allocation, world, arch)
    # Micro-batches of several sequences, some not a multiple of 2c = 4 tokens (padded, the padding unscored).
    assert any(len(seqs) > 1 for seqs in many["plan"]) and any(n % 4 for n in many["mb_tokens"]), many["mb_tokens"]
    # FSDP shards every weight over all d x c ranks (one flattened mesh dimension).
    assert set(many["layout"].values()) == {"(Shard(dim=0),)"}
    assert_trained_like_one(many, one, tmp_path)


@pytest.mark.parametrize(("allocation", "world"), [
    pytest.param("fsdp:c2t2@cpu", 4, id="c2t2"),
    # Eight ranks: FSDP over the flattened d x c dimension beside tp; about a minute on 2 CPU cores.
    pytest.param("fsdp:d2c2t2@cpu", 8, id="d2c2t2", marks=pytest.mark.slow)])
def test_context_x_tensor_parallel_ranks_train_save_and_export_like_one(models, tmp_path, allocation, world):
    """c2t2 over gloo: each (cp, tp) rank holds half of every packed row and half of the heads; keys and values of
    its local heads are all-gathered over its cp group, FSDP shards over the (d x) c ranks; the same logprobs,
    entropy, losses, clipped grad norm, weights and checkpoints as one process. Qwen2: q/k/v biases split with the
    heads, and each tp rank keeps grouped-query attention (2 heads, 1 key-value head)."""
    many, one, _ = train_on_ranks_and_in_one_process(models, tmp_path, allocation, world=world, arch="qwen2")
    assert any(len(seqs) > 1 for seqs in many["plan"]) and any(n % 4 for n in many["mb_tokens"]), many["mb_tokens"]
    # Rank 0's attention got plain tensors of its 2 of 4 heads (1 of 2 key-value heads) for half of the padded row,
    # and gathered keys and values from its cp peer (rank 2: same tp rank) only, not from the world.
    seen = many["attention"]
    assert (seen["types"], seen["heads"], seen["kv_heads"]) == (("Tensor", "Tensor"), 2, 1)
    assert seen["tokens"] * 2 == seen["row"] and seen["cp_group"] == [0, 2]
    # (d x c, tp) placements: q split over tp (dim 0), then FSDP-sharded over d x c; the embedding FSDP-sharded only.
    layout = many["layout"]
    assert layout["q_proj"].startswith("(_StridedShard(dim=0") and layout["q_proj"].endswith(", Shard(dim=0))")
    assert (layout["o_proj"], layout["embed"]) == ("(Shard(dim=0), Shard(dim=1))", "(Shard(dim=0),)")
    assert_trained_like_one(many, one, tmp_path)
