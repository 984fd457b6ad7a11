"""Runs inside the sandbox, as a script (``python -I _runner.py STAGE CONFIG_JSON``); stdlib only.

Stage ``setup`` (namespaces mode: root of a fresh user, mount, network and
pid namespace): join the pids cgroup, remount every mount read-only, then
build the program's own file system and move into it: a small tmpfs as the
new root holding read-only binds of what the interpreter needs (``/usr`` and
its links, the Python installation, the dynamic linker's cache), ``/dev/null``,
``/dev/zero``, ``/dev/urandom`` and ``/dev/random``, a fresh ``/proc`` of the
new pid namespace (only the sandbox's processes), and ``/box``, a tmpfs of
``disk_bytes`` holding ``main.py``: the only place it can write, and all it
can write. ``pivot_root`` makes that the root and the host's root is
detached, so no host file (root-owned or not) and no host process is
visible. Then re-exec as stage ``run`` inside a nested user namespace, which
holds no capability over those mounts and so cannot make them writable again.

Stage ``run``: set the resource limits, install an audit hook that refuses
sockets and writes outside the sandbox folder, tell the host on ``ready_fd``
that the program starts (its wall clock starts then), and execute the program.
The audit hook is a guard for honest mistakes and the fallback mode, not a
security boundary (Python code can reach around it); the namespaces, the
new root, the read-only mounts, the rlimits and the cgroup are the boundary.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MARK = "areal-sandbox: blocked"


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
# statvfs flags that a remount must keep (they are locked in a user namespace): statvfs bit -> mount flag
LOCKED = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}  # the syscall's number; glibc has no wrapper
DEVICES = ("null", "zero", "urandom", "random")


def fail(what, errno_=None):
    why = os.strerror(errno_) if errno_ else ""
    sys.exit(f"areal-sandbox: setup failed: {what}{': ' + why if why else ''}")


def setup(cfg):
    if cfg.get("cgroup"):
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write("0")  # this process; every descendant is born inside
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target, fstype, flags, data=None):
        if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                      data and data.encode()) != 0:
            fail(f"mount {fstype or source} on {target}", ctypes.get_errno())

    def read_only(point):
        have = os.statvfs(point).f_flag
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for st, ms in LOCKED.items():
            if have & st:
                flags |= ms
        return libc.mount(b"none", point.encode(), None, flags, None) == 0

    with open(os.path.join(cfg["box"], "main.py"), "rb") as f:
        source = f.read()
    with open(os.path.abspath(__file__), "rb") as f:
        runner = f.read()
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mounts.append(line.split()[4].encode().decode("unicode_escape"))
    for point in mounts:  # every host mount read-only first: the binds below inherit it
        if point == "/proc" or point.startswith("/proc/"):
            continue
        try:
            if not read_only(point) and point == "/":
                fail("read-only /", ctypes.get_errno())
        except OSError:
            continue

    root = cfg["root"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=8m,mode=755")
    for src in cfg["binds"]:
        dst = root + src
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):  # /bin -> usr/bin: the same link, so paths resolve as on the host
            os.symlink(os.readlink(src), dst)
            continue
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        elif os.path.exists(src):
            open(dst, "w").close()
        else:
            continue
        mount(src, dst, None, MS_BIND | MS_REC)
        read_only(dst)  # already read-only by inheritance; said again for a mount made writable since
    os.makedirs(root + "/dev")
    for name in DEVICES:
        open(root + "/dev/" + name, "w").close()
        mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this pid namespace's processes only
    os.makedirs(root + "/box")
    mount("tmpfs", root + "/box", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_bytes']},mode=777")
    with open(root + "/box/main.py", "wb") as f:
        f.write(source)
    os.makedirs(root + "/.areal")
    with open(root + "/.areal/_runner.py", "wb") as f:
        f.write(runner)
    os.makedirs(root + "/.old")
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        fail(f"pivot_root: no syscall number known for {os.uname().machine}")
    if libc.syscall(number, root.encode(), (root + "/.old").encode()) != 0:
        fail("pivot_root", ctypes.get_errno())
    os.chdir("/")
    if libc.umount2(b"/.old", 2) != 0:  # MNT_DETACH: the host's root is gone from this namespace
        fail("detach the host's root", ctypes.get_errno())
    os.rmdir("/.old")
    if not read_only("/"):
        fail("read-only new root", ctypes.get_errno())
    cfg = {**cfg, "box": "/box"}
    os.execv(cfg["unshare"], [cfg["unshare"], "--user", "--map-root-user", "--",
                              cfg["python"], "-I", "/.areal/_runner.py", "run", json.dumps(cfg)])


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
