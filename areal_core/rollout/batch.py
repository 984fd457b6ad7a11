"""Episode records and the padding-free batch the trainer receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_core.api.batch import PackedBatch
from areal_core.api.workflow import Trajectory


@dataclass
class EpisodeGroup:
    """One dataset item's accepted trajectories and how they came to be.

    ``seq`` is the item's position in the data stream (what resume keys on);
    ``start_version`` the trainer version when the episode was admitted;
    times are seconds on the controller's clock (``time.monotonic()``, or simulated time).
    """

    seq: int
    item: Any
    start_version: int
    trajectories: list[Trajectory]
    admitted_at: float
    finished_at: float
    info: dict = field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def generated_tokens(self) -> int:
        return sum(sum(t.loss_mask) for t in self.trajectories)


def pack_groups(groups: list[EpisodeGroup]) -> PackedBatch:
    """Concatenate every trajectory into one padding-free :class:`~areal_core.api.batch.PackedBatch`.

    Per token (length T = total tokens): ``input_ids``, ``position_ids``
    (restarting at 0 per sequence), ``loss_mask``, ``logprobs`` (behaviour),
    ``versions``. Per sequence (N): ``rewards``, ``group_index``, ``seq_lens``;
    ``cu_seqlens`` has N + 1 entries. The columns are plain lists (this module
    needs no torch); whoever needs one as a tensor asks ``batch.tensor(key)``,
    which converts it once for everyone after.
    """
    out: dict[str, list] = {k: [] for k in (
        "input_ids", "position_ids", "loss_mask", "logprobs", "versions",
        "rewards", "group_index", "seq_lens")}
    cu = [0]
    for g_index, group in enumerate(groups):
        for traj in group.trajectories:
            n = len(traj.tokens)
            out["input_ids"].extend(traj.tokens)
            out["position_ids"].extend(range(n))
            out["loss_mask"].extend(traj.loss_mask)
            out["logprobs"].extend(traj.logprobs)
            out["versions"].extend(traj.versions)
            out["rewards"].append(traj.reward)
            out["group_index"].append(g_index)
            out["seq_lens"].append(n)
            cu.append(cu[-1] + n)
    out["cu_seqlens"] = cu
    return PackedBatch(out)
