"""The rules of `areal_vllm_guard` (the middleware a vLLM server runs under), loaded as the server loads it, from
the environment the plugin's recipe gives it; test_vllm_guard.py (slow) drives them on a real vLLM server."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import pytest

from areal_vllm.engine import SERVER_PATH, VLLMEngineConfig, server_argv


def load_guard(monkeypatch, env: dict[str, str]):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location("areal_vllm_guard_under_test", SERVER_PATH / "areal_vllm_guard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def folders(tmp_path):
    run = tmp_path / "runs" / "exp" / "trial"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    return run, tmp_path / "elsewhere"


def test_reloads_come_only_from_the_run_folder(monkeypatch, folders):
    run, elsewhere = folders
    _, env = server_argv("/py", "/m", 8000, VLLMEngineConfig(), load_roots=[str(run)])
    guard = load_guard(monkeypatch, env)

    def rpc(**body):
        return guard.check_rpc("/collective_rpc", body)

    assert rpc(method="reload_weights", kwargs={"weights_path": str(run / "checkpoints" / "step-2")}) is None
    status, detail = rpc(method="reload_weights", kwargs={"weights_path": str(elsewhere)})
    assert status == 403 and str(elsewhere) in detail and str(run) in detail
    assert rpc(method="reload_weights", args=[None, str(elsewhere)])[0] == 403  # positional, as vLLM takes it too
    assert rpc(method="reload_weights", kwargs={}) is None  # the model's own folder, as vLLM started with it
    assert rpc(method="areal_weight_digest", kwargs={"mode": "on"}) is None
    # the trainer's buckets (update_weights_from_tensors writes them in /dev/shm under its prefix)
    bucket = Path(tempfile.mkdtemp(prefix="areal-vllm-weights-", dir="/dev/shm")) / "bucket-0"
    other = Path(tempfile.mkdtemp(prefix="someone-else-", dir="/dev/shm"))
    try:
        bucket.mkdir()
        assert rpc(method="reload_weights", kwargs={"weights_path": str(bucket)}) is None
        assert rpc(method="reload_weights", kwargs={"weights_path": str(other)})[0] == 403
    finally:
        shutil.rmtree(bucket.parent)
        shutil.rmtree(other)


def test_a_server_started_without_load_roots_reloads_from_anywhere(monkeypatch, folders):
    _, elsewhere = folders
    _, env = server_argv("/py", "/m", 8000, VLLMEngineConfig())
    assert env["AREAL_SERVER_LOAD_ROOTS"] == ""
    guard = load_guard(monkeypatch, env)
    assert guard.check_rpc("/collective_rpc", {"method": "reload_weights",
                                               "kwargs": {"weights_path": str(elsewhere)}}) is None
