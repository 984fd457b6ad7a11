"""What the embedded generator refuses to drive, `areal check` refuses too, and `areal run` refuses before it
starts anything: the same verdict three ways (issue 40, point 6). The core's RL doubles stand in for the
trainer; the embedded engine is the real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_core.testing import rl_doubles, tiny_model

# `areal check` and `areal run` subprocesses (~10 s): in CI's slow suite, the default one being near its limit
pytestmark = pytest.mark.slow


def areal(command: str, folder: Path, model: Path):
    return rl_doubles.areal_command(command, folder, ["allocation=local:cpu+rl_train_double:cpu",
                                                      "rollout.backend=local", f"model.path={model}",
                                                      "model.dtype=float32"])


def with_layer_types(folder: Path, layer_types: list[str]) -> Path:
    model = tiny_model(folder, arch="llama", seed=0)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "layer_types": layer_types}))
    return model


def test_check_run_and_the_generator_refuse_a_layer_type_alike(tmp_path):
    from transformers import AutoModelForCausalLM

    from areal_local.generator import Generator

    model = with_layer_types(tmp_path / "hybrid", ["full_attention", "linear_attention"])
    check = areal("check", tmp_path, model)
    assert check.returncode == 1 and "[local.architecture]" in check.stdout, check.stdout
    assert "['linear_attention']" in check.stdout and "Traceback" not in check.stdout
    run = areal("run", tmp_path, model)
    assert run.returncode == 1 and "[local.architecture]" in run.stdout, run.stdout
    assert not (tmp_path / "runs").exists()  # refused before the run folder was made: no server started
    loaded = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"layer types \['linear_attention'\]"):
        Generator(loaded, eos_token_ids=[0])


def test_layer_types_the_generator_drives_pass_the_check(tmp_path):
    model = with_layer_types(tmp_path / "windowed", ["sliding_attention", "full_attention"])
    check = areal("check", tmp_path, model)
    assert check.returncode == 0, check.stdout
    assert "OK. allocation local:cpu+rl_train_double:cpu" in check.stdout
