"""Keep freed memory in the process for reuse: glibc malloc settings for trainers and inference servers.

glibc serves every allocation above its mmap threshold (32 MiB at most) with a
fresh ``mmap`` and unmaps it on ``free``. A training step allocates and frees
the same large buffers every time (the [vocab, hidden] embedding gradient, its
bf16 cast, the tied head's gradient: 28M elements each for SmolLM2-135M), so
every step page-faults them in again: on the 2-core test machine that was
about 40 % of a bf16 step (``train_batch`` 1.9 s -> 1.15 s with the settings
below, SmolLM2-135M, 16 sequences of ~30 tokens). CUDA's caching allocator
does the same job for GPU memory; PyTorch's CPU allocator is plain malloc.

:func:`retain_freed_memory` turns mmap-served chunks off and raises the trim
threshold, through ``mallopt`` at run time so it applies however the process
was started (the local launcher, torchrun, Ray, SLURM). The price is that the
process keeps its peak heap: RSS does not shrink after a peak.

It also makes every thread allocate from the one main arena. A thread of its
own gets an arena made of 64 MiB heaps, and glibc serves a larger request there
with a fresh ``mmap`` even with mmap turned off, unmapping it on free: the
embedded server's engine thread page-faulted a 113 MiB temporary in at every
weight load (27.6k faults; the packed-copy rebuild 0.145 s -> 0.099 s with one
arena), and the trainer's export thread its large tensors at every update
(making a delta 0.78-0.84 -> 0.43-0.44 s on the demo). Threads then share the
arena's lock; in these Python processes few threads allocate at once (the
demo's step time did not change: 4.35 / 4.63 s against 4.39 / 4.33).

It stands aside when the user took control: any ``MALLOC_*`` variable or
``GLIBC_TUNABLES`` set, another allocator preloaded (``LD_PRELOAD``), or
``AREAL_MALLOC=system``. Not glibc (macOS, musl): nothing to do.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1

OPT_OUT = "AREAL_MALLOC"


def _user_controls_malloc(env: dict[str, str]) -> str | None:
    if env.get(OPT_OUT, "").lower() == "system":
        return f"{OPT_OUT}=system"
    for key in env:
        if key.startswith("MALLOC_") or key == "GLIBC_TUNABLES":
            return key
    if env.get("LD_PRELOAD"):
        return "LD_PRELOAD"
    return None


def retain_freed_memory(env: dict[str, str] | None = None) -> str:
    """Apply the settings (once per process); returns what was done, for the process's log."""
    env = dict(os.environ) if env is None else env
    reason = _user_controls_malloc(env)
    if reason is not None:
        return f"malloc left as configured ({reason} is set)"
    if not sys.platform.startswith("linux"):
        return "malloc left alone (not Linux)"
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc left alone (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, _INT_MAX) != 1 or mallopt(M_ARENA_MAX, 1) != 1:
        return "malloc left alone (mallopt refused the settings)"
    return (f"malloc keeps freed memory for reuse (mmap off, trim threshold 2 GiB, one arena; {OPT_OUT}=system to "
            "opt out)")
