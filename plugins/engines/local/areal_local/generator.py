"""The embedded engine's generation core: continuous batching over any HF causal LM, on CPU.

A :class:`Generator` is synchronous and single-threaded; a server loop drives
it step by step (``add`` requests, call ``step`` until they come back as
:class:`Finished`, ``abort_all`` / ``load_state_dict`` between steps). It owns
no thread, socket or policy version: the caller stamps versions on tokens.

Batching and the KV cache
-------------------------
Every running request owns one row ("slot") of a preallocated KV buffer per
layer, ``[rows, kv_heads, columns, head_dim]``, handed to the HF model as its
``past_key_values`` (:class:`~areal_local.cache.SlotCache`). A row's tokens occupy columns
``start .. end-1``; its next token is written at column ``end``. Each forward
gets a 4D attention mask built from ``start`` / ``end`` (so the model never
builds one) and per-row position ids ``column - start``:

- *join*: waiting requests are prefilled together, left-padded to the longest
  prompt of the group, straight into free rows (columns ``0 .. P-1``, a
  shorter prompt starting at ``P - len``); their first token is sampled from
  the prefill's last position. Nothing else in the batch moves.
- *decode*: one forward of ``[B, 1]`` tokens; each row writes its K/V at its
  own column ``end`` (one ``index_put`` per layer) and attends to columns
  ``start .. end``. Rows of different lengths share the batch; attention spans
  ``max(end) + 1`` columns, the others masked.
- *leave*: a finished request's row is refilled by the last row (one copy of
  that row's K/V), so running rows are always ``0 .. B-1`` and the next
  waiting request can join in the same step.

Joiners are prefilled longest first, in groups of similar lengths (at most
10% padding once a group holds 128 tokens). Identical sequences run once; a
prefix every joiner starts with (a chat template's system prompt, a few-shot
header) runs once when that saves at least 64 tokens, its K/V placed into each
row, and the groups' forwards start after it. Buffers grow by doubling (rows up to
``max_batch``, columns up to what the running requests can reach) and are only
copied when they grow. Attention runs through the model's own attention code
(``sdpa`` with a boolean mask, or ``eager`` with an additive one); the cache
layout works for any model whose layers call ``past_key_values.update``
(Llama, Qwen2, Mistral-style models; sliding-window layers get their own mask).

Requests
--------
Per request: ``temperature`` (0 = greedy), ``top_k``, ``top_p``,
``max_new_tokens``, ``stop`` strings, ``stop_token_ids`` / EOS, ``seed``. All
running rows are sampled at once by :func:`areal_local.sampling.sample`, which
says how tokens and their logprobs are drawn and why a seeded request samples
the same tokens whatever else is in the batch.

Stops: EOS and ``stop_token_ids`` end a request with the stop token kept in
``output_ids``; a stop string ends it at the token that completed it (kept,
text is not cut; the check decodes the last few tokens with ``decode_fn``);
``max_new_tokens`` ends it with ``"length"``. A token that completes a stop and
reaches ``max_new_tokens`` reports ``"stop"``.
"""

from __future__ import annotations

import inspect
import os
import random
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from areal_core.api.inference import SamplingParams
from areal_local.cache import SlotCache
from areal_local.hooks import LAYER_TYPES, unsupported_layer_types
from areal_local.lean_decode import SUPPORTED_MODEL_TYPES, LeanDecoder
from areal_local.lean_decode import supports as lean_supports
from areal_local.packed import PackedLinears, packing_available
from areal_local.requests import Finished, RequestError, _Request, new_request
from areal_local.sampling import sample

__all__ = ["Finished", "Generator", "RequestError"]

_SUPPORTED_ATTENTION = ("sdpa", "eager")

# A prompt prefix shared by the joiners is run once (Generator._shared_prefix) when it is at least this
# long and saves at least this many tokens of prefill in all.
_MIN_SHARED_PREFIX = 8
_MIN_SHARED_SAVING = 64


class Generator:
    """Continuous-batching generation for one HF causal LM, driven by :meth:`step`.

    ``model``: a ``transformers`` causal LM (``sdpa`` or ``eager`` attention,
    float32 / bfloat16 / float16). ``eos_token_ids`` end every request
    (``"stop"``). ``max_batch``: running requests at most; more wait. ``max_seq_len``
    (default ``model.config.max_position_embeddings``): prompt + ``max_new_tokens``
    at most. ``decode_fn``: token ids -> text, needed for stop strings
    (``tokenizer.decode``). ``max_prefill_tokens``: padded prompt tokens per
    prefill forward (more joiners are prefilled in several forwards of the same
    step). ``seed``: the RNG of requests without their own seed.
    ``packed_linears``: run the model's linear layers on oneDNN-prepacked
    weights (:mod:`areal_local.packed`; default: whenever the model is on CPU
    and torch has oneDNN). Logits then differ from a plain forward by float
    rounding (~1e-4 on SmolLM2 in float32); ``False`` keeps torch's own kernels.
    ``load_workers``: threads that rebuild the derived copies (packed and
    fused weights) after a weight load (default 1: the loading thread).
    ``lean_decode``: decode steps of Llama-family models through
    :mod:`areal_local.lean_decode` (fused projections, one attention call per
    layer on the cache; default: whenever the model qualifies); prefill always
    uses the model's own forward.
    ``defer_derived`` (with ``load_workers`` > 1): a weight load returns once
    the new weights are in place and the derived copies' rebuild has started
    on all load workers but one (generation takes a core meanwhile); until it
    has ended, steps run on the new weights
    themselves (the model's own linears and forward: the copies being rebuilt
    are never read), then the copies are put in use between two steps
    (:meth:`settle`). Every later load, and anything else that changes the
    weights, waits for the rebuild first.
    """

    def __init__(
        self,
        model,
        *,
        eos_token_ids: Iterable[int],
        max_batch: int = 64,
        max_seq_len: int | None = None,
        decode_fn: Callable[[list[int]], str] | None = None,
        max_prefill_tokens: int = 4096,
        seed: int | None = None,
        packed_linears: bool | None = None,
        lean_decode: bool | None = None,
        load_workers: int = 1,
        defer_derived: bool = False,
    ) -> None:
        config = model.config
        if max_batch < 1:
            raise ValueError(f"Generator: max_batch is {max_batch}; it must be at least 1")
        if max_seq_len is None:
            max_seq_len = getattr(config, "max_position_embeddings", None)
            if max_seq_len is None:
                raise ValueError(
                    f"Generator: {type(model).__name__}'s config has no max_position_embeddings; pass max_seq_len"
                )
        if max_seq_len < 2:
            raise ValueError(f"Generator: max_seq_len is {max_seq_len}; it must be at least 2")
        attention = getattr(config, "_attn_implementation", None) or "eager"
        if attention not in _SUPPORTED_ATTENTION:
            raise ValueError(
                f"Generator: {type(model).__name__} uses attention {attention!r}; the generator drives "
                f"{' or '.join(_SUPPORTED_ATTENTION)} (load the model with attn_implementation='sdpa')"
            )
        layer_types = list(getattr(config, "layer_types", None) or [])
        unknown = unsupported_layer_types(layer_types)
        if unknown:  # judged from config.json by the plan rule too (areal_local.hooks): areal check says it first
            raise ValueError(
                f"Generator: {type(model).__name__} has layer types {unknown}; the generator handles "
                f"{' and '.join(LAYER_TYPES)} layers only"
            )
        self.model = model.eval()
        if packed_linears is None:
            packed_linears = packing_available(model)
        self._packed = PackedLinears(model) if packed_linears else None
        if lean_decode is None:
            lean_decode = lean_supports(model)
        elif lean_decode and not lean_supports(model):
            raise ValueError(f"Generator: lean_decode=True but {type(model).__name__} is not a Llama-family model "
                             f"with full attention ({', '.join(SUPPORTED_MODEL_TYPES)}); leave lean_decode unset")
        self._lean = LeanDecoder(model, packed=self._packed) if lean_decode else None
        if load_workers < 1:
            raise ValueError(f"Generator: load_workers is {load_workers}; it must be at least 1")
        # Rebuilding the derived copies after a load is one strided copy per weight (a transpose for oneDNN's
        # packing): on Python threads of one torch thread each (torch ops release the GIL), not an OpenMP team,
        # whose barrier would wait for a core another process holds (areal_core.threads). SmolLM2-135M float32
        # on the idle 2-core test machine: 0.225 s on one thread, 0.140 s on two.
        self._load_workers, self._load_pool = load_workers, None
        if load_workers > 1:
            from concurrent.futures import ThreadPoolExecutor

            from areal_core.threads import serial_torch

            self._load_pool = ThreadPoolExecutor(load_workers, thread_name_prefix="areal-load",
                                                 initializer=serial_torch)
        if defer_derived and self._load_pool is None:
            raise ValueError("Generator: defer_derived needs load_workers > 1 (the rebuild runs on the load workers)")
        self._defer_derived = defer_derived
        # A rebuild still running on the load workers (defer_derived): its futures and the call that puts the lean
        # decoder's results in place; the derived copies are not read meanwhile.
        self._rebuilding: tuple[list, Callable[[], None] | None] | None = None
        self._rebuild_error: BaseException | None = None  # a background rebuild that failed: raised at the next load
        self._derived_live = True  # whether forwards read the derived copies (False while they are rebuilt)
        self._last_background: tuple[float, list] | None = None  # the last background rebuild (background_rebuild_s)
        self._mapped = None  # areal_local.shm.MappedWeights, on the first load_safetensors_dir
        # Weight loads with adopt (load_state_dict): every state-dict name's Parameter (tied aliases too), the
        # name its memory is kept under, that memory, and the weights now served from a caller's tensors.
        self._params = dict(model.named_parameters(remove_duplicate=False))
        first = {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
        self._canonical = {name: first[id(p)] for name, p in self._params.items()}
        self._private = {name: self._params[name].data for name in set(self._canonical.values())}
        self._adopted: set[str] = set()  # canonical names of the weights now viewing a caller's tensors
        self.load_phases: dict[str, float] = {}  # seconds of the last load's phases: read, checked, copied, derived
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_batch = max_batch
        self.max_seq_len = int(max_seq_len)
        self.decode_fn = decode_fn
        self.max_prefill_tokens = max_prefill_tokens
        self._bool_mask = attention == "sdpa"
        self._dtype = next(model.parameters()).dtype
        # Models with sliding-window layers take a mask per layer type.
        self._sliding_window = getattr(config, "sliding_window", None) if "sliding_attention" in layer_types else None
        self._mask_per_type = bool(layer_types) and self._sliding_window is not None
        self._keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        # transformers 5.x renamed forward's past_key_values to cache (the old name warns, and goes in 5.40)
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._rng = random.Random(seed)
        self._cache = SlotCache()
        self._rows: list[_Request] = []  # running, row i of the cache
        self._start: list[int] = []  # first column of row i
        self._end: list[int] = []  # next column row i writes
        self._waiting: deque[_Request] = deque()
        self._live: set[str] = set()

    # ------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def progress(self) -> dict[str, int]:
        """Tokens sampled so far by each live request (running, then waiting), by rid. Safe to call from another
        thread than the one stepping: it reads copies of the lists (a snapshot, possibly one token behind)."""
        return {r.rid: len(r.output_ids) for r in [*list(self._rows), *list(self._waiting)]}

    # ---------------------------------------------------------------- requests
    def add(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> None:
        """Queue a request; it joins the running batch at the next :meth:`step` with a free row.

        Raises :class:`RequestError` (and changes nothing) for an empty prompt,
        a token id outside the vocabulary, ``max_new_tokens < 1``, a prompt or
        prompt + ``max_new_tokens`` longer than ``max_seq_len``, a bad
        temperature / top_p / top_k / stop / seed, or an ``rid`` already live.
        """
        request = self._validate(rid, input_ids, sampling)
        self._waiting.append(request)
        self._live.add(rid)

    def _validate(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> _Request:
        return new_request(rid, input_ids, sampling, live=self._live, vocab_size=self.vocab_size,
                           max_seq_len=self.max_seq_len, eos_token_ids=self.eos_token_ids,
                           can_decode=self.decode_fn is not None)

    def abort(self, rid: str) -> Finished | None:
        """Take ``rid`` out (running or waiting) with its tokens so far, ``"abort"``; None when not live."""
        for i, request in enumerate(self._rows):
            if request.rid == rid:
                with torch.inference_mode():  # the cache holds inference tensors
                    self._remove_row(i)
                self._live.discard(rid)
                if not self._rows:
                    self._cache.clear()
                return request.finished("abort")
        for request in self._waiting:
            if request.rid == rid:
                self._waiting.remove(request)
                self._live.discard(rid)
                return request.finished("abort")
        return None

    def abort_all(self) -> list[Finished]:
        """Every running then waiting request with its tokens so far, ``"abort"``; the KV cache is dropped."""
        out = [r.finished("abort") for r in self._rows] + [r.finished("abort") for r in self._waiting]
        self._rows, self._start, self._end = [], [], []
        self._waiting.clear()
        self._live.clear()
        self._cache.clear()
        return out

    # -------------------------------------------------------------------- step
    def step(self) -> list[Finished]:
        """Admit waiting requests (prefill), run one decode step for all running ones; return those that finished.

        A joining request samples its first token from its prefill and, if
        still running, its second from the decode step of the same call.
        """
        finished: list[Finished] = []
        if self._rebuilding is not None:
            self._settle(wait=False)
        with torch.inference_mode():
            free = min(len(self._waiting), self.max_batch - len(self._rows))
            joining = [self._waiting.popleft() for _ in range(free)]
            try:
                prefix = self._shared_prefix(joining)
            except BaseException:  # nobody joined: everyone waits again
                self._waiting.extendleft(reversed(joining))
                raise
            groups = self._prefill_groups(joining, prefix[0] if prefix is not None else 0)
            while groups:
                group = groups.pop(0)
                try:
                    logits = self._prefill(group, prefix)
                except BaseException:  # the forward failed: nobody joined, everyone waits again
                    for unstarted in [group, *groups][::-1]:
                        self._waiting.extendleft(reversed(unstarted))
                    raise
                finished += self._advance(range(len(self._rows) - len(group), len(self._rows)), logits)
            if self._rows:
                finished += self._decode()
        if not self._rows:
            self._cache.clear()
        return finished

    def _prefill_groups(self, joining: list[_Request], shared: int = 0) -> list[list[_Request]]:
        """Split the joiners into prefill forwards of similar lengths.

        Longest first; a group closes when the next prompt would push it past
        ``max_prefill_tokens`` padded tokens, or (once it holds 128 real tokens)
        make more than 10% of it padding. Lengths count from after the
        ``shared`` prefix tokens, which the forwards do not run.
        """

        def length(r: _Request) -> int:
            return len(r.input_ids) + len(r.output_ids) - shared

        groups: list[list[_Request]] = []
        group: list[_Request] = []
        real = 0
        for request in sorted(joining, key=length, reverse=True):
            size = length(request)
            if group:
                padded = length(group[0]) * (len(group) + 1)
                if padded > self.max_prefill_tokens or (real >= 128 and padded > 1.1 * (real + size)):
                    groups.append(group)
                    group, real = [], 0
            group.append(request)
            real += size
        return groups + [group] if group else groups

    def _shared_prefix(self, joining: list[_Request]) -> tuple[int, SlotCache] | None:
        """The joiners' common first tokens, run once: ``(length, a one-row cache holding their K/V)``, or
        None when too little would be saved.

        Prompts of an RL batch often start alike (a chat template's system
        prompt, a few-shot header: the demo's prompts share 20 of 26 tokens,
        SmolLM2's chat prompts 24): each group's forward then starts after
        them and the prefix's K/V are copied in. Every sequence keeps at least
        its last token for its group's forward, which gives its logits.
        Exact, as any split of a causal forward; not used with sliding-window
        layers (their mask per layer type is left as it was).
        """
        if self._sliding_window is not None or len(joining) < 2:
            return None
        seqs = {tuple(r.input_ids + r.output_ids) for r in joining}
        if len(seqs) < 2:
            return None  # identical sequences are computed once anyway (_prefill)
        common = min(len(os.path.commonprefix(list(seqs))), min(map(len, seqs)) - 1)
        # The prefix costs one more forward (every weight read once more): worth it past ~64 saved tokens.
        if common < _MIN_SHARED_PREFIX or (len(seqs) - 1) * common < _MIN_SHARED_SAVING:
            return None
        cache = SlotCache()
        cache.reserve(1, common, 1, common)
        cache.plan_prefill(0, 1, common)
        ids = torch.tensor([next(iter(seqs))[:common]])
        causal = torch.ones(common, common, dtype=torch.bool).tril_()[None, None]
        self._forward(ids, torch.arange(common)[None], causal, None, cache=cache)
        return common, cache

    def _prefill(self, group: list[_Request], prefix: tuple[int, SlotCache] | None = None) -> torch.Tensor:
        """Write the group's prompts (+ output so far) into new rows; their last logits ``[n, vocab]``.

        Identical sequences are computed once: GRPO-style workflows send every
        prompt ``group_size`` times, so the forward runs on the distinct ones
        and their K/V rows are copied to the repeats (8 samples per prompt: an
        eighth of the prefill work). Each request still samples on its own.
        With a ``prefix`` (:meth:`_shared_prefix`) its K/V are placed in each
        row and the forward covers only the columns after the latest-ending
        copy of it (rows that are shorter recompute a few of their prefix
        tokens, to the same values, so every row still ends at the last column).
        """
        everyone = [r.input_ids + r.output_ids for r in group]
        index: dict[tuple[int, ...], int] = {}
        source = [index.setdefault(tuple(s), len(index)) for s in everyone]  # request -> its distinct sequence
        seqs = [list(key) for key in index]
        n, length = len(seqs), max(len(s) for s in seqs)
        first = len(self._rows)
        starts = [length - len(s) for s in seqs]
        self._cache.reserve(first + len(group), length, self.max_batch, self._reach(group, length))
        skip = 0  # columns before the forward's window: the shared prefix, placed
        if prefix is not None:
            common, cache = prefix
            self._cache.place(cache, first, starts, common)
            skip = min(starts) + common
        ids = torch.tensor([[0] * st + s for st, s in zip(starts, seqs)])[:, skip:]  # [n, P - skip], left-padded
        start = torch.tensor(starts)
        col = torch.arange(length)
        q, k = col[skip:, None], col[None, :]
        position_ids = (q.T - start[:, None]).clamp_(min=0)  # [n, P - skip]
        causal = (k <= q)[None] & (k[None] >= start[:, None, None])  # [n, P - skip (q), P (k)]
        # A padding query attends to itself only, so nothing it computes is NaN.
        causal |= (k == q)[None]
        sliding = None
        if self._sliding_window is not None:
            sliding = causal & ((q - k) < self._sliding_window)[None]
        self._cache.plan_prefill(first, n, length, skip)
        logits = self._forward(ids, position_ids, causal[:, None], None if sliding is None else sliding[:, None])
        if n < len(group):
            self._cache.copy_rows(first, source, length)
            logits = logits[torch.tensor(source)]
        self._rows += group
        self._start += [starts[i] for i in source]
        self._end += [length] * len(group)
        return logits

    def _decode(self) -> list[Finished]:
        n = len(self._rows)
        length = max(self._end) + 1
        self._cache.reserve(n, length, self.max_batch, self._reach())
        start = torch.tensor(self._start)
        end = torch.tensor(self._end)
        ids = torch.tensor([r.output_ids[-1] for r in self._rows])[:, None]  # [B, 1]
        position_ids = (end - start)[:, None]
        col = torch.arange(length)[None, :]
        mask = (col >= start[:, None]) & (col <= end[:, None])  # [B, L]
        sliding = None
        if self._sliding_window is not None:
            sliding = mask & (end[:, None] - col < self._sliding_window)
        self._cache.plan_decode(n, end, length)
        if self._lean is not None and self._derived_live:  # sliding windows never reach it (lean_decode.supports)
            logits = self._lean.step(ids[:, 0], position_ids[:, 0], self._cache, mask)
        else:
            sliding = None if sliding is None else sliding[:, None, None]
            logits = self._forward(ids, position_ids, mask[:, None, None], sliding)
        self._end = [e + 1 for e in self._end]
        return self._advance(range(n), logits)

    def _reach(self, joining: Iterable[_Request] = (), length: int = 0) -> int:
        """The most KV columns the running rows, and a group joining with prefill ``length``, can need."""
        rows = zip(self._rows, self._start)
        reach = max((start + len(r.input_ids) + r.sampling.max_new_tokens for r, start in rows), default=0)
        return max([reach] + [length - len(r.output_ids) + r.sampling.max_new_tokens for r in joining])

    def _forward(self, ids, position_ids, mask, sliding, cache: SlotCache | None = None) -> torch.Tensor:
        """Last-position logits, float32 ``[rows, vocab]``; K/V go to ``cache`` (default: the generator's)."""
        mask = self._mask_format(mask)
        if self._mask_per_type:
            mask = {"full_attention": mask, "sliding_attention": self._mask_format(sliding)}
        kwargs = {"logits_to_keep": 1} if self._keep_last else {}
        kwargs[self._cache_arg] = self._cache if cache is None else cache
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1].float()

    def _mask_format(self, mask: torch.Tensor) -> torch.Tensor:
        if self._bool_mask:
            return mask
        return torch.zeros(mask.shape, dtype=self._dtype).masked_fill_(~mask, torch.finfo(self._dtype).min)

    def _advance(self, rows: range, logits: torch.Tensor) -> list[Finished]:
        """Sample one token for each of ``rows``; record it; finish and remove the rows that stop."""
        requests = [self._rows[i] for i in rows]
        draws = [self._rng.random if r.seed_state is None else r.draw for r in requests]
        tokens, logprobs = sample(logits, [r.sampling for r in requests], draws)
        done: list[tuple[int, str]] = []
        for i, request, token, logprob in zip(rows, requests, tokens, logprobs):
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            reason = self._stop_reason(request, token)
            if reason is not None:
                done.append((i, reason))
        finished = []
        for i, reason in sorted(done, reverse=True):  # highest row first: moves never touch a row still to remove
            request = self._rows[i]
            self._remove_row(i)
            self._live.discard(request.rid)
            finished.append(request.finished(reason))
        finished.reverse()
        return finished

    def _stop_reason(self, request: _Request, token: int) -> str | None:
        if token in request.stop_ids:
            return "stop"
        if request.sampling.stop:
            text = self.decode_fn(request.output_ids[-request.stop_window :])
            if any(s in text for s in request.sampling.stop):
                return "stop"
        if len(request.output_ids) >= request.sampling.max_new_tokens:
            return "length"
        return None

    def _remove_row(self, i: int) -> None:
        last = len(self._rows) - 1
        if i != last:
            self._cache.move_row(last, i, self._end[last])
            self._rows[i], self._start[i], self._end[i] = self._rows[last], self._start[last], self._end[last]
        self._rows.pop()
        self._start.pop()
        self._end.pop()

    # ----------------------------------------------------------------- weights
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True,
                        adopt: bool = False, beside: Callable[[], None] | None = None) -> None:
        """Copy new weights into the model, between steps (or, with ``adopt``, serve from them as they are).

        Names are the model's ``state_dict()`` names. Every name must exist,
        with the same shape; floating-point tensors are cast to the
        parameter's dtype, other dtypes must match. With ``strict`` every
        parameter must be given (a tied alias such as ``lm_head.weight`` may
        be left out). Everything is checked before anything is copied, so a
        refused state dict leaves the old weights in place.

        Running requests keep their tokens so far and go back to the front of
        the queue: the KV cache computed under the old weights is dropped and
        the next step prefills prompt + output under the new weights.

        ``adopt``: the caller's tensors stay valid and unchanged until the next
        load (views of a ``/dev/shm`` stage slot, :mod:`areal_local.shm`), so a
        parameter of the same dtype becomes that tensor (``param.data``, no
        copy: 0.05 s of a SmolLM2-135M float32 load on the test machine) and
        the model serves from it, read only. Anything else is copied into the
        model's own memory, which it keeps for that (:meth:`_own`): a load
        without ``adopt`` (a disk folder), a cast, a buffer, and, before a
        delta is applied in place, every adopted weight. A weight a load leaves
        out is copied back too, so no weight is ever left viewing a slot the
        writer may rewrite.

        ``beside``: called on this thread once the new weights are in place, while the derived copies are
        rebuilt on the load workers (the server digests the weights there for the integrity gate).
        """
        self.settle()  # the load workers must be done reading the weights this load replaces
        began = time.perf_counter()
        own = self.model.state_dict()
        problems = []
        for name, tensor in state_dict.items():
            target = own.get(name)
            if target is None:
                problems.append(f"{name!r} is not a weight of {type(self.model).__name__}")
            elif not isinstance(tensor, torch.Tensor):
                problems.append(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            elif tuple(tensor.shape) != tuple(target.shape):
                problems.append(f"{name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(target.shape)}")
            elif tensor.dtype != target.dtype and not (tensor.is_floating_point() and target.is_floating_point()):
                problems.append(f"{name!r} has dtype {tensor.dtype}, the model's is {target.dtype}")
        if strict:
            given = {own[name].data_ptr() for name in state_dict if name in own}
            missing = [name for name, t in own.items() if name not in state_dict and t.data_ptr() not in given]
            if missing:
                shown = ", ".join(repr(m) for m in missing[:5])
                shown += f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                problems.append(f"missing {len(missing)} weight(s): {shown} (pass strict=False for a partial update)")
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise ValueError(f"Generator.load_state_dict: refused, nothing was loaded: {shown}")
        copied = time.perf_counter()
        with torch.no_grad():
            # A weight this load leaves out must not stay a view of a file the writer will rewrite after it.
            given = {self._canonical[n] for n in state_dict if n in self._canonical}
            for name in [n for n in self._adopted if n not in given]:
                self._own(name)
            for name, tensor in state_dict.items():
                param = self._params.get(name)
                if adopt and param is not None and tensor.dtype == param.dtype and tensor.is_contiguous():
                    param.data = tensor
                    self._adopted.add(self._canonical[name])
                else:
                    self._own(name, keep=False).copy_(tensor)  # overwritten whole: nothing to copy back
        derived = time.perf_counter()
        self._refresh_derived(beside)
        self.load_phases = dict(checked=copied - began, copied=derived - copied, derived=time.perf_counter() - derived)
        self._requeue_running()

    def _own(self, name: str, keep: bool = True) -> torch.Tensor:
        """The tensor behind state-dict entry ``name``, in the model's own memory: an adopted weight goes back to
        the memory it had before it was adopted (kept for this: no allocation per load), its values copied
        there unless ``keep`` is False (the caller overwrites it whole)."""
        param = self._params.get(name)
        if param is None:
            return self.model.state_dict()[name]  # a persistent buffer: never adopted
        key = self._canonical[name]
        if key in self._adopted:
            private = self._private[key]
            if keep:
                private.copy_(param.data)
            param.data = private
            self._adopted.discard(key)
        return param.data

    def own_all(self) -> int:
        """Copy every adopted weight back into the model's own memory (before anything writes into the weights
        in place); the number copied."""
        self.settle()
        names = list(self._adopted)
        with torch.no_grad():
            for name in names:
                self._own(name)
        return len(names)

    @property
    def adopted(self) -> frozenset[str]:
        """The weights now served from the caller's tensors (:meth:`load_state_dict` with ``adopt``)."""
        return frozenset(self._adopted)

    def warm_weight_loads(self) -> None:
        """Rebuild the derived copies once, before the first weight load, on the thread that will load.

        Why: the first rebuild in a process checks each packed layout's copy plan against oneDNN's own reorder
        (:func:`areal_local.packed.repack`: 0.3-0.7 s for SmolLM2-135M in float32 on the 2-core test machine,
        mostly the output head) and faults in the memory its temporaries use. Done at the server's start, that
        cost is off the first training step's path. The freed pages stay for reuse only when the process keeps
        freed memory (:func:`areal_core.allocator.retain_freed_memory`, which the server applies: one arena for
        every thread); should the user's own malloc settings give each thread an arena of its own, only a
        warm-up on the loading thread would count, hence "on the thread that will load".
        """
        self.settle()
        with torch.no_grad():
            self._refresh_derived(defer=False)

    @property
    def rebuilding(self) -> bool:
        """Whether the derived copies are being rebuilt in the background (``defer_derived``), steps meanwhile
        running on the weights themselves (they are put in use at the next step once it has ended)."""
        return self._rebuilding is not None and not all(future.done() for future in self._rebuilding[0])

    @property
    def derived_live(self) -> bool:
        """Whether steps now read the derived copies (False from a background rebuild's start until it is
        settled; always True when the model has none)."""
        return self._derived_live

    @property
    def background_workers(self) -> int:
        """Load workers a background rebuild takes (``defer_derived``: all but one; 0 without)."""
        return self._load_workers - 1 if self._defer_derived else 0

    @property
    def background_rebuild_s(self) -> float | None:
        """Seconds from the last load's start of a background rebuild to the end of its last job; None while it
        runs, when it failed, or when the last load rebuilt before returning."""
        if self._last_background is None:
            return None
        began, running = self._last_background
        if not all(future.done() and future.exception() is None for future in running):
            return None
        return max(future.result() for future in running) - began

    def settle(self) -> None:
        """Wait for a background rebuild of the derived copies (``defer_derived``) and put them in use; raises
        the error of one that failed (the copies then stay unused, steps on the weights themselves)."""
        self._settle(wait=True)
        error, self._rebuild_error = self._rebuild_error, None
        if error is not None:
            raise RuntimeError(f"Generator: the background rebuild of the derived copies failed: "
                               f"{type(error).__name__}: {error}") from error

    def _settle(self, wait: bool) -> None:
        """Put the copies of a background rebuild in use once it has ended (``wait``: block until then); a
        rebuild that failed leaves them unused and its error for :meth:`settle` (the next load raises it)."""
        if self._rebuilding is None:
            return
        running, finish = self._rebuilding
        if not wait and not all(future.done() for future in running):
            return
        self._rebuilding = None
        try:
            for future in running:
                future.result()
            if finish is not None:
                finish()
        except BaseException as exc:  # the copies are half rebuilt: they stay out of use (off since the rebuild began)
            self._rebuild_error = exc
            return
        self._set_derived_live(True)

    def _set_derived_live(self, live: bool) -> None:
        """Whether forwards read the derived copies (packed linears; the lean decoder is gated in _decode)."""
        self._derived_live = live
        if self._packed is not None:
            self._packed.live = live

    def _refresh_derived(self, beside: Callable[[], None] | None = None, defer: bool | None = None) -> None:
        """Rebuild the copies made of the weights for speed (oneDNN-packed linears, the lean decoder's fused ones),
        one job per weight, spread over ``load_workers`` threads (see ``__init__``); ``beside()`` runs on this
        thread meanwhile."""
        jobs = self._packed.jobs() if self._packed is not None else []
        finish = None
        if self._lean is not None:
            lean_jobs, finish = self._lean.jobs()
            jobs += lean_jobs
        if self._load_pool is None:
            for _, job in jobs:
                job()
            if beside is not None:
                beside()
        else:  # the largest first, each to the least loaded worker
            deferred = self._defer_derived if defer is None else defer
            # in the background, one worker fewer: generation resumes meanwhile and takes a core of its own
            count = max(1, self.background_workers) if deferred else self._load_workers
            shares: list[list] = [[] for _ in range(count)]
            sizes = [0] * len(shares)
            for size, job in sorted(jobs, key=lambda pair: -pair[0]):
                k = sizes.index(min(sizes))
                shares[k].append(job)
                sizes[k] += size
            if deferred:
                self._set_derived_live(False)  # before the first job writes into a copy
                began = time.perf_counter()
                running = [self._load_pool.submit(_run_jobs, share) for share in shares]
                self._rebuilding = (running, finish)
                self._last_background = (began, running)
                try:
                    if beside is not None:
                        beside()
                except BaseException:
                    self._settle(wait=True)
                    raise
                return
            self._last_background = None
            running = [self._load_pool.submit(_run_jobs, share) for share in shares]
            try:
                if beside is not None:
                    beside()
            finally:
                for future in running:
                    future.result()  # a job's exception is raised here
        if finish is not None:
            finish()
        self._set_derived_live(True)

    def load_safetensors_dir(self, path: str | Path, version: int | None = None, *, strict: bool = True,
                             adopt: bool = False, beside: Callable[[], None] | None = None) -> None:
        """:meth:`load_state_dict` from every ``*.safetensors`` file in folder ``path`` (HF names), copied
        straight from the mapped files into the parameters (:class:`areal_local.shm.MappedWeights`: the
        ``/dev/shm`` stage stays mapped between versions), or with ``adopt`` and a stage file, served from the
        mapping as it is (the stage's rule says the writer leaves it alone until this server loads another
        version). A stage file must hold ``version`` and be whole; anything refused leaves the weights as they
        were."""
        from areal_local.shm import MappedWeights

        folder = Path(path)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"Generator.load_safetensors_dir: no *.safetensors file in {folder}")
        if self._mapped is None:
            self._mapped = MappedWeights()
        began = time.perf_counter()
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(self._mapped.tensors(file, version))
        read = time.perf_counter() - began
        try:
            self.load_state_dict(state, strict=strict, adopt=adopt and self._mapped.last_is_stage, beside=beside)
        finally:
            state.clear()  # views of the mapping: only the adopted ones outlive the load
        self.load_phases["read"] = read

    def load_delta_dir(self, path: str | Path, base_version: int, version: int,
                       beside: Callable[[], None] | None = None) -> None:
        """Apply the :class:`areal_core.weight_delta.WeightDelta` saved in folder ``path`` (its named form) to the
        model's weights, between steps; checked whole before anything changes, as :meth:`load_state_dict`."""
        from safetensors.torch import load_file

        from areal_core.weight_delta import apply_delta, delta_from_named

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"Generator.load_delta_dir: no *.safetensors file in {path}")
        named: dict[str, torch.Tensor] = {}
        for file in files:
            named.update(load_file(str(file)))
        delta = delta_from_named(named, base_version, version)
        self.own_all()  # the delta is applied in place: not into a read-only stage slot (own_all settles first)
        apply_delta(self.model.state_dict(), delta)
        self._refresh_derived(beside)
        self._requeue_running()

    def _requeue_running(self) -> None:
        if self._rows:
            self._waiting.extendleft(reversed(self._rows))
        self._rows, self._start, self._end = [], [], []
        self._cache.clear()


def _run_jobs(jobs: list[Callable[[], None]]) -> float:
    """Run ``jobs`` in order (one load worker's share of a rebuild); when the last ended (``perf_counter``)."""
    for job in jobs:
        job()
    return time.perf_counter()
