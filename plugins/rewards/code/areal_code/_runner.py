"""Runs inside the sandbox, as a script (``python -I _runner.py STAGE CONFIG_JSON``); stdlib only.

Stage ``setup`` (namespaces mode: root of a fresh user, mount, network and
pid namespace): join the pids cgroup, bind the sandbox folder onto itself,
remount every other mount read-only, then re-exec as stage ``run`` inside a
nested user namespace, which holds no capability over those mounts and so
cannot make them writable again.

Stage ``run``: set the resource limits, install an audit hook that refuses
sockets and writes outside the sandbox folder, tell the host on ``ready_fd``
that the program starts (its wall clock starts then), and execute the program.
The audit hook is a guard for honest mistakes and the fallback mode, not a
security boundary (Python code can reach around it); the namespaces, the
read-only mounts, the rlimits and the cgroup are the boundary.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MARK = "areal-sandbox: blocked"


def setup(cfg):
    if cfg.get("cgroup"):
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write("0")  # this process; every descendant is born inside
    libc = ctypes.CDLL(None, use_errno=True)
    ms_rdonly, ms_remount, ms_bind, ms_rec = 1, 32, 4096, 16384
    box = cfg["box"]
    if libc.mount(box.encode(), box.encode(), None, ms_bind | ms_rec, None) != 0:
        sys.exit(f"areal-sandbox: setup failed: bind {box}: {os.strerror(ctypes.get_errno())}")
    # statvfs flags that a remount must keep (they are locked in a user namespace)
    keep = {2: 2, 4: 4, 8: 8, 1024: 1024, 2048: 2048, 4096: 1 << 21}
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mounts.append(line.split()[4].encode().decode("unicode_escape"))
    for point in mounts:
        # /proc stays writable: the nested unshare writes its uid_map there (see docs/rewards.md)
        if point == box or point.startswith(box + "/") or point == "/proc" or point.startswith("/proc/"):
            continue
        try:
            have = os.statvfs(point).f_flag
        except OSError:
            continue
        flags = ms_remount | ms_bind | ms_rdonly
        for st, ms in keep.items():
            if have & st:
                flags |= ms
        if libc.mount(b"none", point.encode(), None, flags, None) != 0 and point == "/":
            sys.exit(f"areal-sandbox: setup failed: read-only /: {os.strerror(ctypes.get_errno())}")
    os.execv(cfg["unshare"], [cfg["unshare"], "--user", "--map-root-user", "--",
                              sys.executable, "-I", os.path.abspath(__file__), "run", json.dumps(cfg)])


def guard(box):
    """Audit hook: no sockets, no writes outside ``box``."""
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    allowed = ("/dev/null",)
    path_events = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
                   "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,),
                   "os.utime": (0,), "shutil.rmtree": (0,)}
    write = os.write
    realpath = os.path.realpath

    def inside(path):
        if isinstance(path, int):
            return True
        path = realpath(os.fsdecode(path))
        return path in allowed or path == box or path.startswith(box + os.sep)

    def refuse(what):
        write(2, f"\n{MARK} {what}\n".encode())
        raise PermissionError(f"{MARK} {what}")

    def hook(event, args):
        if event == "socket.__new__":
            refuse("network: the sandbox has no network")
        if event == "open" and args[2] is not None and args[2] & write_flags and not inside(args[0]):
            refuse(f"write: {args[0]!r} is outside the sandbox folder")
        if event in path_events:
            for i in path_events[event]:
                if i < len(args) and args[i] is not None and not inside(args[i]):
                    refuse(f"write: {event} {args[i]!r} is outside the sandbox folder")

    sys.addaudithook(hook)


def on_cpu_limit(signum, frame):
    os.write(2, b"\nareal-sandbox: cpu time limit reached\n")
    os._exit(152)


def run(cfg):
    # SIGXCPU at the soft limit names the cause; the hard limit (one second later) kills regardless
    signal.signal(signal.SIGXCPU, on_cpu_limit)
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    limits = [ (resource.RLIMIT_AS, cfg["memory_bytes"]),
              (resource.RLIMIT_FSIZE, cfg["file_bytes"]), (resource.RLIMIT_NOFILE, 64),
              (resource.RLIMIT_CORE, 0)]
    if cfg.get("nproc"):
        limits.append((resource.RLIMIT_NPROC, cfg["nproc"]))
    for which, value in limits:
        resource.setrlimit(which, (value, value))
    os.chdir(cfg["box"])
    with open(os.path.join(cfg["box"], "main.py")) as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    sys.argv = ["main.py"]
    sys.path.insert(0, cfg["box"])
    guard(cfg["box"])
    ready = cfg.get("ready_fd")
    if ready is not None:  # the host starts the program's wall clock now
        os.write(ready, b"1")
        os.close(ready)
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    stage, config = sys.argv[1], json.loads(sys.argv[2])
    del sys.argv[1:]
    setup(config) if stage == "setup" else run(config)
