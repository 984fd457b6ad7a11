"""The plugin system as a user meets it: discovery, allow / block lists, and
the wording of every failure (tested word for word: users read these)."""

from __future__ import annotations

import sys

import pytest

from areal_core.plugins import get_plugin_manager
from areal_core.registry import ComponentError, list_components, resolve
from areal_core.testing.distributions import install_fake_distribution

GOOD_HOOKS = '''
from areal_core import hookimpl
from areal_core.parallelism import BackendSupport

@hookimpl
def areal_declare_backends():
    return [BackendSupport("acme", "train", dims="d", devices=("cpu",))]
'''


def fake(tmp_path, name, version="1.0.0", eps=None, files=None):
    return install_fake_distribution(tmp_path / name, name, version, eps or {}, files or {})


def plugin(tmp_path, dist, ep_name, module, source, version="1.0.0"):
    return fake(tmp_path, dist, version, {"areal": {ep_name: module}}, {f"{module}.py": source})


def resolve_error(kind, name):
    """The ComponentError that resolving ``name`` of ``kind`` raises."""
    with pytest.raises(ComponentError) as err:
        resolve(kind, name)
    return err.value


def test_hook_plugin_is_found_through_its_entry_point(tmp_path):
    with plugin(tmp_path, "areal-plugin-acme", "acme", "acme_hooks", GOOD_HOOKS, "1.2.3"):
        info = get_plugin_manager(refresh=True).plugins["acme"]
    assert (info.distribution, info.version, info.hooks, info.errors) == (
        "areal-plugin-acme", "1.2.3", ["areal_declare_backends"], [])


def test_builtins_are_plugins_of_the_core_distribution():
    manager = get_plugin_manager(refresh=True)
    assert manager.plugins["core"].distribution == "areal-core"
    assert manager.plugins["cli"].builtin
    assert "areal_register_commands" in manager.plugins["cli"].hooks


def test_import_error_names_plugin_distribution_and_fix(tmp_path):
    source = "import nonexistent_dependency_xyz\n"
    with plugin(tmp_path, "areal-plugin-broken", "broken", "broken_hooks", source, "0.3.0"):
        info = get_plugin_manager(refresh=True).plugins["broken"]
    assert info.errors == [
        'Error importing plugin "broken" (areal-plugin-broken 0.3.0) from broken_hooks: '
        "ModuleNotFoundError: No module named 'nonexistent_dependency_xyz'. "
        "Fix: reinstall or upgrade areal-plugin-broken, or skip it with "
        "AREAL_DISABLE_PLUGINS=areal-plugin-broken."
    ]


def test_misspelt_hook_fails_loudly_with_the_closest_name(tmp_path):
    source = "from areal_core import hookimpl\n@hookimpl\ndef areal_validate_paralelism(config):\n    return []\n"
    with plugin(tmp_path, "areal-plugin-typo", "typo", "typo_hooks", source):
        manager = get_plugin_manager(refresh=True)
    assert manager.plugins["typo"].errors == [
        'plugin "typo" (areal-plugin-typo 1.0.0): areal_validate_paralelism is not an areal hook. '
        "Fix: rename it to areal_validate_parallelism."
    ]
    assert not manager.hook.areal_validate_parallelism.get_hookimpls() or all(
        i.plugin_name != "typo" for i in manager.hook.areal_validate_parallelism.get_hookimpls())


def test_hook_signature_mismatch_names_the_arguments(tmp_path):
    source = "from areal_core import hookimpl\n@hookimpl\ndef areal_validate_config(config, cluster):\n    return []\n"
    with plugin(tmp_path, "areal-plugin-sig", "sig", "sig_hooks", source):
        info = get_plugin_manager(refresh=True).plugins["sig"]
    assert info.errors == [
        'plugin "sig" (areal-plugin-sig 1.0.0): areal_validate_config takes argument(s) cluster '
        "that the hook does not provide; it provides (config). Fix: accept only those names (any subset)."
    ]


def test_unmarked_hook_function_is_a_warning(tmp_path):
    source = "def areal_validate_config(config):\n    return []\n"
    with plugin(tmp_path, "areal-plugin-plain", "plain", "plain_hooks", source):
        info = get_plugin_manager(refresh=True).plugins["plain"]
    assert info.errors == []
    assert info.warnings == [
        'plugin "plain" (areal-plugin-plain 1.0.0): function areal_validate_config is not marked with '
        "@areal_core.hookimpl, so it is never called. Fix: decorate it."
    ]


def test_two_distributions_claiming_one_plugin_name_are_both_named(tmp_path):
    with plugin(tmp_path, "areal-plugin-one", "same", "one_hooks", GOOD_HOOKS), \
         plugin(tmp_path, "areal-plugin-two", "same", "two_hooks", GOOD_HOOKS, "2.0.0"):
        manager = get_plugin_manager(refresh=True)
    errors = [e for info in manager.plugins.values() for e in info.errors]
    expected = ('plugin name "same" is provided by two distributions: areal-plugin-one 1.0.0 and '
                "areal-plugin-two 2.0.0. Fix: uninstall one of them, or block one with "
                "AREAL_DISABLE_PLUGINS=<distribution>.")
    assert errors == [expected, expected]
    assert "same" not in manager.pm.list_name_plugin()


@pytest.mark.parametrize(
    ("env", "loaded"),
    [
        ({}, True),
        ({"AREAL_LOAD_PLUGINS": ""}, False),
        ({"AREAL_LOAD_PLUGINS": "acme"}, True),
        ({"AREAL_LOAD_PLUGINS": "areal-plugin-acme,other"}, True),
        ({"AREAL_LOAD_PLUGINS": "other"}, False),
        ({"AREAL_DISABLE_PLUGINS": "areal_plugin_acme"}, False),
        ({"AREAL_DISABLE_PLUGINS": "acme"}, False),
        ({"AREAL_DISABLE_PLUGINS": "other"}, True),
    ],
)
def test_allow_and_block_lists(tmp_path, monkeypatch, env, loaded):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    eps = {"areal": {"acme": "acme_hooks"}, "areal.rewards": {"acme_reward": "acme_hooks:reward"}}
    files = {"acme_hooks.py": GOOD_HOOKS + "\ndef reward(prompt, completion, item):\n    return 1.0\n"}
    with fake(tmp_path, "areal-plugin-acme", eps=eps, files=files):
        manager = get_plugin_manager(refresh=True)
        assert ("acme" in manager.plugins) is loaded
        assert ("acme_reward" in [c.name for c in list_components("reward")]) is loaded
        assert "core" in manager.plugins  # built-ins are always loaded


LAZY = "import sys\nsys.modules['lazy_marker_was_imported'] = True\nclass Thing:\n    pass\n"


def test_listing_components_imports_nothing_and_resolve_imports_only_the_selected(tmp_path):
    eps = {"areal.workflows": {"lazy_a": "lazy_a:Thing", "lazy_b": "lazy_b:Thing"}}
    files = {"lazy_a.py": LAZY.replace("marker", "a"), "lazy_b.py": LAZY.replace("marker", "b")}
    with fake(tmp_path, "areal-plugin-lazy", eps=eps, files=files):
        names = [c.name for c in list_components("workflow")]
        assert {"lazy_a", "lazy_b"} <= set(names)
        assert "lazy_a_was_imported" not in sys.modules
        resolve("workflow", "lazy_a")
        assert "lazy_a_was_imported" in sys.modules
        assert "lazy_b_was_imported" not in sys.modules
    sys.modules.pop("lazy_a_was_imported", None)


def test_unknown_component_lists_what_exists_and_suggests_the_closest(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_LOAD_PLUGINS", "areal-plugin-r")  # not the real math / code plugins
    eps = {"areal.rewards": {"math": "m:f", "code": "m:f"}}
    with fake(tmp_path, "areal-plugin-r", eps=eps, files={"m.py": "def f(*a):\n    return 0.0\n"}):
        error = resolve_error("reward", "mth")
    assert str(error) == (
        "no reward named 'mth' is installed. Did you mean 'math'? Available: "
        "code (areal-plugin-r 1.0.0), function (areal-core 0.1.0), math (areal-plugin-r 1.0.0), "
        "weighted (areal-core 0.1.0). "
        "Fix: correct reward.name, or install a plugin that provides reward 'mth' (areal plugins lists what is "
        "installed)."
    )


def test_two_distributions_claiming_one_component_name(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_LOAD_PLUGINS", "areal-plugin-a,acme-rewards")  # not the real math plugin
    src = {"m.py": "def f(*a):\n    return 0.0\n"}
    with fake(tmp_path, "areal-plugin-a", eps={"areal.rewards": {"math": "m:f"}}, files=src), \
         fake(tmp_path, "acme-rewards", "2.0", eps={"areal.rewards": {"math": "m:f"}}, files=src):
        error = resolve_error("reward", "math")
    assert str(error) == (
        "reward 'math' is provided by two distributions: acme-rewards 2.0 (m:f) and "
        "areal-plugin-a 1.0.0 (m:f). Fix: uninstall one of them, or block one with "
        "AREAL_DISABLE_PLUGINS=<distribution>."
    )
    assert error.fix == "uninstall one of them, or block one with AREAL_DISABLE_PLUGINS=<distribution>"


def test_component_import_error_names_distribution_and_fix(tmp_path):
    eps = {"areal.algorithms": {"boom": "boom_mod:Algo"}}
    with fake(tmp_path, "areal-plugin-boom", "0.2.0", eps=eps, files={"boom_mod.py": "raise RuntimeError('no GPU here')\n"}):
        error = resolve_error("algorithm", "boom")
    assert str(error) == (
        "algorithm 'boom' from areal-plugin-boom 0.2.0 failed to import (boom_mod:Algo): "
        "RuntimeError: no GPU here. Fix: reinstall it with `pip install --force-reinstall "
        "areal-plugin-boom`, or select another algorithm."
    )


def test_a_missing_declared_requirement_is_named_in_the_fix_instead_of_a_reinstall(tmp_path):
    """A plugin whose module imports a library it declares but that is not installed (torch missing for the
    megatron plugin): the fix installs that requirement, with its range, rather than reinstalling the plugin."""
    eps = {"areal.engines.train": {"needy": "needy_mod:Engine"}}
    with install_fake_distribution(tmp_path / "needy", "areal-plugin-needy", "0.3.0", eps,
                                   {"needy_mod.py": "import not_installed_lib_xyz\n"},
                                   requires=["not-installed-lib-xyz>=2.6,<3"]):
        error = resolve_error("train_engine", "needy")
    assert "requires not-installed-lib-xyz<3,>=2.6 (not installed)" in error.message
    assert error.fix == "pip install 'not-installed-lib-xyz<3,>=2.6', or select another train engine"
    assert "force-reinstall" not in str(error)


def test_component_of_the_wrong_contract_is_refused(tmp_path):
    from areal_core.api import Algorithm

    eps = {"areal.algorithms": {"notalgo": "na:NotAlgo"}}
    with fake(tmp_path, "areal-plugin-na", eps=eps, files={"na.py": "class NotAlgo:\n    pass\n"}):
        with pytest.raises(ComponentError, match="not a subclass of areal_core.api.algorithm.Algorithm"):
            resolve("algorithm", "notalgo", expected=Algorithm)


def test_a_crashing_validation_hook_becomes_a_problem_naming_the_plugin(tmp_path, double_stack):
    from areal_core.config.validate import validate_run

    source = ("from areal_core import hookimpl\n@hookimpl\ndef areal_validate_config(config):\n"
              "    raise KeyError('oops')\n")
    with plugin(tmp_path, "areal-plugin-crash", "crash", "crash_hooks", source, "0.0.1"):
        run = validate_run(None, double_stack, manager=get_plugin_manager(refresh=True))
    assert [str(p) for p in run.problems] == [
        '[core.plugin-crash] plugin "crash" (areal-plugin-crash 0.0.1) crashed in areal_validate_config: '
        "KeyError: 'oops'\n    fix: report this to the maintainers of areal-plugin-crash, or skip the "
        "plugin with AREAL_DISABLE_PLUGINS=areal-plugin-crash"
    ]


def test_areal_plugins_lists_a_component_whose_module_is_not_shipped_without_importing_the_healthy(tmp_path):
    from areal_core.listing import collect_listing

    eps = {"areal.rewards": {"good": "good_mod:f", "gone": "gone_mod:f"}}
    files = {"good_mod.py": LAZY.replace("marker", "good") + "def f(*a):\n    return 0.0\n"}
    with fake(tmp_path, "areal-plugin-half", "0.4.0", eps=eps, files=files):
        listed = {d["distribution"]: d for d in collect_listing()["distributions"]}["areal-plugin-half"]
        assert "good_was_imported" not in sys.modules
        error = resolve_error("reward", "gone")
    assert listed["components"] == {"reward": ["gone", "good"]}
    assert listed["errors"] == [
        "reward 'gone' (gone = gone_mod:f) cannot be imported: areal-plugin-half 0.4.0 does not ship module "
        "gone_mod. Fix: its entry point is wrong, so reinstalling will not help: the maintainers of "
        "areal-plugin-half must name a module the distribution contains (uninstall it, or block it with "
        "AREAL_DISABLE_PLUGINS=areal-plugin-half)."]
    assert error.message == ("reward 'gone' from areal-plugin-half 0.4.0 failed to import (gone_mod:f): "
                             "areal-plugin-half 0.4.0 does not ship module gone_mod")
    assert "reinstall it" not in error.fix and error.fix.endswith(", or select another reward")


def test_a_shipped_module_gone_from_disk_is_fixed_by_reinstalling(tmp_path):
    from areal_core.listing import collect_listing

    eps = {"areal.rewards": {"lost": "lost_pkg.scoring:f"}}
    with fake(tmp_path, "areal-plugin-lost", eps=eps, files={"lost_pkg/__init__.py": "", "lost_pkg/scoring.py": ""}):
        (tmp_path / "areal-plugin-lost" / "lost_pkg" / "scoring.py").unlink()  # in RECORD, not on disk
        listed = {d["distribution"]: d for d in collect_listing()["distributions"]}["areal-plugin-lost"]
        assert "lost_pkg" not in sys.modules  # its parent package was not imported to tell
    assert listed["errors"] == [
        "reward 'lost' (lost = lost_pkg.scoring:f) cannot be imported: its module lost_pkg.scoring is listed in "
        "areal-plugin-lost 1.0.0's installed files but is missing. Fix: reinstall it with "
        "`pip install --force-reinstall areal-plugin-lost`."]


def test_a_hook_module_not_shipped_says_so(tmp_path):
    with fake(tmp_path, "areal-plugin-nohooks", eps={"areal": {"nohooks": "nohooks_mod"}}):
        info = get_plugin_manager(refresh=True).plugins["nohooks"]
    assert info.errors == [
        'Error importing plugin "nohooks" (areal-plugin-nohooks 1.0.0) from nohooks_mod: areal-plugin-nohooks '
        "1.0.0 does not ship module nohooks_mod. Fix: its entry point is wrong, so reinstalling will not help: "
        "the maintainers of areal-plugin-nohooks must name a module the distribution contains (uninstall it, "
        "or block it with AREAL_DISABLE_PLUGINS=areal-plugin-nohooks)."]


def test_discovery_scans_metadata_once_until_sys_path_changes_or_it_is_invalidated(tmp_path, monkeypatch):
    from importlib import metadata

    from areal_core import discovery

    scans = []
    real = metadata.distributions
    monkeypatch.setattr(metadata, "distributions", lambda *a, **k: scans.append(1) or real(*a, **k))
    discovery.invalidate_cache()
    for _ in range(3):
        list_components()
        get_plugin_manager(refresh=True)
    assert len(scans) == 1
    monkeypatch.syspath_prepend(str(tmp_path))
    list_components()
    assert len(scans) == 2
    discovery.invalidate_cache()
    list_components()
    assert len(scans) == 3


def test_a_distribution_added_to_a_folder_already_on_sys_path_is_seen(tmp_path):
    src = {"m.py": "def f(*a):\n    return 0.0\n"}
    with fake(tmp_path, "areal-plugin-first", eps={"areal.rewards": {"first_r": "m:f"}}, files=src):
        assert "first_r" in [c.name for c in list_components("reward")]
        with install_fake_distribution(tmp_path / "areal-plugin-first", "areal-plugin-second", "1.0",
                                       {"areal.rewards": {"second_r": "m:f"}}, {}):
            assert {"first_r", "second_r"} <= {c.name for c in list_components("reward")}
        assert "second_r" not in [c.name for c in list_components("reward")]
    assert "first_r" not in [c.name for c in list_components("reward")]
