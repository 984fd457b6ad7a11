"""areal_core.allocator: large freed buffers stay in the process instead of being unmapped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from areal_core.allocator import retain_freed_memory
from areal_core.testing.waits import scaled

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")

# A child allocates 100 MiB through malloc and reports glibc's count of mmap-served bytes (mallinfo2().hblkhd):
# with the settings applied the chunk comes from the heap (0 bytes mmapped), without them from its own mmap.
PROBE = r"""
import ctypes, sys
from areal_core.allocator import retain_freed_memory
said = retain_freed_memory() if sys.argv[1] == "apply" else "not applied"
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
if sys.argv[2] == "thread":  # from a thread of its own: glibc gives it an arena of its own unless told not to
    import threading
    t = threading.Thread(target=lambda: libc.malloc(100 << 20))
    t.start()
    t.join()
else:
    p = libc.malloc(100 << 20)
print(libc.mallinfo2().hblkhd >> 20, said, sep="|")
"""


def probe(mode: str, where: str = "main", **env: str) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")
             and k not in ("GLIBC_TUNABLES", "LD_PRELOAD", "AREAL_MALLOC")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, where], capture_output=True, text=True, check=True,
                         env={**clean, **env}, timeout=scaled(60)).stdout.strip()
    mmapped, said = out.split("|")
    return int(mmapped), said


def test_large_allocations_come_from_the_heap_once_applied():
    assert probe("skip")[0] >= 100  # glibc's default: a 100 MiB chunk is its own mmap, unmapped on free
    mmapped, said = probe("apply")
    assert mmapped == 0, said
    assert "keeps freed memory" in said


def test_large_allocations_of_other_threads_come_from_the_heap_too():
    """A thread's own arena is a 64 MiB heap: glibc maps anything larger on its own, mmap turned off or not, and
    unmaps it on free (an engine thread's 113 MiB temporary page-faulted in at every weight load). One arena for
    every thread keeps it in the heap."""
    assert probe("skip", "thread")[0] >= 100
    mmapped, said = probe("apply", "thread")
    assert mmapped == 0, said


@pytest.mark.parametrize("env", [{"AREAL_MALLOC": "system"}, {"MALLOC_ARENA_MAX": "2"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}])
def test_the_users_own_malloc_settings_win(env):
    mmapped, said = probe("apply", **env)
    assert mmapped >= 100, said
    assert said.startswith("malloc left as configured") and next(iter(env)) in said


def test_the_decision_names_what_the_user_set():
    assert retain_freed_memory({"LD_PRELOAD": "/usr/lib/libjemalloc.so"}) == \
        "malloc left as configured (LD_PRELOAD is set)"
