"""areal_local.shm: the /dev/shm safetensors file the client rewrites in place for every weight version."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
import sys

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from safetensors.torch import save_file  # noqa: E402

from areal_local.shm import DELTA_PREFIX, FILE_NAME, PREFIX, IncompleteWeights, MappedWeights, WeightStage, sweep_stale  # noqa: E402


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


def test_versions_go_into_the_two_slots_in_turn_rewritten_in_place_and_read_back_exactly(tmp_path):
    stage = WeightStage(tmp_path)
    folders, inodes = [], []
    for version in range(1, 5):
        expected = weights(version)
        folder = stage.write(expected.items(), version)
        assert folder.parent.parent == tmp_path and folder.parent.name.startswith(PREFIX)
        assert_same(folder, expected)
        folders.append(folder)
        inodes.append((folder / FILE_NAME).stat().st_ino)
    # slot 0, slot 1, slot 0, slot 1: the slot holding the newest version is never the one written
    assert folders[0] == folders[2] != folders[1] == folders[3] and [f.name for f in folders[:2]] == ["slot0", "slot1"]
    assert inodes[0] == inodes[2] and inodes[1] == inodes[3]  # same files, same pages
    assert_same(folders[2], weights(3))  # the slot not written last still holds its version, untouched
    stage.close()
    assert not folders[0].parent.exists()


def test_a_new_layout_gets_a_new_file_and_the_old_one_goes(tmp_path):
    stage = WeightStage(tmp_path)
    old = stage.write(weights(0).items(), 1)
    bigger = {**weights(1), "extra": torch.ones(4)}
    new = stage.write(bigger.items(), 2)
    assert new.parent != old.parent and not old.parent.exists() and new.name == "slot0"
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
    stale, stale_delta = tmp_path / f"{PREFIX}{int(dead.stdout)}-abc", tmp_path / f"{DELTA_PREFIX}{int(dead.stdout)}-d"
    live_delta = tmp_path / f"{DELTA_PREFIX}{os.getpid()}-d"
    for folder in (stale, stale_delta, live_delta):
        folder.mkdir()
        (folder / FILE_NAME).write_bytes(b"x")
    stage = WeightStage(tmp_path)
    live = stage.write(weights(0).items(), 1)  # creating a file sweeps first
    assert not stale.exists() and not stale_delta.exists() and live.exists() and live_delta.exists()
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
    assert reader.last_is_stage
    pointer = got["proj.weight"].data_ptr()
    other = stage.write(second.items(), 2) / FILE_NAME  # the other slot: the first one's views are untouched
    assert other != file
    assert_views_equal(reader.tensors(other, 2), second)
    assert_views_equal(got, first)
    del got
    assert stage.write(weights(3).items(), 3) / FILE_NAME == file  # in place: the same pages, still mapped
    got = reader.tensors(file, 3)
    assert got["proj.weight"].data_ptr() == pointer  # a view of the same mapping, no copy and no new map
    assert_views_equal(got, weights(3))
    del got
    reader.close()
    stage.close()


def test_a_half_written_stage_file_is_refused_not_half_read(tmp_path):
    stage, reader = WeightStage(tmp_path), MappedWeights()
    kept = stage.write(weights(0).items(), 1) / FILE_NAME
    reader.tensors(kept, 1)
    file = stage.slot_folder(1) / FILE_NAME  # where version 2 goes

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
    assert_views_equal(reader.tensors(kept, 1), weights(0))  # the slot served from is untouched
    assert stage.write(weights(1).items(), 2) / FILE_NAME == file  # the retry goes into the same slot
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


# ------------------------------------------------------------------ exports straight into the stage (destination)
def version_weights(version: int) -> dict:
    return {"a.weight": torch.full((3, 5), float(version)), "b.weight": torch.full((7,), -float(version)),
            "c": torch.full((2,), version, dtype=torch.int64)}


def export(stage: WeightStage, version: int) -> list:
    """What an engine declaring export_into does with the stage's destination: each tensor into what it gives."""
    into = stage.destination(version)
    named = []
    for name, value in version_weights(version).items():
        target = into(name, tuple(value.shape), value.dtype) if into is not None else None
        named.append((name, target.copy_(value) if target is not None else value.clone()))
    if into is not None:
        into.complete()
    return named


def test_an_export_into_the_destination_is_the_write_and_the_slot_served_from_is_left_alone(tmp_path):
    stage = WeightStage(tmp_path)
    assert stage.destination(1) is None  # no layout yet: the first export makes its own tensors
    first = stage.write(export(stage, 1), 1)
    served = load_file(str(first / FILE_NAME))
    into = stage.destination(2)
    assert stage.destination(2) is into  # one destination per version, whoever asks
    assert into("a.weight", (3, 5), torch.float32) is not None
    assert into("a.weight", (5, 3), torch.float32) is None and into("new", (1,), torch.float32) is None
    named = [(name, into(name, tuple(v.shape), v.dtype).copy_(v)) for name, v in version_weights(2).items()]
    into.complete()
    second = stage.write(named, 2)
    assert second != first
    assert_same(second, version_weights(2))
    assert all(torch.equal(load_file(str(first / FILE_NAME))[k], v) for k, v in served.items())
    assert stage.write(named, 2) == second  # a version written already is not written again
    named[0][1].fill_(-7.0)  # the exported tensors are the file's bytes: nothing was copied out of them
    assert torch.equal(load_file(str(second / FILE_NAME))[named[0][0]], torch.full_like(named[0][1], -7.0))
    stage.close()


def test_an_export_that_was_never_written_stays_the_delta_base_and_a_failed_one_is_reused(tmp_path):
    stage = WeightStage(tmp_path)
    stage.write(export(stage, 1), 1)
    base = export(stage, 2)  # engines took version 2 as a delta: never written, the trainer's next delta base
    kept = {name: t.clone() for name, t in base}
    export(stage, 3)  # must go into the other slot than the base's
    assert all(torch.equal(t, kept[name]) for name, t in base)
    failed = stage.destination(4)
    failed("a.weight", (3, 5), torch.float32).fill_(99.0)  # an export that failed half way: never completed
    assert stage.destination(5).slot == failed.slot  # its slot is reused, not the one holding version 3
    stage.close()


def test_random_sequences_of_exports_deltas_and_full_updates_never_touch_a_slot_being_served(tmp_path):
    """The stage's rule, run against random hand-overs: two engines each take every version whole (adopting the
    slot written) or as a delta (their own memory); whatever the sequence, the bytes of a slot an engine serves
    from stay those of its version until it moves, and the trainer's delta base survives the next export."""
    import random

    for seed in range(30):
        draw = random.Random(seed)
        stage = WeightStage(tmp_path)
        serving: dict[int, tuple[Path, int]] = {}  # engine -> (slot folder, version) it serves from
        base = None
        def check_served() -> None:
            for folder, held in serving.values():
                got = load_file(str(folder / FILE_NAME))
                assert all(torch.equal(got[n], v) for n, v in version_weights(held).items()), (seed, version)

        for version in range(1, 12):
            named = export(stage, version)
            check_served()
            if base is not None:  # the delta is made after the export, from the base the trainer kept
                base_version, tensors = base
                assert all(torch.equal(t, version_weights(base_version)[n]) for n, t in tensors), (seed, version)
            base = (version, named)
            for engine in (0, 1):
                if version == 1 or draw.random() < 0.5:
                    serving[engine] = (stage.write(named, version), version)
                else:
                    serving.pop(engine, None)  # a delta: the engine copies its weights out first
            check_served()
        stage.close()
