"""A tiny model folder (random weights, a real BPE tokenizer with a ChatML template) shared by the tests."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from areal_core.testing import tiny_model

    return tiny_model(tmp_path_factory.mktemp("areal-rlvr") / "model", seed=0, max_position_embeddings=1024)
