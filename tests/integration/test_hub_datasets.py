"""``dataset.hub_id`` through ``run create``, offline: save_to_disk folders, parquet folders, chats, answer
extraction, and errors that name the field to change."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, open_bucket
from asyncgrpo.run.config import ConfigError, DatasetConfig
from asyncgrpo.run.creation import create_run, load_run
from asyncgrpo.run.datasets import PromptFileError, build_dataset, dump_prompts_jsonl, parse_prompts_jsonl
from tests.support.paths import REPO_ROOT

datasets = pytest.importorskip("datasets")

TRAIN = {
    "question": ["Natalia sold 48 clips. How many?", "Weng earns $12 an hour. How much?", "Third?"],
    "answer": ["She sold 48/2 = 24.\n#### 72", "12/60 = 0.2\n#### 10", "#### 3"],
}
TEST = {"question": ["A test question?"], "answer": ["#### 5"]}
CHATS = [
    [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": "42"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+1?"},
    ],
]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    # No network in tests: the Hub is unreachable, and load_dataset's cache is the test's own.
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
        monkeypatch.setattr(datasets.config, name, True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    yield


@pytest.fixture
def gsm8k_like(tmp_path: Path) -> Path:
    """A DatasetDict (train + test) in gsm8k's shape, written by save_to_disk."""
    folder = tmp_path / "data" / "gsm8k-like"
    splits = {"train": datasets.Dataset.from_dict(TRAIN), "test": datasets.Dataset.from_dict(TEST)}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    return folder


def _create(tmp_path: Path, dataset_toml: str, run: str = "hub") -> tuple[Bucket, list[dict], str]:
    config = tmp_path / "run.toml"
    config.write_text(f"[dataset]\n{dataset_toml}\n[[rewards]]\nname = 'exact_match'\n")
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    summary = create_run(config, run, bucket)
    _, prompts, _ = load_run(bucket, run)
    return bucket, prompts, summary


def test_save_to_disk_split_and_columns_load_through_run_create(tmp_path: Path, gsm8k_like: Path) -> None:
    toml = (
        'hub_id = "data/gsm8k-like"\nsplit = "test"\nprompt_column = "question"\nanswer_column = "answer"\n'
        "answer_pattern = '####\\s*(.+)'\n"
    )
    bucket, prompts, summary = _create(tmp_path, toml)  # a relative folder resolves against the config's folder
    assert prompts == [{"prompt": "A test question?", "answer": "5"}]
    assert "1 prompts from data/gsm8k-like" in summary
    train = build_dataset(
        DatasetConfig(hub_id=str(gsm8k_like), prompt_column="question", answer_pattern=r"####\s*(.+)"), seed=0
    )
    assert [record["answer"] for record in train] == ["72", "10", "3"]
    assert [record["prompt"] for record in train] == TRAIN["question"]
    # the prompts are frozen into the bucket: the source can go away
    stored = bucket.get(bucket_keys.prompts_key("hub"))
    assert parse_prompts_jsonl(stored) == prompts


def test_single_saved_dataset_and_max_rows(tmp_path: Path) -> None:
    folder = tmp_path / "one"
    datasets.Dataset.from_dict(TRAIN).save_to_disk(str(folder))
    config = DatasetConfig(hub_id=str(folder), prompt_column="question", answer_column="", max_rows=2)
    assert build_dataset(config, seed=0) == [{"prompt": q, "answer": None} for q in TRAIN["question"][:2]]


def test_parquet_folder_names_its_splits_after_the_files(tmp_path: Path) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    datasets.Dataset.from_dict(TRAIN).to_parquet(str(folder / "train.parquet"))
    datasets.Dataset.from_dict(TEST).to_parquet(str(folder / "test.parquet"))
    toml = f'hub_id = "{folder}"\nprompt_column = "question"\n'
    _, prompts, _ = _create(tmp_path, toml)
    assert [record["prompt"] for record in prompts] == TRAIN["question"]
    assert prompts[0]["answer"] == TRAIN["answer"][0]  # no answer_pattern: the whole column
    with pytest.raises(PromptFileError, match=r"^dataset\.split: .*Unknown split \"validation\".*'train', 'test'"):
        build_dataset(DatasetConfig(hub_id=str(folder), split="validation", prompt_column="question"), seed=0)
    with pytest.raises(PromptFileError, match=r"^dataset\.subset: .*'nope'.*Available"):
        build_dataset(DatasetConfig(hub_id=str(folder), subset="nope", prompt_column="question"), seed=0)


def test_errors_name_the_field_and_the_choices(tmp_path: Path, gsm8k_like: Path) -> None:
    def error(**fields: object) -> str:
        with pytest.raises(PromptFileError) as raised:
            build_dataset(DatasetConfig(hub_id=str(gsm8k_like), **fields), seed=0)
        return str(raised.value)

    assert "dataset.split='validation' is not a split" in error(split="validation", prompt_column="question")
    assert "splits present: 'train', 'test'" in error(split="validation", prompt_column="question")
    missing = error()  # prompt_column defaults to 'prompt'
    assert "no column 'prompt'; columns present: 'question', 'answer'. Set dataset.prompt_column" in missing
    assert "dataset.subset does not apply" in error(subset="main", prompt_column="question")
    assert "does not match its answer" in error(prompt_column="question", answer_pattern=r"@@(\d+)")
    with pytest.raises(PromptFileError, match=r"dataset\.hub_id: cannot load 'nobody/nothing-here'"):
        build_dataset(DatasetConfig(hub_id="nobody/nothing-here"), seed=0)
    with pytest.raises(PromptFileError, match=r"dataset\.hub_id='\./gone': folder .* does not exist"):
        build_dataset(DatasetConfig(hub_id="./gone"), seed=0)


def test_datasets_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch, gsm8k_like: Path) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(PromptFileError, match=r"pip install 'asyncgrpo\[hub\]'"):
        build_dataset(DatasetConfig(hub_id=str(gsm8k_like)), seed=0)


def test_messages_column_loads_without_the_reference_reply(tmp_path: Path) -> None:
    folder = tmp_path / "chats"
    table = datasets.Dataset.from_dict({"messages": CHATS, "solution": ["42", "2"]})
    datasets.DatasetDict({"train": table}).save_to_disk(str(folder))
    toml = f'hub_id = "{folder}"\nmessages_column = "messages"\nanswer_column = "solution"\nsystem_prompt = "Hi"\n'
    _, prompts, _ = _create(tmp_path, toml)
    assert prompts == [
        {"prompt": "What is 6*7?", "answer": "42", "messages": [{"role": "user", "content": "What is 6*7?"}]},
        {"prompt": "What is 1+1?", "answer": "2", "messages": CHATS[1]},
    ]
    # records without messages keep their old bytes, so old runs' prompts.jsonl still parse the same
    assert dump_prompts_jsonl([{"prompt": "3=", "answer": "3"}]) == b'{"answer": "3", "prompt": "3="}\n'


def test_messages_column_in_a_prompt_file(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    config = DatasetConfig(path=str(path), messages_column="messages", answer_column="")
    assert [record["messages"][-1]["content"] for record in build_dataset(config, seed=0)] == [
        "What is 6*7?",
        "What is 1+1?",
    ]
    path.write_text(json.dumps({"messages": "not a chat"}) + "\n")
    with pytest.raises(PromptFileError, match=r"line 1 column 'messages' \(dataset\.messages_column\) must hold"):
        build_dataset(config, seed=0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hub_id": "a/b", "path": "p.jsonl"}, "dataset.path and dataset.hub_id are all set"),
        ({"system_prompt": "Be brief."}, "dataset.system_prompt is only used with a chat template"),
        ({"subset": "main"}, "dataset.subset applies to dataset.hub_id only"),
        ({"hub_id": "a/b", "answer_pattern": "(unclosed"}, "answer_pattern"),
        ({"hub_id": "a/b", "answer_pattern": "(a)(b)"}, "use at most one"),
    ],
)
def test_config_refuses_conflicting_dataset_fields(tmp_path: Path, fields: dict, message: str) -> None:
    lines = "".join(f"{key} = {json.dumps(value)}\n" for key, value in fields.items())
    (tmp_path / "run.toml").write_text(f"[dataset]\n{lines}")
    with pytest.raises(ConfigError, match=r"dataset") as raised:
        create_run(tmp_path / "run.toml", "bad", open_bucket(f"file://{tmp_path / 'bucket'}"))
    assert message in str(raised.value)


def test_a_generator_beside_a_file_or_hub_source_is_ignored_as_in_runs_stored_before_hub_id() -> None:
    # A run created before hub_id existed stored the default generator next to its `path` in config.json;
    # its workers and proxy must still read it, with the file as the source.
    stored = DatasetConfig.model_validate({"path": "prompts.jsonl", "generator": "repeat_digit"})
    assert (stored.path, stored.generator) == ("prompts.jsonl", None)
    assert DatasetConfig.model_validate({"hub_id": "a/b", "generator": "repeat_digit"}).generator is None


def test_the_gpu_recipe_reads_its_hub_dataset_and_held_out_split(tmp_path: Path) -> None:
    # examples/gpu-qwen2.5-math-1.5b.toml as shipped, with its Hub id pointed at a local copy in MATH-lighteval's
    # shape: the training prompts come from `train`, the eval's from the first 500 rows of `test`.
    from asyncgrpo.run.creation import load_eval_prompts

    def rows(split: str, count: int) -> dict[str, list[str]]:
        problems = [f"{split} problem {i}: what is {i}+{i}?" for i in range(count)]
        solutions = [f"Add them: $\\boxed{{{2 * i}}}$." for i in range(count)]
        return {"problem": problems, "solution": solutions, "level": ["Level 1"] * count, "type": ["Algebra"] * count}

    folder = tmp_path / "math-lighteval"
    splits = {split: datasets.Dataset.from_dict(rows(split, count)) for split, count in (("train", 7), ("test", 510))}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    recipe = (REPO_ROOT / "examples" / "gpu-qwen2.5-math-1.5b.toml").read_text()
    assert recipe.count('hub_id = "DigitalLearningGmbH/MATH-lighteval"') == 2
    config = tmp_path / "recipe.toml"
    config.write_text(recipe.replace("DigitalLearningGmbH/MATH-lighteval", str(folder)))
    bucket = open_bucket(f"file://{tmp_path / 'bucket'}")
    create_run(config, "qwen-math", bucket)
    run_config, prompts, manifest = load_run(bucket, "qwen-math")
    assert [record["prompt"] for record in prompts] == rows("train", 7)["problem"]
    assert prompts[3]["answer"] == "Add them: $\\boxed{6}$."
    assert run_config.dataset.chat_templated and run_config.eval.every_versions > 0
    held_out = load_eval_prompts(bucket, "qwen-math", manifest)
    assert [record["prompt"] for record in held_out] == rows("test", 510)["problem"][:500]
