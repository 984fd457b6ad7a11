"""model.path as a Hugging Face Hub id, resolved by huggingface_hub's real download code against a stand-in of
the hub on 127.0.0.1 (areal_core.testing.hub; ``HF_ENDPOINT`` points there): what is downloaded and when, pinned
revisions, offline use of the cache, and one clear message for each way it fails. Every case runs in a fresh
process, as `areal` does, since huggingface_hub reads its environment when it is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing import rl_doubles, tiny_model
from areal_core.testing.hub import serve

REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    model = tiny_model(root / "models" / "tiny-org" / "tiny-llama", seed=0)
    (model / "pytorch_model.bin").write_bytes(b"a framework's weights a run does not read")
    bins = root / "models" / "tiny-org" / "bin-only"
    bins.mkdir(parents=True)
    (bins / "config.json").write_text((model / "config.json").read_text())
    (bins / "pytorch_model.bin").write_bytes(b"weights")
    with serve(root) as endpoint:
        yield root, endpoint


def online_env() -> dict[str, str]:
    """This environment without HF_HUB_OFFLINE (some test modules set it for the whole session)."""
    return {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}


def resolve(hub, home: Path, path: str, offline: bool = False) -> subprocess.CompletedProcess:
    root, endpoint = hub
    env = {**online_env(), "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
           **({"HF_HUB_OFFLINE": "1"} if offline else {})}
    code = ("import sys; from areal_core.models import resolve_model_path, ModelNotFoundError\n"
            "try:\n    print(resolve_model_path(sys.argv[1]))\n"
            "except ModelNotFoundError as e:\n    print('REFUSED', e); sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=120)


def fetched(hub) -> list[str]:
    return [line.split()[1].rsplit("/", 1)[-1] for line in (hub[0] / "requests.log").read_text().splitlines()
            if line.startswith("GET ") and "/resolve/" in line]


def sha_of(hub) -> str:
    import httpx

    return httpx.get(f"{hub[1]}/api/models/{REPO}").json()["sha"]


def test_a_hub_id_is_downloaded_into_the_cache_with_what_a_run_reads_only(hub, tmp_path):
    (hub[0] / "requests.log").unlink(missing_ok=True)
    done = resolve(hub, tmp_path / "home", REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    folder = Path(done.stdout.strip().splitlines()[-1])
    assert folder.is_relative_to(tmp_path / "home") and (folder / "model.safetensors").is_file()
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "tokenizer.json", "tokenizer_config.json"]
    assert "pytorch_model.bin" not in fetched(hub)
    # pinned to the commit, and again from the cache with the hub out of reach
    pinned = resolve(hub, tmp_path / "home", f"{REPO}@{sha_of(hub)}")
    assert pinned.returncode == 0 and Path(pinned.stdout.split()[-1]) == folder, pinned.stderr
    offline = resolve(hub, tmp_path / "home", REPO, offline=True)
    assert offline.returncode == 0 and Path(offline.stdout.split()[-1]) == folder, offline.stderr


@pytest.mark.parametrize("path, says", [
    ("tiny-org/nowhere", "has no model repo 'tiny-org/nowhere' this token may read. Fix: check the id"),
    (f"{REPO}@v9", "tiny-org/tiny-llama has no revision 'v9'"),
    ("tiny-org/bin-only", "has no *.safetensors weights (the engines read safetensors only)"),
])
def test_each_way_a_hub_id_fails_is_one_message(hub, tmp_path, path, says):
    done = resolve(hub, tmp_path / "home", path)
    assert done.returncode == 3 and says in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and hub[1] in done.stdout


def test_offline_without_the_model_in_the_cache_says_how_to_get_it(hub, tmp_path):
    done = resolve(hub, tmp_path / "empty-home", REPO, offline=True)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "HF_HUB_OFFLINE is set and tiny-org/tiny-llama is not in the cache" in done.stdout
    assert f"`hf download {REPO}`" in done.stdout


def test_check_reads_the_models_config_from_the_hub_and_downloads_no_weights(hub, tmp_path):
    (hub[0] / "requests.log").unlink(missing_ok=True)
    env = {"HF_ENDPOINT": hub[1], "HF_HOME": str(tmp_path / "home")}
    with rl_doubles.installed(tmp_path) as (config, base):
        def check(*overrides):
            return subprocess.run([str(Path(sys.executable).with_name("areal")), "check", str(config),
                                   f"output_dir={tmp_path / 'runs'}", *overrides],
                                  env={**{k: v for k, v in base.items() if k != "HF_HUB_OFFLINE"}, **env},
                                  capture_output=True, text=True, timeout=120)

        ok = check(f"model.path={REPO}")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert fetched(hub) == ["config.json"]  # the shape for the plan rules; no weights, no tokenizer
        missing = check("model.path=tiny-org/nowhere")
    said = missing.stdout + missing.stderr
    assert missing.returncode == 1 and "[core.model-hub] model.path: 'tiny-org/nowhere' is not a local folder" in said
    assert "Traceback" not in said
    code = ("import json, sys; from areal_core.config.model_info import read_model_info; "
            "m = read_model_info(sys.argv[1]); print(json.dumps([m.model_type, m.num_attention_heads]))")
    info = subprocess.run([sys.executable, "-c", code, REPO], env={**os.environ, **env, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=60)
    heads = json.loads((hub[0] / "models" / REPO / "config.json").read_text())["num_attention_heads"]
    assert json.loads(info.stdout) == ["llama", heads], info.stderr  # read from the cache check filled


def test_an_unreachable_hub_is_told_at_once_and_the_cache_still_serves(hub, tmp_path):
    """A hub whose host cannot be reached (no network; here a name under .invalid, which never resolves):
    `areal check`'s read of the model's config and a run's download use the cache alone, without
    huggingface_hub's retries (5 tries with back-off: 23 s for one config.json here, minutes for a config's
    files); not cached, the message says the hub could not be reached."""
    cached = resolve(hub, tmp_path / "home", REPO)  # fetched once while the stand-in answers
    assert cached.returncode == 0, cached.stderr
    env = {**online_env(), "HF_ENDPOINT": "http://hub.invalid", "HF_HUB_DISABLE_TELEMETRY": "1"}
    code = ("import sys; from areal_core.hub import model_config_folder, model_folder\n"
            "from areal_core.models import ModelNotFoundError\n"
            "try:\n    print(model_config_folder(sys.argv[1])); print(model_folder(sys.argv[1]))\n"
            "except ModelNotFoundError as e:\n    print('REFUSED', e); sys.exit(3)\n")
    runs = {home: subprocess.run([sys.executable, "-c", code, REPO], env={**env, "HF_HOME": str(tmp_path / home)},
                                 capture_output=True, text=True, timeout=120) for home in ("home", "empty-home")}
    from_cache, missing = runs["home"], runs["empty-home"]
    assert from_cache.returncode == 0, from_cache.stdout + from_cache.stderr
    assert Path(from_cache.stdout.split()[-1]) == Path(cached.stdout.split()[-1])
    assert missing.returncode == 3 and "the hub at http://hub.invalid could not be reached" in missing.stdout, \
        missing.stdout
    for done in runs.values():
        assert "Retrying in" not in done.stdout + done.stderr  # no back-off waits
