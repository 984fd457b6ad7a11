"""A whole `areal run` with REAL vLLM servers: the local launcher starts them from the plugin's
recipe (their own interpreter, dev mode, a small KV cache), FSDP trains a tiny model, and each new
version reaches the servers from disk. Slow; skipped without the vLLM environment (.venv-vllm)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from areal_core.testing import requires_plugin, rl_doubles, scaled
from areal_vllm.engine import default_python

# The train side of these runs is the fsdp engine, another plugin: found by its entry point.
pytestmark = [pytest.mark.slow, requires_plugin("areal.engines.train", "fsdp")]

PYTHON = default_python()
if PYTHON == sys.executable or not Path(PYTHON).is_file():
    pytest.skip("no vLLM environment: .venv-vllm/bin/python is missing (and $AREAL_VLLM_PYTHON is unset); "
                "make it with: bash scripts/install_vllm.sh", allow_module_level=True)



def tiny_vllm_model(tmp_path):
    from areal_core.testing import tiny_model

    # vLLM's CPU attention needs a head size of 64 (the default tiny shape has 16)
    return tiny_model(tmp_path / "tiny", seed=0, hidden_size=128, heads=2, kv_heads=1, dtype="bfloat16")


def areal_run(tmp_path, trial: str, model, overrides: list[str]):
    """``areal run`` of the RL doubles' config (fsdp actor, vLLM rollout) with ``overrides``; returns the
    finished process and the run's folder."""
    return rl_doubles.areal_run(tmp_path, trial, [
        "rollout.backend=vllm", "actor.backend=fsdp", "algorithm.name=rl_pg_double", f"model.path={model}",
        "model.dtype=bfloat16", *overrides], timeout_s=900)


def test_areal_run_trains_fsdp_against_real_vllm_servers(tmp_path):
    proc, run_dir = areal_run(tmp_path, "vllm", tiny_vllm_model(tmp_path), [
        "allocation=vllm:d2@cpu+fsdp:cpu", f"rollout.python={PYTHON}", "rollout.kv_cache_gib=1",
        "rollout.max_model_len=256", "rollout.max_head_offpolicyness=1", "trainer.total_steps=3",
        "rollout.dynamic_filtering=true", "rollout.elastic.enabled=true", "rollout.elastic.interval_s=1"])
    assert proc.returncode == 0, proc.stdout[-6000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # the integrity gate digested the servers' weights (areal's worker extension) and found what was sent
    assert any(m.get("time/weight_digest_engines_s", 0) > 0 for m in metrics), metrics
    assert "does not serve the weights" not in proc.stdout and "cannot digest" not in proc.stdout
    for i in (0, 1):
        log = (run_dir / "logs" / f"rollout-{i}.log").read_text()
        assert "vllm.entrypoints.openai.api_server" in log.splitlines()[0]  # the launcher's own recipe
        assert "Reloading" in log  # new weights arrived through /collective_rpc reload_weights


def test_areal_run_attaches_to_a_running_vllm_server(tmp_path):
    """rollout.addresses: the launcher starts no server; the run generates on, and sends its weights to, one
    started beforehand (here by a ServerFleet, as a user would start it elsewhere)."""
    from areal_core.api import ServerProcess
    from areal_core.remote import ServerFleet, http_ready
    from areal_vllm.engine import VLLMEngineConfig, server_argv

    model = tiny_vllm_model(tmp_path)
    options = VLLMEngineConfig(kv_cache_gib=1, max_model_len=256)

    def recipe(index, port):
        argv, env = server_argv(PYTHON, str(model), port, options, dtype="bfloat16")
        return ServerProcess(argv, http_ready(port), f"the vLLM server on 127.0.0.1:{port}", env=env,
                             startup_timeout_s=scaled(600))

    with ServerFleet(tmp_path / "elsewhere") as fleet:
        (server,) = fleet.launch(recipe, 1, prefix="vllm", threads=1)
        proc, run_dir = areal_run(tmp_path, "attached", model, [
            "allocation=vllm:d1@cpu+fsdp:cpu", f"rollout.addresses=['{server.address}']", "trainer.total_steps=2"])
        served = server.log_path.read_text()
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert not (run_dir / "logs" / "rollout-0.log").exists(), "the launcher started a server of its own"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "Reloading" in served  # the run's new weights reached the attached server
