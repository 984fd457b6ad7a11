"""Fixtures of the sglang engine's tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def llama_weights(seed: int) -> dict:
    """A small Llama-shaped state dict in bfloat16: embeddings, 3 decoder layers (two 64x64 tensors each, so
    about 16 KiB a layer), final norm."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(32, 64, generator=g).bfloat16()}
    for i in range(3):
        for part in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
            tensors[f"model.layers.{i}.{part}.weight"] = torch.randn(64, 64, generator=g).bfloat16()
    tensors["model.norm.weight"] = torch.randn(64, generator=g).bfloat16()
    return tensors


# A tiny model of the Llama family in SGLang's terms: 4 heads of 16, 2 kv heads, a vocabulary (100) that is no
# multiple of 64 (padded), untied embeddings, bfloat16
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
              "num_hidden_layers": 2, "vocab_size": 100, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "rms_norm_eps": 1e-6}


def tiny_model(folder: Path, seed: int, **config) -> Path:
    """Write ``config.json`` (:data:`TINY_LLAMA` with ``config``) and the model's HF-named weights (random,
    ``seed``) as ``model.safetensors`` into ``folder``; Qwen2 gets q/k/v biases, Qwen3 q/k norms."""
    import json

    import torch
    from safetensors.torch import save_file

    c = {**TINY_LLAMA, **config}
    g = torch.Generator().manual_seed(seed)
    hidden, head_dim, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    dtype = getattr(torch, c["torch_dtype"])

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(c["vocab_size"], hidden), "model.norm.weight": rand(hidden)}
    if not c["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(c["vocab_size"], hidden)
    arch = c["architectures"][0]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for part, heads in (("q", c["num_attention_heads"]), ("k", c["num_key_value_heads"]),
                            ("v", c["num_key_value_heads"])):
            tensors[f"{p}self_attn.{part}_proj.weight"] = rand(heads * head_dim, hidden)
            if arch == "Qwen2ForCausalLM":
                tensors[f"{p}self_attn.{part}_proj.bias"] = rand(heads * head_dim)
        if arch == "Qwen3ForCausalLM":
            tensors[f"{p}self_attn.q_norm.weight"] = rand(head_dim)
            tensors[f"{p}self_attn.k_norm.weight"] = rand(head_dim)
        tensors[f"{p}self_attn.o_proj.weight"] = rand(hidden, c["num_attention_heads"] * head_dim)
        tensors[f"{p}mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[f"{p}mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[f"{p}mlp.down_proj.weight"] = rand(hidden, inter)
        tensors[f"{p}input_layernorm.weight"] = rand(hidden)
        tensors[f"{p}post_attention_layernorm.weight"] = rand(hidden)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(c))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="session")
def make_weights():
    """``make_weights(seed)``: :func:`llama_weights`, the same tensors for the same seed."""
    return llama_weights


@pytest.fixture(scope="session")
def weights_digest():
    """How the SGLang protocol double names the weights it holds (its ``digest``), to compare with what
    ``/get_server_info`` reports; loaded from the file beside this one (tests import no test module by name
    under --import-mode=importlib)."""
    spec = importlib.util.spec_from_file_location("sglang_server_double",
                                                  Path(__file__).with_name("sglang_server_double.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.digest


@pytest.fixture(scope="session")
def make_model():
    """``make_model(folder, seed, **config)``: :func:`tiny_model`."""
    return tiny_model


@pytest.fixture(scope="session")
def gpu_hash_vectors():
    """The module ``gpu_hash_vectors.py`` beside this one (SGLang's GPU hash, known answers)."""
    spec = importlib.util.spec_from_file_location("gpu_hash_vectors", Path(__file__).with_name("gpu_hash_vectors.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
