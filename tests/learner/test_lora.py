"""LoRA adapters on policy and value models (peft)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from rl_data.tiny import build_tiny_model
from rl_learner.lora import LoraOptions, apply_lora, linear_module_names
from rl_learner.models import packed_logprobs, packed_values

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import experience, tiny_critic

pytest.importorskip("peft")


@pytest.fixture(autouse=True)
def _seeded():
    """The tiny models and peft's adapter init draw from the global RNG: each test starts from the
    same state whichever tests ran before it in this process."""
    torch.manual_seed(0)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _train(model, loss_of, steps: int = 5) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = loss_of(model)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def test_lora_training_lowers_the_loss_and_changes_only_adapters(tokenizer):
    batch = experience(4, seed=5)
    model = apply_lora(build_tiny_model(tokenizer, dtype=torch.float64), LoraOptions(rank=4, alpha=8))
    before = _snapshot(model)

    def nll(m):
        return -(packed_logprobs(m, batch) * batch.action_mask).sum() / batch.num_actions

    losses = _train(model, nll)
    assert losses[-1] < losses[0] - 0.05
    changed = {name for name, value in _snapshot(model).items() if not torch.equal(value, before[name])}
    assert changed
    assert all(".lora_" in name for name in changed), sorted(changed)
    assert any("lora_A" in name for name in changed)
    assert any("lora_B" in name for name in changed)


def test_value_model_lora_keeps_the_score_head_trainable(tokenizer):
    batch = experience(4, seed=6)
    model = apply_lora(
        tiny_critic(tokenizer, torch.float64), LoraOptions(rank=4, target_modules=["q_proj", "v_proj"])
    )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("score" in name for name in trainable)
    assert all(".lora_" in name or "score" in name for name in trainable), sorted(trainable)
    targets = torch.where(batch.action_mask, 1.0, 0.0).double()
    before = _snapshot(model)

    def squared_error(m):
        return ((packed_values(m, batch) - targets).square() * batch.action_mask).sum() / batch.num_actions

    losses = _train(model, squared_error)
    assert losses[-1] < losses[0]
    changed = {name for name, value in _snapshot(model).items() if not torch.equal(value, before[name])}
    assert any("score" in name for name in changed)
    assert all(".lora_" in name or "score" in name for name in changed), sorted(changed)
    assert not any("k_proj.lora" in name for name in changed)


def test_merge_and_unload_gives_the_adapted_outputs(tokenizer):
    batch = experience(3, seed=7)
    model = apply_lora(build_tiny_model(tokenizer, dtype=torch.float64), LoraOptions(rank=4))
    with torch.no_grad():  # non-zero B so the adapters matter
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        adapted = packed_logprobs(model, batch)
        merged = model.merge_and_unload()
        assert not any("lora" in name for name, _ in merged.named_parameters())
        torch.testing.assert_close(packed_logprobs(merged, batch), adapted, rtol=0, atol=1e-10)
        assert (
            adapted - packed_logprobs(build_tiny_model(tokenizer, dtype=torch.float64), batch)
        ).abs().max() > 1e-3


def test_adapters_start_as_the_identity(tokenizer):
    batch = experience(2, seed=8)
    plain = build_tiny_model(tokenizer, dtype=torch.float64)
    with torch.no_grad():
        expected = packed_logprobs(plain, batch)
        adapted = apply_lora(plain, LoraOptions(rank=8))
        torch.testing.assert_close(packed_logprobs(adapted, batch), expected, rtol=0, atol=1e-12)


def test_rank_zero_returns_the_model_unchanged(tokenizer):
    model = build_tiny_model(tokenizer)
    assert apply_lora(model, LoraOptions()) is model


def test_targets_that_match_nothing_are_named_with_the_available_layers(tokenizer):
    with pytest.raises(
        ValueError, match=r"target_modules: \['qkv_proj'\] match no linear layer.*'q_proj', 'k_proj'"
    ):
        apply_lora(build_tiny_model(tokenizer), LoraOptions(rank=4, target_modules=["q_proj", "qkv_proj"]))


def test_linear_module_names_exclude_the_heads(tokenizer):
    names = linear_module_names(build_tiny_model(tokenizer))
    assert names == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": -1}, r"LoraOptions.rank: -1 is not an integer >= 0"),
        ({"rank": 4, "alpha": 0}, r"LoraOptions.alpha: 0 is not a number > 0"),
        ({"dropout": 1.0}, r"LoraOptions.dropout: 1.0 is not in \[0, 1\)"),
        ({"target_modules": "all"}, r"LoraOptions.target_modules: 'all' is neither 'all-linear'"),
        ({"target_modules": []}, r"LoraOptions.target_modules: \[\] must be a non-empty list"),
    ],
)
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraOptions(**kwargs)
