"""The sandbox's wall clock on a machine busy with other work: the time it waits for a CPU is not the program's.

The test runs the sandbox on one core shared with 16 busy loops at the same priority (the test process's
affinity, inherited by both), so a program that needs a fraction of a second of CPU takes several seconds of
wall time; on a training machine the trainer and the inference servers take that place."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from pathlib import Path

from areal_code.sandbox import MAX_CPU_WAIT, Limits, isolation, run_python
from areal_core.testing import scaled

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or not hasattr(os, "sched_setaffinity"),
                                reason="needs Linux's schedstat and CPU affinity")


@contextmanager
def one_busy_core(burners: int = 16):
    """This process, and what it starts, on one core, with ``burners`` busy loops there too, each in a session of
    its own as the sandbox is (with the kernel's autogroups, CPU is shared between sessions first)."""
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    loops = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.write('busy\\n'); sys.stdout.flush()\n"
                                                    "while True: pass"], stdout=subprocess.PIPE,
                              start_new_session=True) for _ in range(burners)]
    try:
        for loop in loops:  # each is in its loop (not still starting) before the sandbox starts
            assert loop.stdout.readline() == b"busy\n"
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
        os.sched_setaffinity(0, before)


def test_a_correct_program_starved_of_cpu_is_not_timed_out():
    # a tenth of a second of CPU of its own (the wall clock starts at its first line: the setup is apart)
    source = "import json, sys\nn = sum(range(3_000_000))\nprint(sum(json.loads(sys.stdin.read())))"
    limits = Limits(wall_s=0.25)
    with one_busy_core():
        outcome = run_python(source, "[1, 2, 3]", limits)
    # it waited for the core longer than its whole wall clock (else this machine did not starve it: no test)
    assert outcome.cpu_wait_s > limits.wall_s, outcome
    assert (outcome.status, outcome.stdout.strip()) == ("ok", "6"), outcome
    assert outcome.seconds > limits.wall_s  # on the wall clock alone it would have been killed


def test_a_sleeping_program_is_still_stopped_when_the_machine_is_busy():
    limits = Limits(wall_s=0.25)
    began = time.monotonic()
    with one_busy_core():
        outcome = run_python("import time\nwhile True:\n    time.sleep(1)", "", limits)
    assert outcome.status == "timeout", outcome
    # at most wall_s plus what it waited for the core (itself at most MAX_CPU_WAIT times wall_s), and the kill
    assert outcome.seconds <= limits.wall_s * (1 + MAX_CPU_WAIT) + 2, outcome
    assert time.monotonic() - began < 30


@pytest.mark.skipif(isolation() != "namespaces", reason="the runner double stands first in the namespaces mode's "
                                                          "command")
def test_the_sandboxs_own_setup_does_not_count_on_the_programs_wall_clock(monkeypatch):
    """A setup that stalls for 2 s (the runner double) before a program with a 0.5 s wall clock: the program
    runs, and its wall clock starts at its first line; one that sleeps is still stopped by it."""
    import areal_code.sandbox as sandbox

    double = Path(__file__).with_name("slow_setup_runner_double.py")
    monkeypatch.setattr(sandbox, "RUNNER_ARGV", [str(double), sandbox.RUNNER])
    limits = Limits(wall_s=0.5)
    outcome = run_python("print('done')", "", limits)
    assert (outcome.status, outcome.stdout.strip()) == ("ok", "done"), outcome
    assert outcome.setup_s >= 2.0 and outcome.seconds >= outcome.setup_s, outcome
    sleeper = run_python("import time\ntime.sleep(30)", "", limits)
    assert sleeper.status == "timeout" and sleeper.seconds - sleeper.setup_s < 0.5 + scaled(5), sleeper


@pytest.mark.skipif(isolation() != "namespaces", reason="the runner double stands first in the namespaces mode's "
                                                          "command")
def test_a_setup_that_does_not_finish_is_the_sandboxs_error_not_the_programs(monkeypatch):
    """The setup's own bound (SETUP_TIMEOUT_S, here 0.5 s against the double's 2 s stall): the run is stopped as a
    sandbox_error that says so, not scored as the program's timeout."""
    import areal_code.sandbox as sandbox

    monkeypatch.setattr(sandbox, "RUNNER_ARGV", [str(Path(__file__).with_name("slow_setup_runner_double.py")),
                                                 sandbox.RUNNER])
    monkeypatch.setattr(sandbox, "SETUP_TIMEOUT_S", 0.5)
    outcome = run_python("print('done')", "", Limits(wall_s=10.0))
    assert outcome.status == "sandbox_error", outcome
    assert "areal-sandbox: setup did not finish in 0.5 s" in outcome.stderr and outcome.stdout == "", outcome
    assert outcome.seconds < scaled(5), outcome
