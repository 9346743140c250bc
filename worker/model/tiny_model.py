"""The tiny offline model: a small random-init Qwen2 causal LM and a tokenizer trained locally.

Nothing is downloaded. The tokenizer is a character-level WordLevel model trained with the ``tokenizers``
library on a corpus of toy-task prompts, so its vocabulary is exactly the ten digits, ``=``, an EOS, a PAD
and an UNK token (14 tokens). The model is small enough that GRPO teaches it the ``repeat_digit`` task from
scratch on a CPU in seconds, which is what the tests and the local demo rely on.

The tokenizer carries a ChatML-style chat template (``TINY_CHAT_TEMPLATE``) so that runs with
``dataset.chat_template = true`` can be tested end to end offline. Its markers are outside the toy alphabet
and tokenize to ``<unk>``, as any character outside it does (never dropped): the vocabulary, the weights and the
toy task (which uses no template) are those of the template-less model. Workers load the tokenizer as it is
saved here (``worker.model.tokenizer``); transformers' ``AutoTokenizer`` would rebuild another one from the
vocabulary (``Qwen2Tokenizer``, which drops unknown characters).

``model.base = "tiny"`` in a run config means: build this model once into the local cache
(``$ASYNCGRPO_CACHE/tiny-model-r2-seed0``, default ``~/.cache/asyncgrpo``) and load it from there.

``model.base = "tiny-agent"`` is its sibling for agent rollouts (``[agent]``): the same shape, with a vocabulary
that also holds the markers of a small tool-calling chat template (``TINY_AGENT_CHAT_TEMPLATE``: ``<user>``,
``<assistant>``, ``<tool>``, and Hermes-style ``<tool_call>{...}</tool_call>`` calls) and '?'. The toy agent
task (``worker.generate.toy_agent``) hides a digit behind a ``reveal()`` tool; its whole call,
``<tool_call>{"name": "reveal", "arguments": {}}</tool_call>``, is one token of the vocabulary (the parser reads
it as text, as it reads any model's), so that the tiny model can find it by chance and learn it in CI time.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import structlog
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from asyncgrpo.protocol.settings import CacheSettings
from asyncgrpo.run.datasets import repeat_digit_prompts

log = structlog.get_logger()

TINY_BASE_NAME = "tiny"
EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
# Every character outside the vocabulary (a chat template's markers, a tool's error message) becomes this token.
UNK_TOKEN = "<unk>"
# Written last by build_tiny_model: a cache folder without it is an interrupted build.
_COMPLETE_MARKER = "TINY_MODEL_COMPLETE"
# Part of the cache folder's name: a build with other files (r2: the chat template) gets a new folder.
TINY_BUILD_REVISION = 2
# ChatML, as Qwen2.5 instruct models use: "<|im_start|>role\ncontent<|im_end|>\n" per message, then the
# generation prompt "<|im_start|>assistant\n".
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_AGENT_BASE_NAME = "tiny-agent"
TINY_AGENT_BUILD_REVISION = 2
# A minimal tool-calling template: the tools' schemas are not rendered (the tiny model cannot read them), a
# call is rendered in the Hermes format the worker parses, and a turn ends with the EOS token, as Qwen's do.
TINY_AGENT_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<user>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<assistant>{{ m.content }}"
    "{%- for c in m.tool_calls or [] -%}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{%- endfor -%}<eos>"
    "{%- elif m.role == 'tool' -%}<tool>{{ m.content }}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<assistant>{%- endif -%}"
)
REVEAL_CALL = '<tool_call>{"name": "reveal", "arguments": {}}</tool_call>'

# Shape of the tiny model. Small enough for CPU RL in seconds, big enough to learn the toy task.
TINY_HIDDEN_SIZE = 128
TINY_LAYERS = 2
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_INTERMEDIATE_SIZE = 256
TINY_MAX_POSITIONS = 256


def train_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer trained on toy prompts: digits, '=', EOS, PAD and UNK."""
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    # Every character is its own token; no whitespace handling is needed for the toy alphabet.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=[EOS_TOKEN, PAD_TOKEN, UNK_TOKEN], min_frequency=1)
    # A corpus that holds every digit (prompts and their ideal completions) fixes the vocabulary.
    corpus = [record["prompt"] + (record["answer"] or "") * 4 for record in repeat_digit_prompts(200, seed=0)]
    corpus.extend(f"{digit}=" for digit in "0123456789")
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN
    )
    wrapped.padding_side = "left"
    wrapped.chat_template = TINY_CHAT_TEMPLATE
    return wrapped


def train_tiny_agent_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer plus '?' and the tool-calling template's markers (see the module docstring)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=[EOS_TOKEN, PAD_TOKEN, UNK_TOKEN], min_frequency=1)
    tokenizer.train_from_iterator(["0123456789=?"], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN
    )
    # Role markers are special (left out of decoded text); a call's tokens are text the worker parses.
    wrapped.add_special_tokens({"additional_special_tokens": ["<user>", "<assistant>", "<tool>"]})
    wrapped.add_tokens([REVEAL_CALL])
    wrapped.padding_side = "left"
    wrapped.chat_template = TINY_AGENT_CHAT_TEMPLATE
    return wrapped


def build_tiny_model(out_dir: Path, seed: int = 0, agent: bool = False) -> Path:
    """Write a tiny random-init Qwen2 causal LM and its tokenizer to ``out_dir`` (Hugging Face format);
    ``agent``: the tiny agent model's vocabulary and template.

    The same seed gives the same weights. Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_agent_tokenizer() if agent else train_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=TINY_HIDDEN_SIZE,
        intermediate_size=TINY_INTERMEDIATE_SIZE,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    # Seed a private RNG scope so building the model leaves the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / _COMPLETE_MARKER).write_text(f"seed={seed}\n")
    log.info("tiny_model.built", path=str(out_dir), seed=seed, parameters=model.num_parameters())
    return out_dir


DEFAULT_CACHE_DIR = Path(str(CacheSettings.model_fields["cache"].default)).expanduser()
"""The default of ``ASYNCGRPO_CACHE``; a process passes its own settings' ``cache`` instead."""


def ensure_tiny_model(seed: int = 0, cache_dir: Path | None = None, agent: bool = False) -> Path:
    """The tiny model's folder in the cache (``agent``: the tiny agent model's), built on first use.

    Safe when several processes race: each builds into its own temporary folder and renames it into place;
    the loser discards its copy.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    name = f"tiny-agent-r{TINY_AGENT_BUILD_REVISION}" if agent else f"tiny-model-r{TINY_BUILD_REVISION}"
    target = cache_dir / f"{name}-seed{seed}"
    if (target / _COMPLETE_MARKER).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-seed{seed}-", dir=cache_dir))
    try:
        build_tiny_model(staging, seed=seed, agent=agent)
        if target.exists() and not (target / _COMPLETE_MARKER).exists():
            # Left over from an interrupted build (only ever renamed into place complete, so this is rare).
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not (target / _COMPLETE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_base_model(base: str, cache_dir: Path | None = None) -> str:
    """A run config's ``model.base`` as something ``from_pretrained`` accepts: 'tiny' (and 'tiny-agent') -> the
    cached folder."""
    if base == TINY_BASE_NAME:
        return str(ensure_tiny_model(cache_dir=cache_dir))
    if base == TINY_AGENT_BASE_NAME:
        return str(ensure_tiny_model(cache_dir=cache_dir, agent=True))
    return base
