"""What `areal run` / `areal check` say with the slurm launcher before anything runs: the dry run's scripts,
a machine without SLURM, a launcher without a dry run, options sbatch would misread."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from slurm_helpers import ALLOCATION, LAUNCHER, SLURM_RUN, areal

from areal_core.testing import scaled


def dry_run_files(output: str) -> dict[str, str]:
    """The files a dry run prints, by name: '==> PATH <==' then the text."""
    parts = re.split(r"^==> (.+) <==$", output, flags=re.M)
    return {Path(path).name: text.strip("\n") + "\n" for path, text in zip(parts[1::2], parts[2::2])}


def test_dry_run_prints_the_scripts_from_the_yaml_options_and_writes_nothing(doubles, standins, tmp_path):
    config, env = doubles
    data = yaml.safe_load(config.read_text())
    data.update(allocation=ALLOCATION, launcher={
        "name": "slurm", "partition": "gpu", "account": "proj-42", "time": "24:00:00", "qos": "high",
        "gpus_per_node": 2, "cpus_per_task": 4, "sbatch_lines": ["--exclusive", "#SBATCH --mem=0"],
        "setup": ["module load cuda/12.4", "source /opt/venvs/areal/bin/activate"],
        "python": "/opt/venvs/areal/bin/python"})
    data["rollout"]["backend"], data["actor"]["backend"] = "served_infer_double", "gpu_train_double"
    written = tmp_path / "slurm.yaml"
    written.write_text(yaml.safe_dump(data))
    runs = tmp_path / "runs"
    proc = areal(["run", str(written), f"output_dir={runs}", "trial=dry", "--dry-run"], standins.env(env))
    assert proc.returncode == 0, proc.stdout
    run_dir = runs / "areal" / "dry"
    assert f"writes these files under {run_dir}/slurm/" in proc.stdout
    assert "2 nodes, 2 GPU(s) per node: 2 inference servers on node 0; 1 train rank on node 1" in proc.stdout
    files = dry_run_files(proc.stdout)
    assert sorted(files) == ["job.sbatch", "plan.json", "step.sh"]
    batch, step = files["job.sbatch"], files["step.sh"]
    assert [line for line in batch.splitlines() if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=areal-areal-dry", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2",
        "#SBATCH --gpus-per-node=2", "#SBATCH --cpus-per-task=4", "#SBATCH --partition=gpu",
        "#SBATCH --account=proj-42", "#SBATCH --time=24:00:00", "#SBATCH --qos=high",
        f"#SBATCH --output={run_dir}/logs/slurm-job-%j.log", "#SBATCH --exclusive", "#SBATCH --mem=0"]
    sruns = [line for line in batch.splitlines() if line.startswith("srun ")]
    assert [re.search(r"--job-name=(\w+)", s).group(1) for s in sruns] == ["check", "servers", "train"]
    check, servers, train = sruns
    assert "--nodes=2 --ntasks=2 --ntasks-per-node=1 --relative=0" in check
    assert "--nodes=1 --ntasks=2 --ntasks-per-node=2 --relative=0 --exact --gpus-per-task=1 --cpus-per-task=4" in servers
    assert "--nodes=1 --ntasks=1 --ntasks-per-node=1 --relative=1 --exact --gpus-per-task=1 --cpus-per-task=4" in train
    assert all("--kill-on-bad-exit=1" in s and s.endswith("&") for s in sruns)
    lines = step.splitlines()
    assert lines.index("module load cuda/12.4") < lines.index("source /opt/venvs/areal/bin/activate") < \
        lines.index(f"exec /opt/venvs/areal/bin/python -m areal_plugin_slurm.step \"$1\" {run_dir}")
    for name, text in (("job.sbatch", batch), ("step.sh", step)):  # both parse as bash
        script = tmp_path / name
        script.write_text(text)
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, name
    assert standins.calls() == []  # nothing submitted
    assert not runs.exists()  # no run folder: the real run afterwards starts as if there had been no dry run


def test_without_sbatch_the_run_is_refused_naming_it_and_nothing_is_written(doubles, tmp_path):
    config, env = doubles
    bare = {**env, "PATH": "/usr/bin:/bin"}
    assert shutil.which("sbatch", path=bare["PATH"]) is None
    runs = tmp_path / "runs"
    proc = areal(["run", str(config), f"output_dir={runs}", *SLURM_RUN, *LAUNCHER], bare)
    assert proc.returncode == 1, proc.stdout
    assert "Traceback" not in proc.stdout
    assert "`sbatch`, `squeue`, `scancel` are not on PATH on this machine" in proc.stdout
    assert "fix: run `areal run` on a login node of the SLURM cluster" in proc.stdout
    assert "launcher.name" in proc.stdout
    assert not runs.exists()
    dry = areal(["run", str(config), f"output_dir={runs}", *SLURM_RUN, *LAUNCHER, "--dry-run"], bare)
    assert dry.returncode == 0, dry.stdout  # a dry run needs no SLURM
    assert not runs.exists()


def test_dry_run_of_a_launcher_without_one_is_one_clear_paragraph(doubles, tmp_path):
    config, env = doubles
    runs = tmp_path / "runs"
    proc = areal(["run", str(config), f"output_dir={runs}", "--dry-run"], env)  # the local launcher
    assert proc.returncode == 1
    assert proc.stdout.startswith("--dry-run: the 'local' launcher has no dry run (it declares no launcher.dry_run "
                                  "option)")
    assert "Fix: drop --dry-run" in proc.stdout and "Traceback" not in proc.stdout
    assert "unknown key" not in proc.stdout and len(proc.stdout.strip().splitlines()) == 1
    assert not runs.exists()


def test_areal_check_names_bad_options_and_placements_before_anything_is_submitted(doubles, tmp_path):
    config, env = doubles
    proc = areal(["check", str(config), *SLURM_RUN, "launcher.name=slurm", "launcher.time=24h",
                  "launcher.sbatch_lines=[--nodes=4]"], env)
    assert proc.returncode == 1
    assert "launcher.time: '24h' is not a SLURM time limit" in proc.stdout
    assert "launcher.sbatch_lines[0]: '--nodes=4' sets --nodes" in proc.stdout
    big = areal(["check", str(config), *SLURM_RUN, "allocation=served_infer_double:d1t4+gpu_train_double:d1",
                 "launcher.name=slurm", "launcher.gpus_per_node=2"], env)
    assert big.returncode == 1
    assert "each inference server uses 4 GPUs, more than one node has (launcher.gpus_per_node=2)" in big.stdout
    ok = areal(["check", str(config), *SLURM_RUN, *LAUNCHER], env)
    assert ok.returncode == 0, ok.stdout


def test_a_run_folder_whose_earlier_job_is_still_queued_is_not_submitted_again(doubles, standins, tmp_path):
    config, env = doubles
    env = standins.env(env)
    sleeper = tmp_path / "sleeper.sh"
    sleeper.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path / 'sleeper-%j.log'}\nexec sleep 60\n")
    job = subprocess.run([str(standins.bin / "sbatch"), "--parsable", str(sleeper)], env=env, capture_output=True,
                         text=True, timeout=scaled(30)).stdout.strip()
    try:
        run_dir = tmp_path / "runs" / "areal" / "queued"
        (run_dir / "slurm").mkdir(parents=True)
        (run_dir / "slurm" / "job-id").write_text(f"{job}\n")  # as an earlier `areal run` left it
        proc = areal(["run", str(config), f"output_dir={tmp_path / 'runs'}", "trial=queued", *SLURM_RUN, *LAUNCHER],
                     env)
        assert proc.returncode == 1, proc.stdout
        assert f"SLURM job {job}, started earlier for this run folder, is still in the queue" in proc.stdout
        assert f"cancel it (scancel {job})" in proc.stdout
        assert len(standins.calls("sbatch")) == 1  # only the sleeper
    finally:
        subprocess.run([str(standins.bin / "scancel"), job], env=env, timeout=scaled(30))
