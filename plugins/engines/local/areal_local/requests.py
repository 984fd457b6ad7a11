"""What a request to the embedded generator is: its checks, its state while it runs, and how it leaves.

:func:`new_request` turns what a client asked for into a :class:`_Request` or
refuses it with a :class:`RequestError` that names the field, the value and
the limit; a request leaves the generator as :class:`Finished`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from areal_core.api.inference import SamplingParams
from areal_local.sampling import _seed_state, _seeded_uniform

__all__ = ["Finished", "RequestError", "new_request"]


class RequestError(ValueError):
    """A request the generator refuses; the message names the request, the field, the value and the limit."""


@dataclass
class Finished:
    """A request that left the generator: its sampled tokens, their logprobs, and why it stopped.

    ``stop_reason``: ``"stop"`` (EOS, a stop token id, or a stop string),
    ``"length"`` (``max_new_tokens`` reached) or ``"abort"`` (the tokens so far;
    continue from ``input_ids + output_ids``).
    """

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    stop_reason: str


@dataclass(eq=False)
class _Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    stop_window: int  # tokens decoded to look for a stop string
    seed_state: int | None  # _seed_state(seed); None: unseeded, draws from the generator's RNG
    output_ids: list[int]
    logprobs: list[float]

    def finished(self, reason: str) -> Finished:
        return Finished(self.rid, self.output_ids, self.logprobs, reason)

    def draw(self) -> float:
        """The seeded uniform number of the token sampled next: keyed by its position in the sequence, so a
        continuation from ``input_ids + output_ids`` draws what this request would have drawn there."""
        return _seeded_uniform(self.seed_state, len(self.input_ids) + len(self.output_ids))


def new_request(rid: str, input_ids: list[int], sampling: SamplingParams, *, live: set[str], vocab_size: int,
                max_seq_len: int, eos_token_ids: frozenset[int], can_decode: bool) -> _Request:
    """A checked request for a generator whose ``live`` request ids, vocabulary, ``max_seq_len`` and EOS ids are
    given (``can_decode``: it can turn tokens into text, which stop strings need); :class:`RequestError`
    naming the request, the field, the value and the limit otherwise."""
    who = f"request {rid!r}"
    if rid in live:
        raise RequestError(f"{who} is already running or waiting; request ids must be unique among live requests")
    ids = list(input_ids)
    if not ids:
        raise RequestError(f"{who}: input_ids is empty; a prompt needs at least 1 token")
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise RequestError(f"{who}: input_ids[{i}] = {tok!r} is outside the vocabulary [0, {vocab_size})")
    n_new = sampling.max_new_tokens
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 1:
        raise RequestError(f"{who}: sampling.max_new_tokens is {n_new!r}; it must be at least 1")
    prompt, limit = len(ids), max_seq_len
    if prompt >= limit:
        raise RequestError(
            f"{who}: the prompt has {prompt} tokens; max_seq_len is {limit}, so a prompt may have "
            f"at most {limit - 1} tokens"
        )
    if prompt + n_new > limit:
        raise RequestError(
            f"{who}: the prompt ({prompt} tokens) + sampling.max_new_tokens ({n_new}) = {prompt + n_new} "
            f"exceeds max_seq_len {limit}; max_new_tokens may be at most {limit - prompt} for this prompt"
        )
    t = sampling.temperature
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise RequestError(f"{who}: sampling.temperature is {t!r}; it must be a finite number >= 0 (0 = greedy)")
    p = sampling.top_p
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
        raise RequestError(f"{who}: sampling.top_p is {p!r}; it must be in (0, 1]")
    k = sampling.top_k
    if isinstance(k, bool) or not isinstance(k, int) or (k != -1 and k < 1):
        raise RequestError(f"{who}: sampling.top_k is {k!r}; it must be -1 (off) or at least 1")
    for i, tok in enumerate(sampling.stop_token_ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise RequestError(
                f"{who}: sampling.stop_token_ids[{i}] = {tok!r} is outside the vocabulary [0, {vocab_size})"
            )
    for i, s in enumerate(sampling.stop):
        if not isinstance(s, str) or not s:
            raise RequestError(f"{who}: sampling.stop[{i}] is {s!r}; stop strings must be non-empty str")
    if sampling.stop and not can_decode:
        raise RequestError(
            f"{who}: sampling.stop is {tuple(sampling.stop)!r} but this Generator has no decode_fn "
            "to turn tokens into text; build it with decode_fn=tokenizer.decode"
        )
    seed = sampling.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"{who}: sampling.seed is {seed!r}; it must be an int or None")
    # A character is at most 4 byte tokens; a little slack for a window that starts mid-character.
    window = 4 * max((len(s) for s in sampling.stop), default=0) + 4
    return _Request(
        rid=rid,
        input_ids=ids,
        sampling=sampling,
        stop_ids=eos_token_ids | frozenset(sampling.stop_token_ids),
        stop_window=window,
        seed_state=_seed_state(seed) if seed is not None else None,
        output_ids=[],
        logprobs=[],
    )
