"""Whole runs through the generated scripts and the SLURM stand-ins (every pretend node is this machine):
a run that trains, a train step that fails, `areal run` stopped by SIGTERM, a node with another plugin version.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from importlib import metadata

import pytest

from areal_core.testing import scaled
from areal_core.testing.distributions import install_fake_distribution
from areal_core.testing.processes import read_jsonl
from slurm_helpers import AREAL, LAUNCHER, SLURM_RUN, areal, run_processes, wait_until


def test_a_run_through_slurm_trains_the_steps_the_local_launcher_does(doubles, standins, tmp_path):
    config, env = doubles
    runs = tmp_path / "runs"
    slurm_env = standins.env({**env, "AREAL_TEST_SERVED_FILE": str(tmp_path / "served-slurm.jsonl")})
    run = ["run", str(config), f"output_dir={runs}", "trial=t", *SLURM_RUN, *LAUNCHER]
    dry = areal([*run, "--dry-run"], slurm_env)  # a dry run first: it must not stand in the real run's way
    assert dry.returncode == 0, dry.stdout
    proc = areal(run, slurm_env)
    assert proc.returncode == 0, proc.stdout
    run_dir = runs / "areal" / "t"
    assert "submitted SLURM job 1000: 2 nodes" in proc.stdout
    assert f"areal run finished: {run_dir} (SLURM job 1000)" in proc.stdout
    steps = standins.steps()  # servers and train start side by side, in either order
    assert steps[0] == "check" and sorted(steps[1:]) == ["servers", "train"]
    assert json.loads((run_dir / "slurm" / "status.json").read_text()) == {
        "job": "1000", "state": "completed", "step": "", "code": 0}
    # The servers ran on node0 where the launcher put them, and the trainer on node1 found each by its address.
    seen = sorted((r["index"], r["hello"]["index"], r["hello"]["node"], r["server_node"], r["trainer_node"],
                   r["same_node"]) for r in read_jsonl(tmp_path / "served-slurm.jsonl"))
    assert seen == [(0, 0, "node0", "node0", "node1", False), (1, 1, "node0", "node0", "node1", False)]
    assert "check passed on 2 node(s) (node0, node1)" in (run_dir / "logs" / "slurm-check-0.log").read_text()
    assert not run_processes(run_dir)

    local_env = {**env, "AREAL_TEST_SERVED_FILE": str(tmp_path / "served-local.jsonl")}
    local = areal(["run", str(config), f"output_dir={runs}", "trial=local", *SLURM_RUN], local_env)
    assert local.returncode == 0, local.stdout
    for name, key in (("samples.jsonl", "items"), ("metrics.jsonl", "step")):
        ours = [row[key] for row in read_jsonl(run_dir / name)]
        assert ours == [row[key] for row in read_jsonl(runs / "areal" / "local" / name)], name
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow  # a whole job each (~7 s): CI's slow suite runs them
def test_a_failing_train_step_tears_the_job_down_and_is_quoted(doubles, standins, tmp_path):
    config, env = doubles
    runs = tmp_path / "runs"
    proc = areal(["run", str(config), f"output_dir={runs}", "trial=fails", *SLURM_RUN, *LAUNCHER,
                  "trainer.save_every=1"], standins.env({**env, "AREAL_TEST_FAIL_AT_STEP": "2"}))
    run_dir = runs / "areal" / "fails"
    assert proc.returncode == 1, proc.stdout
    out = proc.stdout
    assert "areal run failed: step train of SLURM job 1000 (the train ranks) exited with status 1; task 0 on node " \
           "node1 failed first" in out
    assert f"last 30 lines of {run_dir}/logs/slurm-train-0.log" in out or \
           f"lines of {run_dir}/logs/slurm-train-0.log" in out
    assert "RuntimeError: injected failure in step 2 (AREAL_TEST_FAIL_AT_STEP)" in out
    assert f"The checkpoint of step 1 is complete and verifies: continue from it with: areal run {config} " in out
    assert re.search(r"continue from it with: areal run .* --resume\n", out), out
    assert json.loads((run_dir / "slurm" / "status.json").read_text())["state"] == "failed"
    assert "stopped (received SIGTERM)" in (run_dir / "logs" / "slurm-servers-0.log").read_text()
    assert not run_processes(run_dir)


@pytest.mark.slow  # a whole job each (~7 s): CI's slow suite runs them
def test_sigterm_to_areal_run_cancels_the_job_and_leaves_nothing_running(doubles, standins, tmp_path):
    config, env = doubles
    runs = tmp_path / "runs"
    run_dir = runs / "areal" / "stopped"
    proc = subprocess.Popen([AREAL, "run", str(config), f"output_dir={runs}", "trial=stopped", *SLURM_RUN, *LAUNCHER,
                             "trainer.total_steps=50", "actor.step_s=0.5"], env=standins.env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 1, 90, "the run's first step")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=scaled(90))
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "areal run received SIGTERM: cancelling SLURM job 1000 (scancel 1000)" in out
    assert "areal run stopped (received SIGTERM); SLURM job 1000 was cancelled and has left the queue. Continue " \
           f"with: areal run {config} output_dir={runs} trial=stopped " in out
    assert re.search(r"Continue with: areal run .* actor.step_s=0.5 --resume\n", out), out
    assert [c["argv"] for c in standins.calls("scancel")] == [["1000"]]
    assert json.loads((run_dir / "slurm" / "status.json").read_text())["state"] == "cancelled"
    assert not run_processes(run_dir)


def test_a_node_with_another_plugin_version_is_refused_before_any_server_starts(doubles, standins, tmp_path):
    config, env = doubles
    mine = metadata.version("areal-plugin-slurm")
    runs = tmp_path / "runs"
    with install_fake_distribution(tmp_path / "node1-site", "areal-plugin-slurm", "9.9.9", {}, {}) as site:
        node_env = json.dumps({"node1": {"PYTHONPATH": str(site)}})  # only node1's tasks see it
        proc = areal(["run", str(config), f"output_dir={runs}", "trial=mismatch", *SLURM_RUN, *LAUNCHER],
                     standins.env({**env, "SLURM_STANDIN_NODE_ENV": node_env}))
    run_dir = runs / "areal" / "mismatch"
    assert proc.returncode == 1, proc.stdout
    assert "areal run failed: step check of SLURM job 1000 (same plugins and shared storage on every node) " \
           "exited with status 1; task 0 on node node0 failed first" in proc.stdout
    assert "every node of a run must have the same areal plugins at the same versions, and these differ:" in proc.stdout
    assert f"areal-plugin-slurm is {mine} on the launcher's machine" in proc.stdout
    assert "but 9.9.9 on node1" in proc.stdout
    assert standins.steps() == ["check"]
    assert not list((run_dir / "logs").glob("rollout-*.log")) and not list((run_dir / "logs").glob("actor-*.log"))
    assert not run_processes(run_dir)


@pytest.mark.slow  # a whole job each (~7 s): CI's slow suite runs them
def test_a_server_that_dies_mid_run_fails_the_job_naming_the_servers_step(doubles, standins, tmp_path):
    config, env = doubles
    runs = tmp_path / "runs"
    run_dir = runs / "areal" / "crash"
    crash = {"AREAL_TEST_SERVER_EXIT": f"1:{run_dir / 'metrics.jsonl'}"}  # server 1 exits after the first step
    proc = areal(["run", str(config), f"output_dir={runs}", "trial=crash", *SLURM_RUN, *LAUNCHER,
                  "trainer.total_steps=50", "actor.step_s=0.3"], standins.env({**env, **crash}))
    assert proc.returncode == 1, proc.stdout
    assert "areal run failed: step servers of SLURM job 1000 (the inference servers) exited with status 1; task 1 " \
           "on node node0 failed first" in proc.stdout
    assert "rollout-1 exited with code 3" in proc.stdout
    assert len(read_jsonl(run_dir / "metrics.jsonl")) < 50  # the train step was stopped, not left to finish
    assert "stopped (received SIGTERM)" in (run_dir / "logs" / "slurm-train-0.log").read_text()
    assert not run_processes(run_dir)


@pytest.mark.slow
def test_two_ranks_on_two_nodes_then_resume_after_a_failure(doubles, standins, tmp_path):
    """Two train ranks on node1 and node2 meet at rank 0's rendezvous; the run fails in step 2, and --resume
    continues it in a second job from the step-1 checkpoint."""
    config, env = doubles
    runs = tmp_path / "runs"
    run = ["run", str(config), f"output_dir={runs}", "trial=ranks", *SLURM_RUN, *LAUNCHER,
           "allocation=served_infer_double:d1+gpu_train_double:d2", "launcher.gpus_per_node=1",
           "trainer.save_every=1"]
    failed = areal(run, standins.env({**env, "AREAL_TEST_FAIL_AT_STEP": "2"}), timeout=240)
    assert failed.returncode == 1, failed.stdout
    assert "submitted SLURM job 1000: 3 nodes" in failed.stdout
    assert "The checkpoint of step 1 is complete" in failed.stdout
    run_dir = runs / "areal" / "ranks"
    for rank, node in ((0, "node1"), (1, "node2")):
        log = (run_dir / "logs" / f"slurm-train-{rank}.log").read_text()
        assert f"train rank {rank} of 2 on {node}" in log
    resumed = areal([*run, "--resume"], standins.env(env), timeout=240)
    assert resumed.returncode == 0, resumed.stdout
    assert "submitted SLURM job 1001" in resumed.stdout
    assert json.loads((run_dir / "slurm" / "plan.json").read_text())["resume"] is True
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert not run_processes(run_dir)
