"""A whole `areal run` with REAL vLLM servers: the local launcher starts them from the plugin's
recipe (their own interpreter, dev mode, a small KV cache), FSDP trains a tiny model, and each new
version reaches the servers from disk. Slow; skipped without the vLLM environment (.venv-vllm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing.distributions import install_fake_distribution
from areal_vllm.engine import default_python

pytestmark = pytest.mark.slow

PYTHON = default_python()
if PYTHON == sys.executable or not Path(PYTHON).is_file():
    pytest.skip("no vLLM environment: .venv-vllm/bin/python is missing (and $AREAL_VLLM_PYTHON is unset); "
                "make it with: bash scripts/install_vllm.sh", allow_module_level=True)

DOUBLES = Path(__file__).resolve().parents[4] / "tests" / "doubles"
AREAL = str(Path(sys.executable).with_name("areal"))


def test_areal_run_trains_fsdp_against_real_vllm_servers(tmp_path):
    pytest.importorskip("areal_fsdp")
    from areal_local.models import tiny_model

    sys.path.insert(0, str(DOUBLES))
    import rl_doubles

    # vLLM's CPU attention needs a head size of 64 (the default tiny shape has 16)
    model = tiny_model(tmp_path / "tiny", seed=0, hidden_size=128, heads=2, kv_heads=1, dtype="bfloat16")
    files = {name: (DOUBLES / name).read_text() for name in ("rl_doubles.py", "latency_engine_double.py")}
    with install_fake_distribution(tmp_path / "site", "areal-test-rl-doubles", "0.0.1", rl_doubles.ENTRY_POINTS,
                                   files) as site:
        config = tmp_path / "run.yaml"
        config.write_text(rl_doubles.CONFIG)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(
            [AREAL, "run", str(config), f"output_dir={tmp_path / 'runs'}", "trial=vllm",
             "allocation=vllm:d2@cpu+fsdp:cpu", "rollout.backend=vllm", "actor.backend=fsdp",
             "algorithm.name=rl_pg_double", f"model.path={model}", "model.dtype=bfloat16",
             f"rollout.python={PYTHON}", "rollout.kv_cache_gib=1", "rollout.max_model_len=256",
             "rollout.max_head_offpolicyness=1", "trainer.total_steps=3", "rollout.dynamic_filtering=true",
             "rollout.elastic.enabled=true", "rollout.elastic.interval_s=1"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    run_dir = tmp_path / "runs" / "areal" / "vllm"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for i in (0, 1):
        log = (run_dir / "logs" / f"rollout-{i}.log").read_text()
        assert "vllm.entrypoints.openai.api_server" in log.splitlines()[0]  # the launcher's own recipe
        assert "Reloading" in log  # new weights arrived through /collective_rpc reload_weights
