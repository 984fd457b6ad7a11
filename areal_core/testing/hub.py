"""TEST DOUBLE of the Hugging Face Hub's HTTP API, for tests of hub loading on machines that cannot reach the
hub. It is not the hub: it serves repositories that are plain folders under a root, so that huggingface_hub's
real download code (``snapshot_download``, ``hf_hub_download``; ``HF_ENDPOINT`` points it here) runs against it.

Layout: ``ROOT/models/ORG/NAME/...`` and ``ROOT/datasets/ORG/NAME/...``, each folder the files of the repo's
one commit. Served, with the shapes huggingface_hub reads:

- ``GET /api/{models,datasets}/ORG/NAME[/revision/REV]``: ``id``, ``sha`` (a hash of the folder's files),
  ``siblings``;
- ``GET /api/{models,datasets}/ORG/NAME/tree/REV[/PATH]``: files (``type``, ``path``, ``size``, ``oid``: the
  git blob id);
- ``HEAD|GET /[datasets/]ORG/NAME/resolve/REV/PATH``: the file, with ``X-Repo-Commit``, ``ETag`` (the blob id)
  and ``Content-Length``.

A repo that is not there answers 404 with ``X-Error-Code: RepoNotFound``, a revision other than ``main`` or the
sha 404 with ``RevisionNotFound``, a missing file 404 with ``EntryNotFound``: the codes huggingface_hub turns
into its own errors. Every request is appended to ``ROOT/requests.log`` (method and path) so a test can tell
what was downloaded.

Run through :func:`serve`, which binds a socket on 127.0.0.1 and starts ``python -m areal_core.testing.hub ROOT
--fd N`` on it.
"""


import argparse
import hashlib
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

KINDS = {"models": "model", "datasets": "dataset"}


def blob_id(data: bytes) -> str:
    """Git's blob id of ``data`` (what the hub reports as a file's ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def build_app(root: Path):
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import JSONResponse

    app = FastAPI(title="TEST DOUBLE of the Hugging Face Hub")
    log = root / "requests.log"

    @app.middleware("http")
    async def record(request: Request, call_next):
        with log.open("a") as f:
            f.write(f"{request.method} {request.url.path}\n")
        return await call_next(request)

    def missing(code: str, message: str) -> Response:
        return JSONResponse({"error": message}, status_code=404, headers={"X-Error-Code": code,
                                                                           "X-Error-Message": message})

    def repo(kind: str, org: str, name: str) -> Path | None:
        folder = root / kind / org / name
        return folder if folder.is_dir() and (org, name) != ("", "") else None

    def files(folder: Path) -> list[Path]:
        return sorted(p for p in folder.rglob("*") if p.is_file())

    def sha(folder: Path) -> str:
        h = hashlib.sha1()
        for p in files(folder):
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + blob_id(p.read_bytes()).encode())
        return h.hexdigest()

    def revision_ok(folder: Path, revision: str) -> bool:
        return revision in ("main", sha(folder))

    def found(kind: str, org: str, name: str, revision: str) -> tuple[Path | None, Response | None]:
        """The repo's folder, or the 404 the hub answers for a missing repo or revision."""
        folder = repo(kind, org, name)
        if folder is None:
            return None, missing("RepoNotFound", f"Repository Not Found for url: {kind}/{org}/{name}")
        if not revision_ok(folder, revision):
            return None, missing("RevisionNotFound", f"Invalid rev id: {revision}")
        return folder, None

    def info(kind: str, org: str, name: str, revision: str = "main") -> Response:
        folder, refusal = found(kind, org, name, revision)
        if refusal is not None:
            return refusal
        return JSONResponse({"id": f"{org}/{name}", "_id": sha(folder)[:24], "sha": sha(folder),
                             "private": False, "disabled": False, "gated": False,
                             "siblings": [{"rfilename": p.relative_to(folder).as_posix()} for p in files(folder)]})

    def entry(folder: Path, p: Path) -> dict:
        if p.is_dir():
            return {"type": "directory", "path": p.relative_to(folder).as_posix(),
                    "oid": hashlib.sha1(p.relative_to(folder).as_posix().encode()).hexdigest()}
        return {"type": "file", "path": p.relative_to(folder).as_posix(), "size": p.stat().st_size,
                "oid": blob_id(p.read_bytes())}

    def tree(kind: str, org: str, name: str, revision: str, path: str = "", recursive: bool = False) -> Response:
        folder, refusal = found(kind, org, name, revision)
        if refusal is not None:
            return refusal
        base = folder / path
        if not base.is_dir():
            return missing("EntryNotFound", f"{path} does not exist on {revision}")
        # as the hub: the folder's children, or with ?recursive=true everything under it (folders included)
        children = base.rglob("*") if recursive else base.iterdir()
        return JSONResponse([entry(folder, p) for p in sorted(children) if p.name != ".git"])

    def paths_info(kind: str, org: str, name: str, revision: str, paths: list[str]) -> Response:
        folder, refusal = found(kind, org, name, revision)
        if refusal is not None:
            return refusal
        return JSONResponse([entry(folder, folder / p) for p in paths if (folder / p).exists()])

    def resolve(kind: str, org: str, name: str, revision: str, path: str, head: bool) -> Response:
        folder, refusal = found(kind, org, name, revision)
        if refusal is not None:
            return refusal
        target = folder / path
        if not target.is_file() or not target.resolve().is_relative_to(folder.resolve()):
            return missing("EntryNotFound", f"{path} does not exist on {revision}")
        data = target.read_bytes()
        headers = {"X-Repo-Commit": sha(folder), "ETag": f'"{blob_id(data)}"', "Content-Length": str(len(data)),
                   "Accept-Ranges": "bytes"}
        return Response(b"" if head else data, headers=headers, media_type="application/octet-stream")

    for prefix, kind in (("/api/models", "models"), ("/api/datasets", "datasets")):
        app.add_api_route(f"{prefix}/{{org}}/{{name}}", lambda org, name, k=kind: info(k, org, name))
        app.add_api_route(f"{prefix}/{{org}}/{{name}}/revision/{{revision}}",
                          lambda org, name, revision, k=kind: info(k, org, name, revision))
        app.add_api_route(f"{prefix}/{{org}}/{{name}}/tree/{{revision}}",
                          lambda org, name, revision, recursive=False, k=kind: tree(k, org, name, revision,
                                                                                     recursive=recursive))
        app.add_api_route(f"{prefix}/{{org}}/{{name}}/tree/{{revision}}/{{path:path}}",
                          lambda org, name, revision, path, recursive=False, k=kind: tree(k, org, name, revision,
                                                                                           path, recursive))

        async def paths_info_route(org: str, name: str, revision: str, request: Request, k: str = kind) -> Response:
            form = await request.form()  # huggingface_hub posts paths=...&paths=...&expand=...
            return paths_info(k, org, name, revision, [str(p) for p in form.getlist("paths")])

        app.add_api_route(f"{prefix}/{{org}}/{{name}}/paths-info/{{revision}}", paths_info_route, methods=["POST"])
    for prefix, kind in (("/datasets", "datasets"), ("", "models")):
        route = f"{prefix}/{{org}}/{{name}}/resolve/{{revision}}/{{path:path}}"

        def get(org: str, name: str, revision: str, path: str, request: Request, k: str = kind) -> Response:
            return resolve(k, org, name, revision, path, request.method == "HEAD")

        app.add_api_route(route, get, methods=["GET", "HEAD"])
    return app


@contextmanager
def serve(root: Path, timeout_s: float = 60.0) -> Iterator[str]:
    """The stand-in on a free port of 127.0.0.1, serving ``root``, for the length of the block: yields its
    endpoint (``http://127.0.0.1:PORT``, what ``HF_ENDPOINT`` takes). The listening socket is made here and
    handed to the server process, so no other process can take the port and connections wait in its backlog
    until the server answers."""
    import socket

    import httpx

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    log = open(Path(root) / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "areal_core.testing.hub", str(root), "--fd",
                             str(listener.fileno())], stdout=log, stderr=subprocess.STDOUT,
                            pass_fds=[listener.fileno()])
    try:
        try:
            httpx.get(f"{endpoint}/api/models/-/-", timeout=timeout_s)  # answered once the app has started
        except httpx.TransportError as exc:
            raise RuntimeError(f"the hub stand-in on {endpoint} did not answer within {timeout_s:g} s (exit "
                               f"{proc.poll()}: {exc}); its log: {Path(root) / 'server.log'}") from None
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        listener.close()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--fd", type=int, required=True, help="a listening socket on 127.0.0.1, inherited")
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(build_app(Path(args.root)), fd=args.fd, log_level="warning")


if __name__ == "__main__":
    main()
