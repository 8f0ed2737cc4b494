"""A model folder's tokenizer, loaded the same way by the offline API and the server."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None when it ships none (then prompts must be token ids)."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        return None
    # Imported on use: from transformers 5 on, AutoTokenizer's model-config classes import
    # torch where it is installed, and importing the API process's modules must not.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
