"""The train engine contract (entry-point group ``areal.engines.train``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Iterator

from areal_core.api.component import Component

# A batch is an areal_core.api.batch.PackedBatch (a dict: packed, padding-free, columns as lists or CPU
# tensors; its module lists every key, its kind and who adds it). Engines read it by key, or as tensors with
# areal_core.train_batches.Packed, which converts each list column once and keeps the tensor in the batch.
Batch = dict
LossFn = Callable[..., Any]  # (logprobs, entropy, batch) -> (scalar loss, stats dict)


class TrainEngine(Component):
    """Holds a model and its optimizer across ranks.

    Capabilities: ``"save_load"``, ``"export_disk"``, ``"export_tensors"``,
    ``"export_beside_training"`` (an ``export_tensors`` result may be read on
    another thread while ``train_batch`` runs: the engine holds the weights
    from the call until the last bucket is read or the result is closed, and
    its optimizer step waits; one-process trainers only), ``"export_into"``
    (``export_tensors`` takes ``into``: it writes each tensor straight into
    memory the caller gives, an inference engine's staging buffer, instead of
    a copy of its own), ``"minibatches"``
    (``train_batch`` takes the ``minibatch`` key and ``epochs``: several
    optimizer steps in one update), ``"reference"``
    (frozen copy for KL), ``"critic"`` (value head).

    ``context.extras["role"]`` is ``"actor"`` (trained), ``"reference"``
    (the initial weights, frozen: no optimizer, only ``forward_logprobs``) or
    ``"critic"`` (the initial weights with a scalar value head instead of the
    LM head, trained with its own optimizer: ``forward_values`` and
    ``train_values``; engines declaring the ``"critic"`` capability build it).
    With world size > 1 every rank calls ``save`` / ``load`` with the same
    folder; the engine decides how ranks share the writing.
    """

    def initialize(self) -> None:
        """Load the model and build the optimizer (inside the launched rank)."""

    @abstractmethod
    def forward_logprobs(self, batch: Batch, temperature: float = 1.0) -> dict:
        """Per-token ``logprobs`` [T] (and ``entropy`` [T]) of ``batch`` under the current weights: CPU float
        tensors (what the first-party engines return, kept in the batch as they are) or lists of floats."""

    @abstractmethod
    def train_batch(self, batch: Batch, loss_fn: LossFn, temperature: float = 1.0, epochs: int = 1) -> dict:
        """One policy update on ``batch`` (``version`` + 1); returns stats (loss, grad_norm, lr, ...).

        The update takes one optimizer step per mini-batch (the sequences
        sharing a ``batch["minibatch"]`` value, in ascending order; the whole
        batch when the key is absent), for each of ``epochs`` passes:
        :func:`areal_core.train_batches.update_batches` gives each step's
        sub-batch, in order.
        Each micro-batch handed to ``loss_fn`` carries ``update_step``, the
        optimizer steps already taken in this update (0 for the first), so a
        loss can tell when the weights have moved away from those the update
        started from. The learning-rate schedule advances once per update.
        Stats are merged over the steps by
        :func:`~areal_core.train_batches.merge_update_stats` and include
        ``n_optimizer_steps``.

        ``loss_fn(logprobs, entropy, mb)`` gets one micro-batch's per-token
        logprobs (under ``temperature``) and entropy, and returns its
        token-mean loss and stats; the engine weights micro-batches by their
        loss tokens so the step does not depend on how the batch was split.
        Logprobs and entropy of tokens outside ``loss_mask`` may be left at
        0.0 (an engine need not compute what no loss reads).
        With world size > 1 every rank calls it with the same batch.
        """

    def forward_values(self, batch: Batch) -> dict:
        """Critic only: per-token ``values`` [T] (a CPU float tensor or a list of floats).

        Aligned like logprobs: ``values[t]`` is the value of the state in which
        token ``t`` was chosen, read from the hidden state of token ``t - 1``;
        0.0 at each sequence's first token. Collective like ``forward_logprobs``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not declare 'critic'")

    def train_values(self, batch: Batch, loss_fn: LossFn, epochs: int = 1) -> dict:
        """Critic only: one update as in ``train_batch`` (mini-batches, ``epochs``);
        ``loss_fn(values, mb) -> (token-mean loss, stats)``.

        ``values`` float32 [T_mb] with grad, aligned as in ``forward_values``;
        micro-batches are weighted by loss tokens exactly as in ``train_batch``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not declare 'critic'")

    @property
    @abstractmethod
    def version(self) -> int:
        """Policy updates taken (``train_batch`` calls, whatever their optimizer steps); the version weights are
        tagged with."""

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not declare 'save_load'")

    def load(self, path: str, *, with_optimizer: bool = True) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not declare 'save_load'")

    def export_to_disk(self, path: str) -> None:
        """Write HF safetensors for inference engines, atomically (a folder per version).

        Collective: every rank calls it with the same ``path``."""
        raise NotImplementedError(f"{type(self).__name__} does not declare 'export_disk'")

    def export_tensors(self, bucket_bytes: int, into: Callable[..., Any] | None = None
                       ) -> Iterator[list[tuple[str, Any]]]:
        """Full tensors in HF names, in buckets of at most ``bucket_bytes``.

        The tensors are the caller's: copies, never views of the engine's
        parameters, so the next optimizer step does not change them (the
        trainer hands them to inference engines that may still be reading them
        while it trains on, at eta > 0).

        ``into`` (engines declaring ``"export_into"``; the trainer passes it only
        to those): ``into(name, shape, dtype)`` gives a CPU tensor of that shape
        and dtype to write tensor ``name`` into (cast on the way), or None for a
        tensor of the engine's own; the bucket then holds the given tensors."""
        raise NotImplementedError(f"{type(self).__name__} does not declare 'export_tensors'")

    def close(self) -> None:
        """Release processes and memory; idempotent."""
