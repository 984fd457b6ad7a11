"""The packed batch: what the rollout controller makes, the trainer and algorithm extend, and train engines take.

Every sequence of a training step lies end to end, without padding: ``T``
tokens in all, ``N`` sequences, ``cu_seqlens`` the ``N + 1`` offsets where
each starts (and the last ends). A value is a **token** column (length
``T``), a **sequence** column (length ``N``) or a **scalar**. :data:`FIELDS`
lists the keys the core and the first-party plugins use, with their kind and
meaning; an algorithm may add its own keys, whose kind is then read from
their length.

:class:`PackedBatch` is a ``dict`` (as transformers' ``BatchEncoding`` is a
mapping): loss functions and third-party engines index it by key as before.
On top it knows its layout (``n_tokens``, ``n_sequences``, ``lengths``,
:meth:`~PackedBatch.kind`), checks it (:meth:`~PackedBatch.validate` names
the key, its length and the length its kind needs), selects sequences
(:meth:`~PackedBatch.select`) and gives a column as a CPU tensor
(:meth:`~PackedBatch.tensor`), converting a list once and keeping the
tensor, so the columns the trainer, the algorithm and the engines add stay
tensors from then on. Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

TOKEN = "token"
SEQUENCE = "sequence"
SCALAR = "scalar"


@dataclass(frozen=True)
class Field:
    """What one key of the batch holds: its ``kind`` (token, sequence, scalar), ``dtype`` (int, float, bool)
    and who adds it."""

    kind: str
    dtype: str
    help: str


FIELDS: dict[str, Field] = {
    # made by the rollout controller (areal_core.rollout.batch.pack_groups)
    "input_ids": Field(TOKEN, "int", "token ids: each sequence's prompt and completion"),
    "position_ids": Field(TOKEN, "int", "position within its sequence, from 0"),
    "loss_mask": Field(TOKEN, "bool", "true on the tokens trained (those the policy generated)"),
    "logprobs": Field(TOKEN, "float", "behaviour logprobs, as the inference engine sampled each token"),
    "versions": Field(TOKEN, "int", "policy version that generated each token (-1 on prompt tokens)"),
    "rewards": Field(SEQUENCE, "float", "the trajectory's reward"),
    "group_index": Field(SEQUENCE, "int", "which dataset item (group) the sequence answers"),
    "seq_lens": Field(SEQUENCE, "int", "tokens of each sequence"),
    # added by the trainer when the algorithm's Needs ask
    "prox_logprobs": Field(TOKEN, "float", "logprobs under the weights being trained (decoupled PPO's proximal)"),
    "ref_logprobs": Field(TOKEN, "float", "logprobs under the reference model (KL)"),
    "values": Field(TOKEN, "float", "the critic's values"),
    "minibatch": Field(SEQUENCE, "int", "the mini-batch (optimizer step of a pass) the sequence is trained in"),
    "policy_version": Field(SCALAR, "int", "the version the batch is trained at"),
    # added by the algorithm (the PPO family)
    "advantages": Field(TOKEN, "float", "per-token advantages (0 where not trained)"),
    "returns": Field(TOKEN, "float", "value targets (ppo with a critic)"),
    "loss_weights": Field(TOKEN, "float", "each token's weight in the step's aggregate"),
    "m2_mask": Field(TOKEN, "float", "M2PO's second-moment mask"),
    "kl_coef": Field(SCALAR, "float", "the KL coefficient of this step"),
    "kl_behaviour": Field(SCALAR, "float", "mean KL of the behaviour policy to the reference"),
}


def _length(value: Any) -> int | None:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        return None
    if getattr(value, "ndim", 1) == 0:  # a 0-d tensor is a scalar
        return None
    return len(value)


class PackedBatch(dict):
    """The packed, padding-free batch of one training step (see the module docstring)."""

    @classmethod
    def of(cls, batch: dict) -> "PackedBatch":
        """``batch`` as a :class:`PackedBatch` (itself when it already is one; the same values otherwise)."""
        return batch if isinstance(batch, cls) else cls(batch)

    # ------------------------------------------------------------------ layout
    @property
    def cu_seqlens(self) -> list[int]:
        value = self["cu_seqlens"]
        return [int(c) for c in (value.tolist() if hasattr(value, "tolist") else value)]

    @property
    def n_sequences(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def n_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def lengths(self) -> list[int]:
        cu = self.cu_seqlens
        return [b - a for a, b in zip(cu[:-1], cu[1:])]

    def kind(self, key: str) -> str:
        """:data:`TOKEN`, :data:`SEQUENCE` or :data:`SCALAR`: from :data:`FIELDS` for a known key, else from the
        value's length (``T`` token, ``N`` sequence, anything else scalar)."""
        if key in FIELDS:
            return FIELDS[key].kind
        n = _length(self[key])
        if n is not None and n == self.n_tokens:
            return TOKEN
        if n is not None and n == self.n_sequences:
            return SEQUENCE
        return SCALAR

    def validate(self, who: str = "the batch") -> "PackedBatch":
        """Raise ``ValueError`` naming the first key whose length does not fit its kind, or offsets that do
        not make a layout; returns the batch."""
        if "cu_seqlens" not in self:
            raise ValueError(f"{who}: the batch has no 'cu_seqlens' (the N + 1 offsets of its sequences)")
        cu = self.cu_seqlens
        if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"{who}: cu_seqlens must start at 0 and rise at every sequence (each at least one "
                             f"token), got {cu[:8]}{' ...' if len(cu) > 8 else ''}")
        if "input_ids" not in self:
            raise ValueError(f"{who}: the batch has no 'input_ids'")
        need = {TOKEN: (cu[-1], "T, the tokens"), SEQUENCE: (len(cu) - 1, "N, the sequences")}
        for key, value in self.items():
            field = FIELDS.get(key)
            if field is None or field.kind == SCALAR:
                continue
            n = _length(value)
            want, what = need[field.kind]
            if n != want:
                raise ValueError(f"{who}: batch[{key!r}] is a {field.kind} column ({field.help}) of length "
                                 f"{want} ({what}), got {n if n is not None else type(value).__name__}")
        return self

    # ------------------------------------------------------------------ values
    def tensor(self, key: str) -> Any:
        """Column ``key`` as a CPU tensor (``loss_mask`` bool, floats float32, ints int64), converted from a
        list once and kept in the batch, so later readers get the same tensor."""
        from areal_core.train_batches import to_tensor

        value = self[key]
        converted = to_tensor(key, value)
        if getattr(value, "dtype", None) == getattr(converted, "dtype", False) and value.device.type == "cpu" \
                and not value.requires_grad:
            return value  # already what a reader wants: the same tensor, kept
        if converted is not value:
            self[key] = converted
        return converted

    def select(self, seqs: Iterable[int]) -> "PackedBatch":
        """The batch of sequences ``seqs`` (in that order), in the same layout: columns sliced by their kind,
        scalars kept, ``cu_seqlens`` following the selection."""
        from areal_core.train_batches import select_sequences

        return PackedBatch(select_sequences(self, list(seqs)))
