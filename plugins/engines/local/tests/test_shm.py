"""areal_local.shm: the /dev/shm safetensors file the client rewrites in place for every weight version."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from areal_local.shm import FILE_NAME, PREFIX, WeightStage, sweep_stale  # noqa: E402


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    # Odd sizes and mixed widths: a 2-byte tensor of odd length before a 4-byte one would misalign the latter
    # if the writer kept the given order.
    return {"norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),
            "proj.weight": torch.randn(3, 5, generator=g),
            "steps": torch.tensor([seed, 3], dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "half": torch.randn(1, 3, generator=g).to(torch.float16)}


def assert_same(folder, expected: dict) -> None:
    got = load_file(str(folder / FILE_NAME))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_versions_are_rewritten_in_place_and_read_back_exactly(tmp_path):
    stage = WeightStage(tmp_path)
    first = weights(0)
    folder = stage.write(first.items(), 1)
    assert folder.parent == tmp_path and folder.name.startswith(PREFIX)
    assert_same(folder, first)
    inode = (folder / FILE_NAME).stat().st_ino
    second = weights(1)
    assert stage.write(second.items(), 2) == folder
    assert (folder / FILE_NAME).stat().st_ino == inode  # same file, same pages
    assert_same(folder, second)
    stage.close()
    assert not folder.exists()


def test_a_new_layout_gets_a_new_file_and_the_old_one_goes(tmp_path):
    stage = WeightStage(tmp_path)
    old = stage.write(weights(0).items(), 1)
    bigger = {**weights(1), "extra": torch.ones(4)}
    new = stage.write(bigger.items(), 2)
    assert new != old and not old.exists()
    assert_same(new, bigger)
    stage.close()


def test_the_same_tensors_and_version_are_written_once_for_every_engine(tmp_path):
    stage = WeightStage(tmp_path)
    pairs = list(weights(0).items())
    folder = stage.write(pairs, 5)
    before = load_file(str(folder / FILE_NAME))["proj.weight"].clone()
    pairs[1][1].add_(1.0)  # if the second engine's call wrote again, the file would hold this
    assert stage.write(pairs, 5) == folder
    assert torch.equal(load_file(str(folder / FILE_NAME))["proj.weight"], before)
    assert not torch.equal(load_file(str(stage.write(pairs, 6) / FILE_NAME))["proj.weight"], before)
    stage.close()


def test_unsupported_dtypes_are_refused_by_name(tmp_path):
    stage = WeightStage(tmp_path)
    with pytest.raises(ValueError, match="'z' has dtype torch.complex64"):
        stage.write([("z", torch.zeros(2, dtype=torch.complex64))], 1)


def test_folders_of_dead_processes_are_swept_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60)
    stale = tmp_path / f"{PREFIX}{int(dead.stdout)}-abc"
    stale.mkdir()
    (stale / FILE_NAME).write_bytes(b"x")
    stage = WeightStage(tmp_path)
    live = stage.write(weights(0).items(), 1)  # creating a file sweeps first
    assert not stale.exists() and live.exists()
    assert sweep_stale(tmp_path) == []
    stage.close()
