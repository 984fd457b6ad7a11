"""The files dataset: each format, the field mapping, the errors, the split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_core.api import Context
from areal_core.config.schema import RunConfig
from areal_core.config.validate import validate_run
from areal_core.testing import DatasetConformance
from areal_tasks.files import DatasetFileError, FilesConfig, FilesDataset

ROWS = [{"q": f"What is {n} + {n}?", "a": f"Twice {n} is {2 * n}.\n#### {2 * n}", "uid": f"u{n}", "level": n % 3}
        for n in range(30)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(split: str = "train", seed: int = 3, **options) -> FilesDataset:
    config = RunConfig()
    config.trainer.seed = seed
    return FilesDataset.create(Context(config=config, options=FilesConfig(**options), extras={"split": split}))


MAPPING = dict(question_field="q", answer_field="a", id_field="uid", answer_pattern=r"####\s*(.+)$")


def test_jsonl_field_mapping_template_and_answer_pattern(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", ROWS)
    items = build(path=str(path), template="Q: {question} (level {level})", system_prompt="Be brief.",
                  shuffle=False, stop=["\n\n"], **MAPPING).items
    assert items[4] == {"id": "u4", "q": ROWS[4]["q"], "a": ROWS[4]["a"], "uid": "u4", "level": 1, "answer": "8",
                        "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Q: What is 4 + 4? (level 1)"}],
                        "stop": ["\n\n"]}


def test_raw_prompt_and_default_ids(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:3])
    items = build(path=str(path), question_field="q", answer_field="a", chat=False, template="{question}\nA:",
                  shuffle=False).items
    assert [i["id"] for i in items] == ["d.jsonl:1", "d.jsonl:2", "d.jsonl:3"]
    assert items[1]["prompt"] == "What is 1 + 1?\nA:" and "messages" not in items[1]


def test_parquet_and_hf_disk_give_the_same_items_as_jsonl(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:5])}).save_to_disk(str(tmp_path / "hfdict"))
    expected = build(path=str(write_jsonl(tmp_path / "d.jsonl", ROWS)), **MAPPING).items
    assert build(path=str(tmp_path / "d.parquet"), **MAPPING).items == expected
    assert build(path=str(tmp_path / "hf"), **MAPPING).items == expected
    assert [i["id"] for i in build(path=str(tmp_path / "hfdict"), shuffle=False, **MAPPING).items] == \
        ["u0", "u1", "u2", "u3", "u4"]
    with pytest.raises(DatasetFileError, match="holds the splits train, not 'test'. Fix: set dataset.hf_split"):
        build(path=str(tmp_path / "hfdict"), hf_split="test", **MAPPING)


def test_missing_field_names_file_row_field_and_fix(tmp_path):
    rows = [dict(r) for r in ROWS[:5]]
    del rows[3]["a"]
    path = write_jsonl(tmp_path / "broken.jsonl", rows)
    with pytest.raises(DatasetFileError) as err:
        build(path=str(path), **MAPPING)
    assert str(err.value) == (
        f"{path} row 4: no field 'a' (dataset.answer_field); the row has fields: q, uid, level. Fix: set "
        f"dataset.answer_field to the column holding the reference answer, or add 'a' to every row")


def task_problems(*overrides: str) -> list[tuple[str, str, str]]:
    run = validate_run(None, list(overrides))
    return [(p.key, p.message, p.hint) for p in run.problems if p.code.startswith("tasks.")]


def test_areal_check_reads_every_row_before_the_run_starts(tmp_path):
    rows = [dict(r) for r in ROWS[:5]]
    del rows[3]["a"]
    path = write_jsonl(tmp_path / "broken.jsonl", rows)
    mapping = ["dataset.name=files", f"dataset.path={path}", "dataset.question_field=q", "dataset.answer_field=a",
               "dataset.id_field=uid"]
    assert task_problems(*mapping, "eval.size=0") == [(
        "dataset.answer_field",
        f"{path} row 4: no field 'a' (dataset.answer_field); the row has fields: q, uid, level",
        "set dataset.answer_field to the column holding the reference answer, or add 'a' to every row")]
    # eval.size > 0 (the default) reads the validation split, which reads the train rows too
    assert [key for key, _, _ in task_problems(*mapping, "dataset.validation_fraction=0.3")] == \
        ["dataset.answer_field"]


def test_areal_check_names_a_bad_pattern_and_an_unreadable_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    ((key, message, _),) = task_problems("dataset.name=files", f"dataset.path={path}", "eval.size=0",
                                         "dataset.answer_pattern='####(.+'")
    assert key == "dataset.answer_pattern" and "not a regular expression" in message
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    ((key, message, hint),) = task_problems("dataset.name=files", f"dataset.path={corrupt}", "eval.size=0")
    assert key == "dataset.path" and message.startswith(f"{corrupt} cannot be read as auto: Arrow")
    # a wrongly typed key is the core's to report: the data is not read against it
    run = validate_run(None, ["dataset.name=files", f"dataset.path={path}", "dataset.validation_fraction=lots"])
    assert [p.key for p in run.problems if p.key.startswith("dataset.")] == ["dataset.validation_fraction"]


def test_areal_check_refuses_evaluation_without_a_validation_split(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    mapping = ["dataset.name=files", f"dataset.path={path}", "dataset.question_field=q", "dataset.answer_field=a"]
    ((key, message, hint),) = task_problems(*mapping)  # eval.size defaults to 64
    assert key == "dataset.validation_fraction" and "the validation split is empty" in message
    assert "eval.size=0" in hint
    assert task_problems(*mapping, "eval.size=0") == []
    assert task_problems(*mapping, "dataset.validation_fraction=0.3") == []


def test_template_field_missing_and_bad_json_are_named(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:2])
    with pytest.raises(DatasetFileError, match=r"row 1: no field 'topic' \(dataset.template\)"):
        build(path=str(path), template="{topic}: {question}", **MAPPING)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(DatasetFileError, match=r"bad.jsonl row 3: not valid JSON"):
        build(path=str(bad), **MAPPING)
    with pytest.raises(DatasetFileError, match="cannot tell the format from the suffix '.txt'"):
        build(path=str(tmp_path / "x.txt"), **MAPPING)


def test_a_bad_json_row_is_named_by_its_line_and_the_column_of_the_error(tmp_path):
    """The column is the error's on that line, not column 1 of an imagined next line (a row cut short used to
    be parsed with its newline, so its error was "line 2 column 1"), with an excerpt ending at the error."""
    good = json.dumps(ROWS[0])
    cut = '{"q": "What is 2 + 2? Show your work.", "a": "#### 4"'  # the closing brace is missing
    bad = tmp_path / "cut.jsonl"
    bad.write_text(f"{good}\n{good}\r\n{cut}\n{good}\n")
    with pytest.raises(DatasetFileError) as caught:
        build(path=str(bad), **MAPPING)
    assert caught.value.message == (
        f"{bad} row 3: not valid JSON at column {len(cut) + 1} (the end of the line): Expecting ',' delimiter; "
        f"the row reads: …{cut[-30:]}")
    assert cut[-30:] == 'how your work.", "a": "#### 4"'

    inside = '{"q": "x", "a": , "uid": "u1"}'
    bad.write_text(f"{good}\r\n{inside}\r\n")
    with pytest.raises(DatasetFileError) as caught:
        build(path=str(bad), **MAPPING)
    assert caught.value.message == (f"{bad} row 2: not valid JSON at column 17 (','): Expecting value; "
                                    f"the row reads: {inside[:26]}…")  # ends 10 characters past the error
    assert inside[16] == ","

    bad.write_text('{"q": "tab\there", "a": "1"}\n')
    with pytest.raises(DatasetFileError, match=r"row 1: not valid JSON at column 11 \('\\t'\): Invalid control "
                                               r"character here; the row reads: \{\"q\": \"tab\\there"):
        build(path=str(bad), **MAPPING)


def test_duplicate_ids_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], ROWS[0]])
    with pytest.raises(DatasetFileError, match="the id 'u0' .* is on two rows"):
        build(path=str(path), **MAPPING)


def test_held_out_fraction_is_disjoint_and_independent_of_the_seed(tmp_path):
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    train = {i["id"] for i in build(path=path, validation_fraction=0.3, **MAPPING)}
    validation = {i["id"] for i in build("validation", path=path, validation_fraction=0.3, **MAPPING)}
    assert train and validation and not train & validation and len(train | validation) == len(ROWS)
    assert validation == {i["id"] for i in build("validation", seed=99, path=path, validation_fraction=0.3,
                                                 **MAPPING)}


def test_validation_file_and_overlap_left_out_of_train(tmp_path):
    train_path = write_jsonl(tmp_path / "train.jsonl", ROWS[:10])
    val_rows = [dict(r, uid=f"v{k}") for k, r in enumerate(ROWS[8:12])]  # two prompts also in train
    val_path = write_jsonl(tmp_path / "val.jsonl", val_rows)
    with pytest.warns(UserWarning, match="2 rows have the same prompt"):
        train = build(path=str(train_path), validation_path=str(val_path), **MAPPING)
    assert sorted(i["id"] for i in train) == [f"u{n}" for n in range(8)]
    assert [i["id"] for i in build("validation", path=str(train_path), validation_path=str(val_path),
                                   **MAPPING)] == ["v0", "v1", "v2", "v3"]
    with pytest.raises(DatasetFileError, match="the validation split is empty"):
        build("validation", path=str(train_path), **MAPPING)


def test_passes_reshuffle_reproducibly(tmp_path):
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    a, b = build(path=path, **MAPPING), build(path=path, **MAPPING)
    first, second = [i["id"] for i in a], [i["id"] for i in a]
    assert first != second and sorted(first) == sorted(second)
    assert [i["id"] for i in b] == first and [i["id"] for i in b] == second
    assert [i["id"] for i in build(path=path, shuffle=False, **MAPPING)] == [r["uid"] for r in ROWS]


class TestFilesConformance(DatasetConformance):
    component_name = "files"

    @pytest.fixture(autouse=True)
    def _rows_on_disk(self, tmp_path):
        write_jsonl(tmp_path / "train.jsonl", ROWS)
        self.options = dict(path=str(tmp_path / "train.jsonl"), validation_fraction=0.25, **MAPPING)


def test_a_hub_dataset_file_is_read_as_the_same_file_on_disk(tmp_path):
    """`dataset.path: hf://datasets/ORG/NAME/FILE`, fetched by huggingface_hub from a stand-in of the hub on
    127.0.0.1 (areal_core.testing.hub), gives the items the same file on disk gives; `areal check` reads it and
    names a file the repo does not have. In subprocesses: huggingface_hub reads HF_ENDPOINT when imported."""
    import os
    import subprocess
    import sys

    from areal_core.testing.hub import serve

    repo = tmp_path / "hub" / "datasets" / "tiny-org" / "sums"
    repo.mkdir(parents=True)
    write_jsonl(repo / "train.jsonl", ROWS[:20])
    write_jsonl(repo / "val.jsonl", ROWS[20:])
    keys = ["dataset.name=files", "dataset.question_field=q", "dataset.answer_field=a", "dataset.id_field=uid",
            "dataset.answer_pattern='####\\s*(.+)$'"]
    code = ("import json, sys\nfrom areal_core.api import Context\nfrom areal_core.config.schema import RunConfig\n"
            "from areal_tasks.files import FilesConfig, FilesDataset\n"
            "o = FilesConfig(path=sys.argv[1], validation_path=sys.argv[2], question_field='q', answer_field='a', "
            "id_field='uid', answer_pattern=r'####\\s*(.+)$', shuffle=False)\n"
            "d = FilesDataset.create(Context(config=RunConfig(), options=o, extras={'split': 'validation'}))\n"
            "print(json.dumps([item['id'] + '=' + item['answer'] for item in d]))\n")
    with serve(tmp_path / "hub") as endpoint:
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"))
        hub = "hf://datasets/tiny-org/sums"
        read = subprocess.run([sys.executable, "-c", code, f"{hub}/train.jsonl", f"{hub}/val.jsonl"], env=env,
                              capture_output=True, text=True, timeout=120)
        areal = str(Path(sys.executable).with_name("areal"))
        checked = subprocess.run([areal, "check", *keys, f"dataset.path={hub}/train.jsonl",
                                  f"dataset.validation_path={hub}/val.jsonl", f"output_dir={tmp_path / 'runs'}"],
                                 env=env, capture_output=True, text=True, timeout=120)
        missing = subprocess.run([areal, "check", *keys, f"dataset.path={hub}/nope.jsonl", "eval.size=0",
                                  f"output_dir={tmp_path / 'runs'}"], env=env, capture_output=True, text=True,
                                 timeout=120)
    assert read.returncode == 0, read.stderr
    local = build("validation", path=str(repo / "train.jsonl"), validation_path=str(repo / "val.jsonl"),
                  shuffle=False, **MAPPING)
    assert json.loads(read.stdout) == [f"{item['id']}={item['answer']}" for item in local]
    assert checked.returncode == 0, checked.stdout + checked.stderr
    said = missing.stdout + missing.stderr
    assert missing.returncode == 1 and "tiny-org/sums on the hub at" in said and "has no file 'nope.jsonl'" in said
    assert "Traceback" not in said


def _gsm8k_shaped_repo(root: Path) -> Path:
    """A dataset repo laid out as GSM8K's is on the hub: two configs (main, socratic) declared in the README's
    YAML, a train and a test parquet file each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = root / "datasets" / "tiny-org" / "gsm8k"
    for config, rows in (("main", ROWS), ("socratic", ROWS[:6])):
        (repo / config).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows[:20]), repo / config / "train-00000-of-00001.parquet")
        pq.write_table(pa.Table.from_pylist(rows[20:]), repo / config / "test-00000-of-00001.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n" + "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
                                    f"  - split: test\n    path: {c}/test-*\n" for c in ("main", "socratic"))
        + "---\n# a GSM8K-shaped test repo\n")
    return repo


_READ_SPLITS = (
    "import json, sys\nfrom areal_core.api import Context\nfrom areal_core.config.schema import RunConfig\n"
    "from areal_tasks.files import DatasetFileError, FilesConfig, FilesDataset\n"
    "o = FilesConfig(**json.loads(sys.argv[1]))\n"
    "try:\n"
    "    out = {s: [i['id'] + '=' + i['answer'] for i in FilesDataset.create(Context(config=RunConfig(), options=o, "
    "extras={'split': s}))] for s in ('train', 'validation')}\n"
    "except DatasetFileError as e:\n"
    "    out = {'error': e.message, 'fix': e.fix, 'key': e.key}\n"
    "print(json.dumps(out))\n")


@pytest.mark.slow
def test_a_hub_dataset_by_its_repo_id_is_read_by_the_datasets_library(tmp_path):
    """`dataset.path: ORG/NAME` with a config and two splits, read by `datasets.load_dataset` from the hub
    stand-in: the same rows as the parquet files on disk, validation from `hf_validation_split`; offline it
    reads the cache; a missing config, an unknown split, a missing repo and an uncached offline read each say
    which key to change. `areal check` reads it too."""
    import os
    import subprocess
    import sys

    from areal_core.testing.hub import serve

    repo = _gsm8k_shaped_repo(tmp_path / "hub")
    base = dict(question_field="q", answer_field="a", answer_pattern=r"####\s*(.+)$", shuffle=False)

    def read(env, **options):
        proc = subprocess.run([sys.executable, "-c", _READ_SPLITS, json.dumps({**base, **options})], env=env,
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    with serve(tmp_path / "hub") as endpoint:
        env["HF_ENDPOINT"] = endpoint
        got = read(env, path="tiny-org/gsm8k", hf_config="main", hf_validation_split="test")
        no_config = read(env, path="tiny-org/gsm8k", hf_validation_split="test")
        bad_split = read(env, path="tiny-org/gsm8k", hf_config="main", hf_validation_split="tset")
        no_repo = read(env, path="hf://datasets/tiny-org/nope", hf_config="main", validation_fraction=0.2)
        areal = str(Path(sys.executable).with_name("areal"))
        checked = subprocess.run([areal, "check", "dataset.name=files", "dataset.path=tiny-org/gsm8k",
                                  "dataset.hf_config=main", "dataset.hf_validation_split=test", "dataset.question_field=q",
                                  "dataset.answer_field=a", "dataset.answer_pattern='####\\s*(.+)$'",
                                  f"output_dir={tmp_path / 'runs'}"], env=env, capture_output=True, text=True,
                                 timeout=180)
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    cached = read(offline, path="tiny-org/gsm8k", hf_config="main", hf_validation_split="test")
    uncached = read(offline, path="tiny-org/gsm8k", hf_config="socratic", hf_validation_split="test")

    on_disk = {}
    for split, name in (("train", "train"), ("validation", "test")):
        local = build("train", path=str(repo / "main" / f"{name}-00000-of-00001.parquet"), shuffle=False,
                      question_field="q", answer_field="a", answer_pattern=r"####\s*(.+)$")
        on_disk[split] = [item["answer"] for item in local]
    assert [x.split("=")[1] for x in got["train"]] == on_disk["train"] and len(got["train"]) == 20
    assert [x.split("=")[1] for x in got["validation"]] == on_disk["validation"] and len(got["validation"]) == 10
    assert got["train"][0].startswith("tiny-org/gsm8k:main/train:1=")
    assert got["validation"][0].startswith("validation/tiny-org/gsm8k:main/test:1=")
    assert cached == got
    assert no_config["key"] == "dataset.hf_config" and "'main', 'socratic'" in no_config["error"], no_config
    assert bad_split["key"] == "dataset.hf_validation_split" and "tset" in bad_split["error"], bad_split
    assert no_repo["key"] == "dataset.path" and "tiny-org/nope" in no_repo["error"] and "HF_TOKEN" in no_repo["fix"]
    assert uncached["key"] == "dataset.path" and "HF_HUB_OFFLINE is set" in uncached["error"], uncached
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_missing_local_data_file_is_not_looked_up_on_the_hub(tmp_path):
    from areal_tasks.files import hub_repo

    assert hub_repo("data/train.jsonl") is None and hub_repo("openai/gsm8k") == ("openai/gsm8k", None)
    assert hub_repo("hf://datasets/openai/gsm8k@v1") == ("openai/gsm8k", "v1")
    assert hub_repo("hf://datasets/openai/gsm8k/main/train.parquet") is None  # one file: huggingface_hub's
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_repo(str(tmp_path / "org" / "name")) is None  # an existing folder stays local
    with pytest.raises(DatasetFileError, match="does not exist"):
        build(path=str(tmp_path / "data" / "train.jsonl"), **MAPPING)
