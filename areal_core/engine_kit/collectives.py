"""The few collectives a train engine's bookkeeping needs beside its parallelism library's own: agreeing on a
count and waiting for the other ranks. Each is a no-op (or the identity) in one process."""

from __future__ import annotations

from typing import Any


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def comm_device(device: Any) -> Any:
    """Where small tensors for a collective live: ``device`` under nccl, the CPU under gloo."""
    import torch
    import torch.distributed as dist

    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def max_over_ranks(count: int, device: Any = "cpu") -> int:
    """The largest ``count`` over the ranks of the default group (an all-reduce MAX; ``count`` in one process).
    Every rank must call it. ``device``: the engine's device (its CUDA device under nccl)."""
    if _world() == 1:
        return count
    import torch
    import torch.distributed as dist

    box = torch.tensor([count], dtype=torch.long, device=comm_device(torch.device(device)))
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())


def barrier() -> None:
    """Wait for every rank of the default group (nothing in one process)."""
    if _world() > 1:
        import torch.distributed as dist

        dist.barrier()


class RankCollectives:
    """The three as methods of an engine with a ``device`` attribute (a mixin for train engines)."""

    device: Any

    def _comm_device(self) -> Any:
        return comm_device(self.device)

    def _max_over_ranks(self, count: int) -> int:
        """The largest ``count`` of all ranks (``count`` itself in one process); every rank calls it."""
        return max_over_ranks(count, self.device)

    def _barrier(self) -> None:
        barrier()
