"""Test double: the embedded engine's real server whose background rebuild of the derived copies is slow.

``python slow_rebuild_server_double.py SECONDS <areal_local.server arguments>`` runs
:func:`areal_local.server.main` with each load worker's share of a rebuild (``areal_local.generator._run_jobs``)
starting SECONDS late, so that a request arriving right after a load finds the copies still being rebuilt.
"""

from __future__ import annotations

import sys
import time

from areal_local import generator, server

DELAY_S = float(sys.argv.pop(1))
_run_jobs = generator._run_jobs


def slow_run_jobs(jobs):
    time.sleep(DELAY_S)
    return _run_jobs(jobs)


generator._run_jobs = slow_run_jobs

if __name__ == "__main__":
    server.main()
