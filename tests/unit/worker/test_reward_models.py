"""Reward models as rewards (worker/model/reward_models.py, RewardConfig's model fields): a tiny random-init
sequence-classification model built locally, scored in batches and compared with a direct forward of each text."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from asyncgrpo.run.config import ConfigError, RewardConfig, RunConfig, load_run_config, parse_run_config
from worker.algo.rewards import RewardFailed, score_completions
from worker.model.reward_models import RewardModelError, RewardModels, check_reward_model
from worker.model.tokenizer import load_tokenizer

PROMPTS = ["7=", "3=", "0=", "7=", "12=", "5="]
COMPLETIONS = ["7777", "3", "", "71717171717", "1212", "5=5=5=5=5=5=55"]


@functools.cache
def _loaded(folder: Path) -> tuple[object, object]:
    return load_tokenizer(folder), AutoModelForSequenceClassification.from_pretrained(folder).eval()


def _direct(folder: Path, text: str, max_length: int | None = None) -> float:
    """The model's score of one text, alone (no padding), as a reader would compute it by hand."""
    tokenizer, model = _loaded(folder)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_length is not None:
        ids = ids[-max_length:]
    with torch.inference_mode():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def _reward(folder: Path, **fields: object) -> RewardConfig:
    return RewardConfig(model=str(folder), **fields)


def test_batched_scores_equal_a_direct_forward_of_each_text(tiny_reward_model_dir: Path) -> None:
    reward = _reward(tiny_reward_model_dir, batch_size=4)
    models = RewardModels.load([reward], "cpu", "float32")
    scores = models.score(reward, PROMPTS, [[]] * len(PROMPTS), COMPLETIONS)
    expected = [_direct(tiny_reward_model_dir, p + c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(value, 4) for value in scores)) > 3  # the texts are told apart
    one_by_one = _reward(tiny_reward_model_dir, batch_size=1)
    assert models.score(one_by_one, PROMPTS, [[]] * len(PROMPTS), COMPLETIONS) == pytest.approx(scores, abs=1e-5)


def test_chat_template_scores_the_reward_tokenizers_template(tiny_reward_model_dir: Path) -> None:
    reward = _reward(tiny_reward_model_dir, chat_template=True, batch_size=3)
    models = RewardModels.load([reward], "cpu", "float32")
    chats = [[{"role": "system", "content": "s"}, {"role": "user", "content": p}] for p in PROMPTS]
    scores = models.score(reward, ["ignored"] * len(PROMPTS), chats, COMPLETIONS)
    tokenizer = load_tokenizer(tiny_reward_model_dir)
    texts = [
        tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": c}], tokenize=False)
        for chat, c in zip(chats, COMPLETIONS, strict=True)
    ]
    assert texts[0] == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\n7=<|im_end|>\n<|im_start|>assistant\n7777<|im_end|>\n"
    )
    assert scores == pytest.approx([_direct(tiny_reward_model_dir, text) for text in texts], abs=1e-5)


def test_max_length_keeps_the_last_tokens(tiny_reward_model_dir: Path) -> None:
    reward = _reward(tiny_reward_model_dir, max_length=3)
    scores = RewardModels.load([reward], "cpu", "float32").score(reward, PROMPTS, [[]] * 6, COMPLETIONS)
    pairs = zip(PROMPTS, COMPLETIONS, strict=True)
    expected = [_direct(tiny_reward_model_dir, p + c, max_length=3) for p, c in pairs]
    assert scores == pytest.approx(expected, abs=1e-5)


def test_score_groups_scores_the_task_at_once_and_splits_by_group(tiny_reward_model_dir: Path) -> None:
    reward = _reward(tiny_reward_model_dir, name="rm")
    models = RewardModels.load([reward, RewardConfig(name="repeat_digit")], "cpu", "float32")
    rewards = [RewardConfig(name="repeat_digit"), reward]
    by_group = models.score_groups(rewards, ["7=", "3="], [[], []], [["77", "1"], ["3"]])
    assert [set(group) for group in by_group] == [{"rm"}, {"rm"}]
    expected = [_direct(tiny_reward_model_dir, "7=77"), _direct(tiny_reward_model_dir, "7=1")]
    assert by_group[0]["rm"] == pytest.approx(expected, abs=1e-5)
    assert by_group[1]["rm"] == pytest.approx([_direct(tiny_reward_model_dir, "3=3")], abs=1e-5)


def test_score_completions_weights_model_scores_and_rejects_non_finite_ones(tiny_reward_model_dir: Path) -> None:
    rewards = [RewardConfig(name="repeat_digit"), _reward(tiny_reward_model_dir, name="rm", weight=0.5)]
    totals, per_reward = score_completions(rewards, ["7=", "7="], ["77", "1"], ["7", "7"], {"rm": [2.0, -4.0]})
    assert totals == pytest.approx([1.0 + 1.0, 0.0 - 2.0])
    assert per_reward == {"repeat_digit": [1.0, 0.0], "rm": [2.0, -4.0]}
    with pytest.raises(RewardFailed) as failed:
        score_completions(rewards, ["7=", "7="], ["77", "1"], ["7", "7"], {"rm": [2.0, math.nan]})
    assert failed.value.reason == "reward_not_finite"


def test_a_folder_that_does_not_load_names_the_reward_and_the_model(
    tmp_path: Path, tiny_reward_model_dir: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    reward = _reward(empty, name="judge")
    for attempt in (lambda: check_reward_model(reward), lambda: RewardModels.load([reward], "cpu", "float32")):
        with pytest.raises(RewardModelError, match=rf"reward 'judge' \(model '{empty}'\).*rewards\[\]\.model"):
            attempt()
    # A config and a tokenizer but no weights: run create already refuses it.
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_weights / name).write_bytes((tiny_reward_model_dir / name).read_bytes())
    with pytest.raises(RewardModelError, match="holds no weights"):
        check_reward_model(_reward(no_weights, name="judge"))
    check_reward_model(_reward(tiny_reward_model_dir))  # the real one passes


# ---- the config ----


def test_a_model_reward_is_named_after_its_model_unless_named() -> None:
    hub_id = "OpenAssistant/reward-model-deberta-v3-large-v2"
    assert RewardConfig(model=hub_id).name == "reward-model-deberta-v3-large-v2"
    assert RewardConfig(model="/models/my rm/").name == "my_rm"
    assert RewardConfig(model="org/rm", name="helpful").name == "helpful"
    assert RewardConfig(model="org/rm").batch_size == 16 and RewardConfig(model="org/rm").max_length is None


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        (
            '[[rewards]]\nmodel = "a/rm"\n[[rewards]]\nmodel = "b/rm"\n',
            r"rewards: .*\['rm'\] are listed more than once",
        ),
        ("[[rewards]]\nweight = 1.0\n", r"rewards\.0: .*set `name` to a built-in reward.*or `model`"),
        ('[[rewards]]\nmodel = "a/rm"\nname = "format"\n', r"rewards\.0: .*'format' is a built-in reward's"),
        ('[[rewards]]\nmodel = "a/rm"\nname = "my rm"\n', r"rewards\.0: .*letters, digits"),
        ('[[rewards]]\nmodel = "a/rm"\nbatch_size = 0\n', r"rewards\.0\.batch_size: .*greater than or equal to 1"),
        (
            '[[rewards]]\nname = "repeat_digit"\ntokenizer = "x/y"\n',
            r"rewards\.0: .*tokenizer applies to a reward model",
        ),
        ('[[rewards]]\nname = "repeat_digit"\nchat_template = true\n', r"chat_template applies to a reward model"),
        ('[[rewards]]\nname = "not_a_reward"\n', r"rewards\.0\.name: .*or set `model` for a reward model"),
    ],
    ids=["same_derived_name", "neither", "builtin_name", "bad_name", "batch_size", "tokenizer", "chat", "unknown"],
)
def test_bad_reward_entries_name_the_field(tmp_path: Path, entries: str, expected: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(entries)
    with pytest.raises(ConfigError, match=expected):
        load_run_config(path)


def test_relative_folders_are_read_from_the_config_files_folder(tmp_path: Path) -> None:
    (tmp_path / "conf" / "rm").mkdir(parents=True)
    path = tmp_path / "conf" / "run.toml"
    path.write_text(
        '[[rewards]]\nmodel = "rm"\n[[rewards]]\nmodel = "./missing"\n[[rewards]]\nmodel = "org/hub-rm"\n'
        'tokenizer = "../conf/rm"\n[eval]\n[[eval.rewards]]\nmodel = "rm"\nname = "rm-eval"\n'
    )
    config = load_run_config(path)
    assert [reward.model for reward in config.rewards] == [
        str(tmp_path / "conf" / "rm"),
        str(tmp_path / "conf" / "missing"),
        "org/hub-rm",
    ]
    assert config.rewards[2].tokenizer == str(tmp_path / "conf" / "rm")
    assert config.eval.rewards[0].model == str(tmp_path / "conf" / "rm")


def test_function_rewards_are_stored_as_before_and_old_configs_load() -> None:
    config = RunConfig(rewards=[RewardConfig(name="repeat_digit"), RewardConfig(model="/m/rm", weight=0.1)])
    stored = RunConfig.from_json(config.to_json())
    assert stored == config
    # A whole dump (as the optimize worker's ranks pass the config on) spells out every default, and loads.
    assert RunConfig.model_validate_json(RunConfig().model_dump_json(by_alias=True)) == RunConfig()
    assert RunConfig.model_validate_json(config.model_dump_json(by_alias=True)) == config
    data = json.loads(config.to_json())
    assert data["rewards"][0] == {"name": "repeat_digit", "weight": 1.0}  # byte-identical to older runs' entries
    assert data["rewards"][1]["model"] == "/m/rm" and data["rewards"][1]["name"] == "rm"
    old = parse_run_config({"rewards": [{"name": "repeat_digit", "weight": 1.0}]})
    assert old.rewards[0].model is None
    assert json.loads(RunConfig().to_json())["rewards"] == [{"name": "repeat_digit", "weight": 1.0}]
