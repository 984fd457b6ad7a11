"""What a launcher that places a run on several machines checks and passes on, whatever places it.

Launchers for clusters (Ray, SLURM) start a run's processes on machines the
cluster picks. Three things then matter that never do on one machine, and
they are the same for every such launcher, so they live here:

- **Where each process runs.** Every process gets ``AREAL_NODE_ID`` (the
  node it runs on, as the cluster names it) and the trainer gets
  ``AREAL_ROLLOUT_<i>_NODE`` for each inference server. From these the
  trainer tells each server whether it shares its node
  (:func:`same_node_as_trainer`), which decides how weights travel to it:
  shared memory only works on one node. ``AREAL_NODE_ADDRESS`` is the
  address other nodes reach this one at (a weight-update process group's
  rendezvous). The ``local`` launcher sets none of them: everything is on
  one node.
- **The same plugins everywhere.** A node with another version of a plugin
  (or without it) would build other components from the same config;
  :func:`installed_plugins` is what each worker reports and
  :func:`plugin_set_difference` lists what differs, so the launcher refuses
  the run before anything starts.
- **Shared storage.** The run folder (checkpoints, metrics, logs, weights on
  disk) must be the same folder on every node. :func:`write_storage_tokens`
  runs on each node and :func:`read_storage_tokens` on each other node;
  :func:`storage_problems` turns what they found into one message naming
  the node and the path.

Stdlib only: these run inside cluster workers before anything heavy is
imported.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

NODE_ENV = "AREAL_NODE_ID"
NODE_ADDRESS_ENV = "AREAL_NODE_ADDRESS"
CHECK_FOLDER = ".areal-storage-check"


def rollout_node_env(index: int) -> str:
    """The variable that names the node inference server ``index`` runs on (set for the trainer)."""
    return f"AREAL_ROLLOUT_{index}_NODE"


def same_node_as_trainer(index: int, environ: dict | None = None) -> bool:
    """Whether inference server ``index`` runs on this process's node.

    True when the launcher placed nothing (the ``local`` launcher: one
    node), so single-machine runs keep their shared-memory paths; False for
    a server whose node a cluster launcher did not say (one it restarted
    later, wherever the cluster put it): the cross-node paths work anywhere.
    """
    env = os.environ if environ is None else environ
    mine, theirs = env.get(NODE_ENV), env.get(rollout_node_env(index))
    return not mine or mine == theirs


# -------------------------------------------------------------------- plugins


def installed_plugins() -> dict[str, str]:
    """``{distribution: version}`` for areal-core and every installed ``areal-plugin-*`` distribution."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "areal-core" or name.startswith("areal-plugin-"):
            found.setdefault(name, dist.version)  # the first on the path is the one imported
    return dict(sorted(found.items()))


def plugin_set_difference(reference: dict[str, str], found: dict[str, str], where: str,
                          here: str = "the launcher's machine") -> list[str]:
    """One line per distribution whose version differs, or that only one side has."""
    lines = []
    for name in sorted(set(reference) | set(found)):
        mine, theirs = reference.get(name), found.get(name)
        if mine == theirs:
            continue
        if theirs is None:
            lines.append(f"{name} {mine} is installed on {here} but not on {where}")
        elif mine is None:
            lines.append(f"{name} {theirs} is installed on {where} but not on {here}")
        else:
            lines.append(f"{name} is {mine} on {here} but {theirs} on {where}")
    return lines


class PluginSetMismatch(RuntimeError):
    """Nodes of one run have different areal distributions; the message lists every difference."""


def check_plugin_sets(reference: dict[str, str], reports: dict[str, dict[str, str]],
                      here: str = "the launcher's machine") -> None:
    """Raise :class:`PluginSetMismatch` listing every difference between ``reference`` and a node's report."""
    lines = [line for node, found in sorted(reports.items())
             for line in plugin_set_difference(reference, found, node, here)]
    if lines:
        raise PluginSetMismatch(
            "every node of a run must have the same areal plugins at the same versions, and these differ:\n"
            + "\n".join(f"  - {line}" for line in lines)
            + "\nFix: install the same versions on every node (e.g. the same `pip install` line, or one "
              "container image), then start the run again. Nothing was launched.")


# -------------------------------------------------------------------- shared storage


def _safe(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", node)[:64] or "node"


def write_storage_tokens(node: str, folders: list[str]) -> dict[str, str]:
    """On ``node``: create each folder and a file in it holding a fresh random token; ``{file: token}``.

    A folder that cannot be written is reported as ``{folder: "!error text"}``
    so the launcher names it with the node.
    """
    written = {}
    for folder in folders:
        check = Path(folder) / CHECK_FOLDER
        path = check / f"{_safe(node)}-{secrets.token_hex(4)}.token"
        token = secrets.token_hex(16)
        try:
            check.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(token)
            os.replace(tmp, path)
            written[str(path)] = token
        except OSError as exc:
            written[str(folder)] = f"!{type(exc).__name__}: {exc}"
    return written


def read_storage_tokens(files: dict[str, str]) -> dict[str, str]:
    """On another node: ``{file: what was wrong}`` for each file that is missing or holds another token."""
    wrong = {}
    for path, token in files.items():
        if token.startswith("!"):
            continue  # the writer's own failure, reported from its side
        try:
            found = Path(path).read_text()
        except OSError as exc:
            wrong[path] = f"cannot read it ({type(exc).__name__}: {exc})"
            continue
        if found != token:
            wrong[path] = "it holds other contents than the writer wrote (another folder under the same path)"
    return wrong


@dataclass
class StorageReport:
    """One node's view: what it wrote and, per other node, what it could not read back."""

    node: str
    written: dict[str, str]
    unreadable: dict[str, dict[str, str]]  # writer node -> {file: why}


def storage_problems(reports: list[StorageReport]) -> list[str]:
    """Every failure of the shared-storage check, one line each, naming node and path."""
    lines = []
    for report in reports:
        for path, token in report.written.items():
            if token.startswith("!"):
                lines.append(f"node {report.node} cannot write under {path}: {token[1:]}")
        for writer, files in report.unreadable.items():
            for path, why in files.items():
                lines.append(f"node {report.node} does not see {path}, written by node {writer}: {why}")
    return lines


class SharedStorageError(RuntimeError):
    """A folder every node must share is not shared; the message names node and path."""


def raise_storage_problems(reports: list[StorageReport], folders: list[str]) -> None:
    lines = storage_problems(reports)
    if lines:
        raise SharedStorageError(
            "the run folder and the weight-exchange folder must be one shared folder on every node "
            f"({', '.join(folders)}), and they are not:\n" + "\n".join(f"  - {line}" for line in lines)
            + "\nFix: put output_dir on storage every node mounts at the same path (NFS, Lustre, a shared "
              "volume), or run on one node. Nothing was launched.")


def remove_storage_tokens(folders: list[str]) -> None:
    """Remove the check's files (from any one node: the folders are shared once the check passed)."""
    for folder in folders:
        check = Path(folder) / CHECK_FOLDER
        for path in check.glob("*.token"):
            path.unlink(missing_ok=True)
        try:
            check.rmdir()
        except OSError:
            pass


# -------------------------------------------------------------------- what runs on a node


def server_recipe(run_dir: str | Path, index: int, host: str, port: int) -> Any:
    """On a node: the :class:`~areal_core.api.ServerProcess` of inference server ``index`` of the run in
    ``run_dir`` (its resolved ``config.yaml``), listening on ``host:port``; None for an engine that runs no
    server of its own."""
    from areal_core.api import Context
    from areal_core.config.validate import validate_run

    run = validate_run(str(Path(run_dir) / "config.yaml"), [])
    if run.problems:
        from areal_core.problems import ProblemsError

        raise ProblemsError(run.problems)
    placement = run.placement("rollout")
    return run.components["rollout"].server_process(
        Context(config=run.config, options=run.options.get("rollout"), placement=placement,
                extras={"host": host}), index, port)


def trainer_argv(run_dir: str | Path, resume: bool) -> list[str]:
    """The command of one train rank (the same on every launcher)."""
    return [sys.executable, "-m", "areal_core.trainer", str(run_dir)] + (["--resume"] if resume else [])


def trainer_env(rank: int, world_size: int, master: tuple[str, int], local: tuple[int, int], node: str,
                servers: list[tuple[str, str]], extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of train rank ``rank`` placed by a cluster launcher.

    ``master`` is the rendezvous (the first rank's node address and a port
    free there), ``local`` this rank's (local rank, ranks on its node),
    ``servers`` each inference server's ``(host:port, node)``.
    """
    local_rank, local_world = local
    env = {"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
           "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world),
           NODE_ENV: node, "PYTHONUNBUFFERED": "1"}
    for i, (address, server_node) in enumerate(servers):
        env[f"AREAL_ROLLOUT_{i}_ADDRESS"] = address
        env[rollout_node_env(i)] = server_node
    env.update(extra or {})
    return env
