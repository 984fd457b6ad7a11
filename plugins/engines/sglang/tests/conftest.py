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
