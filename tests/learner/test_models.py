"""Loading policy/value models from checkpoints and their packed forwards (no DeepSpeed here)."""

from __future__ import annotations

import itertools
import json
import pathlib
import sys

import pytest
import torch

from rl_algos import entropy_from_logits
from rl_data import ExperienceBatch, Trajectory, build_experience
from rl_data.tiny import build_tiny_model
from rl_learner.models import (
    load_causal_lm,
    load_value_model,
    packed_logprobs,
    packed_model_inputs,
    packed_scores,
    packed_values,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import experience


@pytest.fixture(scope="module")
def batch() -> ExperienceBatch:
    return experience(6, seed=3)


def _sequences(batch: ExperienceBatch) -> list[torch.Tensor]:
    bounds = batch.cu_seqlens.tolist()
    return [batch.input_ids[a:b] for a, b in itertools.pairwise(bounds)]


def _model(tokenizer, architecture: str, attention: str):
    model = build_tiny_model(tokenizer, architecture=architecture, dtype=torch.float64)
    model.config._attn_implementation = attention
    return model


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_and_entropy_equal_per_sequence_forwards(tokenizer, batch, architecture, attention):
    model = _model(tokenizer, architecture, attention)
    with torch.no_grad():
        logprobs, entropy = packed_logprobs(model, batch, with_entropy=True, temperature=0.7)
        expected_lp, expected_entropy = [], []
        for ids in _sequences(batch):
            logits = model(ids[None]).logits[0].double() / 0.7
            step = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
            expected_lp.append(torch.cat([torch.zeros(1, dtype=torch.float64), step]))
            expected_entropy.append(
                torch.cat([torch.zeros(1, dtype=torch.float64), entropy_from_logits(logits[:-1])])
            )
    assert logprobs.dtype == torch.float64
    # transformers' eager attention takes its softmax in float32, even for a float64 model.
    atol = 1e-10 if attention == "sdpa" else 1e-6
    torch.testing.assert_close(logprobs, torch.cat(expected_lp), rtol=0, atol=atol)
    torch.testing.assert_close(entropy, torch.cat(expected_entropy), rtol=0, atol=atol)
    assert (logprobs[batch.position_ids == 0] == 0).all()


def test_packed_inputs_follow_the_attention_implementation(tokenizer, batch):
    model = _model(tokenizer, "qwen2", "sdpa")
    inputs = packed_model_inputs(model, batch)
    assert model.config._attn_implementation == "rl_packed_sdpa"
    assert inputs["attention_mask"].shape == (1, 1, 0, 0)  # a placeholder: no N×N mask
    assert inputs["packed_length_buckets"].num_tokens == batch.num_tokens
    model.config._attn_implementation = "eager"
    inputs = packed_model_inputs(model, batch)
    assert model.config._attn_implementation == "rl_packed_eager"
    assert inputs["attention_mask"].shape == (1, 1, 0, 0)
    model.config._attn_implementation = "flash_attention_2"
    inputs = packed_model_inputs(model, batch)
    assert "attention_mask" not in inputs
    assert "packed_length_buckets" not in inputs
    assert torch.equal(inputs["position_ids"][0], batch.position_ids)


def test_empty_batch_gives_empty_outputs_connected_to_the_model(tokenizer):
    model = _model(tokenizer, "qwen2", "sdpa")
    logprobs = packed_logprobs(model, ExperienceBatch.empty())
    assert logprobs.shape == (0,)
    logprobs.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


# --------------------------------------------------------------------------- value models


@pytest.fixture(scope="module")
def value_checkpoint(tiny_checkpoint, tmp_path_factory) -> pathlib.Path:
    """A reward model saved by us: load from the causal-LM checkpoint, perturb the head, save."""
    from transformers import AutoTokenizer

    model = load_value_model(tiny_checkpoint, dtype=torch.float64)
    with torch.no_grad():
        model.score.weight.mul_(50.0)  # scores of order 1, so the comparison below means something
    path = tmp_path_factory.mktemp("reward")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(path)
    return path


def test_value_model_from_a_causal_lm_gets_a_seeded_small_head_and_the_pad_id(tiny_checkpoint):
    first = load_value_model(tiny_checkpoint, dtype=torch.float64)
    second = load_value_model(tiny_checkpoint, dtype=torch.float64)
    hidden = first.config.hidden_size
    assert first.score.weight.shape == (1, hidden)
    torch.testing.assert_close(first.score.weight, second.score.weight, rtol=0, atol=0)
    assert first.score.weight.abs().max() < 6 / (hidden + 1)
    assert float(first.score.weight.detach().std()) == pytest.approx(1 / (hidden + 1), rel=0.3)
    assert first.config.pad_token_id is not None
    causal = load_causal_lm(tiny_checkpoint, dtype=torch.float64)
    backbone = dict(causal.model.named_parameters())
    for name, parameter in first.model.named_parameters():
        torch.testing.assert_close(parameter, backbone[name], rtol=0, atol=0)


def test_saved_value_model_loads_back_with_its_head(value_checkpoint):
    from safetensors.torch import load_file

    model = load_value_model(value_checkpoint, dtype=torch.float64)
    saved = load_file(str(value_checkpoint / "model.safetensors"))
    torch.testing.assert_close(model.score.weight, saved["score.weight"], rtol=0, atol=0)


def test_packed_scores_equal_hf_sequence_classification_on_right_padded_batches(value_checkpoint, batch):
    from transformers import AutoModelForSequenceClassification

    ours = load_value_model(value_checkpoint, dtype=torch.float64)
    theirs = AutoModelForSequenceClassification.from_pretrained(value_checkpoint, dtype=torch.float64)
    sequences = _sequences(batch)
    pad = theirs.config.pad_token_id
    assert all(int(ids[-1]) != pad for ids in sequences)
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
    with torch.no_grad():
        expected = theirs(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
        scores = packed_scores(ours, batch)
    assert scores.shape == (batch.num_sequences,)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_packed_values_are_the_head_at_the_previous_token(tmp_path, tokenizer, batch, architecture):
    build_tiny_model(tokenizer, architecture=architecture).save_pretrained(tmp_path)
    model = load_value_model(tmp_path, dtype=torch.float64, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        values = packed_values(model, batch)
        expected = []
        for ids in _sequences(batch):
            hidden = getattr(model, model.base_model_prefix)(ids[None]).last_hidden_state
            head = model.score(hidden)[0, :, 0]
            expected.append(torch.cat([torch.zeros(1, dtype=torch.float64), head[:-1]]))
    torch.testing.assert_close(values, torch.cat(expected), rtol=0, atol=1e-10)
    assert (values[batch.position_ids == 0] == 0).all()


def test_gradient_checkpointing_gives_the_same_gradients(tiny_checkpoint, batch):
    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = load_causal_lm(tiny_checkpoint, dtype=torch.float64, gradient_checkpointing=checkpointing)
        model.train()
        assert model.is_gradient_checkpointing == checkpointing
        logprobs = packed_logprobs(model, batch)
        (logprobs * batch.action_mask).sum().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, checkpointed = gradients(False), gradients(True)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- errors


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=f"causal LM checkpoint '{missing}' does not exist"):
        load_causal_lm(missing)


def test_folder_without_config_is_named(tmp_path):
    with pytest.raises(ValueError, match=rf"value model checkpoint '{tmp_path}' has no config.json"):
        load_value_model(tmp_path)


def test_checkpoint_that_is_not_a_causal_lm_names_path_and_architecture(tmp_path):
    from transformers import ViTConfig

    ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"'{tmp_path}' has architecture model_type='vit'"):
        load_causal_lm(tmp_path)


def test_unknown_architecture_names_path_and_model_type(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "made-up-lm", "architectures": ["MadeUp"]})
    )
    with pytest.raises(ValueError, match=r"model_type='made-up-lm', architectures=\['MadeUp'\]") as error:
        load_causal_lm(tmp_path)
    assert str(tmp_path) in str(error.value)


def test_bad_attention_implementation_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="attn_implementation: 'flash' is not one of"):
        load_causal_lm(tiny_checkpoint, attn_implementation="flash")


def test_loaded_policy_matches_the_checkpoint_forward(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    ours = load_causal_lm(tiny_checkpoint, dtype=torch.float64, attn_implementation="eager")
    theirs = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float64, attn_implementation="eager"
    )
    assert ours.config._attn_implementation == "eager"
    batch = build_experience([Trajectory(prompt_ids=[5, 6, 7], response_ids=[8, 9])])
    with torch.no_grad():
        torch.testing.assert_close(
            packed_logprobs(ours, batch), packed_logprobs(theirs, batch), rtol=0, atol=1e-10
        )
