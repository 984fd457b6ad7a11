"""``model.path`` as a Hugging Face Hub id: ``ORG/NAME``, ``ORG/NAME@REVISION`` or ``hf://ORG/NAME[@REVISION]``.

Resolved by huggingface_hub itself (its cache, ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``,
``HF_ENDPOINT``): :func:`model_folder` downloads what a run reads (config, tokenizer, safetensors weights; not
``*.bin``, ``*.pt``, ONNX or other frameworks' files) into the cache and returns the snapshot folder, which every
engine and the trainer then load as a local folder. :func:`model_config_folder` fetches ``config.json`` alone,
for ``areal check`` (plan rules read the model's shape; nothing heavy is downloaded). Every failure is one
:class:`HubModelError` naming the id, the endpoint and the fix, never a traceback.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from areal_core.models import ModelNotFoundError

# ORG/NAME as the hub allows them (letters, digits, '-', '_', '.'), an optional @revision (branch, tag or sha)
_HUB_ID = re.compile(r"(?:hf://)?(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
# hf://datasets/ORG/NAME[@REVISION]/PATH: one file of a dataset repo (huggingface_hub's file-system paths)
_HUB_FILE = re.compile(r"hf://datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.-]+))?"
                       r"/(?P<file>[^@].*)")
# What a run reads from a model repo; everything else (other frameworks' weights, images, ...) stays there.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


class HubModelError(ModelNotFoundError):
    """A hub id that cannot be resolved: the message says why and what to do."""


def parse_hub_id(path: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``path`` is a hub id and not an existing local path, else None."""
    match = _HUB_ID.fullmatch(path or "")
    if match is None or (not path.startswith("hf://") and Path(path).expanduser().exists()):
        return None
    return match["repo"], match["revision"]


REACH_TIMEOUT_S = 5.0
_reached: dict[str, tuple[float, bool]] = {}  # endpoint -> (when probed, whether it answered)


def hub_reachable(timeout_s: float = REACH_TIMEOUT_S) -> bool:
    """Whether the hub's host takes a TCP connection within ``timeout_s`` (remembered for a minute). Where it does
    not (no network, a name that does not resolve), the fetches below read the cache only: huggingface_hub would
    otherwise retry every file 5 times with back-off, minutes before the same failure. With a proxy configured
    (``HTTPS_PROXY``, ...) the host is not probed directly: the proxy may be the only way out."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                                             "ALL_PROXY", "all_proxy")):
        return True
    endpoint = constants.ENDPOINT
    seen = _reached.get(endpoint)
    if seen is not None and time.monotonic() - seen[0] < 60:
        return seen[1]
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            answered = True
    except OSError:
        answered = False
    _reached[endpoint] = (time.monotonic(), answered)
    return answered


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _explain(path: str, repo: str, revision: str | None, exc: Exception) -> HubModelError:
    """One paragraph for a failure of huggingface_hub, by its error class."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"the hub at {_endpoint()}"
    local = f"model.path {path!r} is not a local folder, so it was looked up as a Hugging Face Hub model"
    if isinstance(exc, GatedRepoError):
        why = (f"{local}: {repo} is gated on {where}. Fix: accept its terms on its hub page, then give a token "
               "that may read it (HF_TOKEN, or `hf auth login`)")
    elif isinstance(exc, RepositoryNotFoundError):
        why = (f"{local}: {where} has no model repo {repo!r} this token may read. Fix: check the id (ORG/NAME), "
               "set HF_TOKEN for a private repo, or point model.path at a local model folder")
    elif isinstance(exc, RevisionNotFoundError):
        why = f"{local}: {repo} has no revision {revision!r} on {where}. Fix: name a branch, tag or commit it has"
    elif isinstance(exc, LocalEntryNotFoundError):
        cause = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{where} could not be reached")
        why = (f"{local}: {cause} and {repo}{'@' + revision if revision else ''} is not in the cache "
               f"({constants.HF_HUB_CACHE}). Fix: download it once where the hub is reachable (`hf download "
               f"{repo}`, same HF_HOME), or point model.path at a local model folder")
    elif isinstance(exc, EntryNotFoundError):
        why = f"{local}: {repo} on {where} has no config.json, so it is not a transformers model"
    else:
        why = f"{local}: {type(exc).__name__}: {exc}"
    return HubModelError(why)


def _from_hub(path: str, fetch) -> Path:
    """``fetch(repo, revision)`` for the hub id ``path``, its failures turned into :class:`HubModelError`."""
    parsed = parse_hub_id(path)
    if parsed is None:
        raise ValueError(f"{path!r} is not a hub id")
    repo, revision = parsed
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(fetch(repo, revision))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise _explain(path, repo, revision, exc) from None


def model_config_folder(path: str) -> Path:
    """The snapshot folder holding the hub model's ``config.json`` (only that file is fetched)."""
    from huggingface_hub import hf_hub_download

    offline = not hub_reachable()
    return _from_hub(path, lambda repo, revision: hf_hub_download(repo, "config.json", revision=revision,
                                                                  local_files_only=offline)).parent


def cached_config_folder(path: str) -> Path | None:
    """The snapshot folder with the hub model's ``config.json`` when the cache has it (nothing is fetched);
    None otherwise, or when ``path`` is no hub id."""
    parsed = parse_hub_id(path)
    if parsed is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(parsed[0], "config.json", revision=parsed[1])
    return Path(found).parent if isinstance(found, str) else None


def model_folder(path: str) -> Path:
    """The hub model downloaded (what a run reads of it) into huggingface_hub's cache: its snapshot folder."""
    from huggingface_hub import snapshot_download

    offline = not hub_reachable()
    folder = _from_hub(path, lambda repo, revision: snapshot_download(repo, revision=revision,
                                                                      allow_patterns=MODEL_FILES,
                                                                      local_files_only=offline))
    repo = parse_hub_id(path)[0]
    if not (folder / "config.json").is_file():
        raise HubModelError(f"model.path {path!r}: {repo} on {_endpoint()} has no config.json, so it is not a "
                            "transformers model")
    if not any(folder.glob("*.safetensors")):
        raise HubModelError(f"model.path {path!r}: {repo} on {_endpoint()} has no *.safetensors weights (the "
                            "engines read safetensors only). Fix: use a repo that has them, or convert a local "
                            "copy with transformers (from_pretrained, then save_pretrained)")
    return folder


class HubFileError(ValueError):
    """An ``hf://datasets/...`` path that cannot be fetched: the message says why and what to do."""


def is_hub_file(path: str) -> bool:
    return bool(path) and path.startswith("hf://")


def hub_file(path: str) -> Path:
    """The local copy, in huggingface_hub's cache, of ``hf://datasets/ORG/NAME[@REVISION]/PATH`` (fetched once;
    ``HF_HUB_OFFLINE`` reads the cache only)."""
    match = _HUB_FILE.fullmatch(path)
    if match is None:
        raise HubFileError(f"{path!r} is not an hf:// dataset file path. Fix: write it as "
                           "hf://datasets/ORG/NAME/FILE (e.g. hf://datasets/openai/gsm8k/main/train-00000-of-00001"
                           ".parquet), with @REVISION after NAME to pin one")
    repo, revision, name = match["repo"], match["revision"], match["file"]
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo, name, repo_type="dataset", revision=revision,
                                    local_files_only=not hub_reachable()))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise HubFileError(_explain_file(path, repo, revision, name, exc)) from None


def _explain_file(path: str, repo: str, revision: str | None, name: str, exc: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"the hub at {_endpoint()}"
    if isinstance(exc, GatedRepoError):
        return (f"{path}: {repo} is gated on {where}. Fix: accept its terms on its hub page, then give a token "
                "that may read it (HF_TOKEN, or `hf auth login`)")
    if isinstance(exc, RepositoryNotFoundError):
        return (f"{path}: {where} has no dataset repo {repo!r} this token may read. Fix: check the id (ORG/NAME), "
                "set HF_TOKEN for a private repo, or point the path at a local file")
    if isinstance(exc, RevisionNotFoundError):
        return f"{path}: {repo} has no revision {revision!r} on {where}. Fix: name a branch, tag or commit it has"
    if isinstance(exc, LocalEntryNotFoundError):
        cause = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{where} could not be reached"
        return (f"{path}: {cause} and the file is not in the cache ({constants.HF_HUB_CACHE}). Fix: fetch it once "
                f"where the hub is reachable (`hf download {repo} {name} --repo-type dataset`, same HF_HOME), or "
                "point the path at a local copy")
    if isinstance(exc, EntryNotFoundError) or "EntryNotFound" in type(exc).__name__:
        return f"{path}: {repo} on {where} has no file {name!r}. Fix: name a file the repo has (its Files tab)"
    return f"{path}: {type(exc).__name__}: {exc}"
