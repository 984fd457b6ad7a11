"""The simulated train engine's time, and whole simulated runs through the real trainer and controller: the
figures they report checked against what the model implies, from outside."""

from __future__ import annotations

import contextlib
import itertools
import io
import json
import subprocess
import sys

import pytest

from areal_core.api import Context
from areal_core.clock import VirtualClock
from areal_core.config.allocation import parse_allocation
from areal_core.testing import scaled
from areal_sim.profile import load_profile
from areal_sim.simulate import SimSettings, SimulationError, run_simulation, simulated_config
from areal_sim.train import SimTrainConfig, SimTrainEngine

pytestmark = pytest.mark.usefixtures("algorithm_double")  # tests/conftest.py: the core's algorithm double

SMALL = """\
experiment: simtest
trial: t
rollout: {batch_size: 8, group_size: 4, max_head_offpolicyness: 2, max_concurrent_rollouts: 32,
          weight_sync: tensors, sampling: {max_new_tokens: 8000}}
algorithm: {name: rl_pg_double}
trainer: {total_steps: 6}
"""


def _simulate(tmp_path, *overrides, text=SMALL):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with contextlib.redirect_stdout(io.StringIO()):
        return run_simulation(str(config), list(overrides), str(tmp_path / "run"))


def test_the_train_engine_spends_the_profiles_time_on_its_layout_and_runs_the_real_loss():
    class Placement:
        parallel = parse_allocation("sim_train:d4t2").components[0].parallel

    clock = VirtualClock(threads=1)
    engine = SimTrainEngine(Context(options=SimTrainConfig(profile="qwen2.5-7b-h800", token_scale=10),
                                    placement=Placement(), extras={"clock": clock}))
    engine.initialize()
    profile = load_profile("qwen2.5-7b-h800")
    batch = {"input_ids": [1] * 300, "logprobs": [-0.5] * 300, "loss_mask": [1] * 300, "cu_seqlens": [0, 100, 300],
             "seq_lens": [100, 200], "advantages": [1.0] * 300}
    engine.forward_logprobs(batch)
    # a quarter of the compute over 8 GPUs, and the tensor-parallel pair's 2 all-reduces a layer
    assert clock.now() == pytest.approx(profile.train.forward_share * 3000 * profile.train.s_per_token_per_gpu / 8
                                        + profile.train.tp_s(3000, 4, 2, 1, 2))
    assert profile.train.tp_s(3000, 4, 2, 1, 2) > 0
    seen = []

    def loss_fn(logprobs, entropy, mb):
        seen.append(len(logprobs))
        loss = -(logprobs * 1.0).mean()
        return loss, {"pg_loss": float(loss.detach())}

    before = clock.now()
    stats = engine.train_batch(batch, loss_fn)
    assert seen == [300] and engine.version == 1 and stats["grad_norm"] > 0
    # 3000 modelled tokens over 8 GPUs, the tensor-parallel all-reduces, and the gradient all-reduce of each
    # rank's half of the gradients over the 4 data-parallel ranks
    assert clock.now() - before == pytest.approx(3000 * profile.train.s_per_token_per_gpu / 8
                                                 + profile.train.tp_s(3000, 4, 2, 1, 6)
                                                 + profile.train.allreduce_s(4, profile.train.grad_bytes / 2))


def test_with_shared_prompts_the_train_engine_computes_each_groups_prompt_once(tmp_path):
    import yaml

    from areal_sim.profile import PROFILES

    data = yaml.safe_load((PROFILES / "qwen2.5-7b-h800.yaml").read_text())
    data["train"].update(shared_prompts=True, s_per_step=0.25)
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(data))
    clock = VirtualClock(threads=1)
    engine = SimTrainEngine(Context(options=SimTrainConfig(profile=str(path)), extras={"clock": clock}))
    engine.initialize()
    # two groups: prompts of 10 and 20 tokens, three samples of 5 trained tokens each
    seqs = [(g, p) for g, p in ((0, 10), (0, 10), (0, 10), (1, 20), (1, 20), (1, 20))]
    batch = {"input_ids": [], "loss_mask": [], "logprobs": [], "advantages": [], "seq_lens": [], "group_index": []}
    for g, p in seqs:
        batch["input_ids"] += [1] * (p + 5)
        batch["loss_mask"] += [0] * p + [1] * 5
        batch["logprobs"] += [-0.5] * (p + 5)
        batch["advantages"] += [1.0] * (p + 5)
        batch["seq_lens"].append(p + 5)
        batch["group_index"].append(g)
    batch["cu_seqlens"] = [0, *itertools.accumulate(batch["seq_lens"])]
    assert engine._computed(batch) == 10 + 20 + 6 * 5  # not the 120 tokens in the batch
    engine.train_batch(batch, lambda lp, ent, mb: (-(lp.mean()), {}))
    assert clock.now() == pytest.approx(60 * engine.profile.train.s_per_token_per_gpu + 0.25)


def test_the_simulated_config_keeps_the_algorithm_and_controller_and_replaces_the_hardware():
    raw = {"allocation": "vllm:d6+fsdp:d2", "rollout": {"backend": "vllm", "batch_size": 64, "group_size": 16,
                                                        "max_head_offpolicyness": 4, "gpu_memory_utilization": 0.9,
                                                        "sampling": {"max_new_tokens": 20000}},
           "actor": {"backend": "fsdp", "ppo_minibatches": 4, "shard": "full"},
           "algorithm": {"name": "ppo", "eps_clip": 0.2}, "workflow": {"name": "rlvr", "seed_samples": True}}
    config, facts = simulated_config(raw, SimSettings(gpus=64, profile="qwen2.5-14b-h800", token_scale=50))
    # 3/4 of the GPUs serve, as in the config's own allocation, in servers of the profile's 2 GPUs
    assert config["allocation"] == "sim:d24t2+sim_train:d16"
    assert facts["inference_gpus"] == 48 and facts["train_gpus"] == 16
    assert config["rollout"]["batch_size"] == 64 and config["rollout"]["max_head_offpolicyness"] == 4
    assert "gpu_memory_utilization" not in config["rollout"] and "shard" not in config["actor"]
    assert config["actor"]["ppo_minibatches"] == 4 and config["algorithm"] == raw["algorithm"]
    assert config["rollout"]["sampling"]["max_new_tokens"] == 400  # 20,000 modelled tokens at 50 a token
    assert config["workflow"] == {"name": "sim"} and config["dataset"]["name"] == "sim"


def test_the_simulated_actor_takes_the_tensor_and_pipeline_sizes_asked_for():
    raw = {"allocation": "sim:d4+sim_train:d12", "rollout": {"backend": "sim"}, "actor": {"backend": "sim_train"}}
    config, facts = simulated_config(raw, SimSettings(gpus=16, inference_gpus=4, profile="qwen2.5-7b-h800",
                                                      train_t=2, train_p=3))
    assert config["allocation"] == "sim:d4+sim_train:d2t2p3" and facts["train_layout"] == [2, 3]
    with pytest.raises(SimulationError, match=r"sim.train_t=8 x sim.train_p=1 must divide the 12 training GPUs"):
        simulated_config(raw, SimSettings(gpus=16, inference_gpus=4, profile="qwen2.5-7b-h800", train_t=8))


@pytest.mark.parametrize("eta, threads", [(0, 2), (4, 1)])
def test_on_a_shared_cpu_each_role_gets_the_threads_the_local_launcher_gives_it(eta, threads):
    """The demo's layout (one server, one train rank, two cores): at eta 0 each side in turn on both cores, else
    one core each; the engines then spend the profile's time at that many threads."""
    raw = {"allocation": "local:d1+fsdp:d1", "rollout": {"backend": "local", "max_head_offpolicyness": eta},
           "actor": {"backend": "fsdp"}}
    config, facts = simulated_config(raw, SimSettings(profile="smollm2-135m-cpu", token_scale=1,
                                                      success_mean=0.4, success_concentration=3.0))
    assert config["allocation"] == "sim:d1+sim_train:d1"
    assert config["rollout"]["threads"] == config["actor"]["threads"] == threads
    assert facts["threads"] == {"inference": threads, "train": threads, "cores": 2, "contended": eta > 0}
    assert config["rollout"]["contended"] == config["actor"]["contended"] == (eta > 0)
    assert config["dataset"]["success_mean"] == 0.4 and config["dataset"]["success_concentration"] == 3.0
    gpu_config, gpu_facts = simulated_config(raw, SimSettings(profile="qwen2.5-7b-h800"))
    assert "threads" not in gpu_config["rollout"] and "threads" not in gpu_facts


def test_the_items_success_rates_have_the_mean_asked_for():
    from areal_core.api import Context

    from areal_sim.workload import SimDataset, SimDatasetConfig

    for mean, concentration in ((0.3, 2.0), (0.7, 20.0)):
        data = SimDataset(Context(options=SimDatasetConfig(size=4000, success_mean=mean,
                                                           success_concentration=concentration)))
        rates = [item["success"] for item in data]
        assert sum(rates) / len(rates) == pytest.approx(mean, abs=0.02)
        # variance of a Beta: m (1 - m) / (c + 1)
        var = sum((r - mean) ** 2 for r in rates) / len(rates)
        assert var == pytest.approx(mean * (1 - mean) / (concentration + 1), rel=0.15)


@pytest.mark.parametrize("override, words", [
    ("sim.gpu=8", "sim.gpu: not a simulation setting"),
    ("sim.gpus=many", "sim.gpus=many: must be a whole number"),
    ("sim.gpus=0", "must be at least 1"),
    ("sim.profile=nope", "'nope' is neither a shipped profile nor a file"),
    ("sim.success_mean=1.5", r"sim.success_mean=1.5: must be above 0 and below 1"),
    ("sim.success_concentration=lots", "sim.success_concentration=lots: must be a number"),
    ("sim.step_cpu_ms=-1", r"sim.step_cpu_ms=-1: must be 0 or more \(milliseconds\)"),
])
def test_bad_simulation_settings_are_named(tmp_path, override, words):
    with pytest.raises(SimulationError, match=words):
        _simulate(tmp_path, override)


def test_inference_gpus_that_leave_nothing_to_train_on_are_refused(tmp_path):
    with pytest.raises(SimulationError, match=r"sim.inference_gpus=8: .* leave GPUs for training"):
        _simulate(tmp_path, "sim.gpus=8", "sim.inference_gpus=8")


def test_a_simulated_run_reports_what_its_metrics_and_engines_say(tmp_path):
    report = _simulate(tmp_path, "sim.gpus=8", "sim.token_scale=50")
    assert report["allocation"] == "sim:d4+sim_train:d4" and report["steps"] == 6
    assert report["samples_per_s"] == pytest.approx(6 * 8 * 4 / report["simulated_s"])
    assert 0 < report["utilisation"]["train"] < 1 and 0.5 < report["utilisation"]["inference"] <= 1
    # the staleness bound (eta = 2), read from the trained tokens' versions
    assert set(report["staleness_tokens_by_lag"]) <= {"0", "1", "2"}
    assert sum(report["staleness_tokens_by_lag"].values()) == pytest.approx(1.0)
    assert report["wall_s"] < 30 and report["simulated_s"] > 100
    written = json.loads((tmp_path / "run" / "simulation.json").read_text())
    assert written["simulated_s"] == report["simulated_s"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if r.get("step", 0) >= 1]) == 6


def test_the_same_config_simulates_to_the_same_figures(tmp_path):
    """Lockstep (areal_core.clock): the trainer's and the loop's real interleaving does not change the run."""
    first = _simulate(tmp_path / "a", "sim.gpus=8", "sim.token_scale=50")
    second = _simulate(tmp_path / "b", "sim.gpus=8", "sim.token_scale=50")
    assert first["simulated_s"] == second["simulated_s"]
    assert first["staleness_tokens_by_lag"] == second["staleness_tokens_by_lag"]
    assert (tmp_path / "a" / "run" / "samples.jsonl").read_text() == \
        (tmp_path / "b" / "run" / "samples.jsonl").read_text()
    # every metric of every step, timings included: simulated time only, no wall-clock figure among them (but
    # the line's own stamp, "time": when it was written)
    rows = [[{k: v for k, v in json.loads(line).items() if k != "time"}
             for line in (tmp_path / run / "run" / "metrics.jsonl").read_text().splitlines()] for run in ("a", "b")]
    assert len(rows[0]) == 6 and all(len(row) > 10 for row in rows[0])
    for one, other in zip(*rows):
        assert one == other, {k: (one.get(k), other.get(k)) for k in one.keys() | other.keys()
                              if one.get(k) != other.get(k)}


def test_synchronous_training_has_no_stale_tokens_and_each_step_lasts_its_parts(tmp_path):
    """eta = 0: every trained token is of the version trained on, and every step trains and lasts at least the
    weight transfer that ends it (a weak floor: the step's generation is not bounded here)."""
    report = _simulate(tmp_path, "sim.gpus=8", "sim.token_scale=50", "rollout.max_head_offpolicyness=0")
    assert report["staleness_tokens_by_lag"] == {"0": 1.0}
    profile = load_profile("qwen2.5-7b-h800")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 1]
    floor = profile.weights.transfer_s()
    for r in rows:
        assert r["time/train_s"] > 0
        assert r["time/wait_batch_s"] + r["time/train_s"] + r["time/weight_sync_s"] >= floor


def test_asynchronous_training_is_faster_than_synchronous_on_long_tailed_lengths(tmp_path):
    sync = _simulate(tmp_path / "sync", "sim.gpus=8", "sim.token_scale=50", "rollout.max_head_offpolicyness=0")
    async_ = _simulate(tmp_path / "async", "sim.gpus=8", "sim.token_scale=50", "rollout.max_head_offpolicyness=4")
    assert async_["samples_per_s"] > 1.2 * sync["samples_per_s"]
    assert async_["utilisation"]["inference"] > sync["utilisation"]["inference"]


def test_areal_simulate_runs_from_the_command_line_and_sweeps(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(SMALL.replace("total_steps: 6", "total_steps: 3"))
    run = subprocess.run([sys.executable, "-m", "areal_cli.app", "simulate", str(config), "sim.gpus=8",
                          "sim.token_scale=50", "--sweep", "rollout.max_head_offpolicyness=0,2",
                          "--out", str(tmp_path / "sweep")], capture_output=True, text=True, timeout=scaled(300))
    assert run.returncode == 0, run.stderr
    assert "samples/s" in run.stdout
    points = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [p["point"]["rollout.max_head_offpolicyness"] for p in points] == ["0", "2"]
    assert (tmp_path / "sweep" / "curves.png").stat().st_size > 10_000


def test_a_bad_setting_on_the_command_line_is_one_line_and_exit_1(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(SMALL)
    run = subprocess.run([sys.executable, "-m", "areal_cli.app", "simulate", str(config), "sim.gpus=zero"],
                         capture_output=True, text=True, timeout=scaled(120))
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "sim.gpus=zero: must be a whole number" in run.stderr


def test_drain_on_update_never_interrupts_and_is_slower_than_interruptible(tmp_path):
    """rollout.interruptible=false: the engine cannot pause, so every update waits for the requests in flight;
    no token is ever produced by a later version than the one its request started under."""
    drain = _simulate(tmp_path / "drain", "sim.gpus=8", "sim.token_scale=50", "rollout.interruptible=false",
                      "rollout.max_head_offpolicyness=4")
    interrupted = _simulate(tmp_path / "inter", "sim.gpus=8", "sim.token_scale=50", "rollout.max_head_offpolicyness=4")
    assert drain["steady_samples_per_s"] < interrupted["steady_samples_per_s"]
    assert drain["engine_aborts"] == 0 and interrupted["engine_aborts"] > 0


def test_the_cpu_time_per_decode_step_is_a_setting_that_moves_the_step_time(tmp_path):
    """sim.step_cpu_ms replaces the profile's assumed CPU-side work per decode step (2 ms in the H800 profiles):
    every decode step costs the difference, so generation slows as it grows, and the report says what was used."""
    profile = load_profile("qwen2.5-7b-h800")
    assert profile.inference.step_cpu_s == 0.002
    gpu_only = profile.with_step_cpu(0.0).inference.decode_step_s
    assert gpu_only(64, 4096) == pytest.approx(profile.inference.decode_step_s(64, 4096) - 0.002)
    reports = {ms: _simulate(tmp_path / str(ms), "sim.gpus=8", "sim.token_scale=50", f"sim.step_cpu_ms={ms}")
               for ms in ("0", "10")}
    assert reports["0"]["step_cpu_ms"] == 0 and reports["10"]["step_cpu_ms"] == 10
    assert reports["10"]["simulated_s"] > 1.2 * reports["0"]["simulated_s"]
    assert _simulate(tmp_path / "default", "sim.gpus=8", "sim.token_scale=50")["step_cpu_ms"] == 2


def test_the_colocated_synchronous_baseline_takes_turns_on_every_gpu(tmp_path):
    """sim.colocate=true: the servers and the actor share all 8 GPUs and take turns (verl's and the AReaL paper's
    synchronous baseline); against eta 0 on a split of the same 8 GPUs, each phase has twice the GPUs: training
    takes about half the time, generation (latency-bound at this batch) no more, and nothing trained is stale."""
    split = _simulate(tmp_path / "split", "sim.gpus=8", "sim.token_scale=50", "rollout.max_head_offpolicyness=0")
    colocated = _simulate(tmp_path / "colo", "sim.gpus=8", "sim.token_scale=50", "rollout.max_head_offpolicyness=0",
                          "sim.colocate=true")
    assert colocated["allocation"] == "sim:d8|sim_train:d8" and colocated["colocated"] is True
    assert (colocated["inference_gpus"], colocated["train_gpus"]) == (8, 8)
    assert colocated["staleness_tokens_by_lag"] == {"0": 1.0}

    def mean_train_s(run):
        rows = [json.loads(line) for line in (tmp_path / run / "run" / "metrics.jsonl").read_text().splitlines()]
        return sum(r["time/train_s"] for r in rows if r.get("step", 0) >= 1) / 6

    # twice the GPUs: half the compute, a little more all-reduce (over 8 ranks instead of 4)
    assert 0.5 < mean_train_s("colo") / mean_train_s("split") < 0.6
    assert colocated["samples_per_s"] > split["samples_per_s"]
    # the two roles never run at once: their busy times add up to at most the run's
    busy = colocated["utilisation"]["inference"] + colocated["utilisation"]["train"]
    assert busy <= 1.0 + 1e-9, colocated["utilisation"]


@pytest.mark.parametrize("overrides, words", [
    (["sim.colocate=true"], r"sim.colocate=true: generation and training take turns .*"
                            r"rollout.max_head_offpolicyness is 2\). Fix: add rollout.max_head_offpolicyness=0"),
    (["sim.colocate=true", "rollout.max_head_offpolicyness=0", "sim.inference_gpus=4"],
     "sim.inference_gpus=4 with sim.colocate=true"),
    (["sim.colocate=maybe"], "sim.colocate=maybe: must be true or false"),
])
def test_a_colocated_setting_that_cannot_be_is_named(tmp_path, overrides, words):
    with pytest.raises(SimulationError, match=words):
        _simulate(tmp_path, "sim.gpus=8", *overrides)


def test_a_simulation_until_steady_stops_once_its_rate_stops_moving(tmp_path):
    """sim.steady_tolerance: the run ends when its second-half rate has stayed within the tolerance since half as
    many steps; its figure is then what the same run gives when left to run all of total_steps, within the
    tolerance, in fewer steps. A run whose rate keeps moving (eta 2 here settles into cycles of a long step and
    two short ones) runs all its steps and says so."""
    from areal_sim.simulate import Steady

    # the rule itself, on made-up step times: a ramp is not steady, a flat run is after min_steps
    assert not Steady(0.02).reached([10.0] * 7, 1)
    assert Steady(0.02).reached([10.0] * 8, 1)
    assert not Steady(0.02).reached([100.0 - 5 * i for i in range(16)], 1)  # still speeding up
    sync = ["sim.gpus=8", "sim.token_scale=50", "trainer.total_steps=40", "rollout.max_head_offpolicyness=0"]
    long = _simulate(tmp_path / "long", *sync)
    steady = _simulate(tmp_path / "steady", *sync, "sim.steady_tolerance=0.02")
    assert steady["steady"] == {"tolerance": 0.02, "reached": True, "max_steps": 40}
    assert 8 <= steady["steps"] < 40 and long["steps"] == 40 and long["steady"] is None
    assert steady["steady_samples_per_s"] == pytest.approx(long["steady_samples_per_s"], rel=0.05)
    assert steady["samples_per_s"] == pytest.approx(steady["steps"] * 8 * 4 / steady["simulated_s"])
    cycling = _simulate(tmp_path / "cycling", "sim.gpus=8", "sim.token_scale=50", "trainer.total_steps=20",
                        "sim.steady_tolerance=0.02")
    assert cycling["steady"] == {"tolerance": 0.02, "reached": False, "max_steps": 20} and cycling["steps"] == 20
