"""Run one command so that it, and everything it starts, dies with the launcher (Linux).

Usage (the supervisor builds this line; stdlib only, run as a file or with ``-m``)::

    python child.py LAUNCHER_PID GRACE_S -- ARGV...

Why this exists: a launcher killed with SIGKILL (or by the out-of-memory killer)
runs no cleanup at all, so nothing it could do in Python would stop its
children. Linux lets a process ask the kernel for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), but the request is cleared on ``fork``: the
command's own helpers (vLLM workers, dataloader workers, a shell's ``sleep``)
would not get it. So this trampoline does not ``exec`` the command; it is a
supervisor of one:

- it asks for SIGTERM when the launcher dies, then starts ARGV in its own
  process group (the supervisor made this process a session leader);
- when the launcher dies it sends SIGTERM to the whole group once, waits for the
  command up to GRACE_S seconds, then SIGKILLs the group, itself included;
- a SIGTERM while the launcher lives came from the supervisor signalling the
  group (or from the kernel because the launcher *thread* that started us
  exited): every member already has it, so it forwards nothing;
- when the command exits on its own, it sends SIGTERM to the processes the
  command left behind in the group, then exits with the command's own status
  (the same exit code, or killed by the same signal);
- when this trampoline itself is killed (SIGKILL, as Ray does to the children
  of a worker that died), the command gets SIGKILL from the kernel: it asked
  for it (``PR_SET_PDEATHSIG``) between fork and exec. Its own children are
  then left to their own means.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(args: list[str]) -> int:
    if len(args) < 4 or args[2] != "--":
        print("usage: child.py LAUNCHER_PID GRACE_S -- ARGV...", file=sys.stderr)
        return 2
    launcher_pid, grace_s, command = int(args[0]), float(args[1]), args[3:]

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        print(f"areal child: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 1
    if os.getppid() != launcher_pid:  # the launcher died before the request took effect
        return 1

    signalled = orphaned = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal signalled, orphaned
        signalled = True
        if os.getppid() != launcher_pid and not orphaned:  # the launcher is gone: we tear down
            orphaned = True
            os.killpg(0, signal.SIGTERM)  # reaches us too; `orphaned` makes that a no-op
            signal.setitimer(signal.ITIMER_REAL, grace_s)

    for s in TERMINATING:
        signal.signal(s, on_signal)
    signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))

    # Block the signals across fork so the child never runs our handler before exec.
    signal.pthread_sigmask(signal.SIG_BLOCK, TERMINATING)
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        # The command dies with this trampoline too, whatever kills it: a cluster launcher's worker that goes
        # down (Ray SIGKILLs a dead worker's children) takes this trampoline with it before its teardown runs.
        # The request survives exec (it is only cleared by fork and set-id programs).
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != me:
            os._exit(1)
        for s in (*TERMINATING, signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores SIGPIPE, SIGXFSZ
            signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINATING)
        try:
            os.execvp(command[0], command)
        except OSError as e:
            print(f"areal child: cannot run {command[0]!r}: {e}", file=sys.stderr, flush=True)
        os._exit(127)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINATING)

    _, status = os.waitpid(pid, 0)
    if orphaned:
        os.killpg(0, signal.SIGKILL)  # the launcher is gone; nobody reads our status
    if not signalled:  # the command exited by itself: its leftover helpers go too
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # mirror death by signal, without dumping a core of this trampoline
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
