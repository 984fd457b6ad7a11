"""areal_local.shm: the /dev/shm safetensors file the client rewrites in place for every weight version."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from safetensors.torch import save_file  # noqa: E402

from areal_local.shm import FILE_NAME, PREFIX, IncompleteWeights, MappedWeights, WeightStage, sweep_stale  # noqa: E402


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


# ---------------------------------------------------------------------------------------------------------------
# MappedWeights: the server's side
# ---------------------------------------------------------------------------------------------------------------


def assert_views_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_the_stage_file_stays_mapped_and_each_version_reads_back_bit_exact(tmp_path):
    stage, reader = WeightStage(tmp_path), MappedWeights()
    first, second = weights(0), weights(1)
    file = stage.write(first.items(), 1) / FILE_NAME
    got = reader.tensors(file, 1)
    assert_views_equal(got, first)
    pointer = got["proj.weight"].data_ptr()
    del got
    stage.write(second.items(), 2)  # in place: the same pages, which the reader still maps
    got = reader.tensors(file, 2)
    assert got["proj.weight"].data_ptr() == pointer  # a view of the same mapping, no copy and no new map
    assert_views_equal(got, second)
    del got
    reader.close()
    stage.close()


def test_a_half_written_stage_file_is_refused_not_half_read(tmp_path):
    stage, reader = WeightStage(tmp_path), MappedWeights()
    file = stage.write(weights(0).items(), 1) / FILE_NAME
    reader.tensors(file, 1)

    class Broken:  # a tensor whose copy fails in the middle of the write
        dtype, shape = torch.float32, (3, 5)

        def detach(self):
            return self

        def cpu(self):
            return self

        def numel(self):
            return 15

        def element_size(self):
            return 4

    pairs = [(name, Broken() if name == "proj.weight" else t) for name, t in weights(1).items()]
    with pytest.raises(Exception):
        stage.write(pairs, 2)
    with pytest.raises(IncompleteWeights, match="header length is 0: a stage write that never finished"):
        reader.tensors(file, 2)
    with pytest.raises(IncompleteWeights, match="header length is 0"):
        MappedWeights().tensors(file)  # a fresh reader (a restarted server) refuses it too
    stage.write(weights(1).items(), 2)
    assert_views_equal(reader.tensors(file, 2), weights(1))
    stage.close()


def test_a_stage_file_holding_another_version_is_refused(tmp_path):
    stage = WeightStage(tmp_path)
    file = stage.write(weights(0).items(), 7) / FILE_NAME
    with pytest.raises(IncompleteWeights, match="holds version 7, not the version 8 asked for"):
        MappedWeights().tensors(file, 8)
    assert_views_equal(MappedWeights().tensors(file, 7), weights(0))
    stage.close()


def test_truncated_or_corrupt_files_are_refused_naming_the_file(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file(weights(0), str(good))
    data = good.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-4])
    with pytest.raises(IncompleteWeights, match=r"cut.safetensors: tensor '.*' .* a truncated or corrupt file"):
        MappedWeights().tensors(cut)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x00")
    with pytest.raises(IncompleteWeights, match="too short for a safetensors file"):
        MappedWeights().tensors(short)
    garbled = tmp_path / "garbled.safetensors"
    garbled.write_bytes(data[:8] + b"{" * (len(data) - 8))
    with pytest.raises(IncompleteWeights, match="the header does not parse"):
        MappedWeights().tensors(garbled)


def test_any_safetensors_file_reads_as_safetensors_reads_it(tmp_path):
    """A disk update's folder (save_file's own layout, no version) reads the same through the mapping."""
    expected = weights(3)
    file = tmp_path / "model.safetensors"
    save_file(expected, str(file), metadata={"format": "pt"})
    assert_views_equal(MappedWeights().tensors(file, 12), load_file(str(file)))
    assert_views_equal(MappedWeights().tensors(file), expected)


def test_a_tensor_at_an_unaligned_offset_is_copied_out_whole(tmp_path):
    """safetensors does not promise alignment: a float32 after three bfloat16 starts 6 bytes in."""
    import json
    import struct

    half, full = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16), torch.tensor([0.1, 0.2], dtype=torch.float32)
    header = json.dumps({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]}}).encode()
    header += b" " * (-len(header) % 8)
    file = tmp_path / "odd.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header + half.view(torch.uint8).numpy().tobytes()
                     + full.view(torch.uint8).numpy().tobytes())
    assert_views_equal(MappedWeights().tensors(file), {"a": half, "b": full})
