"""Run a command against a Ray cluster of several nodes made on this machine, then take the cluster down.

Usage::

    python cluster.py NODES_JSON LISTENERS_FILE -- COMMAND...

``NODES_JSON`` is a list of node arguments for :class:`ray.cluster_utils.Cluster` (the first is the head),
e.g. ``[{"num_cpus": 1}, {"num_cpus": 1, "env_vars": {"PYTHONPATH": "..."}}]``. The cluster's address is
appended to COMMAND as ``launcher.address=...``; this script exits with the command's status. Before the
cluster goes down, every TCP socket listening in this network namespace is written to LISTENERS_FILE.

Ray binds the machine's external address when it has one, which tests must not do; run this inside a network
namespace that has only loopback (:func:`netns`), where every node falls back to 127.0.0.1. This is a real
multi-node Ray cluster (separate raylets, object stores and resources per node), not a double.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def netns(argv: list[str]) -> list[str]:
    """``argv`` run in a new user + network namespace whose only interface is loopback, brought up."""
    return ["unshare", "-rn", "bash", "-c", 'ip link set lo up && exec "$@"', "netns", *argv]


def netns_available() -> bool:
    try:
        return subprocess.run(netns(["true"]), capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def command(nodes: list[dict], listeners: Path, argv: list[str]) -> list[str]:
    """The whole command line: ``argv`` against a cluster of ``nodes``, in a loopback-only namespace."""
    return netns([sys.executable, str(HERE), json.dumps(nodes), str(listeners), "--", *argv])


def _listening() -> list[str]:
    """Local addresses of listening TCP sockets in this network namespace (from /proc/net/tcp{,6})."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, _remote, state = row.split()[1:4]
            if state == "0A":  # LISTEN
                found.append(local)
    return found


def _loopback(hex_address: str) -> bool:
    host = hex_address.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian
        return host.endswith("7F")  # 127.x.x.x
    # ::1, or ::ffff:127.x.x.x (each 32-bit word little-endian)
    return host == "00000000000000000000000001000000" or (host.startswith("0000000000000000FFFF0000")
                                                          and host.endswith("7F"))


def main(args: list[str]) -> int:
    nodes, listeners, argv = json.loads(args[0]), Path(args[1]), args[args.index("--") + 1:]
    from ray.cluster_utils import Cluster

    head = {"include_dashboard": False, **nodes[0]}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for node in nodes[1:]:
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        print(f"cluster: {len(nodes)} nodes at {cluster.address}", flush=True)
        proc = subprocess.Popen([*argv, f"launcher.address={cluster.address}"])
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            code = proc.wait()
        listening = _listening()
        listeners.write_text(json.dumps({"all": listening, "not_loopback": [a for a in listening
                                                                            if not _loopback(a)]}))
        return code
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
