"""Answer equivalence through math-verify, in worker processes killed on a timeout.

math-verify's own timeouts use ``signal.alarm``, which raises off the main
thread and cannot stop C code anyway. So its timeouts are off and every
comparison runs in a pebble ``ProcessPool``: a call that outlives its bound
has its worker killed and replaced, and the caller gets ``timeout``. Any
thread may call :func:`equivalent`; the pools are shared per worker count.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing
import threading
import time
from typing import NamedTuple

# How long beyond the per-call bound the caller waits for pebble itself to
# report; a backstop only (pebble kills the worker at the bound).
_GRACE_S = 5.0


# Decimals are compared to this many places, where a double's precision ends: in effect exactly, so
# 0.3333333 is not 1/3 nor 2.4999999 2.5 (math-verify's default rounds to 6 places, which makes them equal),
# while 0.5 is 1/2 and 12.50 is 12.5. A rounded answer counts only when the reference is that decimal.
FLOAT_PLACES = 15


class Verdict(NamedTuple):
    equal: bool
    reason: str  # correct | wrong | unparsable_answer | unparsable_reference | timeout | error
    detail: str = ""


def _parse(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    # Wrapped in $...$ first: LaTeX parsing reads \frac, 50\%, sets, intervals and 1,234.
    for candidate in (f"${text}$", text):
        parsed = parse(candidate, extraction_config=configs, parsing_timeout=None)
        if any(not isinstance(p, str) for p in parsed):  # only the raw string back: nothing understood
            return parsed
    return []


def compare(reference: str, answer: str) -> Verdict:
    """The comparison itself (runs inside a worker process)."""
    from math_verify import verify

    gold = _parse(reference)
    if not gold:
        return Verdict(False, "unparsable_reference", f"math-verify parsed nothing from {reference!r}")
    got = _parse(answer)
    if not got:
        return Verdict(False, "unparsable_answer", f"math-verify parsed nothing from {answer!r}")
    equal = verify(gold, got, float_rounding=FLOAT_PLACES, timeout_seconds=None)
    return Verdict(bool(equal), "correct" if equal else "wrong", f"{gold[-1]!s} vs {got[-1]!s}")


def _warm_up() -> None:
    """Worker initializer: import sympy and math-verify once, and silence its timeout notices."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    compare("1", "1")


_pools: dict[int, object] = {}
_lock = threading.Lock()


def pool(workers: int):
    """The shared pool with ``workers`` processes (started on first use)."""
    from pebble import ProcessPool

    with _lock:
        found = _pools.get(workers)
        if found is None or not found.active:
            # spawn: the caller may hold threads (asyncio executors, torch); forking them is unsafe.
            found = ProcessPool(max_workers=workers, initializer=_warm_up,
                                context=multiprocessing.get_context("spawn"))
            _pools[workers] = found
        return found


def shutdown() -> None:
    """Stop every pool and its workers (also run at interpreter exit)."""
    with _lock:
        for p in _pools.values():
            p.stop()
            p.join(timeout=10)
        _pools.clear()


atexit.register(shutdown)


_waiting: dict[int, int] = {}  # comparisons scheduled and not finished, per pool (worker count)


def _started(future: concurrent.futures.Future, bound_s: float) -> bool:
    """Whether a worker picked ``future`` up (or it finished) within ``bound_s`` seconds."""
    deadline = time.monotonic() + bound_s
    while not (future.running() or future.done()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def equivalent(reference: str, answer: str, timeout_s: float, workers: int) -> Verdict:
    """Whether ``answer`` equals ``reference`` mathematically; never raises, never waits past the bound.

    The bound is ``timeout_s`` of comparison, counted from when a worker
    starts it, as pebble counts: a comparison queued behind others on a busy
    pool is not reported as a timeout for the time it spent waiting.
    """
    from pebble import ProcessExpired

    with _lock:
        ahead = _waiting.get(workers, 0)
        _waiting[workers] = ahead + 1
    try:
        future = pool(workers).schedule(compare, args=(reference, answer), timeout=timeout_s)
        # Each comparison ahead of this one finishes, or is killed and its worker replaced, within about
        # timeout_s + _GRACE_S; `workers` of them run at once.
        start_bound = (ahead // workers + 1) * (timeout_s + _GRACE_S)
        if not _started(future, start_bound):
            future.cancel()
            return Verdict(False, "timeout", f"not started within {start_bound:.0f} s: {ahead} comparisons were "
                                             f"ahead of it on {workers} math-verify workers (reward.workers)")
        return future.result(timeout=timeout_s + _GRACE_S)
    except (concurrent.futures.TimeoutError, TimeoutError):
        if "future" in locals():
            future.cancel()
        return Verdict(False, "timeout", f"no verdict within {timeout_s} s; the worker was killed")
    except ProcessExpired as exc:
        return Verdict(False, "error", f"the worker died: {exc}")
    except Exception as exc:  # a bug in math-verify or sympy on odd input: score 0, say why
        return Verdict(False, "error", f"{type(exc).__name__}: {exc}")
    finally:
        with _lock:
            _waiting[workers] -= 1
