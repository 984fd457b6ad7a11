"""The integrity gate for SGLang (``weight_digest``): the checksums SGLang's ``/weights_checker`` reports, in its
own layout, equal what the trainer computes from the weights it sends (``SGLangEngine.sent_digests``), against a
TEST DOUBLE of SGLang's HTTP protocol (sglang_server_double.py) that holds the weights fused and sharded as SGLang
does, written from the layer facts apart from the plugin's mapping; the GPU hash port against known answers of
SGLang's real triton kernel (gpu_hash_vectors.py)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from areal_core.api import ServerProcess
from areal_core.remote import ServerFleet, http_ready
from areal_core.rollout import RolloutController
from areal_core.testing import scaled
from areal_core.weight_check import NOT_CHECKABLE, SentDigests, WeightCheckError, compare_digests, not_checkable
from areal_sglang.engine import SGLangEngine
from areal_sglang.weight_layout import cpu_hash, gpu_hash, server_dtype

DOUBLE = Path(__file__).with_name("sglang_server_double.py")
TIMEOUT_S = 20


def launch(fleet: ServerFleet, model: Path, tp: int = 1, hash_kind: str = "cpu", corrupt: str = "", n: int = 1):
    def recipe(index: int, port: int) -> ServerProcess:
        return ServerProcess([sys.executable, str(DOUBLE), "--port", str(port), "--tp", str(tp), "--model-path",
                              str(model), "--hash", hash_kind, "--corrupt", corrupt, "--group-timeout-s",
                              str(TIMEOUT_S)], http_ready(port),
                             f"the SGLang protocol double {index} on 127.0.0.1:{port}",
                             startup_timeout_s=scaled(60))

    return fleet.launch(recipe, n, prefix=f"sglang-digest-tp{tp}-{hash_kind}")


def engine_for(address: str) -> SGLangEngine:
    return SGLangEngine(None, address, weight_group_backend="gloo", request_timeout_s=TIMEOUT_S,
                        weight_bucket_mb=0.02)


async def load_and_digest(address: str, folder: Path) -> tuple[dict, dict]:
    """(what the trainer computes for ``folder``, what the server reports after loading it)."""
    engine = engine_for(address)
    await engine.start()
    try:
        sent = engine.sent_digests(str(folder))
        await engine.update_weights_from_disk(str(folder), 1)
        return sent, await engine.weight_digest()
    finally:
        await engine.aclose()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with ServerFleet(tmp_path_factory.mktemp("sglang-digest") / "logs") as f:
        yield f


@pytest.mark.parametrize("tp,hash_kind,kv_heads", [(1, "cpu", 2), (2, "gpu", 2), (4, "cpu", 2)])
def test_checksums_after_disk_and_tensor_updates_equal_what_the_trainer_computes(
        fleet, tmp_path, make_model, tp, hash_kind, kv_heads):
    """tp 1; tp 2 with the GPU hash; tp 4 over 2 kv heads (replicated). Each update is of other weights, so a
    server still holding the previous ones would differ."""
    base = make_model(tmp_path / "base", 0, num_key_value_heads=kv_heads)
    updates = [make_model(tmp_path / f"v{i}", i, num_key_value_heads=kv_heads) for i in (1, 2)]
    from safetensors.torch import load_file

    (server,) = launch(fleet, base, tp, hash_kind)

    async def body():
        engine = engine_for(server.address)
        await engine.start()
        try:
            checks = []
            sent = engine.sent_digests(str(updates[0]))
            await engine.update_weights_from_disk(str(updates[0]), 1)
            checks.append(("disk", sent, await engine.weight_digest()))
            tensors = sorted(load_file(str(updates[1] / "model.safetensors")).items())
            sent = engine.sent_digests(tensors, "sample")
            await engine.update_weights_from_tensors(tensors, 2)
            checks.append(("tensors", sent, await engine.weight_digest("sample")))
            return checks
        finally:
            await engine.aclose()

    checks = asyncio.run(body())
    for how, sent, held in checks:
        assert compare_digests(sent, held) == [], f"after the update from {how}"
        assert not not_checkable(sent, held), f"{how}: {not_checkable(sent, held)}"
        # every parameter the server holds was computed by the trainer: 2 layers x (qkv, o, gate_up, down, two
        # norms) + embed, lm_head, norm, on each rank
        assert set(sent) == set(held) and len(sent) == (2 * 6 + 3) * tp
        prefix = "gpu:" if hash_kind == "gpu" else "sha256-8:"
        assert all(v.startswith(prefix) for v in held.values())
    assert checks[0][1] != checks[1][1]  # the two updates are of different weights


def test_a_layout_bug_is_caught_by_the_controllers_check_naming_the_tensor(fleet, tmp_path, make_model):
    """The double's loader swaps k and v of layer 1 (as a wrong shard offset would): the controller's real check
    refuses the server and names the fused tensor, on the rank that holds it."""
    base = make_model(tmp_path / "base", 0)
    update = make_model(tmp_path / "v1", 1)
    (good,) = launch(fleet, base, 2)
    (bad,) = launch(fleet, base, 2, corrupt="swap-kv:1")
    engines = [engine_for(good.address), engine_for(bad.address)]
    with RolloutController(engines, None, batch_size=1, request_timeout_s=TIMEOUT_S, call_timeout_s=60) as ctrl:
        sent = SentDigests(1, "on", ctrl.engines[0].sent_digests(str(update)))
        with pytest.raises(WeightCheckError) as failed:
            ctrl.update_weights_from_disk(str(update), 1, sent=sent)
    error = failed.value
    assert error.engine == bad.address, str(error)
    assert sorted(d.split(":")[0] for d in error.differences) == [
        "model.layers.1.self_attn.qkv_proj.weight@tp0", "model.layers.1.self_attn.qkv_proj.weight@tp1"], str(error)


def test_two_servers_over_the_shared_group_pass_the_controllers_check(fleet, tmp_path, make_model):
    """The rollout controller's own path: tensors broadcast once over ONE group to two tp-2 servers, then its
    check_weights against the trainer's sent_digests."""
    from safetensors.torch import load_file

    base = make_model(tmp_path / "base", 0)
    update = make_model(tmp_path / "v1", 1)
    servers = launch(fleet, base, 2, n=2)
    tensors = sorted(load_file(str(update / "model.safetensors")).items())
    with RolloutController([engine_for(s.address) for s in servers], None, batch_size=1,
                           request_timeout_s=TIMEOUT_S, call_timeout_s=60) as ctrl:
        sent = SentDigests(1, "on", ctrl.engines[0].sent_digests(tensors))
        ctrl.update_weights_from_tensors(tensors, 1, sent=sent)
        assert ctrl.weight_group is not None and ctrl.weight_group.builds == 1  # the shared group carried them
        assert ctrl.fleet.weight_failures == [] and ctrl.fleet.sent_digests is sent
        assert [e.version for e in ctrl.engines] == [1, 1]


def test_a_skipped_bucket_is_caught(fleet, tmp_path, make_model):
    base = make_model(tmp_path / "base", 0)
    update = make_model(tmp_path / "v1", 1)
    (server,) = launch(fleet, base, 1, corrupt="skip:model.layers.0.mlp.")
    differences = compare_digests(*asyncio.run(load_and_digest(server.address, update)))
    assert sorted(d.split(":")[0] for d in differences) == ["model.layers.0.mlp.down_proj.weight",
                                                            "model.layers.0.mlp.gate_up_proj.weight"]


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_biases_and_norms_and_tied_embeddings(fleet, tmp_path, make_model, arch):
    """Qwen2's q/k/v biases fuse like their weights, Qwen3's q/k norms are whole; tied embeddings: the server
    holds embed_tokens alone, and the trainer does not ask for an lm_head."""
    base = make_model(tmp_path / "base", 0, architectures=[arch], tie_word_embeddings=True)
    update = make_model(tmp_path / "v1", 1, architectures=[arch], tie_word_embeddings=True)
    (server,) = launch(fleet, base, 2)
    sent, held = asyncio.run(load_and_digest(server.address, update))
    assert compare_digests(sent, held) == [] and set(sent) == set(held)
    assert not any(name.startswith("lm_head") for name in sent)
    extra = "self_attn.qkv_proj.bias@tp1" if arch == "Qwen2ForCausalLM" else "self_attn.k_norm.weight@tp1"
    assert f"model.layers.0.{extra}" in sent


def test_an_unknown_architecture_is_not_checkable_and_named(fleet, tmp_path, make_model, caplog):
    """A model outside the Llama family: nothing is mapped, every tensor sent is reported not checkable (the
    run log names them), none passes as checked."""
    base = make_model(tmp_path / "base", 0, architectures=["GPT2LMHeadModel"])
    (server,) = launch(fleet, base, 1)
    engines = [engine_for(server.address)]
    with RolloutController(engines, None, batch_size=1, request_timeout_s=TIMEOUT_S, call_timeout_s=60) as ctrl:
        sent = SentDigests(1, "on", ctrl.engines[0].sent_digests(str(base)))
        with caplog.at_level("WARNING"):
            ctrl.update_weights_from_disk(str(base), 1, sent=sent)
        held = asyncio.run(_digest(server.address))
    skipped = not_checkable(sent.digests, held)
    assert skipped and set(skipped) == set(sent.digests) and "model.layers.0.self_attn.q_proj.weight" in skipped
    assert all("architecture GPT2LMHeadModel" in why for why in skipped.values())
    assert all(sent.digests[name].startswith(NOT_CHECKABLE) for name in skipped)  # marked on the trainer's side
    assert compare_digests(sent.digests, held) == []  # whatever the server reports for them (here: its own hashes)
    assert "cannot digest" in caplog.text and "model.layers.1.mlp.up_proj.weight" in caplog.text


async def _digest(address: str) -> dict:
    engine = engine_for(address)
    await engine.start()
    try:
        return await engine.weight_digest()
    finally:
        await engine.aclose()


def test_a_fused_weight_sent_without_all_its_parts_is_not_checkable(make_model, tmp_path):
    from areal_sglang.weight_layout import expected_checksums, folder_tensors, read_config

    folder = make_model(tmp_path / "m", 0)
    named = [(n, t) for n, t in folder_tensors(folder) if n != "model.layers.0.self_attn.v_proj.weight"]
    expected, unmapped = expected_checksums(named, read_config(folder), 1, "bfloat16", "sha256-8")
    assert set(unmapped) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    assert "model.layers.0.self_attn.qkv_proj.weight" not in expected
    assert "model.layers.1.self_attn.qkv_proj.weight" in expected


def test_the_server_dtype_follows_sglang():
    assert server_dtype("auto", {"torch_dtype": "bfloat16"}) == "bfloat16"
    assert server_dtype("auto", {"torch_dtype": "float32"}) == "float16"  # SGLang's auto on a float32 model
    assert server_dtype("auto", {}) == "float16"
    assert server_dtype("bfloat16", {"torch_dtype": "float32"}) == "bfloat16"


def test_the_cpu_hash_is_sha256s_first_8_bytes():
    import hashlib

    import torch

    t = torch.arange(10, dtype=torch.int16)
    assert cpu_hash(t) == int.from_bytes(hashlib.sha256(t.numpy().tobytes()).digest()[:8], "big")


@pytest.mark.parametrize("device", [None, "cpu", "cuda"], ids=["numpy", "torch", "torch-cuda"])
def test_the_gpu_hash_port_gives_sglangs_kernel_answers(gpu_hash_vectors, device):
    """Known answers of SGLang 0.5.23's triton kernels (run by triton's interpreter; see gpu_hash_vectors.py):
    sizes from 1 byte up, not multiples of 4 bytes, one tile, many tiles, more than 1024 tiles (two levels of the
    kernel's reduction), an empty tensor. Both ports: numpy (the CPU's) and torch (a GPU's, run here on the CPU;
    a chunk of 3 tiles so chunks end inside and at the end of a tensor, and an unaligned start)."""
    import torch

    from areal_sglang.weight_layout import _gpu_hash_numpy, _gpu_hash_torch

    assert len(gpu_hash_vectors.VECTORS) == len(gpu_hash_vectors.CASES) == 10
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (a device check)")
    for key, want in gpu_hash_vectors.VECTORS.items():
        dtype, numel = key.split(":")
        tensor = gpu_hash_vectors.vector_tensor(dtype, int(numel))
        if device is None:
            assert f"{_gpu_hash_numpy(tensor):016x}" == want, key
            if not torch.cuda.is_available():  # without a GPU, gpu_hash is the numpy port
                assert f"{gpu_hash(tensor):016x}" == want, key
            continue
        assert f"{_gpu_hash_torch(tensor, torch.device(device), chunk_tiles=3):016x}" == want, key
        if tensor.numel() > 1:  # a view starting one element in: not 4-byte aligned for 1- and 2-byte dtypes
            shifted = torch.cat([tensor[:1], tensor])[1:]  # the same bytes, one element into its storage
            assert shifted.storage_offset() == 1
            assert f"{_gpu_hash_torch(shifted, torch.device(device), chunk_tiles=3):016x}" == want, key


@pytest.mark.parametrize("status,answer,says", [
    (404, {"detail": "Not Found"}, r"has no /weights_checker endpoint \(SGLang 0.5.23\).*rollout.weight_check=off"),
    (400, {"success": False, "message": "Unsupported action"}, r"refused POST /weights_checker: .*Unsupported"),
    (200, {"success": False, "message": "rank 1 failed"}, r"could not compute the checksums .*: rank 1 failed"),
])
def test_a_server_that_cannot_checksum_says_so(status, answer, says):
    """Answers of a server without the endpoint, or whose checksum failed (a transport double of the HTTP
    protocol: no server process), each an error naming the server and what to do."""
    import httpx

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/weights_checker":
            return httpx.Response(status, json=answer)
        return httpx.Response(200, json={"version": "0.5.23", "tp_size": 1, "device": "cuda"})

    async def body():
        engine = SGLangEngine(None, "127.0.0.1:9", transport=httpx.MockTransport(handle), retries=0)
        engine.server_version = "0.5.23"
        try:
            return await engine.weight_digest()
        finally:
            await engine.aclose()

    with pytest.raises((RuntimeError, ValueError), match=says) as failed:
        asyncio.run(body())
    assert "SGLang server at 127.0.0.1:9" in str(failed.value)


def test_a_checksum_that_does_not_come_back_times_out_naming_the_server_and_the_wait():
    import httpx

    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)  # what httpx raises past the request's timeout

    async def body():
        engine = SGLangEngine(None, "127.0.0.1:9", transport=httpx.MockTransport(handle), request_timeout_s=7)
        try:
            return await engine.weight_digest()
        finally:
            await engine.aclose()

    with pytest.raises(TimeoutError, match=r"waited 7 s .*for the SGLang server at 127.0.0.1:9 to answer POST "
                                           r"/weights_checker"):
        asyncio.run(body())
