"""The tiny offline model (worker/model/tiny_model.py): built locally, deterministic, loadable by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from worker.model.policy import Policy
from worker.model.tiny_model import (
    EOS_TOKEN,
    PAD_TOKEN,
    REVEAL_CALL,
    UNK_TOKEN,
    build_tiny_model,
    ensure_tiny_model,
    resolve_base_model,
    train_tiny_agent_tokenizer,
    train_tiny_tokenizer,
)
from worker.model.tokenizer import load_tokenizer


def test_tokenizer_is_character_level_over_the_toy_alphabet(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    vocab = tokenizer.get_vocab()
    assert set("0123456789=") <= set(vocab)
    assert len(tokenizer) == len(vocab) == 14
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    ids = tokenizer("7=", add_special_tokens=True)["input_ids"]
    assert ids == [vocab["7"], vocab["="]]
    decoded = tokenizer.decode([vocab["4"], vocab["4"], tokenizer.eos_token_id], skip_special_tokens=True)
    assert decoded == "44"


def test_tokenizer_has_a_chatml_template(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "7="}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n7=<|im_end|>\n<|im_start|>assistant\n"
    # the markers are outside the toy alphabet: the vocabulary (and so the toy task) is unchanged
    assert len(tokenizer) == 14


# Texts whose tokens the builder fixes: the toy alphabet, characters outside it, a tool's error message.
ROUND_TRIP_TEXTS = ["7=", "0123456789=", "3=x", "Error: tool reveal timed out after 30 s", "?=é\n"]
CHAT = [{"role": "user", "content": "7="}, {"role": "assistant", "content": "77"}, {"role": "user", "content": "4="}]


@pytest.mark.parametrize("agent", [False, True], ids=["tiny", "tiny-agent"])
def test_the_saved_tokenizer_loads_as_the_one_built(tmp_path: Path, agent: bool) -> None:
    built = train_tiny_agent_tokenizer() if agent else train_tiny_tokenizer()
    folder = build_tiny_model(tmp_path / "model", agent=agent)
    for loaded in (load_tokenizer(str(folder)), Policy.load(str(folder)).tokenizer):  # the workers' loaders
        assert loaded.get_vocab() == built.get_vocab()
        for text in ROUND_TRIP_TEXTS:
            assert loaded(text)["input_ids"] == built(text)["input_ids"], text
        unknown = loaded("3=x", add_special_tokens=False)["input_ids"]
        assert loaded.convert_ids_to_tokens(unknown) == ["3", "=", UNK_TOKEN]  # mapped, never dropped
        rendered = loaded.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
        meant = built.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(rendered) == list(meant)
        assert loaded.eos_token_id == built.eos_token_id and loaded.pad_token_id == built.pad_token_id


def test_the_chat_templates_markers_reach_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    plain = load_tokenizer(str(tiny_model_dir))
    templated = plain.apply_chat_template([CHAT[0]], add_generation_prompt=True, tokenize=True, return_dict=False)
    # ChatML's markers are outside the toy alphabet: an <unk> per character, around the prompt's own tokens, so
    # dataset.chat_template = true feeds other tokens than the bare prompt.
    markers = "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    assert plain.convert_ids_to_tokens(templated).count(UNK_TOKEN) == len(markers)
    assert list(templated) != plain("7=")["input_ids"]
    agent = load_tokenizer(str(ensure_tiny_model(cache_dir=tmp_path, agent=True)))
    ids = agent.apply_chat_template([CHAT[0]], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert agent.convert_ids_to_tokens(ids) == ["<user>", "7", "=", "<assistant>"]
    # A tool's error message reaches the tiny agent model as unknown tokens, not as nothing.
    error = agent("<tool>Error: no", add_special_tokens=False)["input_ids"]
    assert agent.convert_ids_to_tokens(error) == ["<tool>", *[UNK_TOKEN] * len("Error: no")]
    call = agent(REVEAL_CALL + "7", add_special_tokens=False)["input_ids"]
    assert agent.convert_ids_to_tokens(call) == [REVEAL_CALL, "7"]


def test_model_loads_and_matches_the_tokenizer(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    logits = model(input_ids=torch.tensor([tokenizer("3=")["input_ids"]])).logits
    assert logits.shape == (1, 2, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    first = load_file(build_tiny_model(tmp_path / "a", seed=1) / "model.safetensors")
    second = load_file(build_tiny_model(tmp_path / "b", seed=1) / "model.safetensors")
    third = load_file(build_tiny_model(tmp_path / "c", seed=2) / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not all(torch.equal(first[key], third[key]) for key in first)
    vocab_a = json.loads((tmp_path / "a" / "tokenizer.json").read_text())["model"]["vocab"]
    vocab_c = json.loads((tmp_path / "c" / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocab_a == vocab_c


def test_ensure_builds_once_and_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_tiny_model(seed=0, cache_dir=tmp_path)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(seed=0, cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging folder left behind
    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path / "elsewhere"))  # read by a process's entry, not here
    assert resolve_base_model("tiny", tmp_path) == str(path)
    assert resolve_base_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
