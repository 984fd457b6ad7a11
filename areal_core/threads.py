"""One thread per process runs torch ops on several cores; helper threads run theirs on one.

Why: PyTorch's CPU kernels parallelise with OpenMP (GNU libgomp in the Linux
wheels). libgomp gives every thread that runs a parallel region a team of its
own, kept until that thread exits, and once a process's teams together hold
more threads than the process has CPUs, it stops spinning between parallel
regions ("throttled" mode: about a hundred spins, then a futex sleep). From
then on every kernel of the busy thread has to wake its workers through the
kernel, thousands of times per training step.

A trainer hit it without any oversubscription: its rollout thread copies new
weights into shared memory (one parallel ``copy_``), which left a second
two-thread team alive beside the training thread's. On the 2-core test
machine a bfloat16 train step of SmolLM2-135M went from 0.89 s to 1.43 s, no
faster than on one thread, with a third of the worker's time in the kernel;
the embedded inference server, which loads its model in the main thread and
generates in another, was throttled the same way. ``GOMP_SPINCOUNT`` does not
lift the throttled spin count and ``OMP_WAIT_POLICY=active`` makes the idle
team spin against the busy one, so the fix is structural: helper threads
(event loops, reward workers, weight staging) call :func:`serial_torch` first.

``torch.set_num_threads`` sets the calling thread's OpenMP thread count and
also the count that threads started afterwards begin with; the threads that
already ran torch ops keep theirs. A thread started later that should use
several cores calls ``torch.set_num_threads(n)`` itself.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator


def serial_torch() -> None:
    """Make torch ops issued from the calling thread run on one thread (nothing to do without torch)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """The block's torch ops from the calling thread run on ``n`` threads; the thread's own count comes back after.

    For bulk memory copies, such as a weight hand-over: they are bound by memory bandwidth, so a second thread
    adds little (a 513 MiB ``copy_`` on the 2-core test machine: 0.04 s on two threads, 0.06 s on one, idle),
    but a two-thread team waits at every parallel region for a worker the kernel may have descheduled, and on
    a busy machine that is everything (load 7: 2.5 s on two threads, 0.2 s on one). The calling thread keeps
    its team; no other thread's count changes.
    """
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else n
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
