"""Latency profiles: the shipped files load and match their derivation, the model's arithmetic on hand cases,
and every bad field is named."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys

import pytest
import yaml

from areal_core.testing import scaled
from areal_sim.profile import PROFILES, DecodeTable, Lengths, ProfileError, TrainModel, load_profile, parse_profile

SHIPPED = sorted(p.stem for p in PROFILES.glob("*-h800.yaml"))
CPU = "smollm2-135m-cpu"  # written by benchmarks/calibrate_cpu.py


def test_the_shipped_profiles_are_the_ones_their_derivation_writes():
    assert SHIPPED == [f"qwen2.5-{size}-h800" for size in ("1.5b", "14b", "32b", "7b")]
    assert sorted(p.stem for p in PROFILES.glob("*.yaml")) == sorted([*SHIPPED, CPU])
    check = subprocess.run([sys.executable, "-m", "areal_sim.profiles.derive_h800", "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_profile_loads_and_grows_the_way_the_hardware_does(name):
    p = load_profile(name)
    assert p.name == name and "measured" in p.source
    step = p.inference.decode_step_s
    assert step(1, 512) < step(64, 512) < step(64, 8192) < step(512, 32768)
    assert p.train.step_s(10_000, 1) > p.train.step_s(10_000, 8) > 0
    assert p.weights.transfer_s() > p.weights.latency_s


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"])
def test_no_measured_figure_beats_the_datasheet(name):
    """The H100 timings behind the H800 profiles against what the hardware cannot exceed: a decode step reads
    the weights and the KV cache at most at 3.35 TB/s (and in practice at no more than about 90 % of it), a token
    of prefill costs 2 x params FLOPs and of training (with recomputation) 8 x params, at most 989 TFLOP/s."""
    from areal_sim.profiles import derive_h800 as d

    m = d.measured()[name]
    params, tp = d.MODELS[name][0], d.MODELS[name][-1]
    for i, b in enumerate(m["batch"]):
        for j, c in enumerate(m["context"]):
            bound = d.roofline_decode_s(name, b, c)
            assert bound < m["decode"][i][j] < 40 * bound, (b, c)
    assert m["prefill"] > 2 * params / tp / d.GPU["bf16_flops"]
    assert m["train"] > 8 * params / d.GPU["bf16_flops"]
    # a large step is bandwidth-bound: within 25 % of the bound, as a streaming kernel on this chip is
    assert m["decode"][-1][-1] < 1.25 * d.roofline_decode_s(name, m["batch"][-1], m["context"][-1])


def test_the_split_attention_used_for_measuring_equals_plain_attention():
    import torch
    import torch.nn.functional as F

    from areal_sim.profiles.measure_gpu import split_kv_attention, splits_for

    q, k, v = torch.randn(3, 2, 6, 16), torch.randn(3, 2, 1024, 16), torch.randn(3, 2, 1024, 16)
    for splits in (1, 2, 8):
        assert torch.allclose(split_kv_attention(q, k, v, splits), F.scaled_dot_product_attention(q, k, v),
                              atol=1e-5)
    assert splits_for(1, 2, 32768, 264) == 128 and splits_for(512, 8, 32768, 264) == 1


def test_the_measuring_script_runs_on_toy_shapes(tmp_path):
    out = tmp_path / "m.json"
    run = subprocess.run([sys.executable, "-m", "areal_sim.profiles.measure_gpu", "--tiny", "--out", str(out)],
                         capture_output=True, text=True, timeout=scaled(120))
    assert run.returncode == 0, run.stderr
    import json

    data = json.loads(out.read_text())
    tiny = data["models"]["tiny"]
    assert all(t > 0 for row in tiny["decode"]["seconds"] for t in row)
    assert tiny["train"]["s_per_token_recompute"] > tiny["train"]["s_per_token"] > 0


def test_bigger_models_are_slower_per_token_and_to_send():
    small, big = load_profile("qwen2.5-1.5b-h800"), load_profile("qwen2.5-32b-h800")
    # 21x the parameters; the small model runs its GEMMs less efficiently (measured: 14.5x per token)
    assert big.train.s_per_token_per_gpu > 10 * small.train.s_per_token_per_gpu
    assert big.weights.transfer_s() > 10 * small.weights.transfer_s()


def test_the_decode_table_interpolates_linearly_in_batch_and_context_and_extends_past_its_edges():
    table = DecodeTable(batch=(1.0, 3.0), context=(100.0, 200.0), seconds=((1.0, 2.0), (3.0, 6.0)))
    assert table(1, 100) == 1.0 and table(3, 200) == 6.0
    assert table(2, 150) == pytest.approx((1.5 + 4.5) / 2)  # 1.5 at batch 1, 4.5 at batch 3
    assert table(5, 200) == pytest.approx(10.0)  # the last batch segment extended: 6 + (6 - 2)
    assert table(1, 300) == pytest.approx(3.0)  # the last context segment extended
    assert table(0, 100) == 0.0


@pytest.mark.parametrize("batch, context, k", [(64, 100, 10000), (1, 8000, 30000), (300, 20000, 5), (7, 1, 3),
                                                (512, 40000, 200), (32, 500, 1)])
def test_a_stretch_of_decode_steps_sums_in_closed_form_to_the_step_by_step_sum(batch, context, k):
    table = load_profile("qwen2.5-7b-h800").inference.decode_step_s
    assert table.sum_steps(batch, context, k) == pytest.approx(sum(table(batch, context + i) for i in range(k)),
                                                               rel=1e-12)
    total = table.sum_steps(batch, context, k)
    assert table.steps_within(batch, context, total, k) == k
    assert table.steps_within(batch, context, table.sum_steps(batch, context, k // 2) + 1e-9, k) == k // 2


def test_the_all_reduce_is_a_ring_over_the_bus():
    train = TrainModel(s_per_token_per_gpu=1e-3, grad_bytes=1e9, allreduce_gbps=80.0, allreduce_latency_s=1e-3)
    assert train.allreduce_s(1) == 0.0
    # 2 (d-1)/d x 1 GB at 10 GB/s, plus 2 (d-1) hops of 1 ms
    assert train.allreduce_s(4) == pytest.approx(2 * 3 / 4 * 0.1 + 6e-3)
    assert train.step_s(1000, 4) == pytest.approx(1000 * 1e-3 / 4 + train.allreduce_s(4))


def test_response_lengths_are_long_tailed_and_capped():
    lengths = Lengths(median=1000, sigma=1.0, cap=4000, prompt=50)
    rng = random.Random(1)
    draws = [lengths.sample(rng) for _ in range(20000)]
    assert max(draws) == 4000 and min(draws) >= 1
    assert statistics.median(draws) == pytest.approx(1000, rel=0.05)
    assert statistics.mean(draws) > 1.2 * statistics.median(draws)  # the tail pulls the mean up
    # P(length >= cap) = P(Z >= ln 4 / 1.0)
    at_cap = sum(d == 4000 for d in draws) / len(draws)
    assert at_cap == pytest.approx(0.5 * math.erfc(math.log(4) / math.sqrt(2)), abs=0.01)


def _data(name: str = "qwen2.5-7b-h800") -> dict:
    return yaml.safe_load((PROFILES / f"{name}.yaml").read_text())


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["train"].pop("grad_bytes"), "train.grad_bytes is missing"),
    (lambda d: d["train"].update(allreduce_gbps=0), "train.allreduce_gbps must be a finite number > 0, got 0"),
    (lambda d: d["inference"].update(prefill_s_per_token=float("nan")), "inference.prefill_s_per_token must be"),
    (lambda d: d["inference"]["decode_step_s"].update(batch=[8, 1, 32, 64, 128, 256, 512]),
     "inference.decode_step_s.batch must increase strictly"),
    (lambda d: d["inference"]["decode_step_s"]["seconds"].pop(), "inference.decode_step_s.seconds must be a list of 7 rows"),
    (lambda d: d["lengths"].update(sigma=-1), "lengths.sigma must be a finite number > 0, got -1"),
    (lambda d: d.update(weights=[1, 2]), "weights must be a mapping"),
])
def test_a_bad_field_is_named_with_its_value(edit, field):
    data = _data()
    edit(data)
    with pytest.raises(ProfileError, match="my.yaml: " + field.replace(".", r"\.").replace("(", r"\(")
                       .replace("[", r"\[")):
        parse_profile(data, "my.yaml")


def test_an_unknown_profile_lists_the_shipped_ones(tmp_path):
    with pytest.raises(ProfileError, match="neither a shipped profile nor a file.*qwen2.5-7b-h800"):
        load_profile("h100-70b")
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**_data(), "name": "mine"}))
    assert load_profile(path).name == "mine"


def test_the_cpu_profile_shares_two_cores_as_the_local_launcher_does():
    """eta 0: generation and training take turns, each on both cores; eta > 0: one core each, at once."""
    p = load_profile(CPU)
    assert p.cpu is not None and p.cpu.cores == 2 and "calibrate_cpu.py" in p.source
    assert p.cpu.threads(servers=1, train_ranks=1, eta=0) == (2, 2)
    assert p.cpu.threads(servers=1, train_ranks=1, eta=4) == (1, 1)
    assert 1.0 < p.cpu.inference_speedup[1] <= 2.0 and 1.0 < p.cpu.train_speedup[1] <= 2.0
    both = p.on_threads(2, 2)
    assert both.inference.decode_step_s(8, 40) == pytest.approx(
        p.inference.decode_step_s(8, 40) / p.cpu.inference_speedup[1])
    assert both.train.step_s(1000, 1) == pytest.approx(p.train.step_s(1000, 1) / p.cpu.train_speedup[1])
    assert both.weights.export_s == pytest.approx(p.weights.export_s / p.cpu.train_speedup[1])
    assert both.weights.transfer_s() == pytest.approx(p.weights.transfer_s() / p.cpu.inference_speedup[1])
    assert p.on_threads(1, 1) == p
    # at eta > 0 each role runs beside the other: slower by the measured contention
    assert p.cpu.inference_contention >= 1.0 and p.cpu.train_contention >= 1.0
    beside = p.on_threads(1, 1, contended=True)
    assert beside.inference.decode_step_s(8, 40) == pytest.approx(
        p.inference.decode_step_s(8, 40) * p.cpu.inference_contention)
    assert beside.train.step_s(1000, 1) == pytest.approx(p.train.step_s(1000, 1) * p.cpu.train_contention)
    # the controller's CPU beside training: half out of each role, only while they run at once
    assert p.cpu.controller_s_per_sample > 0.0
    assert beside.inference.side_s_per_request == beside.train.side_s_per_sample == pytest.approx(
        p.cpu.controller_s_per_sample / 2)
    assert both.inference.side_s_per_request == both.train.side_s_per_sample == 0.0
    gpu = load_profile("qwen2.5-7b-h800")
    assert gpu.cpu is None and gpu.on_threads(2, 2) is gpu  # GPUs are not shared


def test_a_training_step_has_a_fixed_part_and_a_share_for_the_logprob_forward():
    model = TrainModel(s_per_token_per_gpu=1e-3, grad_bytes=1e6, allreduce_gbps=8.0, allreduce_latency_s=0.0,
                       s_per_step=0.5)
    assert model.step_s(100, 1) == pytest.approx(0.6)
    data = _data()
    assert parse_profile(data).train.s_per_step == 0.0 and parse_profile(data).train.forward_share == 0.25


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(cpu={"cores": 2, "inference_speedup": [1.0], "train_speedup": [1.0, 1.5]}),
     "cpu.inference_speedup must list 2 numbers"),
    (lambda d: d.update(cpu={"cores": 2, "inference_speedup": [1.2, 1.5], "train_speedup": [1.0, 1.5]}),
     "cpu.inference_speedup must list 2 numbers .* the first 1.0"),
    (lambda d: d.update(cpu={"cores": 1.5, "inference_speedup": [1.0], "train_speedup": [1.0]}),
     "cpu.cores must be a whole number"),
    (lambda d: d.update(cpu={"cores": 1, "inference_speedup": [1.0], "train_speedup": [1.0],
                             "contention": {"inference": 1.2}}), "cpu.contention.train is missing"),
    (lambda d: d.update(cpu={"cores": 1, "inference_speedup": [1.0], "train_speedup": [1.0],
                             "controller_s_per_sample": -0.01}), "cpu.controller_s_per_sample must be a finite"),
    (lambda d: d["train"].update(shared_prompts="yes"), "train.shared_prompts must be true or false"),
    (lambda d: d["train"].update(s_per_step=-1), "train.s_per_step must be a finite number >= 0, got -1"),
    (lambda d: d["weights"].update(export_s="soon"), "weights.export_s must be a finite number >= 0"),
])
def test_a_bad_shared_cpu_or_fixed_cost_field_is_named(edit, field):
    data = _data()
    edit(data)
    with pytest.raises(ProfileError, match="my.yaml: " + field):
        parse_profile(data, "my.yaml")


def test_tensor_and_pipeline_parallelism_cost_their_communication_and_bubble():
    """step_s on d x t x p: the compute splits over every rank; a pipeline idles (p - 1) / m of it; tensor
    parallelism adds 6 all-reduces a layer over NVLink; the gradient all-reduce moves a 1 / (t p) share."""
    base = dict(s_per_token_per_gpu=1e-4, grad_bytes=8e9, allreduce_gbps=320.0, allreduce_latency_s=0.0)
    shape = dict(layers=32, hidden=4096, tp_link_gbps=1200.0, tp_latency_s=0.0, pipeline_microbatches=8)
    plain, shaped = TrainModel(**base), TrainModel(**base, **shape)
    tokens = 80_000
    compute = tokens * 1e-4 / 8
    assert plain.step_s(tokens, 8) == pytest.approx(compute + 2 * 7 / 8 * 8e9 / 40e9)  # d only: as before
    # without the model's shape, t and p are an ideal split of the compute (and of the gradients)
    assert plain.step_s(tokens, 4, 2) == pytest.approx(compute + 2 * 3 / 4 * 4e9 / 40e9)
    tp_bytes = 6 * 32 * 2 * (2 - 1) / 2 * (tokens / 4) * 4096 * 2
    assert shaped.step_s(tokens, 4, 2) == pytest.approx(compute + tp_bytes / 150e9 + 2 * 3 / 4 * 4e9 / 40e9)
    assert shaped.step_s(tokens, 4, 1, 2) == pytest.approx(compute * (1 + 1 / 8) + 2 * 3 / 4 * 4e9 / 40e9)
    assert shaped.forward_s(tokens, 4, 2) == pytest.approx(0.25 * compute + tp_bytes / 3 / 150e9)
    assert shaped.models_tp and not plain.models_tp
    for name in ("qwen2.5-1.5b-h800", "qwen2.5-7b-h800", "qwen2.5-14b-h800", "qwen2.5-32b-h800"):
        assert load_profile(name).train.models_tp  # derive_h800.py writes the shape and the NVLink figures
