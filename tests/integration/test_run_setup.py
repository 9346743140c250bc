"""``run create`` and ``load_run``: idempotent, never overwrites, verifies what it reads back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from asyncgrpo.bucket import layout as bucket_keys
from asyncgrpo.bucket.backends import Bucket, FileBucket
from asyncgrpo.bucket.layout import IntegrityError, sha256_hex
from asyncgrpo.run.config import ConfigError, RunConfig
from asyncgrpo.run.creation import RunExistsError, RunNotFound, create_run, load_run
from asyncgrpo.run.datasets import PromptFileError

CONFIG = """\
seed = 3
[dataset]
num_prompts = 40
[async]
groups_per_step = 4
"""


def _config(tmp_path: Path, text: str = CONFIG, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _snapshot(bucket: Bucket) -> dict[str, bytes]:
    return {key: bucket.get(key) for key in bucket.list("runs/")}


def test_create_then_load(bucket: Bucket, tmp_path: Path) -> None:
    summary = create_run(_config(tmp_path), "exp-1", bucket)
    assert "exp-1" in summary and "40 prompts" in summary and "asyncgrpo proxy --run exp-1" in summary
    assert bucket.list("runs/exp-1/") == sorted(
        [
            bucket_keys.config_key("exp-1"),
            bucket_keys.prompts_key("exp-1"),
            bucket_keys.run_manifest_key("exp-1"),
        ]
    )
    config, prompts, manifest = load_run(bucket, "exp-1")
    assert config.seed == 3 and config.async_.groups_per_step == 4 and config.dataset.num_prompts == 40
    assert len(prompts) == manifest.num_prompts == 40
    assert manifest.config.sha256 == sha256_hex(bucket.get(bucket_keys.config_key("exp-1")))
    assert manifest.prompts.sha256 == sha256_hex(bucket.get(bucket_keys.prompts_key("exp-1")))
    assert RunConfig.from_json(bucket.get(bucket_keys.config_key("exp-1"))) == config


def test_recreate_identical_is_a_noop(bucket: Bucket, tmp_path: Path) -> None:
    create_run(_config(tmp_path), "exp", bucket)
    before = _snapshot(bucket)
    # Same settings, written differently (comments, order): same validated config, so same run.
    summary = create_run(_config(tmp_path, "# again\n" + CONFIG, "copy.toml"), "exp", bucket)
    assert "nothing changed" in summary
    assert _snapshot(bucket) == before


def test_different_config_is_refused_and_nothing_is_lost(bucket: Bucket, tmp_path: Path) -> None:
    create_run(_config(tmp_path), "exp", bucket)
    # The run is under way: a version and a rollout exist.
    bucket.put(bucket_keys.manifest_key("exp", 0), b"{}")
    bucket.put(bucket_keys.rollout_key("exp", "t1"), b"samples")
    before = _snapshot(bucket)
    changed = _config(tmp_path, CONFIG.replace("groups_per_step = 4", "groups_per_step = 2"), "b.toml")
    with pytest.raises(RunExistsError, match=r"different config.*another --run name"):
        create_run(changed, "exp", bucket)
    assert _snapshot(bucket) == before


def test_changed_prompt_file_is_refused(tmp_path: Path) -> None:
    bucket = FileBucket(tmp_path / "bucket")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "1"}\n')
    config = _config(tmp_path, '[dataset]\npath = "p.jsonl"\n')
    create_run(config, "exp", bucket)
    before = _snapshot(bucket)
    prompts.write_text('{"prompt": "b", "answer": "1"}\n')
    with pytest.raises(RunExistsError, match="different prompts"):
        create_run(config, "exp", bucket)
    assert _snapshot(bucket) == before


def test_bad_prompt_file_is_refused_before_anything_is_written(bucket: Bucket, tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text('{"question": "a"}\n{"question": ""}\n')
    config = _config(tmp_path, '[dataset]\npath = "p.jsonl"\nprompt_column = "question"\nanswer_column = ""\n')
    with pytest.raises(PromptFileError, match=r"line 2 has an empty or non-text prompt"):
        create_run(config, "exp", bucket)
    wrong_column = _config(tmp_path, '[dataset]\npath = "p.jsonl"\n', "wrong.toml")
    with pytest.raises(PromptFileError, match=r"no column 'prompt'; columns present: 'question'"):
        create_run(wrong_column, "exp", bucket)
    assert bucket.list("runs/") == []


def test_bad_config_and_run_name(tmp_path: Path) -> None:
    bucket = FileBucket(tmp_path / "bucket")
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        create_run(_config(tmp_path, "[lora]\nrank = 0\n"), "exp", bucket)
    with pytest.raises(ValueError, match="run name"):
        create_run(_config(tmp_path), "../escape", bucket)
    with pytest.raises(ConfigError, match=r"model\.base='\./no/such/model'"):
        create_run(_config(tmp_path, '[model]\nbase = "./no/such/model"\n'), "exp", bucket)
    assert bucket.list("") == []
    # A hub id and an existing local folder are accepted as they are (nothing is downloaded).
    create_run(_config(tmp_path, '[model]\nbase = "Qwen/Qwen2.5-0.5B"\n'), "hub", bucket)
    (tmp_path / "local-model").mkdir()
    create_run(_config(tmp_path, f'[model]\nbase = "{tmp_path / "local-model"}"\n'), "local", bucket)


def test_half_created_run_with_other_content_is_not_overwritten(tmp_path: Path) -> None:
    bucket = FileBucket(tmp_path / "bucket")
    bucket.put(bucket_keys.config_key("exp"), b'{"someone": "else"}')
    with pytest.raises(RunExistsError, match="partly created"):
        create_run(_config(tmp_path), "exp", bucket)
    assert bucket.list("runs/") == [bucket_keys.config_key("exp")]
    assert bucket.get(bucket_keys.config_key("exp")) == b'{"someone": "else"}'


def test_interrupted_create_is_completed(tmp_path: Path) -> None:
    bucket = FileBucket(tmp_path / "bucket")
    create_run(_config(tmp_path), "exp", bucket)
    bucket.delete(bucket_keys.run_manifest_key("exp"))  # as if killed before the manifest landed
    create_run(_config(tmp_path), "exp", bucket)
    assert load_run(bucket, "exp")[0].seed == 3


def test_load_run_refuses_tampered_objects(bucket: Bucket, tmp_path: Path) -> None:
    create_run(_config(tmp_path), "exp", bucket)
    config_key = bucket_keys.config_key("exp")
    original = json.loads(bucket.get(config_key))
    original["async"]["max_staleness"] = 9
    bucket.put(config_key, json.dumps(original).encode())
    with pytest.raises(IntegrityError, match=re.escape(config_key)):
        load_run(bucket, "exp")

    create_run(_config(tmp_path), "exp2", bucket)
    prompts_key = bucket_keys.prompts_key("exp2")
    bucket.put(prompts_key, bucket.get(prompts_key) + b'{"answer": "1", "prompt": "1="}\n')
    with pytest.raises(IntegrityError, match=re.escape(prompts_key)):
        load_run(bucket, "exp2")


def test_load_missing_run_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(RunNotFound, match="asyncgrpo run create"):
        load_run(FileBucket(tmp_path), "nope")


def test_cli_run_create(tmp_path: Path) -> None:
    from cli.main import main

    url = f"file://{tmp_path / 'bucket'}"
    runner = CliRunner()
    created = runner.invoke(main, ["run", "create", str(_config(tmp_path)), "--run", "cli", "--bucket", url])
    assert created.exit_code == 0, created.output
    assert "Created run 'cli'" in created.output
    bad = runner.invoke(
        main,
        ["run", "create", str(_config(tmp_path, "[async]\nqueue_maxsize = 2\n", "bad.toml")), "--run", "x"],
        env={"ASYNCGRPO_BUCKET": url},
    )
    assert bad.exit_code == 1 and "async.queue_maxsize=2" in bad.output


def test_prompts_with_unicode_line_breaks_load_back(tmp_path: Path) -> None:
    """A prompt holding U+2028, U+2029 or U+0085 is created and read back whole (the run is usable)."""
    from cli.main import main

    prompts = [f"one{brk}two" for brk in ("\u2028", "\u2029", "\x85", "\x0b", "\x1c", "\r")]
    rows = [{"prompt": prompt, "answer": f"{i}\u2029"} for i, prompt in enumerate(prompts)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    config = _config(tmp_path, '[dataset]\npath = "p.jsonl"\n')
    url = f"file://{tmp_path / 'bucket'}"
    created = CliRunner().invoke(main, ["run", "create", str(config), "--run", "lines", "--bucket", url])
    assert created.exit_code == 0, created.output
    _, loaded, manifest = load_run(FileBucket(tmp_path / "bucket"), "lines")
    assert loaded == rows and manifest.num_prompts == len(rows)


FIXED_REWARD = '[[rewards]]\nname = "repeat_digit"\n'


@pytest.mark.parametrize(
    ("rewards", "dataset", "expected"),
    [
        ('[[rewards]]\nname = "reapeat_digit"\n', "", r"rewards\.0\.name: .*'reapeat_digit' is unknown"),
        ('[[rewards]]\nname = "rewards.py"\n', "", r"rewards\.0\.name: .*'rewards\.py' is unknown"),
        (
            FIXED_REWARD + '[[rewards]]\nname = "tests.no_such_module_xyz:score"\n',
            "",
            r"rewards\.1\.name='tests\.no_such_module_xyz:score': cannot import module 'tests\.no_such_module_xyz' "
            r"\(ModuleNotFoundError.*PYTHONPATH",
        ),
        (
            '[[rewards]]\nname = "tests.unit.worker.test_rewards:no_such_function"\n',
            "",
            r"module 'tests\.unit\.worker\.test_rewards' has no function 'no_such_function'",
        ),
        (FIXED_REWARD + FIXED_REWARD, "", r"rewards: .*\['repeat_digit'\] are listed more than once"),
        (
            '[[rewards]]\nname = "math_verify"\n',
            '[dataset]\npath = "p.jsonl"\nanswer_column = ""\n',
            r"rewards\.0\.name='math_verify' scores against a reference answer.*dataset\.answer_column",
        ),
    ],
    ids=["misspelt", "not_a_module_path", "unimportable", "no_such_function", "listed_twice", "needs_answers"],
)
def test_cli_run_create_refuses_unusable_rewards(tmp_path: Path, rewards: str, dataset: str, expected: str) -> None:
    """A reward the workers could not use is refused by `run create`, which stores nothing: the name stays free."""
    from cli.main import main

    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    url = f"file://{tmp_path / 'bucket'}"
    bad = _config(tmp_path, dataset + rewards, "bad.toml")
    refused = CliRunner().invoke(main, ["run", "create", str(bad), "--run", "exp", "--bucket", url])
    assert refused.exit_code == 1, refused.output
    assert re.search(expected, refused.output, re.DOTALL), refused.output
    if "unknown" in expected or "function" in expected:
        assert "a built-in (exact_match, format, math_verify, repeat_digit)" in refused.output
    assert FileBucket(tmp_path / "bucket").list("") == []

    length_reward = "tests.unit.worker.test_rewards:length_reward"
    good = _config(tmp_path, dataset + FIXED_REWARD + f'[[rewards]]\nname = "{length_reward}"\n')
    created = CliRunner().invoke(main, ["run", "create", str(good), "--run", "exp", "--bucket", url])
    assert created.exit_code == 0, created.output
    config, _, _ = load_run(FileBucket(tmp_path / "bucket"), "exp")
    assert [reward.name for reward in config.rewards] == ["repeat_digit", length_reward]


def test_cli_run_create_refuses_a_reward_model_that_does_not_load(tmp_path: Path, tiny_reward_model_dir: Path) -> None:
    """A reward model whose config or tokenizer does not load is refused by `run create` with its name, before
    anything is stored; a relative folder is read from the config file's folder and stored as an absolute path."""
    from cli.main import main

    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "broken-rm").mkdir()
    (tmp_path / "broken-rm" / "config.json").write_text("{not json")
    bad = _config(tmp_path, CONFIG + FIXED_REWARD + '[[rewards]]\nmodel = "broken-rm"\nname = "judge"\n', "bad.toml")
    refused = CliRunner().invoke(main, ["run", "create", str(bad), "--run", "exp", "--bucket", url])
    assert refused.exit_code == 1, refused.output
    assert f"reward 'judge' (model '{tmp_path / 'broken-rm'}')" in refused.output, refused.output
    assert "cannot load its config" in refused.output
    assert FileBucket(tmp_path / "bucket").list("") == []
    missing = _config(tmp_path, CONFIG + '[[rewards]]\nmodel = "./no-such-rm"\n', "missing.toml")
    refused = CliRunner().invoke(main, ["run", "create", str(missing), "--run", "exp", "--bucket", url])
    assert refused.exit_code == 1 and "reward 'no-such-rm'" in refused.output, refused.output
    with pytest.raises(ConfigError, match=r"rewards\.0\.model=.*is not an existing folder"):
        create_run(missing, "exp", FileBucket(tmp_path / "bucket"))  # without the command line's load check too
    assert FileBucket(tmp_path / "bucket").list("") == []

    (tmp_path / "rm").symlink_to(tiny_reward_model_dir)
    good = _config(tmp_path, CONFIG + FIXED_REWARD + '[[rewards]]\nmodel = "rm"\nweight = 0.1\n', "good.toml")
    created = CliRunner().invoke(main, ["run", "create", str(good), "--run", "exp", "--bucket", url])
    assert created.exit_code == 0, created.output
    config, _, _ = load_run(FileBucket(tmp_path / "bucket"), "exp")
    assert [(reward.name, reward.model) for reward in config.rewards] == [
        ("repeat_digit", None),
        ("rm", str(tmp_path / "rm")),
    ]
