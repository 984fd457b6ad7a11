"""The fsdp train engine on tiny random Llama / Qwen2 models, on CPU, in one process.

Also the helpers the plugin's other test files load from here (``models``, ``make_batch``, ``config``,
``engine``, ``nll``, ``run_ranks``, ...); the multi-rank scenarios are in test_fsdp_ranks.py.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
# Loaded at collection (see plugins/engines/local/tests/test_models.py for why).
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM  # noqa: E402, F401

from areal_core.api import Context  # noqa: E402
from areal_core.config.schema import RunConfig  # noqa: E402
from areal_core.testing import TrainEngineConformance, scaled, tiny_model  # noqa: E402
from areal_core.testing.models import hf_logprobs, max_abs_diff as worst  # noqa: E402
from areal_core.testing.ranks import run_worker_ranks  # noqa: E402
from areal_core.testing.train import (check_two_steps, engine_run_config, masked_nll as nll,  # noqa: E402
                                      random_packed_batch)
from areal_fsdp.engine import FSDPEngine, FSDPEngineConfig  # noqa: E402
from areal_fsdp.logprobs import packed_attention_mask  # noqa: E402

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
    return random_packed_batch(lengths, VOCAB, seed, prompt)


def config(path, **spec) -> RunConfig:
    """:func:`areal_core.testing.train.engine_run_config` of the model folder ``path``."""
    return engine_run_config({"model": str(path), **spec})


def engine(cfg: RunConfig, role: str = "actor", **options) -> FSDPEngine:
    e = FSDPEngine.create(Context(config=cfg, options=FSDPEngineConfig(**options), extras={"role": role}))
    e.initialize()
    return e


def weights(e: FSDPEngine) -> dict:
    return {k: v.detach().clone() for k, v in e.lm.state_dict().items()}


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
    check_two_steps(e, make_batch(), lrs=(0.5e-2, 1e-2))
    assert e.version == 2
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


class _Payload:
    """Unpickled, it runs ``touch <path>``: what a checkpoint from someone else could carry."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_an_optimizer_index_carrying_code_is_refused_and_runs_nothing(models, tmp_path):
    """DCP pickles its index (optimizer/.metadata) and reads it back with pickle.load; the engine reads it with an
    unpickler that builds only DCP's own classes. The real index loads; one with a payload is refused."""
    import pickle

    from areal_fsdp.safe_dcp import UnsafeCheckpointError

    e = engine(config(models["llama"], mb_max_tokens=16))
    e.train_batch(make_batch(), nll)
    e.save(str(tmp_path / "ckpt"))
    e.load(str(tmp_path / "ckpt"))  # the index DCP wrote passes the restricted unpickler
    marker = tmp_path / "pwned"
    index = tmp_path / "ckpt" / "optimizer" / ".metadata"
    real = index.read_bytes()
    index.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"names posix\.system, which a torch\.distributed\.checkpoint "
                                                    r"index never holds; it is not loaded"):
        e.load(str(tmp_path / "ckpt"))
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(_Payload(marker))) == 0 and marker.exists()  # the payload is live
    index.write_bytes(real)
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
    from areal_core.engine_kit.hf_folder import write_hf_folder

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


# ---------------------------------------------------------------------- several ranks over gloo (test_fsdp_ranks.py)
def run_ranks(spec: dict, folder: Path, world: int = 2, timeout: float = 240) -> dict:
    """Run dist_worker.py on ``world`` gloo ranks with ``spec``; rank 0's result."""
    run_worker_ranks(WORKER, spec, folder, world, timeout)
    return torch.load(folder / "result.pt")


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

    monkeypatch.setattr(fsdp_engine, "EXPORT_WAIT_S", scaled(20.0))  # a broken lock fails here, not in 10 minutes
    e = engine(config(models["llama"]))
    before = dict(pair for bucket in e.export_tensors(1 << 30) for pair in bucket)
    stream = e.export_tensors(40_000)  # the weights are held from this call on, before anything is read
    stepped, at_the_step = threading.Event(), threading.Event()
    hold = e._hold_weights

    def noting_hold(what, *args):  # train_batch's: the gradients are computed, the step comes next
        if what == "train_batch":
            at_the_step.set()
        hold(what, *args)

    monkeypatch.setattr(e, "_hold_weights", noting_hold)
    trainer = threading.Thread(target=lambda: (e.train_batch(make_batch(), nll), stepped.set()))
    trainer.start()
    assert at_the_step.wait(scaled(60)), "the trainer never reached its optimizer step"
    assert not stepped.wait(0.5), "the optimizer step ran while an export had not read the weights"
    exported = dict(pair for bucket in stream for pair in bucket)  # read on this thread, to the end
    trainer.join(scaled(20))
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


def test_model_parallel_needs_d_x_t_x_c_ranks(models):
    from areal_core.config.allocation import parse_allocation

    for text in ("fsdp:t2@cpu", "fsdp:d2t2@cpu", "fsdp:c2@cpu", "fsdp:d2c2@cpu", "fsdp:c2t2@cpu", "fsdp:d2t2c2"):
        (placement,) = parse_allocation(text).components
        e = FSDPEngine.create(Context(config=config(models["llama"]), placement=placement))
        with pytest.raises(RuntimeError, match=f"asks for d\\d+(t2)?(c2)? but 1 rank.*exactly d x t x c = "
                                               f"{placement.world_size}"):
            e.initialize()


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
