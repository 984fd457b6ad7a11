"""A run whose model.path is a Hugging Face Hub id, through `areal check` and `areal run` with the embedded
engine: the weights are downloaded once into huggingface_hub's cache (from a stand-in of the hub on 127.0.0.1,
areal_core.testing.hub), the server and the trainer load that snapshot, and the plan rules read the hub model's
config. The core's RL doubles stand in for the trainer's algorithm and engine."""

from __future__ import annotations

import json

import pytest

from areal_core.testing import rl_doubles, tiny_model
from areal_core.testing.hub import serve


@pytest.mark.slow  # a whole run (~15 s): CI's slow suite runs it; tests/test_hub.py covers resolution by default
def test_a_run_on_a_hub_model_downloads_it_once_and_the_server_loads_the_snapshot(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    tiny_model(root / "models" / "tiny-org" / "tiny-llama", seed=0)
    hybrid = tiny_model(root / "models" / "tiny-org" / "hybrid", seed=1)
    config = json.loads((hybrid / "config.json").read_text())
    (hybrid / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention", "linear_attention"]}))
    overrides = ["allocation=local:cpu+rl_train_double:cpu", "rollout.backend=local", "model.dtype=float32",
                 "trainer.total_steps=2", "rollout.batch_size=2"]
    with serve(root) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # some test modules set it for the whole session
        refused = rl_doubles.areal_command("check", tmp_path / "a", [*overrides, "model.path=tiny-org/hybrid"])
        assert refused.returncode == 1 and "[local.architecture]" in refused.stdout, refused.stdout  # its config
        proc, run_dir = rl_doubles.areal_run(tmp_path / "b", "hub", [*overrides, "model.path=tiny-org/tiny-llama"],
                                             timeout_s=300)
    assert proc.returncode == 0, proc.stdout
    gets = [line for line in (root / "requests.log").read_text().splitlines()
            if line.startswith("GET") and "tiny-llama/resolve/" in line and line.endswith("model.safetensors")]
    assert len(gets) == 1, gets  # once, by the launcher; the server and the trainer read the cache
    snapshot = next((tmp_path / "hf-home" / "hub" / "models--tiny-org--tiny-llama" / "snapshots").iterdir())
    assert f"loaded {snapshot}" in (run_dir / "logs" / "rollout-0.log").read_text()
    assert not (root / "requests.log").read_text().count("hybrid/resolve/main/model.safetensors")
