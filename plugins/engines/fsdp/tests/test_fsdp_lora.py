"""LoRA through PEFT in the fsdp engine: adapters only trained, merged and adapter exports, save / load."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from areal_core.api import Context  # noqa: E402
from areal_fsdp.engine import FSDPEngine, FSDPEngineConfig  # noqa: E402
from areal_core.testing import tiny_model  # noqa: E402

_spec = importlib.util.spec_from_file_location("areal_fsdp_engine_tests",
                                               Path(__file__).with_name("test_fsdp_engine.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
make_batch, config, nll, worst, hf_logprobs = base.make_batch, base.config, base.nll, base.worst, base.hf_logprobs

LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("lora-model") / "llama", arch="llama", seed=0)


def lora_engine(path, **options) -> FSDPEngine:
    e = FSDPEngine.create(Context(config=config(path), options=FSDPEngineConfig(**{**LORA, **options}),
                                  extras={"role": "actor"}))
    e.initialize()
    return e


def full(e: FSDPEngine) -> dict:
    return {k: v.detach().clone() for k, v in e.lm.state_dict().items()}


def test_only_the_adapters_train_and_only_they_are_in_the_optimizer(model):
    e = lora_engine(model, lora_target_modules=["q_proj", "v_proj"])
    trainable = {n for n, p in e.lm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    in_optimizer = {id(p) for g in e.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in e.lm.named_parameters() if n in trainable}
    before = full(e)
    stats = e.train_batch(make_batch(), nll)
    assert stats["grad_norm"] > 0 and stats["update_skipped"] == 0
    after = full(e)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trainable
    assert any(".lora_B." in n for n in changed)  # B starts at 0: the merged weights move
    e.close()


def test_merged_exports_equal_peft_merging_the_saved_adapters(model, tmp_path):
    e = lora_engine(model)
    e.train_batch(make_batch(), nll)
    e.train_batch(make_batch(seed=1), nll)
    e.export_to_disk(str(tmp_path / "merged"))
    e.save(str(tmp_path / "ckpt"))
    exported = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(exported) == sorted(load_file(Path(model) / "model.safetensors"))  # plain names, no adapters
    # PEFT's own merge of the adapters the checkpoint holds, onto the untouched base model.
    reference = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                               tmp_path / "ckpt" / "adapter").merge_and_unload().eval()
    assert max(worst(exported[k], reference.state_dict()[k]) for k in exported) < 1e-6
    assert max(worst(exported[k], load_file(Path(model) / "model.safetensors")[k]) for k in exported) > 1e-4
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.tensor(make_batch()["input_ids"][:20])[None]
    with torch.no_grad():
        assert worst(merged(ids).logits, reference(ids).logits) < 1e-5
    assert worst(hf_logprobs(merged, make_batch()), e.forward_logprobs(make_batch())["logprobs"]) < 1e-5
    # export_tensors merges too: the same tensors as the folder.
    tensors = {n: t for bucket in e.export_tensors(50_000) for n, t in bucket}
    assert sorted(tensors) == sorted(exported)
    assert max(worst(tensors[k], exported[k]) for k in exported) == 0.0
    e.close()


def test_adapter_export_loads_in_peft_with_the_engines_logprobs(model, tmp_path):
    e = lora_engine(model, lora_export="adapter", lora_dropout=0.1)
    e.train_batch(make_batch(), nll)
    e.export_to_disk(str(tmp_path / "adapter"))
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    assert all(".lora_" in n and n.startswith("base_model.model.")
               for n in load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    with_adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                                  tmp_path / "adapter").eval()
    assert worst(hf_logprobs(with_adapter, make_batch()), e.forward_logprobs(make_batch())["logprobs"]) < 1e-5
    e.close()


def test_save_load_resumes_adapters_optimizer_and_version(model, tmp_path):
    e = lora_engine(model)
    e.train_batch(make_batch(), nll)
    e.save(str(tmp_path / "ckpt"))
    saved = e.forward_logprobs(make_batch())["logprobs"]
    e.train_batch(make_batch(seed=1), nll)
    continued = e.forward_logprobs(make_batch())["logprobs"]
    # The checkpoint's model files are the frozen base, loadable by transformers; the adapters sit beside them.
    base_files = load_file(tmp_path / "ckpt" / "model.safetensors")
    initial = load_file(Path(model) / "model.safetensors")
    assert max(worst(base_files[k], initial[k]) for k in initial) == 0.0
    fresh = lora_engine(model)
    fresh.load(str(tmp_path / "ckpt"))
    assert fresh.version == 1
    assert worst(fresh.forward_logprobs(make_batch())["logprobs"], saved) == 0.0
    fresh.train_batch(make_batch(seed=1), nll)
    assert worst(fresh.forward_logprobs(make_batch())["logprobs"], continued) < 1e-6  # the optimizer state came back
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors is missing.*actor.lora_rank=0"):
        fresh.load(str(model), with_optimizer=False)
    e.close()
    fresh.close()


def test_targets_that_name_no_module_are_refused_with_the_key(model):
    with pytest.raises(ValueError, match=r"actor.lora_target_modules \['nowhere_proj'\] does not fit"):
        lora_engine(model, lora_target_modules=["nowhere_proj"])


def test_the_reference_role_ignores_lora(model):
    ref = FSDPEngine.create(Context(config=config(model), options=FSDPEngineConfig(**LORA),
                                    extras={"role": "reference"}))
    ref.initialize()
    assert not any(".lora_" in n for n in ref.lm.state_dict())
    ref.close()


def test_two_ranks_train_lora_like_one(model, tmp_path):
    """FSDP2 shards frozen base weights and trained adapters in the same layers: same losses and exports."""
    batch = make_batch(base.LENGTHS + [4])
    spec = {"model": str(model), "batch": batch, "mb_max_tokens": 16, "lr": 1e-2, "grad_clip": 0.0,
            "scenario": "tensors", "bucket_bytes": 50_000, "options": LORA}
    two = base.run_ranks(spec, tmp_path / "world2")
    one = base.worker.tensors_scenario(base.worker.make_engine(spec), batch, str(tmp_path / "world1"), 50_000)
    assert worst(two["lp1"], one["lp1"]) < 1e-5
    state2 = {n: t for b in two["buckets"] for n, t in b}
    state1 = {n: t for b in one["buckets"] for n, t in b}
    assert sorted(state2) == sorted(state1) == sorted(load_file(Path(model) / "model.safetensors"))
    assert max(worst(state2[k], state1[k]) for k in state1) < 1e-6
    initial = load_file(Path(model) / "model.safetensors")
    assert max(worst(state2[k], initial[k]) for k in initial) > 1e-4  # the merged adapters moved the weights
