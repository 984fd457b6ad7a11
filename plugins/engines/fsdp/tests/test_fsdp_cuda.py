"""The fsdp engine on a GPU against the same engine on the CPU: same logprobs, losses and gradient norms.

Skipped where CUDA is not available (this project's CI machine has no GPU). Run on a GPU machine with
``pytest plugins/engines/fsdp/tests/test_fsdp_cuda.py``; its first run on an H100 found three bugs the CPU suite
could not (index tensors left on the CPU in packed attention, the loss function handed CPU tensors, packed
attention's output allocated in float32 under CUDA autocast).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from areal_core.testing import tiny_model  # noqa: E402

# The engine tests' helpers (make_batch, LENGTHS, and dist_worker's make_engine / scenario), loaded as
# test_shared_prefixes.py does.
_spec = importlib.util.spec_from_file_location("areal_fsdp_test_engine_for_cuda",
                                               Path(__file__).with_name("test_fsdp_engine.py"))
engine_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_tests)
worker = engine_tests.worker
BATCH = engine_tests.make_batch(engine_tests.LENGTHS + [4])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-models")
    return {"llama": tiny_model(root / "llama", arch="llama", seed=0),
            "qwen2": tiny_model(root / "qwen2", arch="qwen2", seed=1)}


def worst(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return (a - b).abs().max().item()


def run(model, dtype: str, out: Path, allocation: str | None = None, **options) -> tuple[str, dict]:
    spec = {"model": str(model), "mb_max_tokens": 16, "lr": 1e-2, "dtype": dtype, "options": options}
    if allocation:
        spec["allocation"] = allocation
    engine = worker.make_engine(spec)
    try:
        return str(engine.device), worker.scenario(engine, BATCH, str(out))
    finally:
        engine.close()


@pytest.mark.parametrize("arch,options", [("llama", {}), ("qwen2", {}), ("llama", {"share_prefixes": False}),
                                          ("llama", {"attn_implementation": "eager"})])
def test_float32_on_the_gpu_matches_the_cpu(models, tmp_path, arch, options):
    gpu_device, gpu = run(models[arch], "float32", tmp_path / "gpu", **options)
    cpu_device, cpu = run(models[arch], "float32", tmp_path / "cpu", "fsdp:cpu", **options)
    assert gpu_device.startswith("cuda") and cpu_device == "cpu"
    assert worst(gpu["lp0"]["logprobs"], cpu["lp0"]["logprobs"]) < 1e-4
    assert gpu["stats1"]["loss"] == pytest.approx(cpu["stats1"]["loss"], rel=1e-4)
    assert gpu["stats1"]["grad_norm"] == pytest.approx(cpu["stats1"]["grad_norm"], rel=1e-3)
    assert worst(gpu["lp1"], cpu["lp1"]) < 1e-3 and worst(gpu["lp2"], cpu["lp2"]) < 1e-3
    assert gpu["loaded_version"] == 1 and worst(gpu["lp_loaded"], gpu["lp1"]) == 0.0  # a checkpoint round-trips
    assert worst(gpu["lp2_after_load"], gpu["lp2"]) < 1e-5  # and training resumes where it was


def test_bfloat16_trains_on_the_gpu(models, tmp_path):
    """bf16 autocast over float32 master weights: the packed attention kernel returns bf16 there (on the CPU too,
    but only CUDA's autocast made its float32 output buffer fail)."""
    gpu_device, gpu = run(models["llama"], "bfloat16", tmp_path / "gpu")
    _, cpu = run(models["llama"], "bfloat16", tmp_path / "cpu", "fsdp:cpu")
    assert gpu_device.startswith("cuda")
    assert worst(gpu["lp0"]["logprobs"], cpu["lp0"]["logprobs"]) < 0.05  # bf16 rounding, two kernels
    assert all(torch.isfinite(torch.tensor(gpu[k])).all() for k in ("lp1", "lp2"))
    assert worst(gpu["lp1"], gpu["lp0"]["logprobs"]) > 0  # the step moved the weights


def test_world_size_one_with_the_trainers_backends(models, tmp_path, monkeypatch):
    """The trainer's process group on a GPU machine is 'cpu:gloo,cuda:nccl'."""
    import torch.distributed as dist

    from areal_core.launch import free_port, rendezvous_env

    for key, value in rendezvous_env(0, 1, free_port()).items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(seconds=60))
    try:
        gpu_device, gpu = run(models["llama"], "float32", tmp_path / "gpu")
    finally:
        dist.destroy_process_group()
    _, cpu = run(models["llama"], "float32", tmp_path / "cpu", "fsdp:cpu")
    assert gpu_device.startswith("cuda")
    assert worst(gpu["lp1"], cpu["lp1"]) < 1e-3
