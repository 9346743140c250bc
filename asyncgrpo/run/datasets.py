"""Prompt datasets: built-in generators (pure Python, seeded) and loading a user's prompt file.

A prompt record is a dict with ``prompt`` (str) and ``answer`` (str or None), and ``messages`` for chats
(see ``asyncgrpo.run.prompt_records``); the record index in the run's ``prompts.jsonl`` is the prompt's identity
for the whole run. Prompt files may be ``.jsonl``, ``.json`` (a list of objects), ``.csv`` or ``.parquet``
(needs pyarrow); Hub datasets and local dataset folders are read by ``asyncgrpo.run.hub_datasets``.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asyncgrpo.run.config import DatasetConfig
from asyncgrpo.run.hub_datasets import load_hub_dataset
from asyncgrpo.run.prompt_records import PromptFileError, PromptRecord, RecordSpec

__all__ = ["PromptFileError", "PromptRecord", "build_dataset", "load_prompt_file", "parse_prompts_jsonl"]


def repeat_digit_prompts(num_prompts: int, seed: int) -> list[PromptRecord]:
    """The toy task: the prompt is one digit and '=' (``"7="``); the answer is that digit.

    The reward ``repeat_digit`` scores the share of completion characters equal to the digit, so a random
    policy over a ~13-token vocabulary scores about 1/13, and a policy that learnt the task scores 1.
    """
    rng = random.Random(seed)
    records: list[PromptRecord] = []
    for _ in range(num_prompts):
        digit = str(rng.randrange(10))
        records.append({"prompt": f"{digit}=", "answer": digit})
    return records


def hidden_digit_prompts(num_prompts: int, seed: int) -> list[PromptRecord]:
    """The toy agent task (``worker.generate.toy_agent``): every prompt is ``"?="``; the answer is a digit the
    environment hides behind a tool, so only a model that calls it can repeat it."""
    rng = random.Random(seed)
    return [{"prompt": "?=", "answer": str(rng.randrange(10))} for _ in range(num_prompts)]


PROMPT_GENERATORS: dict[str, Callable[[int, int], list[PromptRecord]]] = {
    "repeat_digit": repeat_digit_prompts,
    "hidden_digit": hidden_digit_prompts,
}


def generate_prompts(name: str, num_prompts: int, seed: int) -> list[PromptRecord]:
    try:
        generator = PROMPT_GENERATORS[name]
    except KeyError:
        known = ", ".join(sorted(PROMPT_GENERATORS))
        raise ValueError(f"dataset.generator={name!r} is unknown; use one of: {known}") from None
    return generator(num_prompts, seed)


PROMPT_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    # JSON Lines separates records by "\n" only (a "\r" before it is JSON whitespace, so CRLF files load);
    # text-mode line iteration would also split at a lone "\r", which JSON allows between tokens.
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as Windows editors write
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PromptFileError(
                f"{path} line {number} is not UTF-8 text ({error.reason}); save it as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            yield f"line {number}", json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptFileError(f"{path} line {number} is not valid JSON: {error.msg}") from None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as error:
        raise PromptFileError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, list):
        raise PromptFileError(
            f"{path} must hold a JSON list of objects (one per prompt), not a {type(data).__name__}; "
            "or use .jsonl with one object per line"
        )
    for index, row in enumerate(data):
        yield f"row {index}", row


def _csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8-sig", newline="") as handle:
        # Data rows start on line 2 (line 1 is the header); multi-line cells make this approximate.
        for index, row in enumerate(csv.DictReader(handle)):
            yield f"row {index} (line {index + 2})", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise PromptFileError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow (or convert the file to .jsonl)"
        ) from None
    for index, row in enumerate(parquet.read_table(path).to_pylist()):
        yield f"row {index}", row


_READERS: dict[str, Callable[[Path], Iterator[tuple[str, Any]]]] = {
    ".jsonl": _jsonl_rows,
    ".json": _json_rows,
    ".csv": _csv_rows,
    ".parquet": _parquet_rows,
}


def load_prompt_file(
    path: str | Path,
    prompt_column: str,
    answer_column: str | None,
    *,
    messages_column: str | None = None,
    answer_pattern: str | None = None,
    environment_column: str | None = None,
) -> list[PromptRecord]:
    """Read a prompt file into records ``{"prompt": str, "answer": str | None}`` (plus ``messages`` with
    ``messages_column``).

    ``answer_column`` None or "" means the file has no answers. Raises PromptFileError naming the missing
    column (and the columns present), an empty prompt's row, or an unsupported suffix.
    """
    path = Path(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise PromptFileError(
            f"prompt file {path} has suffix {path.suffix!r}; use one of {', '.join(PROMPT_FILE_SUFFIXES)}"
        )
    if not path.is_file():
        raise PromptFileError(f"prompt file {path} does not exist; check dataset.path")
    spec = RecordSpec(prompt_column, answer_column or None, messages_column, answer_pattern, environment_column)
    try:
        records = [_object_row(path, where, row, spec) for where, row in reader(path)]
    except UnicodeDecodeError as error:
        raise PromptFileError(
            f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8"
        ) from None
    if not records:
        raise PromptFileError(f"prompt file {path} has no rows")
    return records


def _object_row(path: Path, where: str, row: Any, spec: RecordSpec) -> PromptRecord:
    if not isinstance(row, dict):
        raise PromptFileError(f"{path} {where} is a {type(row).__name__}, not an object with named columns")
    return spec.record(str(path), where, row)


def build_dataset(config: DatasetConfig, seed: int, base_dir: Path | None = None) -> list[PromptRecord]:
    """The run's prompts: from ``config.path`` or ``config.hub_id`` (relative paths resolve against
    ``base_dir``, e.g. the config file's folder), or else from the built-in ``config.generator``."""
    if config.hub_id:
        return load_hub_dataset(config, base_dir)
    if config.path:
        path = Path(config.path).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        records = load_prompt_file(
            path,
            config.prompt_column,
            config.answer_column,
            messages_column=config.messages_column,
            answer_pattern=config.answer_pattern,
            environment_column=config.environment_column,
        )
        return records[: config.max_rows]
    assert config.generator is not None  # DatasetConfig guarantees one source
    return generate_prompts(config.generator, config.num_prompts, seed)


def dump_prompts_jsonl(records: list[PromptRecord]) -> bytes:
    """The canonical bytes of a run's ``prompts.jsonl``: one JSON object per line, keys sorted."""
    return "".join(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n" for record in records).encode()


def parse_prompts_jsonl(data: bytes, source: str = "prompts.jsonl") -> list[PromptRecord]:
    """Records from the bytes ``dump_prompts_jsonl`` wrote (already checked at ``run create``).

    Split at "\n" only, the one separator the writer emits: ``json.dumps`` escapes every other control
    character but leaves U+0085, U+2028 and U+2029 raw inside strings, where ``str.splitlines`` would cut."""
    records: list[PromptRecord] = []
    for number, line in enumerate(data.decode("utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptFileError(f"{source} line {number} is not valid JSON: {error.msg}") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise PromptFileError(f"{source} line {number} is not a prompt record with a text 'prompt'")
        records.append(record)
    return records
