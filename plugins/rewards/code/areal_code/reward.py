"""The ``code`` reward: run the completion's code against the item's tests in the sandbox."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

from areal_core.api import Reward
from areal_core.config.schema import spec

from areal_code.sandbox import Limits, isolation, run_python

FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The last fenced block tagged python/py (or untagged), or None."""
    blocks = [body for lang, body in FENCE.findall(completion) if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else None


def same_output(got: str, expected: str) -> bool:
    """Equal up to trailing spaces on each line and trailing blank lines."""
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip("\n").splitlines()]
    return norm(got) == norm(expected)


@dataclass
class CodeConfig:
    """Keys of the ``reward`` section when ``reward.name: code``."""

    tests_key: str = spec("tests", help="item field: a list of {input, output} stdin/stdout cases")
    test_code_key: str = spec("test_code", help="item field: assert-style Python run after the solution")
    partial: bool = spec(False, help="score the fraction of tests passed instead of all-or-nothing")
    cpu_s: int = spec(5, ge=1, help="CPU seconds per test run (RLIMIT_CPU)")
    wall_s: float = spec(10.0, gt=0.0, help="wall-clock seconds per test run, not counting time spent waiting "
                                                "for a CPU the machine gave to other work; then the sandbox is killed")
    memory_mb: int = spec(512, ge=64, help="address space per process (RLIMIT_AS)")
    max_processes: int = spec(32, ge=1, help="processes per run (pids cgroup, else RLIMIT_NPROC)")
    file_size_mb: int = spec(16, ge=1, help="largest file or output a run may write (RLIMIT_FSIZE)")
    disk_mb: int = spec(64, ge=1, help="all a run may write, in its own folder (a tmpfs of this size; namespaces)")
    allow_weak_isolation: bool = spec(False, help="where the machine gives no user namespaces, run the code with "
                                      "rlimits and an audit hook only (no boundary) instead of refusing it")
    max_concurrent: int = spec(2, ge=1, help="sandboxes running at once for this reward")


class CodeReward(Reward):
    """1.0 when the last ```python block passes every test (``partial``: the fraction passed).

    Returns ``{"reward", "passed", "total", "reason", "detail", "isolation"}``;
    ``reason`` is ``passed``, ``wrong_answer``, ``no_code``, ``no_tests``, or
    the sandbox's status of the first failing run (``error``, ``timeout``,
    ``cpu_time``, ``memory``, ``process_limit``, ``file_size``, ``disk_full``,
    ``network``, ``write_blocked``, ``sandbox_error``). Never raises on any completion.
    """

    config_class = CodeConfig

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        o = self.options = self.context.options or CodeConfig()
        self.limits = Limits(cpu_s=o.cpu_s, wall_s=o.wall_s, memory_mb=o.memory_mb,
                             max_processes=o.max_processes, file_size_mb=o.file_size_mb, disk_mb=o.disk_mb,
                             allow_weak_isolation=o.allow_weak_isolation)
        self._slots = threading.BoundedSemaphore(o.max_concurrent)

    def _runs(self, code: str, item: Any) -> list[tuple[str, str, str | None]]:
        """(source, stdin, expected stdout or None for assert-style) per test."""
        item = item if isinstance(item, dict) else {}
        runs = [(code, str(case.get("input", "")), str(case.get("output", "")))
                for case in item.get(self.options.tests_key) or [] if isinstance(case, dict)]
        test_code = item.get(self.options.test_code_key)
        if isinstance(test_code, str) and test_code.strip():
            runs.append((f"{code}\n\n# --- tests ---\n{test_code}\n", "", None))
        return runs

    def __call__(self, prompt: str, completion: str, item: Any) -> dict:
        code = extract_code(completion)
        result = {"reward": 0.0, "passed": 0, "total": 0, "reason": "", "detail": "", "isolation": isolation()}
        if code is None:
            return {**result, "reason": "no_code", "detail": "no ```python block in the completion"}
        runs = self._runs(code, item)
        result["total"] = len(runs)
        if not runs:
            return {**result, "reason": "no_tests",
                    "detail": f"item has neither {self.options.tests_key!r} cases nor {self.options.test_code_key!r}"}
        for i, (source, stdin, expected) in enumerate(runs):
            with self._slots:
                outcome = run_python(source, stdin, self.limits)
            if outcome.status == "ok" and (expected is None or same_output(outcome.stdout, expected)):
                result["passed"] += 1
                continue
            if not result["reason"]:
                result["reason"] = "wrong_answer" if outcome.status == "ok" else outcome.status
                result["detail"] = f"test {i}: " + (outcome.stderr.strip()[-500:] or
                                                    f"stdout {outcome.stdout[:200]!r} != expected {expected!r}")
                if outcome.status == "timeout":
                    result["detail"] += (f" (stopped after {outcome.seconds:.1f} s, of which {outcome.setup_s:.1f} s of "
                                         f"the sandbox's setup and {outcome.cpu_wait_s:.1f} s waiting for a CPU were "
                                         f"not counted; wall_s is {self.limits.wall_s})")
            if not self.options.partial:
                break
        if result["passed"] == len(runs):
            result["reason"] = "passed"
        result["reward"] = result["passed"] / len(runs) if self.options.partial else float(result["passed"] == len(runs))
        return result
