"""What cluster launchers check before a run starts on several nodes (areal_core.processes.nodes)."""

from __future__ import annotations

import pytest

from areal_core.processes import nodes


def test_a_server_shares_the_trainers_node_only_when_the_launcher_says_so():
    assert nodes.same_node_as_trainer(0, {})  # the local launcher: one node
    env = {nodes.NODE_ENV: "a", "AREAL_ROLLOUT_0_NODE": "a", "AREAL_ROLLOUT_1_NODE": "b"}
    assert nodes.same_node_as_trainer(0, env)
    assert not nodes.same_node_as_trainer(1, env)
    assert not nodes.same_node_as_trainer(2, env)  # restarted later, node unknown: the cross-node path


def test_the_installed_set_holds_the_core_and_the_plugins():
    found = nodes.installed_plugins()
    assert "areal-core" in found and all(n == "areal-core" or n.startswith("areal-plugin-") for n in found)


def test_a_different_plugin_set_is_listed_and_refused():
    reference = {"areal-core": "0.1.0", "areal-plugin-ray": "0.1.0", "areal-plugin-fsdp": "0.1.0"}
    reports = {"node b": {"areal-core": "0.1.0", "areal-plugin-ray": "0.2.0", "areal-plugin-vllm": "0.1.0"},
               "node a": dict(reference)}
    with pytest.raises(nodes.PluginSetMismatch) as caught:
        nodes.check_plugin_sets(reference, reports)
    text = str(caught.value)
    assert "areal-plugin-ray is 0.1.0 on the launcher's machine but 0.2.0 on node b" in text
    assert "areal-plugin-fsdp 0.1.0 is installed on the launcher's machine but not on node b" in text
    assert "areal-plugin-vllm 0.1.0 is installed on node b but not on the launcher's machine" in text
    assert "node a" not in text and "Nothing was launched" in text
    nodes.check_plugin_sets(reference, {"node a": dict(reference)})  # the same set passes


def test_storage_that_is_not_shared_is_named_with_node_and_path(tmp_path):
    """Two nodes that see different folders under the same path (here: two folders standing for one path on
    each node): each one's token is missing on the other, and both are named."""
    a, b = tmp_path / "a", tmp_path / "b"
    written_a = nodes.write_storage_tokens("node-a", [str(a)])
    written_b = nodes.write_storage_tokens("node-b", [str(b)])
    # what node b finds at node a's paths is its own folder, where node a's files are not
    seen_by_b = {str(b / nodes.CHECK_FOLDER / p.split("/")[-1]): t for p, t in written_a.items()}
    reports = [nodes.StorageReport("node-a", written_a, {}),
               nodes.StorageReport("node-b", written_b, {"node-a": nodes.read_storage_tokens(seen_by_b)})]
    with pytest.raises(nodes.SharedStorageError) as caught:
        nodes.raise_storage_problems(reports, [str(a)])
    assert "node node-b does not see " in str(caught.value) and "written by node node-a" in str(caught.value)


def test_shared_storage_passes_and_is_cleaned_up(tmp_path):
    written = {n: nodes.write_storage_tokens(n, [str(tmp_path)]) for n in ("a", "b")}
    reports = [nodes.StorageReport(n, written[n], {o: nodes.read_storage_tokens(written[o])
                                                   for o in written if o != n}) for n in written]
    assert nodes.storage_problems(reports) == []
    nodes.remove_storage_tokens([str(tmp_path)])
    assert not (tmp_path / nodes.CHECK_FOLDER).exists()


def test_an_unwritable_folder_is_named_with_its_node(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    written = nodes.write_storage_tokens("node-a", [str(blocker / "run")])
    [line] = nodes.storage_problems([nodes.StorageReport("node-a", written, {})])
    assert line.startswith(f"node node-a cannot write under {blocker / 'run'}")


def test_a_file_with_other_contents_is_reported(tmp_path):
    [(path, token)] = nodes.write_storage_tokens("a", [str(tmp_path)]).items()
    open(path, "w").write("something else")
    assert "other contents" in nodes.read_storage_tokens({path: token})[path]


def test_a_train_ranks_environment_names_rendezvous_servers_and_nodes():
    env = nodes.trainer_env(1, 2, ("10.0.0.5", 29500), (0, 1), "node-b", [("10.0.0.4:8000", "node-a")])
    assert env["MASTER_ADDR"] == "10.0.0.5" and env["MASTER_PORT"] == "29500" and env["RANK"] == "1"
    assert env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1"
    assert env["AREAL_ROLLOUT_0_ADDRESS"] == "10.0.0.4:8000" and env["AREAL_ROLLOUT_0_NODE"] == "node-a"
    assert env[nodes.NODE_ENV] == "node-b" and not nodes.same_node_as_trainer(0, env)
