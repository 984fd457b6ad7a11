"""A fuzzer over what users type: `areal check` with random override lists and config files.

Every failure must be the project's own validation error, the one the CLI gives every user mistake (a
ProblemsError or ``run.problems`` printed by ``format_problems``, then exit 1: "N problem(s) in ...", one
numbered entry per problem with its key and fix), never an uncaught exception, a traceback or a plugin's
crash reported as a problem (``core.plugin-crash``), and `check` writes nothing in its working folder.
An option click does not know (``--resume`` on check) is click's own usage error (exit 2).

Keys are the schema's own, the installed components' own and junk; values are huge integers, floats with
nan and inf, unicode and long strings, YAML's special words and syntax, lists and nested mappings; files
are empty, comments only, invalid YAML, not a mapping, not UTF-8, or a random config. The default suite
runs 200 cases (AREAL_FUZZ_EXAMPLES=n for more); the slow suite (`pytest -m slow`, run by .ci/run) runs
10,000 (about 3.5 min on a 2-core machine). A failure prints the case and a blob to reproduce it with
``@reproduce_failure``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from areal_cli.app import build_app
from areal_core.config.describe import key_rows
from areal_core.config.schema import COMPONENT_SECTIONS
from areal_core.plugins import get_plugin_manager
from areal_core.registry import list_components, resolve

SCHEMA_KEYS = [row[0] for row in key_rows()]
SECTIONS = sorted({key.split(".")[0] for key in SCHEMA_KEYS if "." in key} | {"rollout.sampling", "rollout.elastic",
                                                                              "actor.optimizer", "rollout.extra"})


def _component_keys() -> tuple[list[str], list[str]]:
    """Every installed component's own keys (``algorithm.eps_clip``), and ``section.key=name`` selections."""
    keys, selections = set(), []
    for section, (kind, name_key) in COMPONENT_SECTIONS.items():
        for entry in list_components(kind):
            selections.append(f"{section}.{name_key}={entry.name}")
            try:
                config_class = getattr(resolve(kind, entry.name), "config_class", None)
            except Exception:  # a component that cannot be imported here is check's to report, not ours
                continue
            if config_class is not None and dataclasses.is_dataclass(config_class):
                keys |= {f"{section}.{f.name}" for f in dataclasses.fields(config_class)}
    return sorted(keys), sorted(selections)


COMPONENT_KEYS, SELECTIONS = _component_keys()

YAML_SPECIALS = [
    ".inf", "-.inf", "+.inf", ".nan", ".NaN", "nan", "inf", "-inf", "1e400", "-1e400", "1e20", "1e-400", "~", "null",
    "Null", "", " ", "yes", "no", "on", "off", "y", "n", "True", "FALSE", "0x1F", "0o17", "0b101", "1_000", "+.5",
    "-0", "007", "'", '"', "''", '""', "[", "]", "{", "}", "[]", "{}", "{a: 1}", "{lr: 1e-5, x: [1, 2]}",
    "[1, [2, [3]]]", '[""]', "['']", "[a, '']", "${x}", "${trial}", "${rollout.group_size}", "${oc.env:HOME}",
    "${oc.env:AREAL_FUZZ_UNSET}", "${oc.decode:'1'}", "${", "${}", "$", "!!binary aGVsbG8=", "!!str 3",
    "!!int x", "!!float .inf", "!!python/object:os.system ls", "!!set {a, b}", "!!omap [a: 1]", "&a 1", "*a",
    "- a", ": x", "#", "# comment", "a: b", "a: {b: c}", "\\0", '"\\0"', '"\\ud800"', '"\\x00"', "\x00", "%", "@",
    "`", "|", ">", "<<: {}", "2001-01-01", "2001-01-01T00:00:00Z", "12:30:00", "1:2:3", "---", "...", "?", "!",
    "9" * 30, "-" + "9" * 30, "1" + "0" * 400, "0." + "0" * 400 + "1", "1e308", "1.7976931348623157e309",
    "9223372036854775807", "9223372036854775808", "-9223372036854775809", "a" * 300, "/" * 300, "é" * 200,
    "/dev/null", "/", ".", "..", "~", "~nosuchuser/x", "/proc/self", "runs", "runs/../runs",
]

FIXED_KEYS = SCHEMA_KEYS + COMPONENT_KEYS + SECTIONS
WORDS = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=8)
JUNK_KEYS = st.one_of(
    st.lists(WORDS, min_size=1, max_size=4).map(".".join),
    st.builds(lambda section, rest: f"{section}.{rest}", st.sampled_from(SECTIONS), WORDS),
    st.text(max_size=20),
)
KEYS = st.one_of(st.sampled_from(FIXED_KEYS), st.sampled_from(FIXED_KEYS), JUNK_KEYS)

SCALARS = st.one_of(
    st.integers(-(2**70), 2**70), st.integers(-(10**400), 10**400), st.integers(-3, 100),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=20), st.text(min_size=1, max_size=8).map(lambda text: text * 60),
    st.text(string.printable, max_size=30),
)
SHORT_KEYS = st.one_of(st.text(string.ascii_letters + "_", min_size=1, max_size=8),
                      st.sampled_from(sorted({key.rsplit(".", 1)[-1] for key in FIXED_KEYS})))
VALUES = st.one_of(  # two levels deep: deeper nesting meets the same code, and costs generation time
    SCALARS, SCALARS, st.lists(SCALARS, max_size=4),
    st.dictionaries(SHORT_KEYS, st.one_of(SCALARS, st.lists(SCALARS, max_size=3)), max_size=4),
)


DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _flow(value) -> str:
    """A value as a user would type it after ``key=``: YAML in flow style."""
    text = yaml.dump(value, Dumper=DUMPER, default_flow_style=True, allow_unicode=True, width=10**6)
    return text.strip().removesuffix("...").strip()


VALUE_TEXTS = st.one_of(st.sampled_from(YAML_SPECIALS), VALUES.map(_flow), st.text(max_size=40))
OVERRIDES = st.one_of(
    st.builds(lambda key, value: f"{key}={value}", KEYS, VALUE_TEXTS),
    st.builds(lambda key, value: f"{key}={value}", KEYS, VALUE_TEXTS),
    st.sampled_from(SELECTIONS),
    st.text(max_size=40),  # no '=', or a key no override may have
    st.sampled_from(["actor.optimizer.lr=1" + "0" * 400, "x" * 300, "trial=" + "x" * 300, "=", "=1", "a.=1",
                     ".a=1", "a..b=1", " = ", "--", "-", "--resume", "a b=1"]),
)


def _nested(pairs: list[tuple[str, object]]) -> dict:
    """``[("a.b", 1)]`` -> ``{"a": {"b": 1}}``; a key that clashes with a section keeps the first."""
    out: dict = {}
    for key, value in pairs:
        *parents, leaf = key.split(".") if key else [""]
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node.setdefault(leaf, value)
    return out


DEMO = yaml.safe_load(Path(__file__).parents[1].joinpath("cli", "areal_cli", "demo.yaml").read_text())


def _edited_demo(pairs: list[tuple[str, object]]) -> str:
    """The built-in demo's YAML with ``pairs`` set (dotted keys), as a user edits a copy of it."""
    import copy

    data = copy.deepcopy(DEMO)
    for key, value in pairs:
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return yaml.dump(data, Dumper=DUMPER, allow_unicode=True)


YAML_TEXT = st.text(alphabet=string.ascii_letters + string.digits + " \n\t:-#[]{}'\",.&*!|>%@`?~=$\\", max_size=120)
BROKEN_FILES = st.one_of(
    st.sampled_from(["", "\n  \n", "# only a comment\n", "# a\n#b\n\n", "---\n", "...\n", "null\n", "~\n", "{}\n",
                     "[]\n", "42\n", "just text\n", "- a\n- b\n", "a: 1\na: 2\n", "? [a, b]\n: c\n",
                     "\ufeffexperiment: x\n", "experiment: x\n\tbad: indent\n", "%YAML 9.9\n---\na: 1\n"]),
    YAML_TEXT,
    st.binary(max_size=60),
)
GOOD_FILES = st.one_of(
    st.lists(st.tuples(st.sampled_from(FIXED_KEYS), VALUES), max_size=4).map(_edited_demo),
    st.lists(st.tuples(KEYS.filter(lambda k: bool(k) and "." not in k[:1]), VALUES), max_size=6).map(
        lambda pairs: yaml.dump(_nested(pairs) or {"trial": "x"}, Dumper=DUMPER, allow_unicode=True)),
    st.lists(st.tuples(st.sampled_from(FIXED_KEYS), st.sampled_from(YAML_SPECIALS)), min_size=1, max_size=6).map(
        lambda pairs: "".join(f"{key}: {value}\n" if "." not in key else
                              f"{key.split('.')[0]}:\n  {key.split('.', 1)[1].replace('.', '_')}: {value}\n"
                              for key, value in pairs)),
)
CASES = st.fixed_dictionaries({
    "file": st.one_of(st.none(), st.none(), GOOD_FILES, GOOD_FILES, BROKEN_FILES),
    "overrides": st.lists(OVERRIDES, max_size=6),
})

PROBLEMS_HEAD = re.compile(r"^(\d+) problems? in .*:\n  1\. \[[a-z_.-]+\] ", re.DOTALL)


def _tree(*roots: Path) -> set[tuple[str, int]]:
    """Every path under ``roots`` with its size (a file written, a folder made or left, shows)."""
    seen = set()
    for root in roots:
        for folder, dirs, files in os.walk(root):
            seen.add((folder, -1))
            seen |= {(os.path.join(folder, name), os.path.getsize(os.path.join(folder, name))) for name in files}
    return seen


class Fuzz:
    """One app, one working folder; each case's config file is written in ``files`` (not checked for writes)."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import areal_core.registry as registry

        # Entry points do not change during the test: read them once, not ~10 times per case.
        monkeypatch.setattr(registry, "entry_points", functools.lru_cache(maxsize=None)(registry.entry_points))
        monkeypatch.delenv("AREAL_FUZZ_UNSET", raising=False)
        self.work, self.files = tmp_path / "work", tmp_path / "files"
        self.work.mkdir()
        self.files.mkdir()
        monkeypatch.chdir(self.work)
        self.app, _ = build_app(get_plugin_manager(refresh=True))
        self.runner = CliRunner()
        self.cases = 0

    def check(self, case: dict) -> None:
        args = ["check"]
        if case["file"] is not None:
            config = self.files / "config.yaml"
            data = case["file"]
            config.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))
            args.append(str(config))
        args += case["overrides"]
        before = _tree(self.work)
        result = self.runner.invoke(self.app, args)
        self.cases += 1
        described = f"areal {' '.join(map(repr, args))}\nfile: {case['file']!r}\noutput:\n{result.output}"
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            f"{type(result.exception).__name__}: {result.exception}\n{described}")
        assert _tree(self.work) == before, f"check wrote on disk\n{described}"
        assert "Traceback" not in result.output, described
        resumes = "--resume" in args[1:]
        if resumes and ": OK. allocation " in result.output:  # valid, then whether the run's folder resumes
            said = [line for line in result.output.splitlines() if line.startswith("--resume: ")]
            assert result.exit_code in (0, 1) and said, described
            return
        if result.exit_code == 0:
            assert result.output.endswith("process(es))\n") and ": OK. allocation " in result.output, described
            return
        if result.exit_code == 2:  # an option typer does not know ("--dry-run" on check, "-x"): its usage error
            assert any(arg.startswith("-") for arg in args[1:]) and "No such option" in result.output, described
            return
        assert result.exit_code == 1, described
        head = PROBLEMS_HEAD.match(result.output)
        assert head, f"not the project's validation error\n{described}"
        count = int(head.group(1))
        assert len(re.findall(r"^  \d+\. \[", result.output, re.MULTILINE)) == count, described
        assert not re.search(r"^  \d+\. \[core\.plugin-crash\]", result.output, re.MULTILINE), (
            f"a plugin crashed on this input\n{described}")


def _fuzz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, examples: int) -> Fuzz:
    fuzz = Fuzz(tmp_path, monkeypatch)

    @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=CASES)
    @example(case={"file": None, "overrides": ["--resume"]})  # found by a suite run: a valid demo, no run to resume
    def one(case):
        fuzz.check(case)

    one()
    return fuzz


def test_check_answers_random_input_with_its_own_problems(tmp_path, monkeypatch):
    n = int(os.environ.get("AREAL_FUZZ_EXAMPLES", 200))  # more for a longer local hunt
    assert _fuzz(tmp_path, monkeypatch, n).cases >= n + 1  # the explicit example, then n drawn


@pytest.mark.slow
def test_check_answers_10000_random_inputs_with_its_own_problems(tmp_path, monkeypatch):
    assert _fuzz(tmp_path, monkeypatch, 10_000).cases >= 10_000


# Inputs the fuzzer found that once ended in a traceback, checked on every run.
FOUND = [
    {"file": "actor:\n 0:", "overrides": []},  # a number as a component's key: TypeError in the did-you-mean
    {"file": "rollout:\n  3: x\n  sampling: {7: 1}\nactor: {1.5: 2}", "overrides": []},
]


@pytest.mark.parametrize("case", FOUND, ids=range(len(FOUND)))
def test_inputs_the_fuzzer_found_get_problems_not_tracebacks(tmp_path, monkeypatch, case):
    Fuzz(tmp_path, monkeypatch).check(case)
