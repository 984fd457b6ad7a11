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

from areal_core.testing import requires_plugin, scaled, tiny_model  # noqa: E402

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

    from areal_core.processes import free_port, rendezvous_env

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


def _export_into_buffers(engine, bucket_bytes: int) -> dict:
    """``export_tensors(into=...)`` into CPU buffers this test owns (in a run: the /dev/shm stage's free file);
    checks every exported tensor is the buffer it was given, not a copy of it."""
    given: dict = {}

    def into(name, shape, dtype):
        given[name] = torch.full(shape, float("nan"), dtype=dtype) if dtype.is_floating_point else \
            torch.zeros(shape, dtype=dtype)
        return given[name]

    named = [pair for bucket in engine.export_tensors(bucket_bytes, into=into) for pair in bucket]
    assert named and len(given) == len(named)
    by_name = dict(named)
    # checkpoint names may differ from the module names `into` was called with; the tensors are the buffers
    assert {t.data_ptr() for t in by_name.values()} == {t.data_ptr() for t in given.values()}
    return by_name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_export_from_the_gpu_into_cpu_memory_is_the_cpu_export_bit_for_bit(models, dtype):
    """The trainer's weight export on a GPU (issue 26): ``export_tensors(into=...)`` gathers, casts to
    ``model.dtype`` and copies the CUDA parameters straight into the CPU memory it is handed. Before any step the
    GPU and CPU engines hold the same weights, so their exports must agree byte for byte (float32 as they are,
    and cast to bfloat16: round-to-nearest-even on both devices), and with them the integrity gate's digests."""
    from areal_core.weight_check import digest_named

    spec = {"model": str(models["qwen2"]), "mb_max_tokens": 16, "lr": 1e-2, "dtype": dtype}
    gpu_engine = worker.make_engine(spec)
    try:
        assert str(gpu_engine.device).startswith("cuda")
        assert "export_into" in gpu_engine.capabilities
        gpu = _export_into_buffers(gpu_engine, 1 << 16)  # small buckets: several gathers in flight
    finally:
        gpu_engine.close()
    cpu_engine = worker.make_engine({**spec, "allocation": "fsdp:cpu"})
    try:
        cpu = dict(pair for bucket in cpu_engine.export_tensors(1 << 16) for pair in bucket)
    finally:
        cpu_engine.close()
    assert sorted(gpu) == sorted(cpu)
    want = getattr(torch, dtype)
    for name, tensor in gpu.items():
        assert tensor.device.type == "cpu" and tensor.dtype == want, name
        assert torch.equal(tensor.view(torch.uint8), cpu[name].view(torch.uint8)), name
    assert digest_named(gpu.items()) == digest_named(cpu.items())


# The CPU run test's reward (rewards that differ within a group on a random model's text), loaded as above
_spec = importlib.util.spec_from_file_location("areal_fsdp_test_run_for_cuda",
                                               Path(__file__).with_name("test_fsdp_run.py"))
run_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_tests)


# The run takes other plugins, found by entry point as `areal run` finds them
@requires_plugin("areal.engines.inference", "local")
@requires_plugin("areal.algorithms", "grpo")
@requires_plugin("areal.workflows", "rlvr")
@requires_plugin("areal.datasets", "arithmetic")
@pytest.mark.parametrize(("dtype", "lora"), [("float32", False), ("bfloat16", True)], ids=["float32", "bf16-lora"])
def test_a_run_training_on_the_gpu_passes_the_integrity_gate_at_every_update(tmp_path, dtype, lora):
    """``areal run`` with the actor on the GPU and the embedded engine on the CPU, weights as tensors through
    /dev/shm (exported from CUDA straight into the stage), deltas on, the integrity gate on with the parity probe
    at every version: the engine's digests must equal the trainer's and the GPU trainer's logprobs of what the
    CPU engine sampled must agree within the dtype's tolerance, at every update, or the run fails naming them."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    model = tiny_model(tmp_path / "tiny", seed=0)
    (tmp_path / "t5_parity_reward.py").write_text(run_tests.REWARD_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    runs = tmp_path / "runs"
    steps = 4
    cmd = [str(Path(sys.executable).with_name("areal")), "run", f"output_dir={runs}", "experiment=gpu",
           "trial=gate", "allocation=local:cpu+fsdp:d1", f"model.path={model}", f"model.dtype={dtype}",
           "rollout.weight_sync=tensors", "rollout.weight_check=on", "rollout.weight_probe_every=1",
           "rollout.weight_delta=auto", f"trainer.total_steps={steps}", "rollout.batch_size=2", "rollout.group_size=4",
           "rollout.sampling.max_new_tokens=8", "eval.size=0", "rollout.max_head_offpolicyness=1",
           "actor.optimizer.lr=1e-3", "reward.name=function", "reward.target=t5_parity_reward:score",
           "rollout.dynamic_filtering=true"]
    if lora:  # adapters trained on the GPU, merged weights sent: only q/v change, so versions 2.. go as deltas
        cmd += ["actor.lora_rank=4", "actor.lora_target_modules=[q_proj,v_proj]", "actor.optimizer.lr=1e-2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = runs / "gpu" / "gate"
    assert "rank 0/1 on cuda" in (run_dir / "logs" / "actor-rank0.log").read_text()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    # the gate ran at every update: the trainer digested what it sent and waited for the engine's digests
    assert all(m["time/weight_digest_s"] > 0 and "time/weight_digest_engines_s" in m for m in metrics), metrics
    server_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "weights v1 from /dev/shm/areal-weights-" in server_log, server_log[-2000:]
    if lora:
        assert all(f"weights v{v} from /dev/shm/areal-delta-" in server_log for v in range(2, steps + 1)), \
            server_log[-2000:]
        assert all(m["weight_sync/delta_bytes"] > 0 for m in metrics[1:])
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    trained = load_file(latest / "actor" / "model.safetensors")
    initial = load_file(Path(model) / "model.safetensors")
    moved = max((trained[k].float() - initial[k].float()).abs().max().item() for k in initial)
    if lora:
        assert moved == 0.0  # the checkpoint keeps the frozen base (the adapters beside it)
    else:
        assert moved > 1e-5
