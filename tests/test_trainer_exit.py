"""A train rank in a torch.distributed group ends without the interpreter's finalization on every way out
(areal_core.trainer.run_main): the atexit functions run, objects' finalizers do not (that is where the
"terminate called without an active exception" SIGABRT came from), and the exit status is the one main chose."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, os, sys, tempfile
import torch.distributed as dist
import areal_core.trainer as trainer

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)

class Finalized:
    def __del__(self):
        print("finalizer ran", flush=True)

kept = Finalized()
atexit.register(lambda: print("atexit ran", flush=True))
how = sys.argv[1]

def main(argv=None):
    if how == "raise":
        raise ValueError("a plugin's bug")
    if how == "sigterm":
        raise SystemExit(143)
    return 1

trainer.main = main
trainer.run_main()
"""


@pytest.mark.parametrize("how, code", [("return", 1), ("raise", 1), ("sigterm", 143)])
def test_a_distributed_rank_ends_with_its_code_after_atexit_and_without_finalization(how, code):
    done = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stdout + done.stderr
    assert "atexit ran" in done.stdout and "finalizer ran" not in done.stdout, done.stdout
    assert ("ValueError: a plugin's bug" in done.stderr) is (how == "raise"), done.stderr  # its traceback kept


def test_without_a_distributed_group_the_ordinary_exit_stays():
    script = SCRIPT.replace('dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), '
                            'rank=0, world_size=1)', "")
    done = subprocess.run([sys.executable, "-c", script, "return"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "atexit ran" in done.stdout and "finalizer ran" in done.stdout, done.stdout
