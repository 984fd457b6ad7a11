"""The ``files`` dataset: rows of a local JSONL file, Parquet file or HF ``save_to_disk`` folder, one file of a
hub dataset (``hf://datasets/ORG/NAME/FILE``, fetched by huggingface_hub), or a whole hub dataset by its repo id
(``openai/gsm8k``, a config and a split, read by the ``datasets`` library: its cache, ``HF_HOME``,
``HF_HUB_OFFLINE`` and ``HF_TOKEN`` apply).

Every row is read and turned into an item when the dataset is built, so a
missing field or a bad line fails the run before the first rollout, with
the file, the row and the field named; nothing is half-read. Rows are
numbered from 1 (for JSONL the row number is the line number).
"""

from __future__ import annotations

import json
import re
import string
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from areal_core.api import Dataset, pass_order, stable_seed
from areal_core.config.schema import spec

FORMATS = ("auto", "jsonl", "parquet", "hf_disk", "hub")
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
RESERVED = ("id", "prompt", "messages", "answer", "stop")


@dataclass
class FilesConfig:
    """Keys of ``dataset`` when ``dataset.name: files``."""

    path: str = spec("", help="a .jsonl / .parquet file, a folder written by datasets' save_to_disk, a file of "
                             "a hub dataset (hf://datasets/ORG/NAME[@REVISION]/FILE), or a hub dataset's id "
                             "(ORG/NAME[@REVISION], read with the datasets library)")
    format: str = spec("auto", choices=list(FORMATS),
                       help="auto: by the path's suffix; a folder is hf_disk; ORG/NAME that is not a local path is hub")
    hf_split: str = spec("train", help="the split to read: of a hub dataset, or of an hf_disk folder holding a "
                                       "DatasetDict")
    hf_config: str = spec("", help="a hub dataset's config (subset), e.g. GSM8K's 'main'; '' = its only one")
    hf_validation_split: str = spec("", help="a hub dataset: the split to evaluate on (e.g. 'test'); '' = "
                                             "validation_path or validation_fraction decide")
    question_field: str = spec("question", help="the column holding the question ({question} in template)")
    answer_field: str = spec("answer", help="the column holding the reference answer")
    id_field: str = spec("", help="the column holding a unique id; '' = '<file name>:<row>'")
    messages_field: str = spec("", help="a column holding a whole chat (list of {role, content}); "
                                        "when set, question_field and template are not used")
    template: str = spec("{question}", help="the prompt, str.format over the row's columns and {question}")
    chat: bool = spec(True, help="true: the prompt is a user message (chat template applied by the workflow); "
                                 "false: raw text sent as it is")
    system_prompt: str = spec("", help="a system message before the user message (chat only)")
    answer_pattern: str = spec("", help="a regex whose first group is taken from the answer column "
                                        "(GSM8K: '####\\s*(.+)$'); '' = the whole value")
    stop: list = spec(factory=list, help="stop strings every item carries")
    validation_path: str = spec("", help="a file or folder holding the validation split")
    validation_fraction: float = spec(0.0, ge=0.0, lt=1.0,
                                      help="without validation_path: the share of rows held out for validation, "
                                           "picked by a hash of each row's id")
    shuffle: bool = spec(True, help="train only: a new seeded order on every pass (the first pass too)")


class DatasetFileError(ValueError):
    """A data file cannot become items; the message names the file, the row, the field and the fix.

    ``key`` is the config key to change (``dataset.answer_field``, ...), so
    ``areal check`` can report it as a :class:`~areal_core.Problem`.
    """

    def __init__(self, message: str, fix: str, key: str = "dataset.path") -> None:
        self.message, self.fix, self.key = message, fix, key
        super().__init__(f"{message}. Fix: {fix}")


def _local(path: str) -> Path:
    """A data path as a local file: ``hf://datasets/ORG/NAME[@REV]/FILE`` fetched into huggingface_hub's cache
    (areal_core.hub), anything else as it is."""
    from areal_core.hub import HubFileError, hub_file, is_hub_file

    if not is_hub_file(path):
        return Path(path).expanduser()
    try:
        return hub_file(path)
    except HubFileError as exc:
        text = str(exc)
        message, _, fix = text.partition(". Fix: ")
        raise DatasetFileError(message, fix or "point dataset.path at a local file") from None


# ORG/NAME[@REVISION], or hf://datasets/ORG/NAME[@REVISION] without a file: a whole hub dataset
_HUB_REPO = re.compile(r"(?:hf://datasets/)?(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")


def hub_repo(path: str) -> tuple[str, str | None] | None:
    """``(repo, revision)`` when ``path`` names a whole hub dataset: ``hf://datasets/ORG/NAME[@REV]``, or
    ``ORG/NAME[@REV]`` that is not a local path and has no data file's suffix (``data/train.jsonl`` that does
    not exist stays a missing local file)."""
    match = _HUB_REPO.fullmatch(path or "")
    if match is None:
        return None
    if not path.startswith("hf://"):
        try:
            if Path(path).expanduser().exists():
                return None
        except (OSError, ValueError, RuntimeError):
            return None
        if Path(match["repo"]).suffix.lower() in SUFFIXES:
            return None
    return match["repo"], match["revision"]


@dataclass(frozen=True)
class HubSplit:
    """One split of a hub dataset, named in messages as a file would be (``str``) and in ids by ``name``."""

    repo: str
    revision: str | None
    config: str
    split: str

    def __str__(self) -> str:
        config = f", config {self.config!r}" if self.config else ""
        return f"hub dataset {self.repo}{'@' + self.revision if self.revision else ''} (split {self.split!r}{config})"

    @property
    def name(self) -> str:
        return f"{self.repo}:{self.config + '/' if self.config else ''}{self.split}"


def read_hub_rows(source: HubSplit, split_key: str) -> list[tuple[int, dict]]:
    """Every row of one split of a hub dataset, through ``datasets.load_dataset`` (cached as it caches); its
    failures become a :class:`DatasetFileError` naming the key to change."""
    import datasets

    try:
        loaded = datasets.load_dataset(source.repo, source.config or None, split=source.split,
                                       revision=source.revision)
    except Exception as exc:  # the datasets library's own messages are good; we add the key and the fix
        raise _hub_error(source, split_key, exc) from None
    return list(enumerate(loaded.to_list(), 1))


def _hub_error(source: HubSplit, split_key: str, exc: Exception) -> DatasetFileError:
    from huggingface_hub import constants

    text = " ".join(str(exc).split())
    what = f"{source}, read from the Hugging Face Hub at {constants.ENDPOINT}"
    if "Config name is missing" in text or "BuilderConfig" in text:
        return DatasetFileError(f"{what}: {text}", "set dataset.hf_config to one of the configs named",
                                "dataset.hf_config")
    if "Unknown split" in text:
        return DatasetFileError(f"{what}: {text}", f"set dataset.{split_key} to one of the splits named",
                                f"dataset.{split_key}")
    if type(exc).__name__ == "DatasetNotFoundError":
        return DatasetFileError(f"{what}: {text}", "check the id (ORG/NAME) and the @REVISION, set HF_TOKEN for "
                                "a private or gated dataset, or point dataset.path at a local file")
    if isinstance(exc, ConnectionError) or constants.HF_HUB_OFFLINE:
        cause = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        return DatasetFileError(f"{what}: {cause} and it is not in the cache: {text}",
                                "load it once where the hub is reachable (same HF_HOME), or point dataset.path at "
                                "a local copy")
    return DatasetFileError(f"{what}: {type(exc).__name__}: {text}", "point dataset.path at a local file")


def detect_format(path: Path, declared: str) -> str:
    if declared != "auto":
        return declared
    if path.is_dir():
        return "hf_disk"
    found = SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise DatasetFileError(f"{path}: cannot tell the format from the suffix {path.suffix!r}",
                               f"set dataset.format to one of {', '.join(FORMATS[1:])}", "dataset.format")
    return found


def read_rows(path: Path, fmt: str, hf_split: str) -> list[tuple[int, dict]]:
    """(row number from 1, row) for every row of the file or folder."""
    if not path.exists():
        raise DatasetFileError(f"{path} does not exist", "point dataset.path (or dataset.validation_path) at a "
                               ".jsonl / .parquet file or a save_to_disk folder")
    if fmt == "jsonl":
        return list(_jsonl_rows(path))
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), 1))
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if hf_split not in loaded:
            raise DatasetFileError(f"{path} holds the splits {', '.join(loaded)}, not {hf_split!r}",
                                   "set dataset.hf_split to one of them", "dataset.hf_split")
        loaded = loaded[hf_split]
    return list(enumerate(loaded.to_list(), 1))


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            text = line.rstrip("\r\n")  # parsed without its newline: an error at its end stays on this line
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DatasetFileError(f"{path} row {line_no}: not valid JSON {json_error_place(text, exc)}",
                                       "write one JSON object per line") from None
            if not isinstance(row, dict):
                raise DatasetFileError(f"{path} row {line_no}: a JSON {type(row).__name__}, not an object",
                                       "write one JSON object per line")
            yield line_no, row


def json_error_place(text: str, exc: json.JSONDecodeError, context: int = 30) -> str:
    """Where in the one-line ``text`` parsing failed: ``at column N ('c'): <msg>; the row reads: …<excerpt>``.

    The column counts characters from 1, as editors do; the excerpt ends a few
    characters past the error, control characters shown escaped.
    """
    pos = exc.pos
    column = pos + 1
    if pos >= len(text):
        where = "the end of the line"
    else:
        where = repr(text[pos])
    start, end = max(0, pos - context), min(len(text), pos + 10)
    excerpt = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text[start:end])
    excerpt = ("…" if start > 0 else "") + excerpt + ("…" if end < len(text) else "")
    msg = exc.msg[:-3] + " here" if exc.msg.endswith(" at") else exc.msg  # "Invalid control character at"
    return f"at column {column} ({where}): {msg}; the row reads: {excerpt}"


def missing_field(path: Path, row_no: int, row: dict, field: str, key: str, what: str) -> DatasetFileError:
    return DatasetFileError(
        f"{path} row {row_no}: no field '{field}' (dataset.{key}); the row has fields: "
        f"{', '.join(map(str, row)) or '(none)'}",
        f"set dataset.{key} to the column holding {what}, or add '{field}' to every row", f"dataset.{key}")


class FilesDataset(Dataset):
    """Items from local files with a field mapping and a prompt template (see :class:`FilesConfig`).

    Item keys: ``id``; ``messages`` (chat) or ``prompt`` (raw); ``answer``;
    ``stop`` when set; and every other column of the row, as it is.
    """

    config_class = FilesConfig

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        o = self.options = self.context.options if self.context.options is not None else FilesConfig()
        if not o.path:
            raise DatasetFileError("dataset.path is empty",
                                   "set dataset.path to a .jsonl / .parquet file or a save_to_disk folder")
        self._template_fields = [name for _, name, _, _ in string.Formatter().parse(o.template) if name]
        self._answer_re = re.compile(o.answer_pattern, re.MULTILINE) if o.answer_pattern else None
        split, self._passes = self.split, 0
        hub = hub_repo(o.path) if o.format in ("auto", "hub") else None
        if o.format == "hub" and hub is None:
            raise DatasetFileError(f"dataset.path {o.path!r} is not a hub dataset id with dataset.format hub",
                                   "write it as ORG/NAME[@REVISION], or set dataset.format to auto", "dataset.format")
        if o.hf_validation_split and hub is None:
            raise DatasetFileError(f"dataset.hf_validation_split is {o.hf_validation_split!r} but dataset.path "
                                   f"{o.path!r} is not a hub dataset", "use dataset.validation_path for a file, or "
                                   "leave hf_validation_split empty", "dataset.hf_validation_split")
        if hub is not None:
            source = HubSplit(hub[0], hub[1], o.hf_config, o.hf_split)
            main = self._load_rows(source, read_hub_rows(source, "hf_split"), "")
        else:
            main = self._load(_local(o.path), "")
        if o.validation_path:
            held = self._load(_local(o.validation_path), "validation/")
            train = self._drop_overlap(main, held) if split == "train" else main
        elif o.hf_validation_split:
            source = HubSplit(hub[0], hub[1], o.hf_config, o.hf_validation_split)
            held = self._load_rows(source, read_hub_rows(source, "hf_validation_split"), "validation/")
            train = self._drop_overlap(main, held) if split == "train" else main
        elif o.validation_fraction > 0:
            held = [item for item in main if self._held_out(item["id"])]
            train = [item for item in main if not self._held_out(item["id"])]
        else:
            held, train = [], main
        self._check_unique_ids(train + held)
        if split == "validation" and not held:
            raise DatasetFileError(
                f"{o.path}: the validation split is empty: dataset.validation_path is not set and "
                f"dataset.validation_fraction is {o.validation_fraction}",
                "set dataset.validation_path, dataset.hf_validation_split for a hub dataset (e.g. test), or "
                "dataset.validation_fraction (e.g. 0.1); or eval.size=0 for a run "
                "without evaluation", "dataset.validation_fraction")
        self.items = held if split == "validation" else train

    # -- reading ----------------------------------------------------------
    def _load(self, path: Path, id_prefix: str) -> list[dict]:
        fmt = detect_format(path, self.options.format)
        return self._load_rows(path, read_rows(path, fmt, self.options.hf_split), id_prefix)

    def _load_rows(self, path: Path | HubSplit, rows: list[tuple[int, dict]], id_prefix: str) -> list[dict]:
        return [self._item(path, row_no, row, id_prefix) for row_no, row in rows]

    def _item(self, path: Path | HubSplit, row_no: int, row: dict, id_prefix: str) -> dict[str, Any]:
        o = self.options

        def field(name: str, key: str, what: str) -> Any:
            if name not in row or row[name] is None:
                raise missing_field(path, row_no, row, name, key, what)
            return row[name]

        item: dict[str, Any] = {k: v for k, v in row.items() if k not in RESERVED}
        item["id"] = str(field(o.id_field, "id_field", "a unique id")) if o.id_field else f"{id_prefix}{path.name}:{row_no}"
        answer = str(field(o.answer_field, "answer_field", "the reference answer"))
        if self._answer_re is not None:
            match = self._answer_re.search(answer)
            if match is None:
                raise DatasetFileError(
                    f"{path} row {row_no}: dataset.answer_pattern {o.answer_pattern!r} does not match the "
                    f"'{o.answer_field}' value {answer[:80]!r}", "correct the pattern or the row",
                    "dataset.answer_pattern")
            answer = (match.group(1) if match.groups() else match.group(0)).strip()
        item["answer"] = answer
        if o.messages_field:
            item["messages"] = self._messages(path, row_no, field(o.messages_field, "messages_field",
                                                                   "the chat messages"))
        else:
            values = {**row, "question": field(o.question_field, "question_field", "the question")}
            for name in self._template_fields:
                if name.split(".")[0].split("[")[0] not in values:
                    raise missing_field(path, row_no, row, name, "template", f"{{{name}}}")
            text = o.template.format(**values)
            if o.chat:
                system = [{"role": "system", "content": o.system_prompt}] if o.system_prompt else []
                item["messages"] = [*system, {"role": "user", "content": text}]
            else:
                item["prompt"] = text
        if o.stop:
            item["stop"] = [str(s) for s in o.stop]
        return item

    def _messages(self, path: Path, row_no: int, value: Any) -> list[dict]:
        if not isinstance(value, list) or not value or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value):
            raise DatasetFileError(
                f"{path} row {row_no}: field '{self.options.messages_field}' (dataset.messages_field) is "
                f"{str(value)[:80]!r}, not a list of {{role, content}} messages",
                "point dataset.messages_field at a chat column, or leave it empty to build the prompt from "
                "dataset.template", "dataset.messages_field")
        return [{"role": m["role"], "content": m["content"]} for m in value]

    # -- the split --------------------------------------------------------
    def _held_out(self, item_id: str) -> bool:
        """Hashed on the id only, so changing trainer.seed never moves a row between splits."""
        return stable_seed("validation", item_id) / 2**31 < self.options.validation_fraction

    @staticmethod
    def _prompt_key(item: dict) -> str:
        return json.dumps(item.get("messages") or item.get("prompt"), sort_keys=True)

    def _drop_overlap(self, train: list[dict], held: list[dict]) -> list[dict]:
        prompts = {self._prompt_key(item) for item in held}
        kept = [item for item in train if self._prompt_key(item) not in prompts]
        if len(kept) < len(train):
            warnings.warn(f"{self.options.path}: {len(train) - len(kept)} rows have the same prompt as a row of "
                          f"{self.options.validation_path}; they are left out of the train split", stacklevel=2)
        return kept

    def _check_unique_ids(self, items: list[dict]) -> None:
        seen: set[str] = set()
        for item in items:
            if item["id"] in seen:
                raise DatasetFileError(
                    f"{self.options.path}: the id {item['id']!r} (dataset.id_field '{self.options.id_field}') is "
                    f"on two rows{' (across the train and validation files)' if self.options.validation_path else ''}",
                    "make the ids unique, or set dataset.id_field to '' to number rows", "dataset.id_field")
            seen.add(item["id"])

    # -- iteration --------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.split == "validation":
            return iter(self.items)
        pass_index, self._passes = self._passes, self._passes + 1
        order = pass_order(len(self.items), self.seed, pass_index, self.options.shuffle)
        return iter([self.items[k] for k in order])

    def __len__(self) -> int:
        return len(self.items)
