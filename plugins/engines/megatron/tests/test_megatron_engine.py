"""The megatron train engine on tiny random Llama / Qwen2 models, on CPU: one process, and two over gloo."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util
import json
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM  # noqa: E402, F401

from areal_core.api import Context  # noqa: E402
from areal_core.config.allocation import parse_allocation  # noqa: E402
from areal_core.config.schema import RunConfig  # noqa: E402
from areal_core.testing import TrainEngineConformance, tiny_model  # noqa: E402
from areal_core.testing.models import hf_logprobs, max_abs_diff as worst  # noqa: E402
from areal_core.testing.ranks import run_worker_ranks  # noqa: E402
from areal_core.testing.train import (check_two_steps, engine_run_config, masked_nll as nll,  # noqa: E402
                                      random_packed_batch)
from areal_megatron import convert  # noqa: E402
from areal_megatron.engine import MegatronEngine, MegatronEngineConfig  # noqa: E402

WORKER = Path(__file__).with_name("dist_worker.py")
_spec = importlib.util.spec_from_file_location("areal_megatron_dist_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

LENGTHS = [5, 9, 3, 12, 7, 6]
VOCAB = 512


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron-models")
    return {
        "llama": tiny_model(root / "llama", arch="llama", seed=0),
        "qwen2": tiny_model(root / "qwen2", arch="qwen2", seed=1),
        "untied": tiny_model(root / "untied", arch="llama", seed=2, tie_word_embeddings=False),
        # 4 layers: 2 pipeline stages x 2 virtual stages of one layer each.
        "qwen2-4": tiny_model(root / "qwen2-4", arch="qwen2", seed=3, layers=4, tie_word_embeddings=False),
    }


def make_batch(lengths=LENGTHS, seed: int = 0, prompt: int = 2) -> dict:
    """A packed batch as ``pack_groups`` makes it, plus per-token advantages."""
    return random_packed_batch(lengths, VOCAB, seed, prompt)


def config(path, **spec) -> RunConfig:
    return engine_run_config({"model": str(path), **spec})


def engine(cfg: RunConfig, role: str = "actor", allocation: str = "megatron:cpu") -> MegatronEngine:
    (placement,) = parse_allocation(allocation).components
    e = MegatronEngine.create(Context(config=cfg, options=MegatronEngineConfig(), placement=placement,
                                      extras={"role": role}))
    e.initialize()
    return e


def hf_state(path) -> dict:
    return load_file(Path(path) / "model.safetensors")


# ---------------------------------------------------------------------- conversion
@pytest.mark.parametrize("name", ["llama", "qwen2", "untied"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_megatron_and_back_is_exact(models, name, tp):
    cfg = AutoConfig.from_pretrained(models[name])
    hf = hf_state(models[name])
    shards = [convert.hf_to_megatron(hf, cfg, tp=tp, rank=r) for r in range(tp)]
    back = convert.megatron_to_hf(shards, cfg)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    if name == "qwen2":
        assert "decoder.layers.0.self_attention.linear_qkv.bias" in shards[0]
    # Column shards hold whole query groups: q heads, then k, then v of each group.
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = convert.head_dim(cfg)
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    per_group = cfg.num_attention_heads // cfg.num_key_value_heads
    assert torch.equal(qkv[:per_group * d], q[:per_group * d])
    assert torch.equal(qkv[per_group * d:(per_group + 1) * d], k[:d])
    fc1 = shards[-1]["decoder.layers.1.mlp.linear_fc1.weight"]
    gate = hf["model.layers.1.mlp.gate_proj.weight"].chunk(tp)[-1]
    assert torch.equal(fc1[:gate.shape[0]], gate)


def test_an_odd_vocabulary_is_padded_for_tensor_parallel_and_trimmed_back(models):
    cfg = AutoConfig.from_pretrained(models["untied"])
    hf = hf_state(models["untied"])
    cfg.vocab_size = 509  # drop 3 rows: 509 is odd
    hf = {k: (v[:509] if v.shape[0] == VOCAB else v) for k, v in hf.items()}
    shards = [convert.hf_to_megatron(hf, cfg, tp=2, rank=r) for r in range(2)]
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] == 255
    assert not shards[1]["output_layer.weight"][-1].any() and shards[1]["output_layer.weight"][-2].any()
    back = convert.megatron_to_hf(shards, cfg)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_transformer_engine_names_translate_both_ways():
    canonical = {"decoder.layers.3.input_layernorm.weight": 1, "decoder.layers.3.pre_mlp_layernorm.weight": 2,
                 "decoder.final_layernorm.weight": 3}
    te = {"decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", "decoder.final_layernorm.weight",
          "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"}
    renamed = convert.model_names(canonical, te)
    assert set(renamed) == te
    assert convert.canonical_names(renamed) == canonical


def test_unsupported_models_are_refused_with_the_fix(models):
    cfg = AutoConfig.from_pretrained(models["llama"])
    cfg.architectures = ["MistralForCausalLM"]
    with pytest.raises(NotImplementedError, match="MistralForCausalLM.*actor.backend: fsdp"):
        convert.check_architecture(cfg)
    cfg = AutoConfig.from_pretrained(models["llama"])
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(NotImplementedError, match="'llama3'"):
        convert.rope_base(cfg)


def test_transformer_config_follows_the_hf_config(models):
    cfg = AutoConfig.from_pretrained(models["qwen2"])
    tf = convert.transformer_config(cfg, tp=1)
    assert (tf.num_layers, tf.hidden_size, tf.num_attention_heads, tf.num_query_groups, tf.ffn_hidden_size) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
        cfg.intermediate_size)
    assert tf.normalization == "RMSNorm" and tf.gated_linear_unit and tf.add_qkv_bias and not tf.add_bias_linear
    assert not convert.transformer_config(AutoConfig.from_pretrained(models["llama"])).add_qkv_bias
    assert convert.rope_base(cfg) == 10000.0


# ---------------------------------------------------------------------- the engine, one process
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_logprobs_equals_a_plain_hf_forward(models, arch, temperature):
    e = engine(config(models[arch], mb_max_tokens=16))
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


def test_loss_fn_sees_each_micro_batch_as_tensors(models):
    e = engine(config(models["llama"], mb_max_tokens=16))
    batch = make_batch()
    seen = []

    def record(logprobs, entropy, mb):
        seen.append(dict(mb))
        assert logprobs.dtype == entropy.dtype == torch.float32 and logprobs.requires_grad
        assert logprobs.shape == mb["input_ids"].shape == mb["advantages"].shape
        return nll(logprobs, entropy, mb)

    stats = e.train_batch(batch, record)
    assert stats["n_micro_batches"] == len(seen) > 1
    assert all(int(mb["seq_lens"].sum()) <= 16 for mb in seen)
    tokens = torch.cat([m["token_index"] for m in seen])
    assert sorted(tokens.tolist()) == list(range(len(batch["input_ids"])))
    for m in seen:
        assert m["loss_mask"].dtype == torch.bool and m["input_ids"].dtype == torch.long
        firsts = m["token_index"][m["cu_seqlens"][:-1]].tolist()
        seqs = [batch["cu_seqlens"].index(f) for f in firsts]
        assert m["rewards"].tolist() == [batch["rewards"][s] for s in seqs]
    e.close()


def sgd_like(path, **kw) -> RunConfig:
    """lr 1, eps 1: AdamW's first step moves each weight by about its gradient, so weights compare gradients."""
    return config(path, lr=1.0, eps=1.0, grad_clip=0.0, **kw)


def test_gradient_does_not_depend_on_the_micro_batch_split(models, tmp_path):
    batch = make_batch()
    results = {}
    for name, budget in {"one": 8192, "many": 12}.items():
        e = engine(sgd_like(models["llama"], mb_max_tokens=budget))
        stats = e.train_batch(batch, nll)
        e.export_to_disk(str(tmp_path / name))
        results[name] = (stats, load_file(tmp_path / name / "model.safetensors"))
        e.close()
    assert results["one"][0]["n_micro_batches"] == 1 and results["many"][0]["n_micro_batches"] >= 3
    initial = hf_state(models["llama"])
    assert max(worst(initial[k], results["one"][1][k]) for k in initial) > 1e-3
    assert results["many"][0]["loss"] == pytest.approx(results["one"][0]["loss"], rel=1e-6)
    assert results["many"][0]["grad_norm"] == pytest.approx(results["one"][0]["grad_norm"], rel=1e-5)
    assert max(worst(results["one"][1][k], results["many"][1][k]) for k in initial) < 1e-5


def test_training_statistics_schedule_and_clipping(models):
    cfg = config(models["llama"], lr=1e-2, grad_clip=0.5)
    cfg.actor.optimizer.warmup_steps = 2
    e = engine(cfg)
    check_two_steps(e, make_batch(), lrs=(0.5e-2, 1e-2), min_grad_norm=0.5)
    assert e.version == 2
    e.close()


def test_an_update_of_minibatches_and_epochs_is_one_version_and_equals_its_steps_one_at_a_time(models, tmp_path):
    """actor.ppo_minibatches = 2, ppo_epochs = 2: four optimizer steps in the planned order, one version, one
    schedule step; the same weights as the four steps taken by single-step updates on the sub-batches."""
    from areal_core.train_batches import (MINIBATCH_KEY, UPDATE_STEP_KEY, assign_minibatches, select_sequences,
                                          update_plan)

    batch = make_batch()
    lengths = [b - a for a, b in zip(batch["cu_seqlens"][:-1], batch["cu_seqlens"][1:])]
    batch[MINIBATCH_KEY] = assign_minibatches(lengths, None, 2)  # each sequence a group of its own
    plan = update_plan(batch, epochs=2)
    steps: list[int] = []

    def recording(logprobs, entropy, mb):
        steps.append(int(mb[UPDATE_STEP_KEY]))
        return nll(logprobs, entropy, mb)

    a, b = engine(config(models["llama"])), engine(config(models["llama"]))
    stats = a.train_batch(batch, recording, epochs=2)
    assert stats["n_optimizer_steps"] == 4 and a.version == 1 and sorted(set(steps)) == [0, 1, 2, 3]
    assert stats["n_tokens"] == len(batch["input_ids"]) and stats["grad_norm_max"] >= stats["grad_norm"] > 0
    for seqs in plan:
        b.train_batch(select_sequences(batch, seqs), nll)
    a.export_to_disk(str(tmp_path / "update"))
    b.export_to_disk(str(tmp_path / "steps"))
    wa, wb = load_file(tmp_path / "update" / "model.safetensors"), load_file(tmp_path / "steps" / "model.safetensors")
    assert max(worst(hf_state(models["llama"])[k], wa[k]) for k in wa) > 1e-3  # the steps moved the weights
    assert max(worst(wa[k], wb[k]) for k in wa) < 1e-6
    a.close()
    b.close()


def test_save_train_load_restores_weights_version_and_optimizer(models, tmp_path):
    e = engine(config(models["qwen2"], mb_max_tokens=16))
    seen = worker.scenario(e, make_batch(), str(tmp_path))
    assert seen["loaded_version"] == 1
    assert worst(seen["lp_loaded"], seen["lp1"]) == 0.0
    assert worst(seen["lp2"], seen["lp1"]) > 1e-3
    assert worst(seen["lp2_after_load"], seen["lp2"]) < 1e-6  # same step again: optimizer state restored
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    assert worst(hf_logprobs(lm, make_batch()), seen["lp1"]) < 1e-5
    # The export after one step holds the same weights in HF names, tied lm_head left out.
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(exported) == sorted(hf_state(models["qwen2"]))
    assert all((tmp_path / folder / name).exists() for folder in ("export", "ckpt")
               for name in ("config.json", "tokenizer.json", "generation_config.json"))
    # The buckets: the same tensors as the last state (after lp2_after_load's step), each bucket within its
    # bytes unless a single tensor is larger.
    buckets = seen["buckets"]
    assert len(buckets) > 1 and sorted(n for b in buckets for n in b) == sorted(exported)
    assert all(len(b) == 1 or sum(t.numel() * t.element_size() for t in b.values()) <= worker.BUCKET_BYTES
               for b in buckets)
    e.export_to_disk(str(tmp_path / "last"))
    last = load_file(tmp_path / "last" / "model.safetensors")
    assert all(torch.equal(t, last[n]) for b in buckets for n, t in b.items())
    e.close()


def test_export_of_untied_and_bfloat16_models(models, tmp_path):
    e = engine(config(models["untied"]))
    e.export_to_disk(str(tmp_path / "untied"))
    assert "lm_head.weight" in load_file(tmp_path / "untied" / "model.safetensors")
    e.close()
    with pytest.raises(NotImplementedError, match="model.dtype bfloat16 .*set model.dtype: float32 on CPU"):
        engine(config(models["llama"], dtype="bfloat16"))
    # A bfloat16 reference engine (no master copy) exports bfloat16.
    e = engine(config(models["llama"], dtype="bfloat16"), role="reference")
    e.export_to_disk(str(tmp_path / "bf16"))
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    e.close()


def test_reference_role_is_frozen_and_refuses_to_train(models):
    ref = engine(config(models["llama"], dtype="bfloat16"), role="reference")
    assert ref.optimizer is None
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for c in ref.chunks for p in c.parameters())
    lm = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
    assert worst(ref.forward_logprobs(make_batch())["logprobs"], hf_logprobs(lm, make_batch())) < 0.1
    with pytest.raises(RuntimeError, match="role 'reference'.*no optimizer"):
        ref.train_batch(make_batch(), nll)
    ref.close()


def test_resuming_at_another_tensor_parallel_size_is_refused_with_the_fix(models, tmp_path):
    e = engine(config(models["llama"]))
    e.save(str(tmp_path / "ckpt"))
    state = json.loads((tmp_path / "ckpt" / "engine_state.json").read_text())
    assert state["tp"] == 1 and state["optimizer"] and (tmp_path / "ckpt" / "optimizer" / "tp0.pt").exists()
    assert (state["pp"], state["vpp"]) == (1, 1)
    for key, value, said in (("tp", 2, "t2 p1 virtual pipeline 1"), ("pp", 2, "t1 p2 virtual pipeline 1")):
        (tmp_path / "ckpt" / "engine_state.json").write_text(json.dumps({**state, key: value}))
        with pytest.raises(ValueError, match=f"saved at {said}, this engine runs t1 p1 .*with_optimizer=False"):
            e.load(str(tmp_path / "ckpt"))
    e.load(str(tmp_path / "ckpt"), with_optimizer=False)  # the weights alone still load
    e.save(str(tmp_path / "weights_only"), with_optimizer=False)
    with pytest.raises(FileNotFoundError, match="holds no optimizer state"):
        e.load(str(tmp_path / "weights_only"))
    e.close()


def test_unbuilt_parallelism_and_missing_folders_are_refused(models, tmp_path):
    cfg = config(models["llama"])
    cfg.actor.gradient_checkpointing = True
    with pytest.raises(NotImplementedError, match="gradient_checkpointing: false on CPU"):
        engine(cfg)
    with pytest.raises(NotImplementedError, match="asks for c2, .*Transformer Engine's attention, which needs a "
                                                  "GPU.*Place the actor with d, t and p only"):
        engine(config(models["llama"]), allocation="megatron:p2c2@cpu")
    with pytest.raises(NotImplementedError, match="asks for e2, .*mixture-of-experts"):
        engine(config(models["llama"]), allocation="megatron:e2@cpu")
    e = MegatronEngine.create(Context(config=config(models["llama"]), options=MegatronEngineConfig(
        virtual_pipeline_size=2), placement=parse_allocation("megatron:cpu").components[0], extras={"role": "actor"}))
    with pytest.raises(ValueError, match="actor.virtual_pipeline_size=2 .*no pipeline parallel \\(p1\\)"):
        e.initialize()
    e = MegatronEngine.create(Context(config=config(models["llama"]), options=MegatronEngineConfig(
        virtual_pipeline_size=2), placement=parse_allocation("megatron:p2@cpu").components[0],
        extras={"role": "actor"}))
    with pytest.raises(ValueError, match="p2 x actor.virtual_pipeline_size=2 = 4 chunks do not divide the model's "
                                         "2 layers; set actor.virtual_pipeline_size to a divisor of 1"):
        e.initialize()
    with pytest.raises(ValueError, match="pipeline parallel p3 .* does not divide the model's 2 layers"):
        engine(config(models["llama"]), allocation="megatron:p3@cpu")
    with pytest.raises(FileNotFoundError, match="holds no \\*.safetensors"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text((Path(models["llama"]) / "config.json").read_text())
        engine(config(tmp_path / "empty"))


# ---------------------------------------------------------------------- two ranks over gloo
def run_ranks(spec: dict, folder: Path, world: int = 2, timeout: float = 300) -> list[dict]:
    """Every rank's :func:`dist_worker.scenario` results, in rank order."""
    run_worker_ranks(WORKER, spec, folder, world, timeout)
    return [torch.load(folder / f"result{rank}.pt", weights_only=False) for rank in range(world)]


def assert_ranks_train_like_one(ranks: list[dict], one: dict, folder: Path, one_folder: Path, tol: float = 1e-5):
    """What every rank saw equals what one process saw: logprobs, losses and gradient norms of two steps,
    exported weights (disk and buckets), and the logprobs after save, a further step and load."""
    for rank, two in enumerate(ranks):
        where = f"{folder.name}, rank {rank}"
        for key in ("logprobs", "entropy"):
            assert worst(two["lp0"][key], one["lp0"][key]) < tol, (where, key)
        for step in ("stats1", "stats2"):
            assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-6), (where, step)
            assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-5), (where, step)
            assert two[step]["entropy"] == pytest.approx(one[step]["entropy"], rel=1e-5), (where, step)
        for key in ("lp1", "lp2"):
            assert worst(two[key], one[key]) < tol, (where, key)
        assert two["loaded_version"] == 1 and worst(two["lp_loaded"], two["lp1"]) == 0.0, where
        assert worst(two["lp2_after_load"], two["lp2"]) < 1e-6, where
        mine = {n: t for b in two["buckets"] for n, t in b.items()}
        theirs = {n: t for b in one["buckets"] for n, t in b.items()}
        assert sorted(mine) == sorted(theirs) and max(worst(mine[n], theirs[n]) for n in mine) < 1e-4, where
    exported = load_file(folder / "export" / "model.safetensors")
    export1 = load_file(one_folder / "export" / "model.safetensors")
    assert sorted(exported) == sorted(export1)
    assert max(worst(exported[k], export1[k]) for k in export1) < tol, folder.name


def one_process(models, name: str, spec: dict, batch: dict, folder: Path) -> dict:
    """The scenario in this process at t1 p1, checked against HF; the step must move the weights."""
    one = worker.scenario(worker.make_engine(spec), batch, str(folder))
    lm = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32)
    assert worst(one["lp0"]["logprobs"], hf_logprobs(lm, batch)) < 1e-5
    initial = hf_state(models[name])
    export1 = load_file(folder / "export" / "model.safetensors")
    assert max(worst(export1[k], initial[k]) for k in initial) > 1e-3
    return one


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_and_data_parallel_ranks_train_like_one(models, tmp_path, arch):
    """t2 and d2 against one process: HF's logprobs, the same loss, the same updated weights, save / load."""
    batch = make_batch(LENGTHS + [4])
    spec = {"model": str(models[arch]), "batch": batch, "mb_max_tokens": 16, "lr": 1.0, "eps": 1.0,
            "grad_clip": 0.0}
    one = one_process(models, arch, spec, batch, tmp_path / "world1")
    for allocation in ("megatron:t2@cpu", "megatron:d2@cpu"):
        name = allocation.split(":")[1].split("@")[0]
        ranks = run_ranks({**spec, "allocation": allocation}, tmp_path / name)
        assert_ranks_train_like_one(ranks, one, tmp_path / name, tmp_path / "world1")


@pytest.mark.parametrize(("name", "vpp", "tol", "allocation"), [
    ("llama", 1, 1e-5, "megatron:p2@cpu"),  # tied embeddings: the last stage's copy of the embedding is the output layer
    # untied, Qwen2's biases, 2 stages x 2 virtual stages; rows padded to one length (last digits differ)
    ("qwen2-4", 2, 5e-5, "megatron:p2@cpu"),
    # four ranks: stages beside data-parallel or tensor-parallel ranks
    pytest.param("llama", 1, 1e-5, "megatron:d2p2@cpu", marks=pytest.mark.slow),
    pytest.param("qwen2-4", 2, 5e-5, "megatron:p2t2@cpu", marks=pytest.mark.slow),
], ids=["p2-tied", "p2-vpp2", "d2p2-tied", "p2t2-vpp2"])
def test_pipeline_stages_train_like_one(models, tmp_path, name, vpp, tol, allocation):
    """p2 against one process: each stage builds and loads its layers, Megatron's schedule runs the
    micro-batches through both, and every rank (the first stage too) returns the same logprobs and
    statistics as one process; export and save gather both stages' layers under their HF names."""
    batch = make_batch(LENGTHS + [4])
    spec = {"model": str(models[name]), "batch": batch, "mb_max_tokens": 16, "lr": 1.0, "eps": 1.0,
            "grad_clip": 0.0}
    one = one_process(models, name, spec, batch, tmp_path / "world1")
    assert one["stats1"]["n_micro_batches"] >= 3  # a pipeline with micro-batches in flight
    (placement,) = parse_allocation(allocation).components
    par = placement.parallel
    out = tmp_path / allocation.split(":")[1].split("@")[0]
    ranks = run_ranks({**spec, "allocation": allocation, "vpp": vpp, "reference": True}, out, world=par.world_size)
    assert_ranks_train_like_one(ranks, one, out, tmp_path / "world1", tol)
    # A reference engine (the initial weights, frozen) beside the actor on the same stages.
    assert all(worst(r["reference_lp"], one["lp0"]["logprobs"]) < tol for r in ranks)
    saved = json.loads((out / "ckpt" / "engine_state.json").read_text())
    assert (saved["pp"], saved["vpp"]) == (2, vpp)
    assert sorted(f.name for f in (out / "ckpt" / "optimizer").iterdir()) == sorted(
        f"pp{s}-tp{r}.pt" for s in range(2) for r in range(par.t))
    # The checkpoint is a HF folder with every layer: transformers gives one process's logits after step 1.
    lm = AutoModelForCausalLM.from_pretrained(out / "ckpt", dtype=torch.float32)
    assert worst(hf_logprobs(lm, batch), one["lp1"]) < tol


# ---------------------------------------------------------------------- the conformance kit
class TestMegatronConformance(TrainEngineConformance):
    component_name = "megatron"

    @pytest.fixture(autouse=True)
    def _model(self, models):
        self.model_path = models["llama"]

    def make(self, cls):
        (placement,) = parse_allocation("megatron:cpu").components
        return cls.create(Context(config=config(self.model_path, mb_max_tokens=16, lr=1e-2),
                                  options=cls.config_class(), placement=placement, extras={"role": "actor"}))

    def make_batch(self) -> dict:
        return make_batch()


def test_built_models_mark_their_tensor_parallel_shards(models):
    """Without random init Megatron leaves the shard marks off; the gradient norm depends on them."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    e = engine(config(models["llama"]))
    (chunk,) = e.chunks
    marks = {n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", None))
             for n, p in chunk.named_parameters()}
    assert marks["decoder.layers.0.self_attention.linear_qkv.weight"] == (True, 0)
    assert marks["decoder.layers.0.mlp.linear_fc2.weight"] == (True, 1)
    assert marks["embedding.word_embeddings.weight"] == (True, 0)
    assert marks["decoder.layers.0.input_layernorm.weight"][0] is False
    parallel = [m for m in chunk.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert parallel and convert.mark_tensor_parallel_shards(chunk) == 0  # nothing left unmarked
    e.close()
