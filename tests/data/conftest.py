"""Shared fixtures for the rl_data tests: tiny tokenizers and a tiny checkpoint, built locally."""

from __future__ import annotations

import pytest

from rl_data.tiny import build_tiny_checkpoint, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A saved Qwen2-style tiny model and ChatML tokenizer (folder path)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2-chatml")


@pytest.fixture(scope="session")
def make_tokenizer():
    """`make_tokenizer(chat_template)`: a tiny tokenizer with that template, built once per name."""
    cache: dict[str, object] = {}

    def make(chat_template: str = "chatml"):
        if chat_template not in cache:
            cache[chat_template] = build_tiny_tokenizer(chat_template=chat_template)
        return cache[chat_template]

    return make


@pytest.fixture(scope="session")
def tokenizer(make_tokenizer):
    """The ChatML tiny tokenizer."""
    return make_tokenizer("chatml")
