"""The trainer's side of the process group SGLang receives tensor weight updates over.

SGLang's protocol (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``): the server's ``t`` tensor-parallel workers
join a torch.distributed group as ranks ``1..t`` beside the trainer's rank 0,
then receive each tensor of a bucket by broadcast from rank 0 while the
bucket's names, dtypes and shapes travel over HTTP. The group is a stand-alone
torch process group (a TCPStore and a ProcessGroupGloo / ProcessGroupNCCL),
never the trainer's default group, so it can be made and dropped while
training runs. Every call here blocks: the engine runs them in a thread.
"""

from __future__ import annotations

import datetime
from typing import Any


class WeightGroup:
    """Rank 0 of a ``world_size``-rank group named ``name`` whose store listens on ``host:port``."""

    def __init__(self, name: str, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        self.name, self.host, self.port = name, host, port
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        self._group: Any = None
        self._store: Any = None

    def connect(self) -> None:
        """Wait (up to ``timeout_s``) for the server's ranks to join; raises naming the group when they do not."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            self._store = dist.TCPStore(self.host, self.port, self.world_size, is_master=True, timeout=timeout,
                                        wait_for_workers=True)
            store = dist.PrefixStore(self.name, self._store)
            if self.backend == "nccl":
                self._group = dist.ProcessGroupNCCL(store, 0, self.world_size)
            else:
                self._group = dist.ProcessGroupGloo(store, 0, self.world_size, timeout)
        except Exception as exc:  # torch raises a bare RuntimeError / DistStoreError naming nothing of ours
            raise TimeoutError(f"waited {self.timeout_s:.0f} s for the {self.world_size - 1} rank(s) of the SGLang "
                               f"server to join weight-update group {self.name!r} on {self.host}:{self.port} "
                               f"({self.backend}): {type(exc).__name__}: {exc}") from None

    def broadcast(self, tensors: list[Any]) -> None:
        """Send ``tensors`` to every rank, in order (each rank receives into tensors of the same shape and dtype)."""
        import torch.distributed as dist

        works = []
        for tensor in tensors:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            works.append(self._group.broadcast([tensor], options))
        for work in works:
            work.wait()

    def close(self) -> None:
        self._group = None
        self._store = None
