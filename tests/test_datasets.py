"""Prompt files: every supported format, and errors that name the file, row or column to fix."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest

from proxy.run.config import DatasetConfig
from proxy.run.datasets import (
    PromptFileError,
    build_dataset,
    dump_prompts_jsonl,
    generate_prompts,
    load_prompt_file,
    parse_prompts_jsonl,
)

ROWS = [
    {"question": "What is 2+2?", "solution": 4, "source": "a"},
    {"question": "Name a colour", "solution": "red", "source": "b"},
    {"question": "ünïcode ✓", "solution": None, "source": "c"},
]
EXPECTED = [
    {"prompt": "What is 2+2?", "answer": "4"},
    {"prompt": "Name a colour", "answer": "red"},
    {"prompt": "ünïcode ✓", "answer": None},
]


def _write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n", encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif path.suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_formats_load(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path / f"p{suffix}", ROWS)
    assert load_prompt_file(path, "question", "solution") == EXPECTED


def test_csv_loads(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.csv", ROWS)
    records = load_prompt_file(path, "question", "solution")
    # CSV has no null: an empty cell is the empty string.
    assert [r["prompt"] for r in records] == [r["prompt"] for r in EXPECTED]
    assert [r["answer"] for r in records] == ["4", "red", ""]


def test_no_answer_column(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", ROWS)
    assert [r["answer"] for r in load_prompt_file(path, "question", "")] == [None, None, None]
    assert [r["answer"] for r in load_prompt_file(path, "question", None)] == [None, None, None]


def test_parquet(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        path.write_bytes(b"PAR1")
        with pytest.raises(PromptFileError, match="pip install pyarrow"):
            load_prompt_file(path, "question", "solution")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_prompt_file(path, "question", "solution") == EXPECTED


def test_missing_column_names_it_and_the_columns_present(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(PromptFileError) as caught:
        load_prompt_file(path, "prompt", "solution")
    message = str(caught.value)
    assert "'prompt'" in message and "'question', 'solution', 'source'" in message
    assert "dataset.prompt_column" in message and str(path) in message
    with pytest.raises(PromptFileError, match=r"dataset\.answer_column"):
        load_prompt_file(path, "question", "answer")


@pytest.mark.parametrize("bad", ["", "   ", None, 17])
def test_empty_prompt_names_the_row(tmp_path: Path, bad: object) -> None:
    rows = [*ROWS[:2], {"question": bad, "solution": "x", "source": "d"}]
    path = _write(tmp_path / "p.json", rows)
    with pytest.raises(PromptFileError, match=r"row 2 has an empty or non-text prompt"):
        load_prompt_file(path, "question", "solution")


def test_bad_json_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(PromptFileError, match="line 2 is not valid JSON"):
        load_prompt_file(path, "prompt", None)


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("p.txt", "hello", "use one of .jsonl, .json, .csv, .parquet"),
        ("p.json", '{"prompt": "a"}', "JSON list of objects"),
        ("p.jsonl", "\n\n", "has no rows"),
        ("p.jsonl", '["a", "b"]\n', "not an object with named columns"),
    ],
)
def test_unusable_files(tmp_path: Path, name: str, content: str, pattern: str) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(PromptFileError, match=re.escape(pattern)):
        load_prompt_file(path, "prompt", None)


def test_missing_file_says_which_setting(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match=r"does not exist; check dataset\.path"):
        load_prompt_file(tmp_path / "nope.jsonl", "prompt", None)


def test_build_dataset_from_file_relative_to_base_dir(tmp_path: Path) -> None:
    _write(tmp_path / "p.jsonl", ROWS)
    config = DatasetConfig(path="p.jsonl", prompt_column="question", answer_column="solution")
    assert build_dataset(config, seed=0, base_dir=tmp_path) == EXPECTED


def test_build_dataset_from_generator_is_seeded() -> None:
    config = DatasetConfig(generator="repeat_digit", num_prompts=50)
    first = build_dataset(config, seed=3)
    assert len(first) == 50 and first == build_dataset(config, seed=3)
    assert first != build_dataset(config, seed=4)
    assert all(r["prompt"] == f"{r['answer']}=" for r in first)
    with pytest.raises(ValueError, match=re.escape("dataset.generator='nope' is unknown")):
        generate_prompts("nope", 3, 0)


def test_prompts_jsonl_roundtrip() -> None:
    data = dump_prompts_jsonl(EXPECTED)
    assert parse_prompts_jsonl(data) == EXPECTED
    assert dump_prompts_jsonl(parse_prompts_jsonl(data)) == data  # canonical bytes: same sha256 again
    with pytest.raises(PromptFileError, match="line 2"):
        parse_prompts_jsonl(b'{"prompt": "a"}\n{"answer": "x"}\n')
