"""Fixtures of the vllm engine's tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def protocol_double():
    """The VLLMProtocolDouble class of vllm_protocol_double.py (beside this file; tests import no test module
    by name under --import-mode=importlib)."""
    spec = importlib.util.spec_from_file_location("vllm_protocol_double",
                                                  Path(__file__).with_name("vllm_protocol_double.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module.VLLMProtocolDouble
