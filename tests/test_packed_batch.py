"""The typed packed batch (areal_core.api.batch.PackedBatch): layout, checks, selection and one conversion."""

from __future__ import annotations

import pickle

import pytest

from areal_core.api import FIELDS, PackedBatch
from areal_core.api.batch import SCALAR, SEQUENCE, TOKEN
from areal_core.api.workflow import Trajectory
from areal_core.rollout import pack_groups
from areal_core.rollout.batch import EpisodeGroup


def two_groups() -> list[EpisodeGroup]:
    def traj(tokens, reward):
        n = len(tokens)
        return Trajectory(tokens, [0, 0] + [1] * (n - 2), [0.0, 0.0] + [-0.5] * (n - 2), [-1, -1] + [3] * (n - 2),
                          reward)

    return [EpisodeGroup(0, {"id": 0}, 3, [traj([1, 2, 3], 1.0), traj([1, 2, 4, 5], 0.0)], 0.0, 1.0),
            EpisodeGroup(1, {"id": 1}, 3, [traj([6, 7, 8, 9, 10], 0.5)], 0.0, 1.0)]


def test_the_controller_makes_a_packed_batch_that_knows_its_layout():
    batch = pack_groups(two_groups())
    assert isinstance(batch, PackedBatch) and isinstance(batch, dict)
    assert batch.cu_seqlens == [0, 3, 7, 12] and batch.lengths == [3, 4, 5]
    assert (batch.n_tokens, batch.n_sequences) == (12, 3)
    assert batch.validate() is batch
    assert [batch.kind(k) for k in ("input_ids", "rewards", "policy_version")] == [TOKEN, SEQUENCE, SCALAR]
    batch["my_token_column"] = [0.0] * 12
    batch["my_sequence_column"] = [1, 2, 3]
    batch["my_scalar"] = 0.3
    assert [batch.kind(k) for k in ("my_token_column", "my_sequence_column", "my_scalar")] == [TOKEN, SEQUENCE,
                                                                                               SCALAR]
    assert pickle.loads(pickle.dumps(batch)) == batch  # how it reaches the other train ranks
    assert type(pickle.loads(pickle.dumps(batch))) is PackedBatch


def test_every_field_has_a_kind_a_dtype_and_a_meaning():
    assert {f.kind for f in FIELDS.values()} <= {TOKEN, SEQUENCE, SCALAR}
    assert {f.dtype for f in FIELDS.values()} <= {"int", "float", "bool"}
    assert all(f.help for f in FIELDS.values())
    produced = set(pack_groups(two_groups())) - {"cu_seqlens"}
    assert produced <= set(FIELDS), produced - set(FIELDS)


@pytest.mark.parametrize(("change", "message"), [
    ({"advantages": [0.0] * 11}, r"batch\['advantages'\] is a token column .* of length 12 \(T, the tokens\), got 11"),
    ({"rewards": [1.0, 2.0]}, r"batch\['rewards'\] is a sequence column .* of length 3 \(N, the sequences\), got 2"),
    ({"cu_seqlens": [0, 3, 3, 12]}, r"cu_seqlens must start at 0 and rise at every sequence"),
    ({"loss_weights": 1.0}, r"batch\['loss_weights'\] is a token column .* got float"),
])
def test_a_column_of_the_wrong_length_is_named_with_the_length_it_needs(change, message):
    batch = pack_groups(two_groups())
    batch.update(change)
    with pytest.raises(ValueError, match="my algorithm: " + message):
        batch.validate("my algorithm")


def test_a_column_becomes_a_tensor_once_and_stays_one():
    torch = pytest.importorskip("torch")
    from areal_core.train_batches import Packed

    batch = pack_groups(two_groups())
    mask = batch.tensor("loss_mask")
    assert mask.dtype == torch.bool and batch["loss_mask"] is mask and batch.tensor("loss_mask") is mask
    Packed(batch, "engine one")  # an engine reads every column as a tensor and leaves them in the batch
    ids = batch["input_ids"]
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.long
    Packed(batch, "engine two")
    assert batch["input_ids"] is ids  # the second reader converts nothing
    assert batch.validate() is batch


def test_select_keeps_the_layout_and_the_type():
    batch = pack_groups(two_groups())
    batch["kl_coef"] = 0.1
    part = batch.select([2, 0])
    assert isinstance(part, PackedBatch)
    assert part.cu_seqlens == [0, 5, 8] and part["input_ids"] == [6, 7, 8, 9, 10, 1, 2, 3]
    assert part["rewards"] == [0.5, 1.0] and part["kl_coef"] == 0.1
    assert part.validate() is part


def test_of_wraps_a_plain_dict_and_keeps_a_packed_batch():
    batch = pack_groups(two_groups())
    assert PackedBatch.of(batch) is batch
    plain = dict(batch)
    wrapped = PackedBatch.of(plain)
    assert isinstance(wrapped, PackedBatch) and wrapped == plain
