"""Fixtures the runtime tests share: the default model's tokenizer, and its chat template applied to one user
message."""
from __future__ import annotations

from typing import Callable

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def chat(tokenizer) -> Callable[[str], list[int]]:
    """chat(text): the prompt ids of one user message under the default model's chat template."""
    def ids(text: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    return ids
