"""A tiny model folder (random weights, a real BPE tokenizer with a ChatML template) shared by the tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir():
    from areal_core.testing import tiny_model

    return tiny_model(Path(tempfile.mkdtemp(prefix="areal-multi-turn-")) / "model", seed=0, max_position_embeddings=1024)
