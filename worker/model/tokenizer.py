"""A model's tokenizer, loaded as it was saved: the one loader every worker, check and backend uses.

transformers 5's ``AutoTokenizer`` picks the tokenizer class from the model's type (``Qwen2Tokenizer`` for a
Qwen2 config) even where the folder saved a tokenizer whose whole definition is its ``tokenizer.json``
(``tokenizer_class`` ``TokenizersBackend``, or ``PreTrainedTokenizerFast`` before 5.0). The model type's class
then rebuilds a byte-level BPE from the vocabulary: the saved model, normalizer and unknown token are lost, so an
unknown character is dropped instead of mapped to the unknown token, and text between added tokens is split
otherwise. A tokenizer saved as one of those generic classes is therefore loaded by that class, from its
``tokenizer.json``; any other (a hub model's ``Qwen2Tokenizer``, say) is loaded as ``AutoTokenizer`` loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The classes that are only a tokenizer.json: transformers 5's name and the name it kept for the same class.
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(source: str | Path, revision: str | None = None) -> Any:
    """The tokenizer of ``source`` (a folder or a hub id) as it was saved (see the module docstring)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    if get_tokenizer_config(source, revision=revision).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(source, revision=revision)
    return AutoTokenizer.from_pretrained(source, revision=revision)
