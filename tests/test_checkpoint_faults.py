"""Fault injection on checkpoints: a run killed mid-way whose newest checkpoint is then damaged (truncated,
overwritten with random bytes, replaced by another step's file, a pickle payload dropped in) resumes from the
checkpoint before it, says which file it passed over, and trains no step on the damaged state; with every
checkpoint damaged it stops with one paragraph naming each, trains nothing and runs no code from the folder.

Every run is `areal run` in a subprocess with the RL doubles (the counter train engine writes
``actor/state.json``; the uninterrupted run's batches are known: items 0-17 in order, three per step).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing.processes import processes_mentioning, read_jsonl
from areal_core.testing.waits import scaled, wait_until

pytestmark = pytest.mark.slow

AREAL = str(Path(sys.executable).with_name("areal"))
ARGS = ("trial=damaged", "actor.step_s=0.2", "trainer.save_every=1")
EXPECTED_ITEMS = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17]]


@pytest.fixture
def killed_after_four_steps(tmp_path, rl_doubles_env):
    """A run killed while it holds at its fifth step: checkpoints of steps 3 and 4 are kept (the store keeps
    two). Yields (start, run_dir)."""
    config, env = rl_doubles_env

    def start(*more: str, extra_env: dict | None = None, command: str = "run") -> subprocess.Popen:
        return subprocess.Popen([AREAL, command, str(config), f"output_dir={tmp_path / 'runs'}", *ARGS, *more],
                                env={**env, **(extra_env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    run_dir = tmp_path / "runs" / "areal" / "damaged"
    proc = start(extra_env={"AREAL_TEST_HOLD_AT_VERSION": f"4:{tmp_path / 'never'}"})
    pointer = run_dir / "checkpoints" / "latest"

    def saved_four() -> bool:
        assert proc.poll() is None, proc.communicate()[0]
        return pointer.exists() and pointer.read_text().strip() == "step-00000004"

    wait_until(saved_four, 120, "the checkpoint of step 4")
    proc.send_signal(signal.SIGKILL)
    proc.wait(scaled(30))
    wait_until(lambda: not processes_mentioning(str(run_dir)), 15, f"the processes of {run_dir} to go")
    assert [s["step"] for s in read_jsonl(run_dir / "samples.jsonl")] == [1, 2, 3, 4]
    yield start, run_dir


def damage(run_dir: Path, step: int, how: str, marker: Path) -> str:
    """Damage checkpoint ``step`` of the run; returns the file the resume must name."""
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    state = folder / "actor" / "state.json"
    if how == "truncated":
        state.write_bytes(state.read_bytes()[:5])
    elif how == "random-bytes":
        state.write_bytes(os.urandom(state.stat().st_size))
    elif how == "other-step":  # finite garbage: a real state of the run, one step older
        state.write_text((run_dir / "checkpoints" / f"step-{step - 1:08d}" / "actor" / "state.json").read_text())
    elif how == "pickle-payload":  # the file name resume used to unpickle
        (folder / "controller.pkl").write_bytes(f"cos\nsystem\n(S'touch {marker}'\ntR.".encode())
        return "controller.pkl"
    else:
        raise AssertionError(how)
    return "actor/state.json"


@pytest.mark.parametrize("how", ["truncated", "random-bytes", "other-step", "pickle-payload"])
def test_a_damaged_newest_checkpoint_is_passed_over_and_nothing_trains_on_it(killed_after_four_steps, tmp_path,
                                                                             how):
    start, run_dir = killed_after_four_steps
    marker = tmp_path / "pwned"
    named = damage(run_dir, 4, how, marker)
    if how == "random-bytes":  # `areal check --resume` says the same, and starts nothing
        check = start("--resume", command="check")
        out, _ = check.communicate(timeout=scaled(60))
        assert check.returncode == 0, out
        assert f"--resume: {run_dir / 'checkpoints' / 'step-00000004'} does not verify: {named} does not hold " \
               f"what was saved" in out
        assert f"--resume: {run_dir} resumes after step 3 from {run_dir / 'checkpoints' / 'step-00000003'}" in out
        assert [s["step"] for s in read_jsonl(run_dir / "samples.jsonl")] == [1, 2, 3, 4]
    proc = start("--resume")
    out, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 0, out
    log = (run_dir / "logs" / "actor-rank0.log").read_text()
    step4 = run_dir / "checkpoints" / "step-00000004"
    assert f"resume: {step4} does not verify: {named}" in log, log
    assert "passing over it" in log
    assert f"resume: continuing after step 3 from {run_dir / 'checkpoints' / 'step-00000003'}" in log
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 2, 3, 4, 5, 6]  # step 4 redone from step 3's state
    assert [s["items"] for s in samples] == EXPECTED_ITEMS  # no item twice, none skipped
    # completions.jsonl (its records carry no text: the doubles' workflow has no tokenizer) is cut back with it
    written = [(r["step"], r["item"]) for r in read_jsonl(run_dir / "completions.jsonl")]
    assert written == [(s["step"], item) for s in samples for item in s["items"] for _ in range(2)]
    final = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert json.loads((final / "actor" / "state.json").read_text())["version"] == 6  # nothing of step 4's state
    assert not marker.exists()


def test_with_every_checkpoint_damaged_the_run_stops_naming_each_and_trains_nothing(killed_after_four_steps,
                                                                                     tmp_path):
    start, run_dir = killed_after_four_steps
    marker = tmp_path / "pwned"
    damage(run_dir, 4, "random-bytes", marker)
    damage(run_dir, 3, "pickle-payload", marker)
    proc = start("--resume")
    out, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 1, out
    checkpoints = run_dir / "checkpoints"
    assert (f"areal: the run stopped at step 0: no checkpoint under {checkpoints} verifies, so none is loaded: "
            f"{checkpoints / 'step-00000004'} does not verify: actor/state.json does not hold what was saved") in out
    assert f"| {checkpoints / 'step-00000003'} does not verify: controller.pkl is not in the manifest" in out
    assert "Traceback" not in out, out
    assert "The checkpoint of step" not in out  # no checkpoint is offered to continue from
    assert [s["step"] for s in read_jsonl(run_dir / "samples.jsonl")] == [1, 2, 3, 4]
    assert not marker.exists()
    check = start("--resume", command="check")
    out, _ = check.communicate(timeout=scaled(60))
    assert check.returncode == 1, out
    assert f"--resume: no checkpoint under {checkpoints} verifies, so none is loaded" in out


def test_a_run_folder_moved_elsewhere_resumes_from_its_new_place(killed_after_four_steps, tmp_path):
    start, run_dir = killed_after_four_steps
    moved = tmp_path / "moved" / "areal" / "copied"
    shutil.move(run_dir, moved)
    proc = start("--resume", f"output_dir={tmp_path / 'moved'}", "trial=copied")
    out, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 0, out
    assert "--resume: continuing with output_dir (" in out and "trial ('damaged' -> 'copied')" in out
    assert f"resume: continuing after step 4 from {moved / 'checkpoints' / 'step-00000004'}" in \
        (moved / "logs" / "actor-rank0.log").read_text()
    assert [s["items"] for s in read_jsonl(moved / "samples.jsonl")] == EXPECTED_ITEMS
    assert not run_dir.exists()
