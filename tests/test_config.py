"""Config loading and validation: every problem at once, each naming key, value and fix."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_core.config.load import load_config
from areal_core.config.schema import RunConfig
from areal_core.config.validate import validate_run
from areal_core.plugins import get_plugin_manager
from areal_core.problems import ProblemsError


def texts(problems):
    return [str(p) for p in problems]


def test_defaults_have_no_type_or_range_problems():
    config, problems = load_config(None, [])
    assert problems == []
    expected = RunConfig()
    expected.model.dtype = config.model.dtype  # "auto" is resolved for this machine
    assert config == expected and config.model.dtype in ("float32", "bfloat16")


def test_yaml_then_overrides_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  optimizer:\n    lr: 1e-5\nrollout:\n  group_size: 4\n")
    config, problems = load_config(str(path), ["rollout.group_size=16", "trial=7"])
    assert problems == []
    assert config.actor.optimizer.lr == 1e-5  # PyYAML alone would read '1e-5' as a string
    assert config.rollout.group_size == 16
    assert config.trial == "7"


def test_unknown_key_names_the_path_and_the_closest_key():
    _, problems = load_config(None, ["trainer.totl_steps=3"])
    assert texts(problems) == [
        "[core.unknown-key] trainer.totl_steps: unknown key\n    fix: did you mean trainer.total_steps?"
    ]


def test_wrong_type_and_out_of_range_and_bad_choice_word_for_word():
    _, problems = load_config(None, [
        "rollout.group_size=many", "actor.optimizer.lr=-1", "model.dtype=fp16", "rollout.sampling=3",
    ])
    assert texts(problems) == [
        "[core.type] rollout.group_size: 'many' (str) is not an integer\n"
        "    fix: set rollout.group_size to an integer",
        "[core.type] rollout.sampling: 3 (int) is not a mapping\n"
        "    fix: write rollout.sampling as a section of keys",
        "[core.range] actor.optimizer.lr: -1.0 is out of range; it must be > 0.0\n"
        "    fix: set actor.optimizer.lr to a value > 0.0",
        "[core.choice] model.dtype: 'fp16' is not allowed; choose one of: auto, float32, bfloat16\n"
        "    fix: set model.dtype=auto",
    ]


def test_override_without_equals_is_a_problem_not_a_traceback():
    _, problems = load_config(None, ["actor.optimizer.lr"])
    assert texts(problems) == [
        "[core.override] actor.optimizer.lr: cannot read override 'actor.optimizer.lr'\n"
        "    fix: write overrides as dotted.key=value, e.g. actor.optimizer.lr=1e-5"
    ]


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("actor:\n  backend: [fsdp\n")
    with pytest.raises(ProblemsError) as err:
        load_config(str(path), [])
    assert str(err.value).startswith(f"1 problem in {path}:\n  1. [core.yaml] {path} is not valid YAML:")


def test_missing_file():
    with pytest.raises(ProblemsError, match=r"\[core.config-file\] config nope.yaml does not exist"):
        load_config("nope.yaml", [])


def test_three_independent_mistakes_are_all_reported(double_stack, tmp_path):
    path = tmp_path / "three.yaml"
    path.write_text("rollout:\n  max_head_offpolicyness: -1\nactor:\n  optimzer: {lr: 1e-5}\n"
                    "allocation: 'infer_double:cpu+train_double:d2p2@cpu'\n")
    run = validate_run(str(path), double_stack, manager=get_plugin_manager(refresh=True))
    assert texts(run.problems) == [
        "[core.range] rollout.max_head_offpolicyness: -1 is out of range; it must be >= 0\n"
        "    fix: set rollout.max_head_offpolicyness to a value >= 0",
        "[core.unknown-key] actor.optimzer: unknown key: neither the core nor train engine "
        "'train_double' declares it\n    fix: did you mean actor.optimizer?",
        "[core.unsupported-dimension] allocation: 'train_double:d2p2@cpu': train_double does not "
        "support pipeline parallelism (p2); it supports d (data), t (tensor).\n"
        "    fix: remove p2 or choose a backend that supports it",
    ]


def test_component_keys_are_typed_by_the_components_config_class(double_stack):
    run = validate_run(None, [*double_stack, "algorithm.eps_clip=0.3", "algorithm.group_nrom=false"],
                       manager=get_plugin_manager(refresh=True))
    assert texts(run.problems) == [
        "[core.unknown-key] algorithm.group_nrom: unknown key: neither the core nor algorithm "
        "'algo_double' declares it\n    fix: did you mean algorithm.group_norm?"
    ]
    assert run.options["algorithm"].eps_clip == 0.3
    assert run.resolved_dict()["algorithm"]["extra"] == {"eps_clip": 0.3, "group_norm": True}


def test_allocation_must_agree_with_the_configured_backends(double_stack):
    run = validate_run(None, [*double_stack, "actor.backend=fsdp", "allocation=infer_double:cpu+train_double:d1@cpu"],
                       manager=get_plugin_manager(refresh=True))
    codes = [p.code for p in run.problems]
    assert "core.backend-mismatch" in codes
    mismatch = next(p for p in run.problems if p.code == "core.backend-mismatch")
    assert mismatch.message == ("the allocation places 'train_double:cpu' as actor, but actor.backend is 'fsdp'")


def test_valid_stack_has_no_problems(double_stack):
    run = validate_run(None, double_stack, manager=get_plugin_manager(refresh=True))
    assert run.problems == []
    assert str(run.allocation) == "infer_double:cpu+train_double:cpu"


KEYS = ["experiment", "trial", "allocation", "actor.backend", "actor.optimizer.lr", "actor.optimizer.lr_schedule",
        "rollout.group_size", "rollout.sampling.top_p", "rollout.sampling.stop", "model.dtype", "trainer",
        "trainer.total_steps", "actor.mb_max_tokens", "bogus", "actor.optimizer", "rollout.extra.x"]
VALUES = st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True), st.booleans(), st.none(),
                   st.text(string.printable, max_size=12), st.lists(st.integers(), max_size=3))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6))
def test_loader_never_crashes_on_any_values(values):
    import yaml

    overrides = []
    for key, value in values.items():  # each value written as YAML flow text, as a user would type it
        overrides.append(f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
                         if value is not None else f"{key}=")
    try:
        config, problems = load_config(None, overrides)
    except ProblemsError:
        return
    assert isinstance(config, RunConfig)
    for p in problems:
        assert p.code.startswith("core.") and p.message


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(string.printable, max_size=30), max_size=4))
def test_arbitrary_override_text_never_crashes(overrides):
    try:
        load_config(None, overrides)
    except ProblemsError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="fsdpvlmgc:dtpce0123456789+|[]@ ", max_size=30))
def test_validation_never_crashes_on_any_allocation(allocation):
    run = validate_run(None, [f"allocation='{allocation}'"], with_components=False)
    assert all(p.code and p.message for p in run.problems)


def test_docs_config_page_lists_every_key_as_the_schema_says():
    from pathlib import Path

    from areal_core.config.describe import key_table

    page = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    assert key_table() in page, "docs/config.md is stale: paste the output of areal_core.config.describe.key_table()"


def test_auto_dtype_is_resolved_for_this_machine(monkeypatch):
    from areal_core.config import dtype

    monkeypatch.setattr(dtype, "has_gpu", lambda: False)
    assert dtype.cpu_has_bf16("flags : fpu avx512f avx512_bf16 amx_tile") is True
    assert dtype.cpu_has_bf16("flags : fpu avx512f") is False
    monkeypatch.setattr(dtype, "cpu_has_bf16", lambda cpuinfo=None: False)
    assert load_config(None, [])[0].model.dtype == "float32"
    assert load_config(None, ["model.dtype=bfloat16"])[0].model.dtype == "bfloat16"
    monkeypatch.setattr(dtype, "has_gpu", lambda: True)
    assert load_config(None, [])[0].model.dtype == "bfloat16"


# --- issue 21, item 3: what the run would refuse or crash on is refused here, each with key, value and fix ---

@pytest.mark.parametrize("override, message, fix", [
    ("rollout.sampling.temperature=.inf", "inf is not a finite number", "a finite number (0 = greedy)"),
    ("rollout.sampling.temperature=-.inf", "-inf is not a finite number", "a finite number (0 = greedy)"),
    ("eval.success=nan", "nan is not a finite number", "a finite number"),
    ("trainer.save_every_s=.inf", "inf is not a finite number", "a finite number (0 = off)"),
    ("actor.optimizer.eps=.inf", "inf is not a finite number", "a finite number"),
    ("actor.optimizer.grad_clip=.nan", "nan is not a finite number", "a finite number (0 disables clipping)"),
    ("rollout.request_timeout_s=1e400", "inf is not a finite number", "a finite number"),
    ("rollout.elastic.cooldown_s=.inf", "inf is not a finite number", "a finite number"),
])
def test_floats_are_finite(override, message, fix):
    key = override.partition("=")[0]
    _, problems = load_config(None, [override])
    assert texts(problems) == [f"[core.range] {key}: {message}\n    fix: set {key} to {fix}"]


def test_a_field_may_allow_inf_but_never_nan():
    from dataclasses import dataclass

    from areal_core.config.load import build
    from areal_core.config.schema import spec

    @dataclass
    class Options:
        patience_s: float = spec(10.0, gt=0.0, allow_inf=True, help="seconds to wait; .inf = forever")

    problems = []
    assert build(Options, {"patience_s": float("inf")}, "x.", problems).patience_s == float("inf") and problems == []
    build(Options, {"patience_s": float("-inf")}, "x.", problems)
    build(Options, {"patience_s": float("nan")}, "x.", problems)
    assert texts(problems) == [
        "[core.range] x.patience_s: -inf is out of range; it must be > 0.0\n    fix: set x.patience_s to a value > 0.0",
        "[core.range] x.patience_s: nan is not a finite number\n    fix: set x.patience_s to a finite number or .inf",
    ]


def test_integers_fit_in_64_bits_and_floats_are_not_integers():
    _, problems = load_config(None, ["rollout.group_size=100000000000000000000", "rollout.batch_size=1e20",
                                     "trainer.seed=9223372036854775807"])
    assert texts(problems) == [
        "[core.range] rollout.group_size: an integer of 21 digits is too large; an integer must fit in 64 bits "
        "(-9223372036854775807 to 9223372036854775807)\n    fix: set rollout.group_size to a smaller integer",
        "[core.type] rollout.batch_size: 1e+20 (float) is not an integer\n"
        "    fix: set rollout.batch_size to an integer",
    ]


def test_an_integer_too_large_for_a_float_is_a_problem_not_an_overflow():
    _, problems = load_config(None, ["actor.optimizer.lr=1" + "0" * 400])
    assert texts(problems) == [
        "[core.range] actor.optimizer.lr: an integer of 401 digits is too large for a number (at most about 1.8e308)"
        "\n    fix: set actor.optimizer.lr to a smaller number"]


def test_stop_strings_are_strings_and_none_is_empty():
    config, problems = load_config(None, ['rollout.sampling.stop=["\\n\\n", 42]'])
    assert problems == [] and config.rollout.sampling.stop == ["\n\n", "42"]
    _, problems = load_config(None, ['rollout.sampling.stop=[a, ""]'])
    assert texts(problems) == ["[core.range] rollout.sampling.stop: item 1 ('') is empty\n"
                               "    fix: remove it from rollout.sampling.stop"]
    _, problems = load_config(None, ["rollout.sampling.stop=[a, [b]]"])
    assert texts(problems) == ["[core.type] rollout.sampling.stop[1]: ['b'] (list) is not a string\n"
                               "    fix: set rollout.sampling.stop[1] to a string"]


def test_a_nul_character_is_refused_in_a_string():
    _, problems = load_config(None, ['output_dir="runs\\0x"'])
    assert texts(problems) == ["[core.type] output_dir: 'runs\\x00x' holds a NUL character\n"
                               "    fix: remove the \\0 from output_dir"]


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n# and another\n", "null\n", "---\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ProblemsError) as err:
        load_config(str(path), [])
    assert err.value.problems[0].code == "core.config-file"
    assert f"config {path} is empty (it sets no key; comments do not count)" in str(err.value)


def test_an_explicitly_empty_mapping_means_the_core_defaults(tmp_path):
    path = tmp_path / "defaults.yaml"
    path.write_text("{}  # the core defaults, on purpose\n")
    config, problems = load_config(str(path), [])
    assert problems == [] and config.rollout.group_size == RunConfig().rollout.group_size


@pytest.mark.parametrize("text, what", [("just words\n", "a string"), ("42\n", "a single int"),
                                        ("- a\n- b\n", "a list")])
def test_a_config_file_that_is_not_a_mapping(tmp_path, text, what):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(ProblemsError, match=f"must hold a mapping of keys at the top level, not {what}"):
        load_config(str(path), [])


def test_a_config_path_the_file_system_refuses_is_a_problem():
    long = "x" * 300 + ".yaml"
    with pytest.raises(ProblemsError) as err:
        load_config(long, [])
    assert err.value.problems[0].code == "core.config-file"
    assert "File name too long" in err.value.problems[0].message and len(err.value.problems[0].message) < 150


def test_a_config_class_that_refuses_its_values_is_a_problem_not_a_traceback():
    from dataclasses import dataclass

    from areal_core.config.load import build
    from areal_core.config.schema import spec

    @dataclass
    class Picky:
        low: int = spec(1)
        high: int = spec(2)

        def __post_init__(self):
            if self.low > self.high:
                raise ValueError(f"low {self.low} is above high {self.high}")

    problems = []
    instance = build(Picky, {"low": 5}, "algorithm.", problems)
    assert instance == Picky() and texts(problems) == [
        "[core.config-class] algorithm: Picky refused these values: ValueError: low 5 is above high 2\n"
        "    fix: correct the keys under algorithm"]


def _model_problems(path):
    run = validate_run(None, [f"model.path='{path}'"], with_components=False)
    return [p for p in run.problems if p.key == "model.path"]


def test_model_path_must_be_a_model_folder(tmp_path):
    (tmp_path / "file.bin").write_text("x")
    (tmp_path / "empty").mkdir()
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_text('{"model_type": "llama"}')
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{nope")
    (bad_json / "model.safetensors").write_bytes(b"")
    torch_bin = tmp_path / "torch_bin"
    torch_bin.mkdir()
    (torch_bin / "config.json").write_text("{}")
    (torch_bin / "pytorch_model.bin").write_bytes(b"")
    cases = {
        tmp_path / "missing": "does not exist, and no installed plugin knows it as a model name",
        tmp_path / "file.bin": "is a file, not a folder, and no installed plugin knows it as a model name",
        tmp_path / "empty": "is an empty folder: it is not a Hugging Face model folder",
        only_config: "holds no *.safetensors weights: it is not a Hugging Face model folder",
        bad_json: "holds a config.json that cannot be read as JSON",
        torch_bin: "holds only PyTorch *.bin weights; the engines read *.safetensors",
    }
    for path, message in cases.items():
        problems = _model_problems(path)
        assert len(problems) == 1 and problems[0].code == "core.model", (path, problems)
        assert message in problems[0].message and str(path) in problems[0].message
        assert "'' for the built-in demo model" in problems[0].hint


def test_a_model_folder_and_the_demo_model_pass(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 4}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert _model_problems(tmp_path) == []
    assert _model_problems("") == []  # the demo model: its plugin provides it at run time


def test_a_model_name_a_plugin_knows_passes_without_materializing_it(tmp_path):
    from areal_core import hookimpl
    from areal_core.plugins import manager_from_modules

    asked = []

    class NamedModels:
        @staticmethod
        @hookimpl
        def areal_resolve_model(path, dtype, materialize):
            asked.append((path, materialize))
            return str(tmp_path / "cache" / path) if path == "tiny-llama" else None

    manager = manager_from_modules(NamedModels)
    for name, expected in (("tiny-llama", []), ("tiny-llamma", ["core.model"])):
        run = validate_run(None, [f"model.path={name}"], manager=manager, with_components=False)
        assert [p.code for p in run.problems if p.key == "model.path"] == expected
    assert asked == [("tiny-llama", False), ("tiny-llamma", False)]
    assert not (tmp_path / "cache").exists()


def test_the_run_folder_must_be_writable_and_the_check_leaves_nothing(tmp_path, monkeypatch):
    import errno
    import os
    import tempfile

    from areal_core.config.validate import output_problems

    config, _ = load_config(None, [f"output_dir={tmp_path / 'runs'}", "experiment=e", "trial=t"])
    assert output_problems(config) == [] and list(tmp_path.iterdir()) == []

    (tmp_path / "a_file").write_text("")
    config, _ = load_config(None, [f"output_dir={tmp_path / 'a_file' / 'runs'}"])
    assert texts(output_problems(config)) == [
        f"[core.output-dir] output_dir: {tmp_path / 'a_file'} is a file, so the run folder "
        f"{tmp_path / 'a_file' / 'runs' / 'areal' / 'run0'} cannot be made there\n"
        "    fix: set output_dir to a folder (it is created if missing)"]

    read_only = tmp_path / "read_only"
    read_only.mkdir()
    config, _ = load_config(None, [f"output_dir={read_only}"])
    if os.geteuid() != 0:  # root writes through permission bits; a read-only mount stops it (below)
        read_only.chmod(0o555)
        try:
            assert "permission denied" in output_problems(config)[0].message
        finally:
            read_only.chmod(0o755)

    def read_only_mount(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only_mount)
    assert texts(output_problems(config)) == [
        f"[core.output-dir] output_dir: {str(read_only)!r}: the run folder <output_dir>/areal/run0 cannot be written: "
        "the file system is read-only\n    fix: set output_dir to a folder you can write (it is created if missing)"]
    assert list(read_only.iterdir()) == []


def test_a_path_with_an_unknown_home_folder_is_a_problem_not_a_traceback():
    from areal_core.config.validate import output_problems

    run = validate_run(None, ["model.path=~no-such-user-here/model", "output_dir=~no-such-user-here/runs"],
                       with_components=False)
    assert [(p.code, p.message) for p in run.problems] == [
        ("core.model", "'~no-such-user-here/model' cannot be a model folder: its '~user' names no home folder on "
                       "this machine")]
    assert [p.message for p in output_problems(run.config)] == [
        "'~no-such-user-here/runs': the run folder <output_dir>/areal/run0 cannot be written: its '~user' names no "
        "home folder on this machine"]
