"""The megatron plugin's parts that run without a model: vocab-parallel logprobs and the CPU accommodation."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
from areal_core.testing.models import max_abs_diff as worst  # noqa: E402
from areal_megatron.cpu import CPURNGStatesTracker, cuda_device_reads_cpu  # noqa: E402
from areal_megatron.logprobs import vocab_parallel_logprobs  # noqa: E402


# ---------------------------------------------------------------------- logprobs
def test_vocab_parallel_logprobs_of_one_rank_equal_a_log_softmax_and_ignore_padding():
    torch.manual_seed(0)
    T, V, pad = 7, 11, 3
    logits = torch.randn(T, V + pad)
    logits[:, V:] = 50.0  # padding columns would dominate the softmax if they were counted
    ids = torch.randint(0, V, (T,))
    starts = torch.tensor([1, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    lp, ent = vocab_parallel_logprobs(logits, ids, starts, vocab_start=0, vocab_size=V, temperature=0.7, chunk=2)
    ref = (logits[:-1, :V] / 0.7).log_softmax(-1)
    want_lp = torch.cat([torch.zeros(1), ref.gather(-1, ids[1:, None]).squeeze(-1)])
    want_ent = torch.cat([torch.zeros(1), -(ref.exp() * ref).sum(-1)])
    keep = ~starts
    assert worst(lp, torch.where(keep, want_lp, 0.0)) < 1e-5
    assert worst(ent, torch.where(keep, want_ent, 0.0)) < 1e-5
    assert lp[3] == 0.0 and ent[0] == 0.0


# ---------------------------------------------------------------------- the CPU accommodation
def test_cpu_rng_tracker_forks_a_stream_of_its_own():
    tracker = CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)  # the default stream is untouched
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the forked stream advanced
    assert torch.equal(first, torch.Generator().manual_seed(1234).manual_seed(1234) and
                       torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    with pytest.raises(KeyError, match="no RNG state 'other'"):
        with tracker.fork("other"):
            pass


def test_cuda_device_reads_cpu_only_inside():
    ones = torch.ones(3)
    with cuda_device_reads_cpu():
        assert torch.cuda.current_device() == "cpu"
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        # What Megatron's pipeline schedules and tied-embedding setup ask for by name.
        assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        assert torch.tensor([1, 2], device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.zeros(1, device=0).device.type == "cpu"  # a CUDA ordinal
        assert torch.ones(1, device="meta").device.type == "meta"  # other devices stay as asked
        assert ones.cuda() is ones
        torch.cuda.synchronize()
        assert torch.add(ones, 1).sum().item() == 6.0  # everything else runs as usual
    if not torch.cuda.is_available():
        for call in (torch.cuda.current_device, torch.cuda.synchronize, ones.cuda,
                     lambda: torch.zeros(1, device="cuda")):
            with pytest.raises((AssertionError, RuntimeError)):
                call()


# ---------------------------------------------------------------------- checkpoints: data, never code
class _Payload:
    """Unpickled, it runs ``touch <path>``: what a checkpoint from someone else could carry."""

    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def test_optimizer_files_load_as_tensors_and_values_only(tmp_path):
    from areal_megatron.checkpoint import _load_tensors

    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "tp0.pt")
    loaded = _load_tensors(tmp_path / "tp0.pt")  # what the engine writes loads under weights_only
    assert torch.equal(loaded["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])

    marker = tmp_path / "pwned"
    torch.save({"state": _Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match=r"evil\.pt holds more than tensors and plain values, so it is not loaded "
                                         r"\(loading it could run code\)"):
        _load_tensors(tmp_path / "evil.pt")
    assert not marker.exists()
    torch.load(tmp_path / "evil.pt", weights_only=False)  # the payload is live: what weights_only=False ran
    assert marker.exists()
