"""A checkpoint that does not fit on its disk (issue 21, item 4): refused before anything is written when the
free space cannot hold it, and a disk that fills up during the write is named as such, with what the checkpoint
needs and the fix, instead of the writer's own words ("[enforce fail at inline_container.cc:672] unexpected
pos"); ``latest`` and the previous checkpoint are untouched and no partial folder is left.

The full disks are real where they can be: a small tmpfs mounted in a user namespace (``unshare``, no root
needed where the kernel allows it) that the real writers (torch.save, safetensors, torch.distributed.checkpoint)
fill, and ``/dev/full``, which answers every write with ENOSPC. Only the free-space precheck on a large disk uses
a stubbed ``shutil.disk_usage``.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest

from areal_core import checkpoint
from areal_core.checkpoint import CheckpointSpaceError, CheckpointStore, is_disk_full
from areal_core.testing.waits import scaled

MiB = 1024**2
Usage = namedtuple("Usage", "total used free")


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def write_bytes(n: int, name: str = "model.bin"):
    def write(folder: Path) -> None:
        (folder / name).write_bytes(b"x" * n)
    return write


@functools.cache
def can_mount_tmpfs() -> bool:
    """Whether this user may mount a tmpfs in a new user + mount namespace (``unshare -rm``)."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"areal-tmpfs-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{probe}'"],
                              capture_output=True, timeout=scaled(30))
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        probe.rmdir()


needs_tmpfs = pytest.mark.skipif(not can_mount_tmpfs(), reason="no unprivileged tmpfs (unshare -rm) here")


def in_tmpfs(mount: Path, size: str, command: str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``command`` (sh) with a ``size`` tmpfs mounted at ``mount``, in a namespace of its own."""
    mount.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs '{mount}' && "
                           f"{command}"], capture_output=True, text=True, timeout=scaled(180), **kwargs)


# ------------------------------------------------------------------ the precheck
def test_a_save_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    store = CheckpointStore(root)
    first = store.save(1, write_bytes(3 * MiB), {})
    size = checkpoint.tree_bytes(first)
    needed = checkpoint.needed_with_margin(size)
    assert needed == int(size * 1.1) + 64 * MiB
    free = needed - 1
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - free, free))
    called = []
    with pytest.raises(CheckpointSpaceError) as caught:
        store.save(2, lambda folder: called.append(folder), {})
    assert called == []  # refused before the engine wrote anything
    err = caught.value
    assert err.errno == errno.ENOSPC and not err.began and err.free == free and err.needed == needed
    message = str(err)
    assert message.startswith(f"no room for the checkpoint of step 2 in {root}: it needs about 3.0 MiB "
                              f"(as much as the checkpoint of step 1) plus a margin of 64.3 MiB, and ")
    assert f"has {checkpoint.human_bytes(free)} free" in message
    assert "the filesystem mounted at " in message
    assert "Nothing was written; the checkpoint of step 1 is still the latest." in message
    assert message.endswith("Fix: free at least 1 B there, or set output_dir to a folder on a disk with room")
    assert names(root) == ["latest", "step-00000001"] and store.latest() == first

    # with room enough it saves, and the next estimate is this save's size (no second walk of the folder)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(10**12, 0, needed))
    second = store.save(2, write_bytes(5 * MiB), {})
    assert store.latest() == second
    assert store._expected_bytes(second) == (checkpoint.tree_bytes(second), "the checkpoint of step 2")


def test_the_precheck_reads_the_size_of_a_checkpoint_saved_by_an_earlier_process(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    CheckpointStore(root).save(4, write_bytes(2 * MiB), {})
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(10**12, 0, 66 * MiB))
    with pytest.raises(CheckpointSpaceError, match=r"needs about 2\.0 MiB \(as much as the checkpoint of step 4\)"):
        CheckpointStore(root).save(5, write_bytes(1), {})  # a resumed run: a new store, no size remembered
    assert names(root) == ["latest", "step-00000004"]


def test_the_first_save_has_nothing_to_compare_with_and_is_not_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(10**12, 0, 1))
    assert CheckpointStore(tmp_path).save(1, write_bytes(10), {}).name == "step-00000001"


# ------------------------------------------------------------------ a disk that fills up during the write
def test_enospc_from_the_writer_is_named_and_the_partial_folder_removed(tmp_path):
    """The kernel's own ENOSPC: the engine's file is /dev/full."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    root = tmp_path / "checkpoints"
    store = CheckpointStore(root)
    first = store.save(1, write_bytes(1000), {"version": 1})

    def engine(folder: Path) -> None:
        (folder / "actor").mkdir()
        (folder / "actor" / "config.json").write_text("{}")
        (folder / "actor" / "model.bin").symlink_to("/dev/full")
        with open(folder / "actor" / "model.bin", "wb") as f:
            f.write(b"x" * 100_000)

    with pytest.raises(CheckpointSpaceError) as caught:
        store.save(2, engine, {"version": 2})
    message = str(caught.value)
    assert caught.value.began and isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ENOSPC
    assert message.startswith(f"no space left for the checkpoint of step 2 in {root}: the filesystem mounted at ")
    assert " ran out of space after 11 B of it were written (" in message  # config.json and the link
    assert " that were free when it began (the checkpoint of step 1 took 1.3 KiB). " in message  # with its manifest
    assert ("The partial checkpoint was removed; the checkpoint of step 1 is still the latest. Fix: free space "
            "there, or set output_dir to a folder on a disk with room (the writer said: ") in message
    assert message.endswith("(the writer said: OSError: [Errno 28] No space left on device)")
    assert names(root) == ["latest", "step-00000001"]
    assert store.latest() == first and store.load_meta(first)["version"] == 1


def test_a_full_disk_at_the_pointer_leaves_the_previous_latest(tmp_path):
    """The new folder is complete but ``latest`` could not be rewritten: the message says which one counts."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    store = CheckpointStore(tmp_path)
    first = store.save(1, write_bytes(10), {})
    (tmp_path / f".latest.tmp-{os.getpid()}").symlink_to("/dev/full")  # where the new pointer is written
    with pytest.raises(CheckpointSpaceError) as caught:
        store.save(2, write_bytes(10), {})
    assert str(caught.value).startswith(f"no space left for the pointer to step-00000002 in {tmp_path}: the "
                                        f"filesystem mounted at ")
    assert (f"{tmp_path / 'step-00000002'} is complete, but the checkpoint of step 1 is still the latest. Fix: "
            in str(caught.value))
    assert names(tmp_path) == ["latest", "step-00000001", "step-00000002"]  # the temporary pointer is gone
    assert store.latest() == first


def test_other_write_errors_keep_their_own_type_and_words(tmp_path):
    store = CheckpointStore(tmp_path)

    def broken(folder: Path) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError, match="Input/output error") as caught:
        store.save(1, broken, {})
    assert not isinstance(caught.value, CheckpointSpaceError)
    assert names(tmp_path) == []


def test_a_writer_that_only_fails_is_judged_by_the_free_space_left(tmp_path, monkeypatch):
    """torch.save on a full disk says only "unexpected pos": less than 4 MiB left free at that moment is what
    tells a full disk from another failure."""
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 0))
    assert is_disk_full(error, tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(10**9, 0, 5 * MiB))
    assert not is_disk_full(error, tmp_path)
    assert is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
                        tmp_path)


def test_the_error_survives_pickling(tmp_path):
    import pickle

    err = CheckpointSpaceError("no room", path=tmp_path, needed=5, free=1, began=False)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.path, back.needed, back.free, back.began, back.errno) == (
        "no room", tmp_path, 5, 1, False, errno.ENOSPC)


FILL = textwrap.dedent('''
    import json, sys, warnings
    from pathlib import Path
    import torch
    from areal_core import checkpoint
    from areal_core.checkpoint import CheckpointSpaceError, CheckpointStore

    warnings.simplefilter("ignore")
    root = Path(sys.argv[1])
    MiB = 1024**2

    def torch_save(n):
        return lambda folder: torch.save(torch.zeros(n // 4), folder / "optimizer.pt")

    def safetensors(n):
        from safetensors.torch import save_file
        return lambda folder: save_file({"w": torch.zeros(n // 4)}, str(folder / "model.safetensors"))

    def dcp(n):
        import torch.distributed.checkpoint as dcp
        return lambda folder: dcp.save({"optimizer": {"w": torch.zeros(n // 4)}},
                                       storage_writer=dcp.FileSystemWriter(str(folder / "optim")), no_dist=True)

    def attempt(store, step, write):
        try:
            store.save(step, write, {})
        except CheckpointSpaceError as exc:
            return {"message": str(exc), "began": exc.began, "left": sorted(p.name for p in store.root.iterdir())}
        return {"saved": True}

    out = {}
    for name, writer in [("torch", torch_save), ("safetensors", safetensors), ("dcp", dcp)]:
        out[name] = attempt(CheckpointStore(root / name), 1, writer(8 * MiB))  # a first save: no estimate
        shutil = __import__("shutil"); shutil.rmtree(root / name, ignore_errors=True)
    store = CheckpointStore(root / "two")
    out["first"] = attempt(store, 1, torch_save(1 * MiB))
    out["refused"] = attempt(store, 2, torch_save(1 * MiB))  # 1 MiB + 64 MiB margin do not fit in 4 MiB
    checkpoint.SPACE_MARGIN_BYTES = 0  # let the write itself meet the full disk
    out["filled"] = attempt(store, 2, torch_save(6 * MiB))
    out["latest"] = (root / "two" / "latest").read_text().strip()
    print(json.dumps(out))
''')


@needs_tmpfs
def test_real_writers_filling_a_real_tmpfs(tmp_path):
    script = tmp_path / "fill.py"
    script.write_text(FILL)
    mount = tmp_path / "disk"
    done = in_tmpfs(mount, "4m", f"'{sys.executable}' '{script}' '{mount}'")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    for writer, said in [("torch", "RuntimeError: [enforce fail at inline_container.cc"),
                         ("safetensors", "No space left on device (os error 28)"),
                         ("dcp", "RuntimeError: [enforce fail at inline_container.cc")]:
        got = out[writer]
        assert got["began"] and got["left"] == [], (writer, got)
        assert got["message"].startswith(f"no space left for the checkpoint of step 1 in {mount / writer}: "
                                         f"the filesystem mounted at {mount} (tmpfs) ran out of space"), got
        assert " free now); it needs more than the 4.0 MiB that were free when it began. " in got["message"], got
        assert ("The partial checkpoint was removed; no checkpoint of this run is complete yet. Fix: free space "
                "there, or set output_dir to a folder on a disk with room (the writer said: ") in got["message"], got
        assert said in got["message"], got

    assert out["first"] == {"saved": True}
    refused = out["refused"]
    assert not refused["began"] and refused["left"] == ["latest", "step-00000001"]
    assert refused["message"].startswith(f"no room for the checkpoint of step 2 in {mount / 'two'}: it needs about "
                                         f"1.0 MiB (as much as the checkpoint of step 1) plus a margin of 64.1 MiB, "
                                         f"and the filesystem mounted at {mount} (tmpfs) has ")
    assert "Nothing was written; the checkpoint of step 1 is still the latest." in refused["message"]

    filled = out["filled"]
    assert filled["began"] and filled["left"] == ["latest", "step-00000001"]
    assert "that were free when it began (the checkpoint of step 1 took 1.0 MiB). " in filled["message"]
    assert "The partial checkpoint was removed; the checkpoint of step 1 is still the latest." in filled["message"]
    assert out["latest"] == "step-00000001"


# ------------------------------------------------------------------ a whole run: trainer, launcher, terminal
AREAL = str(Path(sys.executable).with_name("areal"))


@needs_tmpfs
@pytest.mark.parametrize("case", ["fills", "refused", "refused-2-ranks"])
def test_a_run_whose_checkpoint_disk_is_full_stops_with_the_message_not_a_traceback(rl_doubles_env, tmp_path,
                                                                                     case):
    """The issue's run: the checkpoints folder on an 8 MiB tmpfs; the train engine (a double) writes its
    optimizer with torch.save. "fills": 16 MiB at step 1, which meets the full disk; "refused": 2 MiB, so step
    1 is saved and step 2 refused by the precheck (2 MiB + the 64 MiB margin > the 6 MiB left); with two
    train ranks, rank 1 (waiting for the folder) stops with rank 0's words."""
    config, env = rl_doubles_env
    run_dir = tmp_path / "runs" / "areal" / case
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    env["AREAL_TEST_CHECKPOINT_PAD_MB"] = "16" if case == "fills" else "2"
    ranks = "allocation=rl_infer_double:d2@cpu+rl_train_double:d2@cpu" if case.endswith("2-ranks") else ""
    command = (f"'{AREAL}' run '{config}' output_dir='{tmp_path / 'runs'}' trial={case} trainer.total_steps=3 {ranks} "
               f"trainer.save_every=1; rc=$?; echo \"@@ left: $(ls -A '{checkpoints}' | tr '\\n' ' ')\"; "
               f"echo \"@@ latest: $(cat '{checkpoints}/latest' 2>/dev/null)\"; exit $rc")
    done = in_tmpfs(checkpoints, "8m", command, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Traceback" not in out, out
    failed = re.search(r"areal run failed: actor-rank(\d) exited with code 1", out)
    assert failed and (failed.group(1) == "0" or case == "refused-2-ranks"), out
    if case == "fills":
        assert (f"areal: the run stopped at step 1: no space left for the checkpoint of step 1 in {checkpoints}: "
                f"the filesystem mounted at {checkpoints} (tmpfs) ran out of space after ") in out, out
        assert ("The partial checkpoint was removed; no checkpoint of this run is complete yet. Fix: free space "
                "there, or set output_dir to a folder on a disk with room (the writer said: RuntimeError: "
                "[enforce fail at inline_container.cc:") in out, out
        assert "@@ left: \n" in out and "@@ latest: \n" in out, out
        assert "The checkpoint of step" not in out
    else:
        assert (f"areal: the run stopped at step 2: no room for the checkpoint of step 2 in {checkpoints}: it needs "
                f"about 2.0 MiB (as much as the checkpoint of step 1) plus a margin of 64.2 MiB, and the "
                f"filesystem mounted at {checkpoints} (tmpfs) has ") in out, out
        assert ("Nothing was written; the checkpoint of step 1 is still the latest. Fix: free at least ") in out
        resume = re.search(r"The checkpoint of step 1 is complete and verifies: continue from it with: (areal run .*)",
                           out)
        assert resume and resume.group(1).endswith(" --resume"), out  # the command that started it, resumed
        assert "@@ left: latest step-00000001 \n" in out and "@@ latest: step-00000001\n" in out, out
    if case == "refused-2-ranks":
        assert "areal: the run stopped at step 2: no room for the checkpoint of step 2" in \
            (run_dir / "logs" / "actor-rank1.log").read_text()


def test_a_run_whose_engine_meets_enospc_stops_with_the_message(rl_doubles_env, tmp_path):
    """Where no tmpfs can be mounted too: the engine double's optimizer file is /dev/full (the kernel's ENOSPC)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    config, env = rl_doubles_env
    env.update(AREAL_TEST_CHECKPOINT_PAD_MB="1", AREAL_TEST_CHECKPOINT_PAD_DEVICE="/dev/full")
    done = subprocess.run([AREAL, "run", str(config), f"output_dir={tmp_path / 'runs'}", "trial=devfull",
                           "trainer.total_steps=2"], env=env, capture_output=True, text=True, timeout=scaled(180))
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in out, out
    checkpoints = tmp_path / "runs" / "areal" / "devfull" / "checkpoints"
    assert (f"areal: the run stopped at step 2: no space left for the checkpoint of step 2 in {checkpoints}: "
            f"the filesystem mounted at ") in out, out
    assert ("The partial checkpoint was removed; no checkpoint of this run is complete yet. Fix: free space there, "
            "or set output_dir to a folder on a disk with room (the writer said: OSError: [Errno 28] No space left "
            "on device)") in out, out
    assert list(checkpoints.iterdir()) == []
