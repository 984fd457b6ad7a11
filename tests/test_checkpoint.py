"""Checkpoints a resumed run can trust: complete or absent, whatever moment the
writer died at, verified against their manifest before anything is loaded, and
RNG state (JSON, never pickle) that reproduces the same random numbers."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import json

from areal_core.checkpoint import (
    CheckpointDamagedError,
    CheckpointStore,
    atomic_dir,
    load_json,
    rng_state,
    save_json_atomic,
    set_rng_state,
    verify,
    write_manifest,
)
from areal_core.testing.waits import wait_until


def writer_of(text):
    def write(folder):
        (folder / "model.bin").write_text(text)
    return write


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_save_makes_a_step_folder_with_meta_and_points_latest_at_it(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    assert store.latest() is None
    path = store.save(12, writer_of("w12"), {"version": 3})
    assert path == tmp_path / "checkpoints" / "step-00000012"
    assert names(path) == ["manifest.json", "meta.json", "model.bin"]
    assert store.load_meta(path) == {"step": 12, "version": 3}
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert manifest == {"meta.json": {"bytes": (path / "meta.json").stat().st_size,
                                      "sha256": hashlib.sha256((path / "meta.json").read_bytes()).hexdigest()},
                        "model.bin": {"bytes": 3, "sha256": hashlib.sha256(b"w12").hexdigest()}}
    assert verify(path) == []
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000012"
    assert store.latest() == path
    assert names(tmp_path / "checkpoints") == ["latest", "step-00000012"]


def test_a_write_that_raises_leaves_no_folder_and_latest_unchanged(tmp_path):
    store = CheckpointStore(tmp_path)
    first = store.save(1, writer_of("w1"), {})

    def broken(folder):
        (folder / "model.bin").write_text("half")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        store.save(2, broken, {})
    assert names(tmp_path) == ["latest", "step-00000001"]
    assert store.latest() == first


def test_replacing_an_existing_step_folder(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(5, writer_of("old"), {"run": 1})
    with pytest.raises(ValueError):
        with atomic_dir(tmp_path / "step-00000005") as tmp:
            (tmp / "model.bin").write_text("never")
            raise ValueError
    assert (tmp_path / "step-00000005" / "model.bin").read_text() == "old"

    path = store.save(5, writer_of("new"), {"run": 2})
    assert (path / "model.bin").read_text() == "new"
    assert store.load_meta(path)["run"] == 2
    assert names(tmp_path) == ["latest", "step-00000005"]


def crash_before_pointer(monkeypatch):
    def crash(name):
        raise KeyboardInterrupt("killed between folder rename and pointer update")
    monkeypatch.setattr(CheckpointStore, "_write_pointer", lambda self, name: crash(name))


def test_crash_between_folder_rename_and_pointer_update(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    store.save(1, writer_of("w1"), {})
    second = store.save(2, writer_of("w2"), {})
    with monkeypatch.context() as m:
        crash_before_pointer(m)
        with pytest.raises(KeyboardInterrupt):
            store.save(3, writer_of("w3"), {})
    assert (tmp_path / "step-00000003" / "meta.json").is_file()
    # the pointer is the commit point: it still names step 2, which is complete
    assert store.latest() == second

    # the pointer names a folder that is gone: fall back to the newest complete one
    (tmp_path / "latest").write_text("step-00000009\n")
    assert store.latest() == tmp_path / "step-00000003"


def test_without_a_pointer_the_newest_complete_folder_wins(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    crash_before_pointer(monkeypatch)
    for step in (1, 2):
        with pytest.raises(KeyboardInterrupt):
            store.save(step, writer_of("w"), {})
    (tmp_path / "step-00000007").mkdir()  # no meta.json: incomplete
    (tmp_path / "step-00000008.tmp-123").mkdir()
    assert not (tmp_path / "latest").exists()
    assert store.latest() == tmp_path / "step-00000002"


def test_prune_keeps_the_newest_and_never_the_latest(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in range(1, 6):
        store.save(step, writer_of(f"w{step}"), {})
    store.prune(keep=2)
    assert names(tmp_path) == ["latest", "step-00000004", "step-00000005"]

    (tmp_path / "latest").write_text("step-00000004\n")  # e.g. a rollback
    store.prune(keep=0)
    assert names(tmp_path) == ["latest", "step-00000004"]
    with pytest.raises(ValueError, match="keep must be >= 0"):
        store.prune(-1)


def test_prune_removes_temporary_folders_of_dead_writers(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, writer_of("w1"), {})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f"step-00000002.tmp-{dead.stdout.strip()}"
    stale.mkdir()
    mine = tmp_path / f"step-00000003.tmp-{os.getpid()}"
    mine.mkdir()
    store.prune(keep=5)
    assert not stale.exists() and mine.exists()


def draws():
    import numpy as np
    import torch

    return (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())


def test_rng_state_round_trip_reproduces_python_numpy_and_torch(tmp_path):
    pytest.importorskip("numpy")
    pytest.importorskip("torch")
    random.seed(1)
    draws()  # advance every generator away from its seed
    save_json_atomic(rng_state(), tmp_path / "rng.json")
    expected = draws()
    draws()  # move on, as the rest of a run would
    set_rng_state(load_json(tmp_path / "rng.json"))
    assert draws() == expected
    assert names(tmp_path) == ["rng.json"]
    saved = json.loads((tmp_path / "rng.json").read_text())  # plain JSON: nothing in it names code
    assert sorted(saved) == ["numpy", "python", "torch"] and isinstance(saved["torch"], str)


def test_save_json_atomic_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state" / "controller.json"
    save_json_atomic({"position": 1}, path)
    save_json_atomic({"position": 2}, path)
    assert load_json(path) == {"position": 2}
    assert names(path.parent) == ["controller.json"]


def two_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    for step in (1, 2):
        def write(folder, step=step):
            (folder / "actor").mkdir()
            (folder / "actor" / "model.safetensors").write_bytes(os.urandom(4096) + bytes([step]))
            (folder / "controller.json").write_text(json.dumps({"consumed": step}))
        store.save(step, write, {"version": step})
    return store, store.path_for(1), store.path_for(2)


def damage(folder, how, other=None):
    """Damage a checkpoint as a disk, a copy or a hand would; the manifest is left as the save wrote it."""
    weights = folder / "actor" / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif how == "random-bytes":  # the same size, 256 bytes in the middle overwritten
        data = bytearray(weights.read_bytes())
        data[1024:1280] = os.urandom(256)
        weights.write_bytes(bytes(data))
    elif how == "other-step":  # finite garbage: another checkpoint's weights, of the same size and format
        weights.write_bytes((other / "actor" / "model.safetensors").read_bytes())
    elif how == "pickle-added":
        (folder / "controller.pkl").write_bytes(b"cos\nsystem\n(S'touch /tmp/areal-pwned'\ntR.")
    elif how == "removed":
        weights.unlink()
    elif how == "no-manifest":
        (folder / "manifest.json").unlink()
    else:
        raise AssertionError(how)


DAMAGE = {"truncated": "actor/model.safetensors has 1000 bytes, the manifest 4097 (truncated or replaced)",
          "random-bytes": "actor/model.safetensors does not hold what was saved",
          "other-step": "actor/model.safetensors does not hold what was saved",
          "pickle-added": "controller.pkl is not in the manifest (a file added after the save)",
          "removed": "actor/model.safetensors is missing",
          "no-manifest": "it has no manifest.json"}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_latest_checkpoint_is_named_and_passed_over_for_the_one_before(tmp_path, how):
    store, first, second = two_checkpoints(tmp_path)
    assert store.resumable() == (second, [])
    damage(second, how, other=first)
    assert store.latest() == second  # complete, as far as the folder's names go
    problems = verify(second)
    assert len(problems) == 1 and problems[0].startswith(DAMAGE[how]), problems
    found, passed = store.resumable()
    assert found == first
    assert passed == [f"{second} does not verify: {problems[0]}"]


def test_when_no_checkpoint_verifies_the_error_names_each_and_nothing_is_chosen(tmp_path):
    store, first, second = two_checkpoints(tmp_path)
    damage(first, "other-step", other=second)
    damage(second, "truncated")
    with pytest.raises(CheckpointDamagedError) as info:
        store.resumable()
    text = str(info.value)
    assert f"no checkpoint under {store.root} verifies, so none is loaded: {second} does not verify: " \
           f"actor/model.safetensors has 1000 bytes" in text
    assert f"| {first} does not verify: actor/model.safetensors does not hold what was saved" in text
    assert "Fix: restore the folder from a copy" in text
    assert CheckpointStore(tmp_path / "nothing").resumable() == (None, [])


def test_a_manifest_that_is_not_one_and_links_in_a_checkpoint_are_refused(tmp_path):
    store, first, second = two_checkpoints(tmp_path)
    (second / "manifest.json").write_text("{not json")
    assert verify(second)[0].startswith("its manifest.json cannot be read (JSONDecodeError")
    target = first / "actor" / "model.safetensors"
    (first / "actor" / "model.safetensors").unlink()
    (first / "actor" / "model.safetensors").symlink_to(second / "actor" / "model.safetensors")
    assert verify(first) == ["actor/model.safetensors is a symbolic link, not the file that was saved"]
    with pytest.raises(ValueError, match="holds a symbolic link, actor/model.safetensors"):
        write_manifest(first)
    assert target.is_symlink()


WRITER = textwrap.dedent('''
    import hashlib, os, sys, time
    from areal_core.checkpoint import CheckpointStore

    store = CheckpointStore(sys.argv[1])
    latest = store.latest()
    step = store.load_meta(latest)["step"] + 1 if latest else 0
    while True:
        files = {name: os.urandom(3 * 1024 * 1024) for name in ("model.bin", "optim.bin")}
        def write(folder):
            for name, data in files.items():
                with open(folder / name, "wb") as f:
                    for i in range(0, len(data), 256 * 1024):
                        f.write(data[i:i + 256 * 1024])
                        time.sleep(0.001)  # a slow disk: most kills land mid-write
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        store.save(step, write, {"sha256": digests})
        store.prune(keep=3)
        with open(sys.argv[2], "a") as log:
            log.write(f"saved {step}\\n")
        step += 1
''')


def test_sigkill_at_random_moments_never_leaves_a_broken_checkpoint(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "checkpoints"
    store = CheckpointStore(root)
    rng = random.Random(0)
    steps = []
    for i in range(10):
        saved = tmp_path / f"saved-{i}.log"  # a line per checkpoint this writer has saved
        proc = subprocess.Popen([sys.executable, str(script), str(root), str(saved)])
        # Each writer saves one checkpoint first, so every round moves the run on however slow the machine; the
        # kill then lands at a random moment of the saves after it (most of them mid-write).
        wait_until(lambda: proc.poll() is not None or (saved.exists() and saved.read_text().endswith("\n")), 120,
                   f"writer {i} to save a checkpoint")
        assert proc.poll() is None, f"writer {i} exited with {proc.returncode}"
        time.sleep(rng.uniform(0.02, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()

        # every folder under a final name that has meta.json is whole, not only the latest
        complete = [p for p in root.glob("step-*") if ".tmp-" not in p.name and (p / "meta.json").exists()]
        for folder in complete:
            assert verify(folder) == [], folder  # and its manifest says so
            for name, digest in store.load_meta(folder)["sha256"].items():
                assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, (folder, name)
        latest = store.latest()
        if latest is not None:
            assert latest in complete
            steps.append(store.load_meta(latest)["step"])
    assert steps == sorted(steps) and steps and steps[-1] >= 3, steps


def test_the_scores_areal_eval_writes_into_a_checkpoint_do_not_break_it(tmp_path):
    from areal_core.evaluate import EVAL_FILE

    store, first, second = two_checkpoints(tmp_path)
    (second / EVAL_FILE).write_text('{"eval/accuracy": 0.5}')
    assert verify(second) == [] and store.resumable() == (second, [])
