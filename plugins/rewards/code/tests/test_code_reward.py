"""The code reward: passing and failing solutions, and one test per sandbox attack.

Each attack test also checks the host afterwards: no sandbox process left,
no sandbox folder or cgroup left, nothing written where it was aimed.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from areal_core.api import Context
from areal_core.testing import RewardConformance, scaled, wait_until

from areal_code.reward import CodeConfig, CodeReward, extract_code
from areal_code.sandbox import RUNNER, Limits, isolation, pids_cgroup_root, run_python

REVERSE = {"tests": [{"input": "abc\n", "output": "cba\n"}, {"input": "hello\n", "output": "olleh"}]}


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


class TestCodeReward(RewardConformance):
    component_name = "code"
    examples = [
        ("Reverse a line.", fenced("print(input()[::-1])"), REVERSE, 1.0),
        ("Reverse a line.", fenced("print(input())"), REVERSE, 0.0),
        ("Reverse a line.", "print(input()[::-1])", REVERSE, 0.0),  # no code block
        ("add", fenced("def add(a, b):\n    return a + b"), {"test_code": "assert add(2, 3) == 5"}, 1.0),
        ("add", fenced("def add(a, b):\n    return a - b"), {"test_code": "assert add(2, 3) == 5"}, 0.0),
    ]


def reward(**options) -> CodeReward:
    base = {"cpu_s": 2, "wall_s": 4.0, "memory_mb": 256, "max_processes": 16}
    return CodeReward.create(Context(options=CodeConfig(**{**base, **options})))


def sandbox_processes() -> list[int]:
    """Host processes still running the sandbox runner (there must be none after a run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if RUNNER.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def leftovers() -> list[str]:
    folders = [str(p) for p in Path(tempfile.gettempdir()).glob("areal-sandbox-*")]
    root = pids_cgroup_root()
    groups = [str(p) for p in Path(root).glob("areal-sandbox-*")] if root else []
    return folders + groups


@pytest.fixture
def host_check():
    before = set(leftovers())
    yield
    wait_until(lambda: sandbox_processes() == [], 5, "the sandbox processes to end with their run", 0.05)
    assert set(leftovers()) - before == set(), "a sandbox folder or cgroup was left behind"
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def attack(code: str, item: dict | None = None, **options) -> dict:
    return reward(**options)("", fenced(code), item or {"tests": [{"input": "", "output": "done"}]})


@contextlib.contextmanager
def listening_server():
    """A TCP server on the host's loopback that sandboxed code must not reach: ``(server, port)``."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        yield server, server.getsockname()[1]


def test_extract_code_takes_the_last_python_block():
    text = "```bash\nls\n```\n```python\nprint(1)\n```\n```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("no fence") is None


def test_partial_scores_the_fraction_passed(host_check):
    item = {"tests": [{"input": "1\n", "output": "2"}, {"input": "5\n", "output": "6"}],
            "test_code": "assert True"}
    result = reward(partial=True)("", fenced("import sys\nn = int(sys.stdin.read() or 0)\nprint(2 if n == 1 else 0)"), item)
    assert (result["passed"], result["total"], result["reason"]) == (2, 3, "wrong_answer")
    assert result["reward"] == pytest.approx(2 / 3)


def test_spawning_past_the_process_limit_fails_cleanly(host_check):
    # the harmless check of the limit the fork bomb relies on: 50 sleeps, a limit of 16
    code = ("import subprocess\nps = []\ntry:\n    for _ in range(50):\n"
            "        ps.append(subprocess.Popen(['sleep', '30']))\nexcept OSError:\n    pass\n"
            "print(len(ps))")
    result = attack(code, {"tests": [{"input": "", "output": "50"}]})
    assert result["reward"] == 0.0
    if pids_cgroup_root() is not None:
        assert result["reason"] == "process_limit", f"{result}"


def test_fork_bomb_is_contained(host_check):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = attack(code, wall_s=2.0)
    assert result["reward"] == 0.0
    assert result["reason"] in ("process_limit", "timeout", "cpu_time"), result
    if pids_cgroup_root() is not None:
        assert result["reason"] == "process_limit", result
    # the sandbox itself, timed: stopped by its 2 s wall clock, less the time the machine kept it from a CPU
    # (which a loaded machine adds, up to MAX_CPU_WAIT x wall_s) and its own setup
    outcome = run_python(code, limits=Limits(wall_s=2.0, max_processes=32))
    assert outcome.seconds - outcome.setup_s - outcome.cpu_wait_s < 2.0 + scaled(8), outcome


def test_memory_bomb_is_contained(host_check):
    result = attack("chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))")
    assert (result["reward"], result["reason"]) == (0.0, "memory"), result


def test_infinite_loop_is_stopped_by_the_cpu_limit(host_check):
    result = attack("while True:\n    pass", cpu_s=1, wall_s=10.0)
    assert (result["reward"], result["reason"]) == (0.0, "cpu_time"), result
    # a second of CPU: well before the 10 s wall clock, once the time the machine kept it from a CPU is taken off
    outcome = run_python("while True:\n    pass", limits=Limits(cpu_s=1, wall_s=10.0))
    assert outcome.status == "cpu_time" and outcome.seconds - outcome.setup_s - outcome.cpu_wait_s < scaled(5), \
        outcome


def test_sleeping_forever_is_stopped_by_the_wall_clock(host_check):
    start = time.monotonic()
    result = attack("import time\nwhile True:\n    time.sleep(1)", wall_s=1.0)
    took = time.monotonic() - start
    assert (result["reward"], result["reason"]) == (0.0, "timeout"), result
    # the detail says how long it ran and how much of that was not counted, so a user can tell load from a hang
    said = re.search(r"stopped after ([\d.]+) s, of which ([\d.]+) s of the sandbox's setup and ([\d.]+) s waiting "
                     r"for a CPU were not counted; wall_s is 1\.0", result["detail"])
    assert said, result["detail"]
    seconds, setup_s, cpu_wait_s = map(float, said.groups())
    # the sandbox's own part is bounded; its setup (bounded apart) and the CPU a loaded machine kept from it are not
    # (a loaded suite run took 7.4 s here in all)
    assert seconds - setup_s - cpu_wait_s < 1.0 + scaled(4), result["detail"]
    assert took < seconds + scaled(4)  # and the reward added little around the sandbox


def test_socket_cannot_reach_the_host(host_check):
    with listening_server() as (server, port):
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                f"s.sendall(b'stolen')\nprint('done')")
        result = attack(code)
        assert (result["reward"], result["reason"]) == (0.0, "network"), result
        with pytest.raises(OSError):  # nobody connected
            server.accept()


@pytest.mark.skipif(isolation() != "namespaces", reason="needs user + network namespaces")
def test_socket_around_the_audit_hook_finds_no_network(host_check):
    # a child interpreter has no audit hook; the empty network namespace still refuses
    with listening_server() as (server, port):
        child = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')"
        code = (f"import subprocess, sys\nr = subprocess.run([sys.executable, '-c', {child!r}])\n"
                f"print('done' if r.returncode == 0 else 'refused')")
        result = attack(code)
        assert result["reward"] == 0.0 and result["reason"] == "wrong_answer", result
        with pytest.raises(OSError):  # nobody connected
            server.accept()


def test_writes_outside_the_folder_are_refused(host_check, tmp_path):
    target = tmp_path / "escaped.txt"
    result = attack(f"open({str(target)!r}, 'w').write('x')\nprint('done')")
    assert (result["reward"], result["reason"]) == (0.0, "write_blocked"), f"{result}"
    assert not target.exists()


@pytest.mark.skipif(isolation() != "namespaces", reason="needs user + mount namespaces")
def test_writes_around_the_audit_hook_hit_a_read_only_filesystem(host_check, tmp_path):
    # a shell has no audit hook: the host's folder does not exist in the sandbox, and what does is read-only
    target = tmp_path / "escaped.txt"
    result = attack(f"import os\nos.system('echo x > {target}; echo x > /usr/escaped.txt; echo x > /escaped.txt')"
                    f"\nprint('done')")
    assert (result["reward"], result["reason"]) == (0.0, "write_blocked"), f"{result}"
    assert not target.exists() and not Path("/usr/escaped.txt").exists() and not Path("/escaped.txt").exists()


def test_writing_a_file_past_the_size_limit_is_stopped(host_check):
    # 4 MiB into a file of its own folder, with a 1 MiB limit
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (4 << 20))\nprint('done')"
    result = attack(code, file_size_mb=1)
    assert (result["reward"], result["reason"]) == (0.0, "file_size"), result
    assert attack(code, file_size_mb=8)["reward"] == 1.0  # the same program under a larger limit passes


def test_flooding_stdout_is_stopped_by_the_size_limit(host_check):
    result = attack("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", file_size_mb=1, wall_s=10.0)
    assert (result["reward"], result["reason"]) == (0.0, "file_size"), result


def test_concurrent_calls_are_bounded_by_max_concurrent(host_check, monkeypatch):
    import areal_code.reward as module

    active, peak, lock = 0, 0, threading.Lock()
    real = module.run_python

    def counting_run_python(*args, **kwargs):  # the real sandbox, with a count of how many run at once
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                active -= 1

    monkeypatch.setattr(module, "run_python", counting_run_python)
    item = {"tests": [{"input": "", "output": "done"}]}
    for bound in (1, 2):
        peak = 0
        scorer = reward(max_concurrent=bound)
        threads = [threading.Thread(target=scorer, args=("", fenced("import time\ntime.sleep(0.6)\nprint('done')"),
                                                          item)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(60))
        assert peak == bound, f"max_concurrent={bound} but {peak} sandboxes ran at once"


@pytest.mark.skipif(isolation() != "namespaces", reason="needs user + mount namespaces")
def test_no_host_file_is_visible_not_even_one_only_its_owner_may_read(host_check, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2-host-secret")
    secret.chmod(0o600)  # root's own file when the trainer runs as root: readable to a namespace root before
    code = (f"import os\nfor path in [{str(secret)!r}, '/etc/shadow', '/etc/passwd', {str(Path(__file__).parent)!r}]:\n"
            f"    try:\n        print(open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
            f"    except OSError as e:\n        print(type(e).__name__)\n")
    result = attack(code, {"tests": [{"input": "", "output": "FileNotFoundError\n" * 4}]})
    assert result["reward"] == 1.0, result  # none of them exists for the program
    assert "hunter2" not in str(result)
    # the host's home folder shows at most the way to the interpreter's installation (bound read-only)
    import sys

    home, prefix = Path.home(), Path(sys.base_prefix)
    allowed = sorted(prefix.relative_to(home).parts[:1]) if prefix.is_relative_to(home) else []
    listing = attack(f"import os\nh = {str(home)!r}\nprint(sorted(os.listdir(h)) if os.path.isdir(h) else [])",
                     {"tests": [{"input": "", "output": repr(allowed)}]})
    assert listing["reward"] == 1.0, listing


@pytest.mark.skipif(isolation() != "namespaces", reason="needs user + pid namespaces")
def test_proc_shows_the_sandboxs_processes_only(host_check):
    code = ("import os\npids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "print(len(pids) <= 3, os.getpid() in pids, open('/proc/1/cmdline').read().count('_runner.py'))")
    result = attack(code, {"tests": [{"input": "", "output": "True True 1"}]})
    assert result["reward"] == 1.0, result  # the host's init and processes are not listed


@pytest.mark.skipif(isolation() != "namespaces", reason="needs user + mount namespaces")
def test_all_a_run_writes_is_capped_not_only_each_file(host_check):
    free = os.statvfs(tempfile.gettempdir())
    code = ("for i in range(40):\n    with open(f'part{i}.bin', 'wb') as f:\n        f.write(b'x' * (1 << 20))\n"
            "print('done')")
    result = attack(code, disk_mb=8, file_size_mb=2)  # 40 files of 1 MiB: each under the file limit
    assert (result["reward"], result["reason"]) == (0.0, "disk_full"), result
    assert "No space left on device" in result["detail"]
    after = os.statvfs(tempfile.gettempdir())
    assert (free.f_bavail - after.f_bavail) * after.f_frsize < 4 << 20  # nothing of it landed on the host's disk
    assert attack(code, disk_mb=64, file_size_mb=2)["reward"] == 1.0  # the same program with room passes


def test_without_namespaces_untrusted_code_is_refused_unless_allowed(host_check, monkeypatch):
    import areal_code.reward as reward_module
    import areal_code.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "isolation", lambda: "rlimits")
    monkeypatch.setattr(reward_module, "isolation", lambda: "rlimits")
    refused = attack("print('done')")
    assert (refused["reward"], refused["reason"]) == (0.0, "sandbox_error"), refused
    assert "so untrusted code would run with rlimits and an audit hook only" in refused["detail"]
    assert "reward.allow_weak_isolation=true" in refused["detail"]
    allowed = attack("print('done')", allow_weak_isolation=True)
    assert allowed["reward"] == 1.0 and allowed["isolation"] == "rlimits", allowed


def test_writes_inside_the_folder_work_and_are_removed(host_check):
    code = "open('scratch.txt', 'w').write('kept')\nprint(open('scratch.txt').read())"
    result = attack(code, {"tests": [{"input": "", "output": "kept"}]})
    assert result["reward"] == 1.0, result


def test_environment_is_scrubbed(host_check, monkeypatch):
    monkeypatch.setenv("AREAL_SECRET_TOKEN", "hunter2")
    code = "import os\nprint('AREAL_SECRET_TOKEN' in os.environ)"
    assert attack(code, {"tests": [{"input": "", "output": "False"}]})["reward"] == 1.0
