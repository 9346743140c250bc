"""Prompt files: every supported format, and errors that name the file, row or column to fix."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.run.config import DatasetConfig
from asyncgrpo.run.datasets import (
    PromptFileError,
    build_dataset,
    dump_prompts_jsonl,
    generate_prompts,
    hidden_digit_prompts,
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

    # A parquet column has one type: the answers as text, then a numeric answer column read back as text.
    rows = [{**row, "solution": None if row["solution"] is None else str(row["solution"])} for row in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_prompt_file(path, "question", "solution") == EXPECTED
    pq.write_table(pa.Table.from_pylist([{"question": "What is 2+2?", "solution": 4}]), path)
    assert load_prompt_file(path, "question", "solution") == [EXPECTED[0]]


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


def test_hidden_digit_prompts_hide_a_digit_and_are_seeded() -> None:
    first = hidden_digit_prompts(200, seed=5)
    assert len(first) == 200 and first == hidden_digit_prompts(200, seed=5)
    assert first != hidden_digit_prompts(200, seed=6)
    assert all(record == {"prompt": "?=", "answer": record["answer"]} for record in first)
    assert all(len(r["answer"]) == 1 and r["answer"].isdigit() for r in first)
    assert len({r["answer"] for r in first}) == 10  # every digit appears in 200 draws
    config = DatasetConfig(generator="hidden_digit", num_prompts=7)
    assert build_dataset(config, seed=5) == hidden_digit_prompts(7, seed=5) == generate_prompts("hidden_digit", 7, 5)


ENVIRONMENT_ROWS = [
    {"question": "Find the digit", "solution": "3", "env": "digit"},
    {"question": "Count to two", "solution": "2", "env": "counter"},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_environment_column_names_each_prompts_environment(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path / f"p{suffix}", ENVIRONMENT_ROWS)
    records = load_prompt_file(path, "question", "solution", environment_column="env")
    assert records == [
        {"prompt": "Find the digit", "answer": "3", "environment": "digit"},
        {"prompt": "Count to two", "answer": "2", "environment": "counter"},
    ]
    # Without the setting, the column is ignored as any other.
    assert all("environment" not in record for record in load_prompt_file(path, "question", "solution"))
    config = DatasetConfig(path=path.name, prompt_column="question", answer_column="solution", environment_column="env")
    built = build_dataset(config, seed=0, base_dir=tmp_path)
    assert built == records and parse_prompts_jsonl(dump_prompts_jsonl(built)) == records


@pytest.mark.parametrize("bad", [None, "", 3, ["digit"]])
def test_a_row_without_an_environment_name_is_refused_naming_the_column(tmp_path: Path, bad: object) -> None:
    path = _write(tmp_path / "p.jsonl", [ENVIRONMENT_ROWS[0], {**ENVIRONMENT_ROWS[1], "env": bad}])
    with pytest.raises(PromptFileError) as caught:
        load_prompt_file(path, "question", "solution", environment_column="env")
    message = str(caught.value)
    assert "line 2" in message and "no environment name in column 'env'" in message, message
    assert "agent.environment" in message


def test_a_missing_environment_column_names_the_setting(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(PromptFileError, match=r"'env'.*dataset\.environment_column|dataset\.environment_column.*'env'"):
        load_prompt_file(path, "question", "solution", environment_column="env")


def test_prompts_jsonl_roundtrip() -> None:
    data = dump_prompts_jsonl(EXPECTED)
    assert parse_prompts_jsonl(data) == EXPECTED
    assert dump_prompts_jsonl(parse_prompts_jsonl(data)) == data  # canonical bytes: same sha256 again
    with pytest.raises(PromptFileError, match="line 2"):
        parse_prompts_jsonl(b'{"prompt": "a"}\n{"answer": "x"}\n')


# Every character str.splitlines() splits at, besides "\n" itself.
LINE_BREAKS = ["\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def test_prompts_jsonl_keeps_every_line_break_inside_prompts() -> None:
    records: list[dict[str, str | None]] = [
        {"prompt": f"before{brk}after", "answer": f"a{brk}b"} for brk in LINE_BREAKS
    ]
    records.append({"prompt": "".join(LINE_BREAKS) + "x\n", "answer": None})
    data = dump_prompts_jsonl(records)
    assert data.count(b"\n") == len(records)  # the writer's only separator is the one between records
    assert parse_prompts_jsonl(data) == records
    assert dump_prompts_jsonl(parse_prompts_jsonl(data)) == data


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1)  # any text UTF-8 can hold


@settings(max_examples=300, deadline=None)
@given(st.lists(st.fixed_dictionaries({"prompt": _TEXT, "answer": st.none() | _TEXT}), min_size=1))
def test_prompts_jsonl_roundtrips_any_text(records: list[dict[str, str | None]]) -> None:
    assert parse_prompts_jsonl(dump_prompts_jsonl(records)) == records


def test_jsonl_file_splits_records_at_newline_only(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [json.dumps({"prompt": f"x{brk}y", "answer": "1"}, ensure_ascii=False) for brk in LINE_BREAKS]
    # CRLF line ends; a BOM as Windows editors write it; a lone "\r" between JSON tokens is whitespace.
    text = "\ufeff" + "\r\n".join(rows) + '\r\n{"prompt": "z",\r"answer": "2"}\r\n'
    path.write_bytes(text.encode("utf-8"))
    expected = [{"prompt": f"x{brk}y", "answer": "1"} for brk in LINE_BREAKS] + [{"prompt": "z", "answer": "2"}]
    records = load_prompt_file(path, "prompt", "answer")
    assert records == expected
    assert parse_prompts_jsonl(dump_prompts_jsonl(records)) == expected


def test_csv_cells_keep_line_breaks(tmp_path: Path) -> None:
    rows = [{"question": f"x{brk}y", "solution": f"{i}\u2028"} for i, brk in enumerate(LINE_BREAKS)]
    path = _write(tmp_path / "p.csv", rows)
    records = load_prompt_file(path, "question", "solution")
    assert records == [{"prompt": row["question"], "answer": row["solution"]} for row in rows]
    assert parse_prompts_jsonl(dump_prompts_jsonl(records)) == records


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_unpaired_surrogate_names_the_row(tmp_path: Path, suffix: str) -> None:
    # JSON can spell a lone surrogate ("\ud800"), which no UTF-8 file (nor tokenizer) can hold.
    path = _write(tmp_path / f"p{suffix}", [ROWS[0], {"question": "ok", "solution": "\ud800"}])
    with pytest.raises(PromptFileError, match=r"(line|row) \d+ column 'solution' holds an unpaired UTF-16 surrogate"):
        load_prompt_file(path, "question", "solution")


@pytest.mark.parametrize(("suffix", "where"), [(".jsonl", "line 2 is not UTF-8"), (".csv", "is not UTF-8")])
def test_not_utf8_names_the_file(tmp_path: Path, suffix: str, where: str) -> None:
    path = tmp_path / f"p{suffix}"
    head = b'{"prompt": "a"}\n' if suffix == ".jsonl" else b"prompt\na\n"
    path.write_bytes(head + (b'{"prompt": "caf\xe9"}\n' if suffix == ".jsonl" else b"caf\xe9\n"))
    with pytest.raises(PromptFileError, match=re.escape(f"{path} {where}") + ".*save it as UTF-8"):
        load_prompt_file(path, "prompt", None)
