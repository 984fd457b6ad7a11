"""What the SLURM plugin's tests share besides fixtures (conftest.py): the run's settings, `areal` as a
subprocess, and what is left running of a run. Imported by file location (this folder is put on sys.path),
never as ``conftest``, which pytest imports under a name of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from areal_core.testing import scaled, wait_until as core_wait_until

HERE = Path(__file__).parent
STANDINS = HERE / "slurm_standins"
AREAL = str(Path(sys.executable).with_name("areal"))
COMMANDS = ("sbatch", "srun", "scancel", "squeue")
# Two pretend nodes: the two inference servers on node0, the train rank on node1 (3 GPUs, 2 per node).
ALLOCATION = "served_infer_double:d2+gpu_train_double:d1"
SLURM_RUN = [f"allocation={ALLOCATION}", "rollout.backend=served_infer_double", "actor.backend=gpu_train_double",
             "trainer.total_steps=3"]
# The launcher's waits, shorter than its defaults so that a broken run fails soon (times AREAL_TEST_TIMEOUT_SCALE).
LAUNCHER = ["launcher.name=slurm", "launcher.gpus_per_node=2", "launcher.host=127.0.0.1", "launcher.poll_s=0.2",
            f"launcher.cancel_timeout_s={scaled(30):g}", f"launcher.step_wait_timeout_s={scaled(60):g}",
            f"launcher.submit_timeout_s={scaled(30):g}"]


@dataclass
class StandIns:
    """The stand-ins' folder on PATH and their state (job table, one JSON line per call)."""

    bin: Path
    state: Path

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "PATH": f"{self.bin}{os.pathsep}{base.get('PATH', '')}", "SLURM_STANDIN_STATE": str(self.state),
                "SLURM_STANDIN_KILL_WAIT_S": f"{scaled(10):g}"}

    def calls(self, command: str | None = None) -> list[dict]:
        path = self.state / "calls.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if command is None or r["command"] == command]

    def steps(self) -> list[str]:
        """The srun steps started, by --job-name, in the order their sruns began."""
        return [r["options"].get("job-name", "?") for r in self.calls("srun")]


def areal(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """``areal ARGS`` to its end, at most ``scaled(timeout)`` seconds."""
    return subprocess.run([AREAL, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=scaled(timeout))


def run_processes(run_dir: Path) -> list[str]:
    """What is still running of a run: processes whose environment or command line names its folder."""
    marker = str(run_dir).encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            with open(f"/proc/{entry.name}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if not zombie and (b"AREAL_SLURM_RUN_DIR=" + marker in environ.split(b"\0") or marker in cmdline):
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
            found.append(f"{entry.name}: {command}")
    return found


def wait_until(check, timeout: float, what: str) -> None:
    """:func:`areal_core.testing.wait_until`, polling every 0.1 s (``timeout`` is scaled there)."""
    core_wait_until(check, timeout, what, 0.1)
