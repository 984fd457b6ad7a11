"""Staleness admission: how many new episodes may start now.

Counted in prompt groups (one dataset item = one group of trajectories).
With batch size ``B``, staleness bound ``eta`` and trainer version ``v``::

    capacity = min(max_concurrent - running,
                   (eta + v + 1) * B - (accepted + running))

``accepted`` counts every group ever accepted (consumed or not); a rejected
group gives its slot back.

Pacing (``pacing=True``): admission uses a *lead* ``L`` in place of ``eta``,
``1 <= L <= eta``, adapted at every batch the trainer takes. Where generation
outpaces training, running ``eta`` versions ahead only fills a queue whose
samples are ``eta`` versions old when trained on; it buys no throughput. The
lead grows by one when the trainer found its batch not ready (generation is
behind: more episodes in flight) and shrinks by one when a whole further batch
was ready besides the one taken (generation is ahead: start later). A run whose
generation is the slower side keeps ``L = eta``; one whose training is slower
settles at ``L = 1``, samples one version old instead of ``eta``, at the same
throughput. ``eta`` stays the bound either way.

Admission alone bounds how many samples exist per version; batches also go
out oldest-first, and a batch is held while an episode old enough to break the
bound is still running (:meth:`StalenessManager.may_hand_out`), which makes
the bound hold for every sample even when episodes finish out of order. Both
halves of the bound live here; the controller only asks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StalenessCounts:
    started: int = 0
    running: int = 0
    accepted: int = 0
    rejected: int = 0


class StalenessManager:
    def __init__(self, batch_size: int, max_head_offpolicyness: int, max_concurrent_rollouts: int,
                 pacing: bool = False) -> None:
        if batch_size < 1 or max_head_offpolicyness < 0 or max_concurrent_rollouts < 1:
            raise ValueError(
                "StalenessManager needs batch_size >= 1, max_head_offpolicyness >= 0 and "
                f"max_concurrent_rollouts >= 1; got {batch_size}, {max_head_offpolicyness}, "
                f"{max_concurrent_rollouts}"
            )
        self.batch_size = batch_size
        self.eta = max_head_offpolicyness
        self.max_concurrent = max_concurrent_rollouts
        self.counts = StalenessCounts()
        self.pacing = pacing and max_head_offpolicyness > 1  # with eta <= 1 there is nothing to adapt
        self.lead = 1 if self.pacing else max_head_offpolicyness  # versions admission may run ahead

    def capacity(self, version: int) -> int:
        c = self.counts
        by_concurrency = self.max_concurrent - c.running
        by_staleness = (self.lead + version + 1) * self.batch_size - (c.accepted + c.running)
        return max(0, min(by_concurrency, by_staleness))

    def may_hand_out(self, ready: list[int], running: list[int], count: int, version: int) -> bool:
        """Whether the ``count`` oldest ready groups may form the batch trained at ``version``.

        ``ready``: the start versions of the ready groups, oldest first;
        ``running``: those of the running ones. Earliest-deadline-first: a
        group started at version ``s`` must be trained by version ``s + eta``.
        Handing out the oldest ready groups is safe when, for every later batch
        ``k = 0..eta`` steps ahead (trained at ``version + k``), the groups left
        behind (ready or still running) that are due by then fit in the ``k``
        batches before it. Otherwise a running group that is due soon must
        finish first, and the batch waits for it.
        """
        if len(ready) < count:
            return False
        if len(ready) == count and not running:
            return True
        left = ready[count:]
        if not self._fits(left + running, count, version):
            # Waiting helps only if running episodes cause the overflow; when the ready groups alone overflow
            # (the version moved on without batches being taken), waiting would never end: hand out the oldest.
            return not self._fits(left, count, version)
        return True

    def _fits(self, starts: list[int], count: int, version: int) -> bool:
        for k in range(self.eta + 1):
            due = version + k - self.eta
            if sum(1 for start in starts if start <= due) > k * count:
                return False
        return True

    def on_hand_out(self, waited: bool, ready: int) -> bool:
        """Pacing feedback from one batch taken by the trainer: ``waited`` when the batch was not ready as it
        asked, ``ready`` the accepted groups ready then (the batch's own included). True when the lead grew
        (admission may open now)."""
        if not self.pacing:
            return False
        if waited and self.lead < self.eta:
            self.lead += 1
            return True
        if not waited and ready >= 2 * self.batch_size and self.lead > 1:
            self.lead -= 1
        return False

    def on_start(self) -> None:
        self.counts.started += 1
        self.counts.running += 1

    def on_accept(self) -> None:
        self.counts.running -= 1
        self.counts.accepted += 1

    def on_reject(self) -> None:
        self.counts.running -= 1
        self.counts.rejected += 1

    def state_dict(self) -> dict:
        return asdict(self.counts)

    def load_state_dict(self, state: dict) -> None:
        self.counts = StalenessCounts(**state)
