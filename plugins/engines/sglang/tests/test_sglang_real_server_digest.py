"""DEVICE CHECK, for a machine with a CUDA GPU and SGLang (skipped elsewhere, i.e. on the CPU test machine): a REAL
SGLang server's ``/weights_checker`` after weight updates equals what the trainer computes
(``SGLangEngine.sent_digests``): the layout mapping and the GPU hash port checked against SGLang itself.

It also checks that the server, started through areal's launcher (``areal_sglang_launch``) with the run's
secret, refuses a weight load without it. Run on a GPU machine where SGLang 0.5.x is installed (the trainer's
interpreter, or ``AREAL_SGLANG_PYTHON``)::

    AREAL_SGLANG_PYTHON=/path/to/sglang/python .venv/bin/python -m pytest \\
        plugins/engines/sglang/tests/test_sglang_real_server_digest.py -q -rA

It starts one server (tp 1, bfloat16) on a tiny random Llama (untied, vocabulary 1000: padded) and a Qwen2 (q/k/v
biases, tied) written by ``areal_core.testing.tiny_model``, then: the checksums of the weights it started from;
after ``update_weights_from_disk`` of other weights; after ``update_weights_from_tensors`` over a gloo group (one
GPU cannot hold two NCCL ranks). ``AREAL_SGLANG_TP=2`` runs tp 2 on two GPUs. Extra server arguments:
``AREAL_SGLANG_ARGS`` (e.g. ``--attention-backend triton``). Budget: about 2 minutes a model once SGLang is
imported.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing import scaled
from areal_core.weight_check import compare_digests, not_checkable

PYTHON = os.environ.get("AREAL_SGLANG_PYTHON") or sys.executable
TP = int(os.environ.get("AREAL_SGLANG_TP", "1"))


def _has_sglang() -> bool:
    try:
        return subprocess.run([PYTHON, "-c", "import sglang, torch; assert torch.cuda.is_available()"],
                              capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(not _has_sglang(), reason=f"needs SGLang and a CUDA GPU in {PYTHON} "
                                "(AREAL_SGLANG_PYTHON): a device check")


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_a_real_servers_checksums_equal_what_the_trainer_computes(tmp_path, monkeypatch, arch, tied):
    import httpx
    from safetensors.torch import load_file

    from areal_core.server_guard import RUN_TOKEN_ENV, new_run_token

    from areal_core.remote import ServerFleet, http_ready
    from areal_core.api import ServerProcess
    from areal_core.testing import tiny_model
    from areal_sglang.engine import SGLangEngine, SGLangEngineConfig, server_argv, server_env

    shape = dict(arch=arch, vocab_size=1000, hidden_size=256, heads=4, kv_heads=2, dtype="bfloat16",
                 tie_word_embeddings=tied)
    base = tiny_model(tmp_path / "base", seed=0, **shape)
    updates = [tiny_model(tmp_path / f"v{i}", seed=i, **shape) for i in (1, 2)]
    options = SGLangEngineConfig(mem_fraction_static=0.3, extra_args=shlex.split(os.environ.get("AREAL_SGLANG_ARGS",
                                                                                                "")))

    def recipe(index: int, port: int) -> ServerProcess:
        return ServerProcess(server_argv(PYTHON, str(base), port, options, "bfloat16", TP), http_ready(port),
                             f"the SGLang server on 127.0.0.1:{port}", env=server_env(),
                             startup_timeout_s=scaled(600))

    async def body(address: str) -> list:
        engine = SGLangEngine(None, address, weight_group_backend="gloo", request_timeout_s=300,
                              tensor_parallel=TP, model_path=str(base))
        await engine.start()
        try:
            checks = [("start", engine.sent_digests(str(base)), await engine.weight_digest())]
            sent = engine.sent_digests(str(updates[0]))
            await engine.update_weights_from_disk(str(updates[0]), 1)
            checks.append(("disk", sent, await engine.weight_digest()))
            tensors = sorted(load_file(str(updates[1] / "model.safetensors")).items())
            sent = engine.sent_digests(tensors)
            await engine.update_weights_from_tensors(tensors, 2)
            checks.append(("tensors", sent, await engine.weight_digest()))
            return checks
        finally:
            await engine.aclose()

    monkeypatch.setenv(RUN_TOKEN_ENV, new_run_token())  # the run's secret: areal's launcher gives it to SGLang
    with ServerFleet(tmp_path / "logs") as fleet:
        (server,) = fleet.launch(recipe, 1, prefix="sglang-real")
        checks = asyncio.run(body(server.address))
        # without the secret, the real server refuses a weight load (SGLang's key check and areal's guard)
        refused = httpx.post(f"http://{server.address}/update_weights_from_disk", timeout=30,
                             json={"model_path": str(updates[0])})
        assert refused.status_code == 401, refused.text
    for how, sent, held in checks:
        print(f"{arch} tp {TP} {how}: {len(sent)} checksums sent, {len(held)} held, e.g. "
              f"{sorted(held.items())[:2]}")
        assert sent and compare_digests(sent, held) == [], f"{how}: {compare_digests(sent, held)[:5]}"
        assert not not_checkable(sent, held), f"{how}: {not_checkable(sent, held)}"
        assert all(v.startswith("gpu:") for v in sent.values())
    assert checks[1][1] != checks[2][1]
