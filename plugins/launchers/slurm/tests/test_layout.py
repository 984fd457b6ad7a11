"""Where the job puts each role, from the allocation alone (no process is started), and the option checks."""

from __future__ import annotations

import pytest

from areal_core.config.allocation import parse_allocation

from areal_plugin_slurm.config import SlurmConfig, option_problems
from areal_plugin_slurm.layout import LayoutError, Step, plan_layout


def layout(text: str, gpus_per_node: int = 8, with_servers: bool = True):
    allocation = parse_allocation(text)
    rollout, actor = allocation.components  # servers first, trainer second, as written below
    return plan_layout(allocation, rollout, actor, gpus_per_node, with_servers)


def test_separate_groups_that_do_not_fit_one_node_get_nodes_of_their_own():
    job = layout("vllm:d2t4+fsdp:d8")
    assert (job.nodes, job.gpus_per_node, job.tasks_per_node) == (2, 8, 8)
    assert job.servers == Step("servers", tasks=2, nodes=1, first_node=0, tasks_per_node=2, gpus_per_task=4)
    assert job.train == Step("train", tasks=8, nodes=1, first_node=1, tasks_per_node=8, gpus_per_task=1)
    assert job.check == Step("check", tasks=2, nodes=2, first_node=0, tasks_per_node=1)
    assert job.describe() == ("2 nodes, 8 GPU(s) per node: 2 inference servers on node 0; "
                              "8 train ranks on node 1")


def test_what_fits_one_node_stays_on_one_node_and_asks_only_for_its_gpus():
    job = layout("vllm:d2+fsdp:d2")
    assert (job.nodes, job.gpus_per_node, job.tasks_per_node) == (1, 4, 4)
    assert job.servers.first_node == job.train.first_node == 0
    assert not job.train.overlap


def test_colocated_components_share_their_nodes_and_gpus():
    job = layout("vllm:d4|fsdp:d4")
    assert (job.nodes, job.gpus_per_node) == (1, 4)
    assert job.train.overlap and "--overlap" in job.train.srun_options(0)
    big = layout("vllm:d2t8|fsdp:d16")
    assert (big.nodes, big.servers.nodes, big.train.nodes) == (2, 2, 2)
    assert big.servers.first_node == big.train.first_node == 0


def test_ranks_spread_evenly_over_the_nodes_they_need():
    job = layout("vllm:d1+fsdp:d12")
    assert (job.train.nodes, job.train.tasks_per_node, job.train.first_node) == (2, 6, 1)
    assert job.nodes == 3


def test_cpu_components_run_on_the_first_node_without_gpus():
    job = layout("rl_infer_double:d2@cpu+rl_train_double:cpu")
    assert (job.nodes, job.gpus_per_node, job.tasks_per_node) == (1, 0, 3)
    assert job.servers.gpus_per_task == 0 and "--gpus-per-task" not in " ".join(job.servers.srun_options(0))
    mixed = layout("local:d2@cpu+fsdp:d16")
    assert (mixed.nodes, mixed.servers.first_node, mixed.train.first_node, mixed.train.nodes) == (2, 0, 0, 2)
    assert mixed.tasks_per_node == 10  # 2 servers beside 8 ranks on node 0


def test_an_engine_inside_the_trainer_gets_no_servers_step():
    job = layout("vllm:d2+fsdp:d2", with_servers=False)
    assert job.servers is None and job.train.tasks == 2


def test_a_server_larger_than_a_node_is_refused_naming_the_option():
    with pytest.raises(LayoutError) as caught:
        layout("vllm:d1t16+fsdp:d8")
    assert caught.value.key == "allocation"
    assert "each inference server uses 16 GPUs, more than one node has (launcher.gpus_per_node=8)" in str(caught.value)


def test_srun_options_of_a_step():
    step = Step("servers", tasks=2, nodes=1, first_node=3, tasks_per_node=2, gpus_per_task=4)
    assert step.srun_options(8) == ["--job-name=servers", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
                                    "--relative=3", "--exact", "--gpus-per-task=4", "--cpus-per-task=8",
                                    "--kill-on-bad-exit=1"]


@pytest.mark.parametrize("time", ["30", "30:00", "24:00:00", "2-00", "1-12:00", "7-00:00:00", "UNLIMITED"])
def test_slurm_time_formats_pass(time):
    assert option_problems(SlurmConfig(time=time)) == []


def test_options_sbatch_would_misread_are_named_with_the_fix():
    problems = option_problems(SlurmConfig(time="24h", partition="gpu a100", sbatch_lines=[
        "--exclusive", "#SBATCH --mem=0", "mem=0", "--nodes=4", "#SBATCH -p debug"]))
    assert [p[0] for p in problems] == ["launcher.time", "launcher.partition", "launcher.sbatch_lines[2]",
                                        "launcher.sbatch_lines[3]", "launcher.sbatch_lines[4]"]
    assert problems[0][1] == "'24h' is not a SLURM time limit"
    assert "e.g. launcher.time=24:00:00" in problems[0][2]
    assert problems[3][1] == ("'--nodes=4' sets --nodes, which the launcher writes itself from the allocation and "
                              "launcher.gpus_per_node")
    assert "set launcher.partition instead" in problems[4][2]
