"""The tiny model and tokenizer factory: built locally, loadable by transformers (vLLM loads the same
checkpoint in tests/rollout/test_vllm_engine.py, whose outputs are checked against transformers)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_data.tiny import (
    ADDED_TOKENS,
    CHAT_TEMPLATES,
    SPECIAL_TOKENS,
    build_tiny_checkpoint,
    build_tiny_model,
    build_tiny_tokenizer,
)

TEXTS = [
    "What is 12 + 7? The answer is 19.",
    "  leading spaces,  double  spaces\n\nand blank lines\t tabs",
    "unicode: ünïcödé 東京 🙂 — and digits 0123456789",
    "<think>reasoning</think> then <|im_end|> as plain text",
]


def test_saved_tokenizer_loads_with_auto_tokenizer_and_encodes_identically(tiny_checkpoint, tokenizer):
    loaded = AutoTokenizer.from_pretrained(tiny_checkpoint)
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.chat_template == CHAT_TEMPLATES["chatml"]
    assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_special_and_added_tokens_are_single_ids_and_digits_are_split(tokenizer):
    for token in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token
    ids = tokenizer("12345", add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


def test_tokenizer_training_is_deterministic():
    first, second = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert first.get_vocab() == second.get_vocab()
    assert first(TEXTS[0])["input_ids"] == second(TEXTS[0])["input_ids"]


def test_chat_templates_render_a_generation_prompt(make_tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    for name in CHAT_TEMPLATES:
        text = make_tokenizer(name).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert "What is 2 + 2?" in text
        assert text.rstrip().endswith(("assistant", "assistant<|im_end|>")), (name, text)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_model_loads_with_auto_model_and_gives_the_same_logits(tmp_path, architecture):
    path = build_tiny_checkpoint(tmp_path / architecture, architecture=architecture)
    model = AutoModelForCausalLM.from_pretrained(path)
    rebuilt = build_tiny_model(AutoTokenizer.from_pretrained(path), architecture=architecture)
    assert model.config.model_type == architecture
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(path))
    ids = torch.tensor([[1, 5, 9, 20, 33]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, rebuilt(ids).logits)


def test_model_initialisation_follows_the_seed(tokenizer):
    first, again, other = (build_tiny_model(tokenizer, seed=seed) for seed in (0, 0, 1))
    weights = [dict(model.named_parameters())["model.embed_tokens.weight"] for model in (first, again, other)]
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])


def test_checkpoint_folder_is_reused_and_a_different_recipe_is_refused(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "m")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_checkpoint(tmp_path / "m") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_tiny_checkpoint(tmp_path / "m", seed=1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a tiny checkpoint"):
        build_tiny_checkpoint(tmp_path / "other")


def test_bad_arguments_are_named(tokenizer):
    with pytest.raises(ValueError, match="architecture: 'gpt2' is not one of"):
        build_tiny_model(tokenizer, architecture="gpt2")
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        build_tiny_model(tokenizer, hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="chat_template: 'nope'"):
        build_tiny_tokenizer(chat_template="nope")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(vocab_size=10)
