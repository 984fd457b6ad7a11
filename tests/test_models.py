"""model.path resolution: folders as they are, '' through the areal_resolve_model hook."""

from __future__ import annotations

import pytest

from areal_core import hookimpl
from areal_core.models import ModelNotFoundError, resolve_model_path
from areal_core.plugins import manager_from_modules


class DemoProviderDouble:
    calls: list = []

    @staticmethod
    @hookimpl
    def areal_resolve_model(path, dtype):
        DemoProviderDouble.calls.append((path, dtype))
        return "/models/demo-" + dtype if path == "" else None


def test_an_existing_folder_is_used_as_it_is(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_the_empty_path_asks_the_plugins_with_a_concrete_dtype(monkeypatch):
    import areal_core.plugins as plugins

    monkeypatch.setattr(plugins, "get_plugin_manager", lambda **_: manager_from_modules(DemoProviderDouble))
    DemoProviderDouble.calls.clear()
    assert str(resolve_model_path("", "float32")) == "/models/demo-float32"
    resolve_model_path("", "auto")
    assert DemoProviderDouble.calls[-1][1] in ("float32", "bfloat16")


def test_nobody_knows_the_path(monkeypatch, tmp_path):
    import areal_core.plugins as plugins

    monkeypatch.setattr(plugins, "get_plugin_manager", lambda **_: manager_from_modules(DemoProviderDouble))
    with pytest.raises(ModelNotFoundError, match="is not a folder and no installed plugin knows it"):
        resolve_model_path(str(tmp_path / "missing"), "float32")

    monkeypatch.setattr(plugins, "get_plugin_manager", lambda **_: manager_from_modules())
    with pytest.raises(ModelNotFoundError, match="areal-plugin-local"):
        resolve_model_path("", "float32")


def test_the_local_plugin_provides_the_demo_model():
    """The real hook of areal-plugin-local answers '' (without converting anything here)."""
    from areal_local import hooks

    assert hooks.areal_resolve_model(path="/some/folder", dtype="float32") is None


def test_a_run_asks_the_plugins_to_materialize_the_model(monkeypatch):
    """`areal check` asks with materialize=False (tests/test_config.py); the run's own resolution with True."""
    import areal_core.plugins as plugins

    asked = []

    class NamedModels:
        @staticmethod
        @hookimpl
        def areal_resolve_model(path, dtype, materialize):
            asked.append((path, dtype, materialize))
            return "/cache/" + path

    monkeypatch.setattr(plugins, "get_plugin_manager", lambda **_: manager_from_modules(NamedModels))
    assert str(resolve_model_path("tiny-llama", "float32")) == "/cache/tiny-llama"
    assert asked == [("tiny-llama", "float32", True)]
