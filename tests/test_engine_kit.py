"""The engine kit (areal_core.engine_kit, areal_core.train_batches.Packed): the parts fsdp, megatron and
third-party train engines share, checked on their own."""

from __future__ import annotations

import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from areal_core.config.schema import RunConfig
from areal_core.engine_kit.hf_folder import read_hf_weights, write_hf_tensors
from areal_core.engine_kit.optim import Schedule, adamw_kwargs, parameter_groups
from areal_core.engine_kit.packing import (buckets, first_fit_decreasing, karmarkar_karp, micro_batches,
                                           rank_micro_batches)
from areal_core.engine_kit.setup import pick_device, run_config
from areal_core.testing.waits import scaled


def test_importing_the_kit_imports_no_torch():
    code = ("import sys, areal_core.engine_kit, areal_core.engine_kit.packing, areal_core.engine_kit.optim, "
            "areal_core.engine_kit.hf_folder, areal_core.engine_kit.setup, areal_core.train_batches; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------------- packing
def test_first_fit_decreasing_respects_the_budget_and_isolates_long_sequences():
    lengths = [7, 3, 9, 2, 8, 20, 1]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 or len(b) == 1 for b in bins)
    assert [5] in bins  # 20 > 10 alone
    assert sorted(bins) == [[0, 1], [2, 6], [3, 4], [5]]  # 7+3 | 9+1 | 2+8 | 20: the optimum, 4 bins


def test_karmarkar_karp_balances_better_than_a_round_robin():
    rng = random.Random(3)
    lengths = [rng.randrange(1, 400) for _ in range(40)]
    parts = karmarkar_karp(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(40))
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(lengths) // 4, sums
    assert karmarkar_karp([5], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="k must be at least 1"):
        karmarkar_karp([1], 0)


@pytest.mark.parametrize("k", [3, 4, 6, 9])
def test_micro_batches_gives_exactly_k_under_the_budget(k):
    lengths = [10, 10, 10, 4, 4, 3, 2, 1]
    bins = micro_batches(lengths, 16, k)
    assert len(bins) == k
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 16 for b in bins)
    assert sum(1 for b in bins if not b) == max(0, k - len(lengths))


def test_micro_batches_refuses_fewer_than_the_budget_needs():
    with pytest.raises(ValueError, match="need 3 micro-batches of at most 10 tokens, more than the 2"):
        micro_batches([10, 10, 10], 10, 2)


@pytest.mark.parametrize("seed", range(20))
def test_rank_micro_batches_cover_the_batch_once_with_the_same_count_on_every_rank(seed):
    rng = random.Random(seed)
    dp = rng.choice([1, 2, 3, 4])
    costs = [rng.randrange(1, 60) for _ in range(rng.randrange(1, 14))]
    capacity = rng.choice([16, 32, 64])
    multiple = rng.choice([1, 2])
    # `agree` stands for the all-reduce MAX: the busiest rank's first-fit count
    counts = [len(first_fit_decreasing([costs[i] for i in part], capacity)) for part in karmarkar_karp(costs, dp)]
    plans = [rank_micro_batches(costs, capacity, dp=dp, dp_rank=r, agree=lambda _: max(counts), multiple_of=multiple)
             for r in range(dp)]
    assert sorted(i for plan in plans for b in plan for i in b) == list(range(len(costs)))
    lens = {len(plan) for plan in plans}
    assert len(lens) == 1 and lens.pop() % multiple == 0
    for plan in plans:
        assert all(sum(costs[i] for i in b) <= capacity or len(b) == 1 for b in plan)
        assert len(plan) >= 1


def test_rank_micro_batches_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="holds no sequences"):
        rank_micro_batches([], 16)


def test_buckets_keep_order_and_the_size_limit():
    assert buckets([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert buckets([], 8) == []
    with pytest.raises(ValueError, match=">= 1 byte, got 0"):
        buckets([1], 0)


# ---------------------------------------------------------------------- optimizer and schedule
def test_schedule_warms_up_then_decays():
    s = Schedule(lr=1.0, warmup_steps=2, total_steps=6, kind="linear")
    assert [s.lr_at(i) for i in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    c = Schedule(lr=2.0, warmup_steps=0, total_steps=4, kind="cosine")
    assert [c.lr_at(i) for i in range(4)] == pytest.approx([2.0, 1.7071068, 1.0, 0.2928932])
    assert Schedule(lr=3.0, warmup_steps=0, total_steps=4, kind="constant").lr_at(99) == 3.0
    with pytest.raises(ValueError, match="'step'.*constant, linear or cosine"):
        Schedule(lr=1.0, warmup_steps=0, total_steps=1, kind="step").lr_at(0)


def test_schedule_and_adamw_arguments_of_a_run_config():
    cfg = RunConfig()
    s = Schedule.of(cfg)
    o = cfg.actor.optimizer
    assert (s.lr, s.warmup_steps, s.total_steps, s.kind) == (o.lr, o.warmup_steps, cfg.trainer.total_steps,
                                                             o.lr_schedule)
    assert adamw_kwargs(o) == {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps}


def test_parameter_groups_decay_matrices_only_and_skip_frozen_and_empty_groups():
    torch = pytest.importorskip("torch")
    lin = torch.nn.Linear(3, 2)
    norm = torch.nn.LayerNorm(2)
    frozen = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)
    groups = parameter_groups([lin.weight, lin.bias, norm.weight, frozen], 0.1)
    assert [(g["weight_decay"], [p.shape for p in g["params"]]) for g in groups] == [
        (0.1, [torch.Size([2, 3])]), (0.0, [torch.Size([2]), torch.Size([2])])]
    only_vectors = parameter_groups([lin.bias], 0.1)
    assert len(only_vectors) == 1 and only_vectors[0]["weight_decay"] == 0.0


# ---------------------------------------------------------------------- setup
def test_run_config_defaults_for_a_bare_engine_and_cpu_when_placed_there():
    bare = SimpleNamespace(config=None, placement=None)
    assert isinstance(run_config(bare), RunConfig)
    given = RunConfig()
    assert run_config(SimpleNamespace(config=given)) is given
    assert str(pick_device(SimpleNamespace(placement=SimpleNamespace(device="cpu")), "E")) == "cpu"


def test_a_gpu_placement_without_cuda_names_the_fix():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="MyEngine: the allocation places the actor on gpu.*'@cpu'"):
        pick_device(SimpleNamespace(placement=SimpleNamespace(device="gpu")), "MyEngine")


# ---------------------------------------------------------------------- HF folders
def test_a_hf_folder_written_from_tensors_reads_back_and_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from areal_core.testing import tiny_model

    source = tiny_model(tmp_path / "source")
    tensors = read_hf_weights(source)
    bumped = {k: v + 1 if v.is_floating_point() else v for k, v in tensors.items()}
    out = tmp_path / "out"
    out.mkdir()
    write_hf_tensors(out, bumped, torch.bfloat16, AutoConfig.from_pretrained(source), source=source,
                     max_shard_bytes=60_000)
    assert (out / "model.safetensors.index.json").exists()  # sharded under the small limit
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    back = read_hf_weights(out)
    assert back.keys() == tensors.keys()
    for k, v in back.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, bumped[k].to(torch.bfloat16))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert str(model.config.dtype).endswith("bfloat16")


def test_reading_a_folder_without_weights_names_the_reader_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="MyEngine: .* holds no \\*.safetensors weights; model.path"):
        read_hf_weights(tmp_path, "MyEngine")


# ---------------------------------------------------------------------- Packed
def test_packed_micro_batches_slice_per_token_and_per_sequence_values():
    torch = pytest.importorskip("torch")
    from areal_core.train_batches import Packed

    batch = {"input_ids": [5, 6, 7, 8, 9, 10], "cu_seqlens": [0, 2, 5, 6], "loss_mask": [0, 1, 0, 1, 1, 1],
             "rewards": [1.0, 2.0, 3.0], "kl_coef": 0.5}
    packed = Packed(batch, "MyEngine")
    assert packed.lengths == [2, 3, 1] and packed.shortest == 2 and packed.T == 6
    mb = packed.micro_batch([2, 0], with_positions=True)
    assert mb["input_ids"].tolist() == [10, 5, 6] and mb["loss_mask"].tolist() == [True, False, True]
    assert mb["rewards"].tolist() == [3.0, 1.0] and mb["kl_coef"] == 0.5
    assert mb["cu_seqlens"].tolist() == [0, 1, 3] and mb["seq_lens"].tolist() == [1, 2]
    assert mb["token_index"].tolist() == [5, 0, 1] and mb["position_ids"].tolist() == [0, 0, 1]
    assert "position_ids" not in packed.micro_batch([0])
    assert mb["input_ids"].dtype == torch.long


@pytest.mark.parametrize(("batch", "message"), [
    ({"input_ids": [], "cu_seqlens": [0]}, "MyEngine: the batch holds no sequences"),
    ({"input_ids": [1, 2], "cu_seqlens": [0, 3]}, "MyEngine: the batch has 2 input_ids but cu_seqlens ends at 3"),
])
def test_packed_refuses_a_malformed_batch(batch, message):
    pytest.importorskip("torch")
    from areal_core.train_batches import Packed

    with pytest.raises(ValueError, match=message):
        Packed(batch, "MyEngine")


# ---------------------------------------------------------------------- collectives
def test_collectives_are_the_identity_in_one_process():
    from areal_core.engine_kit.collectives import barrier, max_over_ranks

    assert max_over_ranks(7) == 7
    barrier()  # returns at once without a process group
    from areal_core.engine_kit.collectives import RankCollectives

    class EngineDouble(RankCollectives):
        device = "cpu"

    assert EngineDouble()._max_over_ranks(3) == 3 and EngineDouble()._barrier() is None


def test_max_over_ranks_agrees_over_two_gloo_ranks(tmp_path):
    """Two real processes over gloo: each gets the larger of the two counts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys, torch.distributed as dist\n"
        "from areal_core.engine_kit.collectives import barrier, max_over_ranks\n"
        "rank = int(sys.argv[1])\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=rank, world_size=2)\n"
        "print(max_over_ranks([3, 11][rank]))\n"
        "barrier()\n"
        "dist.destroy_process_group()\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=scaled(120))[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == ["11", "11"]
