"""The fsdp train engine on tiny random Llama / Qwen2 models, on CPU: one process, and two over gloo."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
# Loaded at collection (see plugins/engines/local/tests/test_models.py for why).
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM  # noqa: E402, F401

from areal_core.api import Context  # noqa: E402
from areal_core.config.schema import RunConfig  # noqa: E402
from areal_core.launch import free_port, rendezvous_env  # noqa: E402
from areal_core.testing import TrainEngineConformance, tiny_model  # noqa: E402
from areal_fsdp.engine import FSDPEngine, FSDPEngineConfig  # noqa: E402
from areal_fsdp.logprobs import packed_attention_mask  # noqa: E402
from areal_fsdp.packing import first_fit_decreasing, karmarkar_karp, micro_batches  # noqa: E402
from areal_core.lr_schedule import lr_factor  # noqa: E402
from areal_core.testing.models import hf_logprobs, max_abs_diff as worst  # noqa: E402

WORKER = Path(__file__).with_name("dist_worker.py")
_spec = importlib.util.spec_from_file_location("areal_fsdp_dist_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

LENGTHS = [5, 9, 3, 12, 7, 6]
VOCAB = 512


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp-models")
    return {
        "llama": tiny_model(root / "llama", arch="llama", seed=0),
        "qwen2": tiny_model(root / "qwen2", arch="qwen2", seed=1),
        "untied": tiny_model(root / "untied", arch="llama", seed=2, tie_word_embeddings=False),
    }


def make_batch(lengths=LENGTHS, seed: int = 0, prompt: int = 2) -> dict:
    """A packed batch as ``pack_groups`` makes it, plus per-token advantages."""
    rng = random.Random(seed)
    out: dict = {k: [] for k in ("input_ids", "position_ids", "loss_mask", "logprobs", "versions", "advantages",
                                 "rewards", "group_index", "seq_lens")}
    cu = [0]
    for j, n in enumerate(lengths):
        out["input_ids"] += [rng.randrange(3, VOCAB) for _ in range(n)]
        out["position_ids"] += list(range(n))
        out["loss_mask"] += [int(i >= prompt) for i in range(n)]
        out["logprobs"] += [-rng.random() for _ in range(n)]
        out["versions"] += [0] * n
        out["advantages"] += [rng.uniform(-1, 1) for _ in range(n)]
        out["rewards"].append(float(j % 2))
        out["group_index"].append(j // 2)
        out["seq_lens"].append(n)
        cu.append(cu[-1] + n)
    out["cu_seqlens"] = cu
    return out


def config(path, *, dtype="float32", mb_max_tokens=8192, lr=1e-2, eps=1e-8, grad_clip=1.0,
           gradient_checkpointing=False) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(path), dtype
    cfg.actor.mb_max_tokens = mb_max_tokens
    cfg.actor.gradient_checkpointing = gradient_checkpointing
    cfg.actor.optimizer.lr, cfg.actor.optimizer.eps, cfg.actor.optimizer.grad_clip = lr, eps, grad_clip
    cfg.trainer.total_steps = 10
    return cfg


def engine(cfg: RunConfig, role: str = "actor", **options) -> FSDPEngine:
    e = FSDPEngine.create(Context(config=cfg, options=FSDPEngineConfig(**options), extras={"role": role}))
    e.initialize()
    return e


def weights(e: FSDPEngine) -> dict:
    return {k: v.detach().clone() for k, v in e.lm.state_dict().items()}


def nll(logprobs, entropy, mb):
    return worker.nll(logprobs, entropy, mb)


# ---------------------------------------------------------------------- pure parts
def test_first_fit_decreasing_respects_the_budget_and_isolates_long_sequences():
    lengths = [7, 3, 9, 2, 8, 20, 1]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 or len(b) == 1 for b in bins)
    assert [5] in bins  # 20 > 10 alone
    assert sorted(bins) == [[0, 1], [2, 6], [3, 4], [5]]  # 7+3 | 9+1 | 2+8 | 20: the optimum, 4 bins


def test_karmarkar_karp_balances_better_than_a_round_robin():
    rng = random.Random(3)
    lengths = [rng.randrange(1, 400) for _ in range(40)]
    parts = karmarkar_karp(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(40))
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(lengths) // 4, sums
    assert karmarkar_karp([5], 3) == [[0], [], []]


@pytest.mark.parametrize("k", [3, 4, 6, 9])
def test_micro_batches_gives_exactly_k_under_the_budget(k):
    lengths = [10, 10, 10, 4, 4, 3, 2, 1]
    bins = micro_batches(lengths, 16, k)
    assert len(bins) == k
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 16 for b in bins)
    assert sum(1 for b in bins if not b) == max(0, k - len(lengths))


def test_lr_schedule_warms_up_then_decays():
    f = [lr_factor(s, warmup_steps=2, total_steps=6, schedule="linear") for s in range(6)]
    assert f == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    c = [lr_factor(s, warmup_steps=0, total_steps=4, schedule="cosine") for s in range(4)]
    assert c == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466])
    assert lr_factor(99, warmup_steps=0, total_steps=4, schedule="constant") == 1.0


# ---------------------------------------------------------------------- packing numerics
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_row_with_block_mask_equals_each_sequence_alone(models, arch, attention):
    lm = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32, attn_implementation=attention)
    batch = make_batch()
    ids = torch.tensor(batch["input_ids"])[None]
    pos = torch.tensor(batch["position_ids"])[None]
    additive = None if attention == "sdpa" else torch.float32
    mask = packed_attention_mask(batch["seq_lens"], additive_dtype=additive)
    with torch.no_grad():
        packed = lm(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits[0]
        alone = torch.cat([lm(ids[:, a:b]).logits[0] for a, b in zip(batch["cu_seqlens"][:-1],
                                                                       batch["cu_seqlens"][1:])])
        unmasked = lm(input_ids=ids, use_cache=False).logits[0]
    assert worst(packed, alone) < 1e-5
    # Without the mask the later sequences see the earlier ones: the test can tell.
    assert worst(unmasked, alone) > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_logprobs_equals_a_plain_hf_forward(models, arch, temperature):
    e = engine(config(models[arch], mb_max_tokens=16), logits_chunk_tokens=5)
    batch = make_batch()
    out = e.forward_logprobs(batch, temperature=temperature)
    lm = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32)
    assert len(out["logprobs"]) == len(out["entropy"]) == len(batch["input_ids"])
    assert worst(out["logprobs"], hf_logprobs(lm, batch, temperature)) < 1e-5
    starts = batch["cu_seqlens"][:-1]
    assert all(out["logprobs"][s] == 0.0 and out["entropy"][s] == 0.0 for s in starts)
    assert all(0 < h <= torch.log(torch.tensor(float(VOCAB))).item() + 1e-4
               for i, h in enumerate(out["entropy"]) if i not in starts)
    e.close()


def test_sliding_window_layers_get_their_own_packed_mask(models, tmp_path):
    from transformers import Qwen2Config

    base = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.float32)
    settings = {k: v for k, v in base.config.to_dict().items() if k != "layer_types"}
    settings.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    config_ = Qwen2Config(**settings)
    assert config_.layer_types == ["full_attention", "sliding_attention"]
    windowed = type(base)(config_)
    windowed.load_state_dict(base.state_dict())
    windowed.save_pretrained(tmp_path / "windowed")
    batch = make_batch()
    e = engine(config(tmp_path / "windowed"))
    out = e.forward_logprobs(batch)["logprobs"]
    reference = hf_logprobs(windowed.eval(), batch)
    assert worst(out, reference) < 1e-5
    assert worst(reference, hf_logprobs(base, batch)) > 1e-3  # the window matters for these lengths
    e.close()


def test_loss_fn_sees_each_micro_batch_as_tensors(models):
    e = engine(config(models["llama"], mb_max_tokens=16))
    batch = make_batch()
    seen = []

    def record(logprobs, entropy, mb):
        seen.append({k: v for k, v in mb.items()})
        assert logprobs.dtype == entropy.dtype == torch.float32 and logprobs.requires_grad
        assert logprobs.shape == mb["input_ids"].shape == mb["advantages"].shape
        return nll(logprobs, entropy, mb)

    stats = e.train_batch(batch, record)
    assert stats["n_micro_batches"] == len(seen) > 1
    assert all(int(mb["seq_lens"].sum()) <= 16 for mb in seen)
    mb = seen[0]
    assert mb["loss_mask"].dtype == torch.bool and mb["advantages"].dtype == torch.float32
    assert mb["input_ids"].dtype == torch.long and mb["cu_seqlens"].tolist()[0] == 0
    # Per-sequence keys follow their sequences; per-token keys their tokens.
    tokens = torch.cat([m["token_index"] for m in seen])
    assert sorted(tokens.tolist()) == list(range(len(batch["input_ids"])))
    for m in seen:
        firsts = m["token_index"][m["cu_seqlens"][:-1]].tolist()
        seqs = [batch["cu_seqlens"].index(f) for f in firsts]
        assert m["rewards"].tolist() == [batch["rewards"][s] for s in seqs]
        assert m["input_ids"].tolist() == [batch["input_ids"][t] for t in m["token_index"].tolist()]
    e.close()


# ---------------------------------------------------------------------- training
def sgd_like(path, **kw) -> RunConfig:
    """lr 1, eps 1: AdamW's first step moves each weight by about its gradient, so weights compare gradients."""
    return config(path, lr=1.0, eps=1.0, grad_clip=0.0, **kw)


def test_gradient_does_not_depend_on_the_micro_batch_split(models):
    batch = make_batch()
    results = {}
    for name, kw in {"one": dict(mb_max_tokens=8192), "many": dict(mb_max_tokens=12),
                     "checkpointed": dict(mb_max_tokens=12, gradient_checkpointing=True)}.items():
        e = engine(sgd_like(models["llama"], **kw))
        before = weights(e)
        stats = e.train_batch(batch, nll)
        results[name] = (stats, weights(e))
        e.close()
    assert results["one"][0]["n_micro_batches"] == 1 and results["many"][0]["n_micro_batches"] >= 3
    moved = max(worst(before[k], results["one"][1][k]) for k in before)
    assert moved > 1e-3, "the step barely moved the weights: the comparison below would prove nothing"
    for other in ("many", "checkpointed"):
        assert results[other][0]["loss"] == pytest.approx(results["one"][0]["loss"], rel=1e-6)
        assert results[other][0]["grad_norm"] == pytest.approx(results["one"][0]["grad_norm"], rel=1e-5)
        assert max(worst(results["one"][1][k], results[other][1][k]) for k in before) < 1e-5, other


def test_training_statistics_and_schedule(models):
    cfg = config(models["llama"], lr=1e-2)
    cfg.actor.optimizer.warmup_steps = 2
    e = engine(cfg)
    batch = make_batch()
    lp = e.forward_logprobs(batch)["logprobs"]
    mask = batch["loss_mask"]
    expected_loss = -sum(v for v, m in zip(lp, mask) if m) / sum(mask)
    first = e.train_batch(batch, nll)
    second = e.train_batch(batch, nll)
    assert first["loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert (first["lr"], second["lr"]) == pytest.approx((0.5e-2, 1e-2))
    assert first["n_tokens"] == len(batch["input_ids"]) and first["n_loss_tokens"] == sum(mask)
    assert first["grad_norm"] > 0 and first["update_skipped"] == 0 and "entropy" in first
    assert second["loss"] < first["loss"] and e.version == 2
    e.close()


def test_save_train_load_restores_weights_version_and_optimizer(models, tmp_path):
    e = engine(config(models["llama"], mb_max_tokens=16))
    seen = worker.scenario(e, make_batch(), str(tmp_path))
    assert seen["loaded_version"] == 1
    assert worst(seen["lp_loaded"], seen["lp1"]) == 0.0
    assert worst(seen["lp2"], seen["lp1"]) > 1e-3  # the step after the save changed something
    assert worst(seen["lp2_after_load"], seen["lp2"]) < 1e-6  # same step again: optimizer state restored
    # The checkpoint's model is a HF folder: the master weights, loadable by transformers.
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    assert worst(hf_logprobs(lm, make_batch()), seen["lp1"]) < 1e-5
    e.close()


def test_export_loads_in_transformers_and_by_name_into_a_live_model(models, tmp_path):
    e = engine(config(models["llama"]))
    e.train_batch(make_batch(), nll)
    e.export_to_disk(str(tmp_path / "v1"))
    e.export_to_disk(str(tmp_path / "v1"))  # replacing a version folder is atomic too
    files = sorted(p.name for p in (tmp_path / "v1").iterdir())
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging folders left behind"
    # What save_pretrained writes: the tied lm_head is left out.
    assert sorted(load_file(tmp_path / "v1" / "model.safetensors")) == \
        sorted(load_file(Path(models["llama"]) / "model.safetensors"))
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32)
    assert worst(hf_logprobs(lm, make_batch()), e.forward_logprobs(make_batch())["logprobs"]) < 1e-5
    # As an inference engine takes a new version from disk (the embedded one does this): every file's tensors
    # copied by name into the running model, every weight given but the tied lm_head, nothing unknown.
    untrained = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
    missing, unexpected = untrained.load_state_dict(load_file(tmp_path / "v1" / "model.safetensors"), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    assert max(worst(v, lm.state_dict()[k]) for k, v in untrained.state_dict().items()) == 0.0
    e.close()


def test_a_large_model_is_written_in_shards_with_an_index(models, tmp_path):
    from areal_fsdp.hf_folder import write_hf_folder

    lm = AutoModelForCausalLM.from_pretrained(models["untied"], dtype=torch.float32)
    state = {k: v for k, v in lm.state_dict().items()}
    write_hf_folder(tmp_path / "sharded", lm, state, torch.float32, source=models["untied"], max_shard_bytes=100_000)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    assert max(worst(v, again.state_dict()[k]) for k, v in state.items()) == 0.0


def test_export_of_untied_and_bfloat16_models(models, tmp_path):
    e = engine(config(models["untied"]))
    e.export_to_disk(str(tmp_path / "untied"))
    assert "lm_head.weight" in load_file(tmp_path / "untied" / "model.safetensors")
    e.close()
    e = engine(config(models["llama"], dtype="bfloat16"))
    assert next(e.lm.parameters()).dtype == torch.float32  # master weights
    stats = e.train_batch(make_batch(), nll)
    assert stats["update_skipped"] == 0
    e.export_to_disk(str(tmp_path / "bf16"))
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert next(lm.parameters()).dtype == torch.bfloat16
    e.close()


def test_reference_role_is_frozen_and_refuses_to_train(models):
    ref = engine(config(models["llama"], dtype="bfloat16"), role="reference")
    assert ref.optimizer is None
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in ref.lm.parameters())
    out = ref.forward_logprobs(make_batch())
    lm = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
    assert worst(out["logprobs"], hf_logprobs(lm, make_batch())) < 0.1  # bf16 weights and compute
    with pytest.raises(RuntimeError, match="role 'reference'.*no optimizer"):
        ref.train_batch(make_batch(), nll)
    assert ref.version == 0
    ref.close()


def test_a_missing_model_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path .*nowhere.* is not a folder"):
        engine(config(tmp_path / "nowhere"))


def test_context_parallel_needs_the_sdpa_attention_option(models):
    from areal_core.config.allocation import parse_allocation

    (placement,) = parse_allocation("fsdp:c2@cpu").components
    e = FSDPEngine.create(Context(config=config(models["llama"]), placement=placement,
                                  options=FSDPEngineConfig(attn_implementation="eager")))
    with pytest.raises(ValueError, match="attn_implementation='eager' cannot run context parallel \\(c2\\).*"
                                         "attn_implementation=sdpa or use d2"):
        e.initialize()


# ---------------------------------------------------------------------- two ranks over gloo
def run_ranks(spec: dict, folder: Path, world: int = 2, timeout: float = 240) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(folder)}
    (folder / "spec.json").write_text(json.dumps(spec))
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        log = open(folder / f"rank{rank}.log", "w")
        logs.append(log)
        # The ranks meet over gloo (dist_worker.py): keep them on the CPU on a machine with a GPU too.
        env = {**os.environ, **rendezvous_env(rank, world, port), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(folder / "spec.json")], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        codes = [p.wait() for p in procs]
    for log in logs:
        log.close()
    if any(codes):
        tails = "\n".join(f"--- rank {r} (exit {c}):\n" + "\n".join(
            (folder / f"rank{r}.log").read_text().splitlines()[-25:]) for r, c in enumerate(codes))
        pytest.fail(f"{world} ranks exited with {codes}:\n{tails}")
    return torch.load(folder / "result.pt")


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
def fresh_from_tensors(folder, buckets) -> torch.nn.Module:
    """A HF model built from ``folder``'s config with random weights, then given the exported tensors."""
    from transformers import AutoConfig

    torch.manual_seed(123)
    lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    state = {name: t for bucket in buckets for name, t in bucket}
    result = lm.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}, result.missing_keys  # tied: the embedding's
    lm.tie_weights()
    return lm.eval()


def bucket_bytes_of(bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def test_exported_tensors_give_a_fresh_hf_model_the_engines_logits(models, tmp_path):
    e = engine(config(models["llama"]))
    e.train_batch(make_batch(), nll)
    limit = 40_000
    buckets = list(e.export_tensors(limit))
    assert len(buckets) > 2
    assert all(bucket_bytes_of(b) <= limit or len(b) == 1 for b in buckets)
    assert any(len(b) > 1 for b in buckets)  # small tensors share a bucket
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(load_file(Path(models["llama"]) / "model.safetensors"))
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for b in buckets for _, t in b)
    e.export_to_disk(str(tmp_path / "v1"))
    from_disk = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32).eval()
    from_tensors = fresh_from_tensors(tmp_path / "v1", buckets)
    ids = torch.tensor(make_batch()["input_ids"][:20])[None]
    with torch.no_grad():
        assert torch.equal(from_tensors(ids).logits, from_disk(ids).logits)
    assert worst(hf_logprobs(from_tensors, make_batch()), e.forward_logprobs(make_batch())["logprobs"]) < 1e-5
    e.close()


def test_the_next_bucket_is_gathered_before_the_current_one_is_handed_out(models):
    e = engine(config(models["llama"]))
    issued = []
    gather = e._gather
    e._gather = lambda state, items: issued.append([name for name, _, _ in items]) or gather(state, items)
    stream = e.export_tensors(40_000)
    first = next(stream)
    assert len(issued) == 2 and [n for n, _ in first] == issued[0]  # bucket 2 in flight while 1 is used
    rest = list(stream)
    assert len(issued) == 1 + len(rest) and [n for n, _ in rest[-1]] == issued[-1]
    e.close()


def test_export_tensors_in_bfloat16_and_bad_bucket_sizes(models):
    e = engine(config(models["untied"], dtype="bfloat16"))
    buckets = list(e.export_tensors(1 << 30))
    assert len(buckets) == 1 and "lm_head.weight" in dict(buckets[0])  # untied: the head is its own weight
    assert {t.dtype for _, t in buckets[0]} == {torch.bfloat16}
    for bad in (0, -5, 1.5, "1MB"):
        with pytest.raises(ValueError, match=f"bucket_bytes must be a positive int, got {bad!r}"):
            e.export_tensors(bad)
    e.close()


def test_an_export_read_on_another_thread_holds_the_optimizer_step_until_it_is_read(models, monkeypatch):
    import threading

    import areal_fsdp.engine as fsdp_engine

    monkeypatch.setattr(fsdp_engine, "EXPORT_WAIT_S", 20.0)  # a broken lock fails here, not in 10 minutes
    e = engine(config(models["llama"]))
    before = dict(pair for bucket in e.export_tensors(1 << 30) for pair in bucket)
    stream = e.export_tensors(40_000)  # the weights are held from this call on, before anything is read
    stepped = threading.Event()
    trainer = threading.Thread(target=lambda: (e.train_batch(make_batch(), nll), stepped.set()))
    trainer.start()
    assert not stepped.wait(0.5), "the optimizer step ran while an export had not read the weights"
    exported = dict(pair for bucket in stream for pair in bucket)  # read on this thread, to the end
    trainer.join(20)
    assert stepped.is_set() and e.version == 1
    assert exported.keys() == before.keys()
    assert all(torch.equal(exported[n], before[n]) for n in before)  # every bucket: the weights before the step
    after = dict(pair for bucket in e.export_tensors(1 << 30) for pair in bucket)
    assert any(not torch.equal(after[n], before[n]) for n in before)
    # An export closed half way, or dropped unread, lets the next step run.
    half = e.export_tensors(40_000)
    next(half)
    half.close()
    e.train_batch(make_batch(), nll)
    e.export_tensors(40_000)
    e.train_batch(make_batch(), nll)
    assert e.version == 3
    # An export left half read past the wait: the step says what it waited for.
    monkeypatch.setattr(fsdp_engine, "EXPORT_WAIT_S", 0.2)
    held = e.export_tensors(40_000)
    next(held)
    with pytest.raises(TimeoutError, match="waited 0 s before the optimizer step for an export_tensors"):
        e.train_batch(make_batch(), nll)
    with pytest.raises(TimeoutError, match="the previous export's buckets to be read"):
        e.export_tensors(40_000)
    held.close()
    assert e.version == 3
    e.train_batch(make_batch(), nll)
    assert e.version == 4
    e.close()


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


def test_model_parallel_needs_d_x_t_x_c_ranks(models):
    from areal_core.config.allocation import parse_allocation

    for text in ("fsdp:t2@cpu", "fsdp:d2t2@cpu", "fsdp:c2@cpu", "fsdp:d2c2@cpu", "fsdp:c2t2@cpu", "fsdp:d2t2c2"):
        (placement,) = parse_allocation(text).components
        e = FSDPEngine.create(Context(config=config(models["llama"]), placement=placement))
        with pytest.raises(RuntimeError, match=f"asks for d\\d+(t2)?(c2)? but 1 rank.*exactly d x t x c = "
                                               f"{placement.world_size}"):
            e.initialize()


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


# ---------------------------------------------------------------------- the conformance kit
class TestFSDPConformance(TrainEngineConformance):
    component_name = "fsdp"

    @pytest.fixture(autouse=True)
    def _model(self, models):
        self.model_path = models["llama"]

    def make(self, cls):
        return cls.create(Context(config=config(self.model_path, mb_max_tokens=16, lr=1e-2),
                                  options=cls.config_class(), extras={"role": "actor"}))

    def make_batch(self) -> dict:
        return make_batch()


@pytest.mark.parametrize("role,asked", [("actor", "float32"), ("reference", "bfloat16")])
def test_trained_roles_load_the_float32_copy_for_their_master_weights(models, monkeypatch, role, asked):
    # A bf16 copy upcast to float32 puts every master weight on the bf16 grid, where bf16 compute cannot see
    # an update smaller than half a bf16 step; a model converted per dtype (the demo) is asked for in float32.
    seen = []
    real = FSDPEngine._model_path

    def spy(path, dtype):
        seen.append(dtype)
        return real(path, dtype)

    monkeypatch.setattr(FSDPEngine, "_model_path", staticmethod(spy))
    e = engine(config(models["llama"], dtype="bfloat16"), role=role)
    assert seen == [asked]
    assert next(e.lm.parameters()).dtype == (torch.float32 if role == "actor" else torch.bfloat16)
    e.close()
