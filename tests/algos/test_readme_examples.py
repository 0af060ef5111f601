"""The Python examples in packages/rl-algos/README.md run as written."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from rl_algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, loss_normalizer

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-algos" / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.+?)```", README.read_text(), re.S)


def block_with(text: str) -> str:
    (block,) = [block for block in python_blocks() if text in block]
    return block


def tiny_batch() -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    logits = torch.randn(4, 5, 11, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (4, 5), generator=gen)
    return {
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "mask": mask,
        "old_logprobs": torch.log_softmax(logits.detach(), -1).gather(-1, labels[..., None]).squeeze(-1),
        "ref_logprobs": -torch.rand(4, 5, generator=gen),
        "values": torch.randn(4, 5, generator=gen),
        "logits": logits,
        "labels": labels,
        "global_token_count": loss_normalizer(mask, "token-mean"),
    }


def test_readme_training_step_example_runs_and_gives_a_gradient():
    namespace = tiny_batch()
    exec(python_blocks()[0], namespace)
    loss = namespace["loss"]
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    loss.backward()
    assert namespace["logits"].grad.abs().sum() > 0


def test_readme_registration_example_registers_working_entries():
    namespace = tiny_batch()
    try:
        exec(block_with(".register("), namespace)
        advantages, _ = ADVANTAGE_ESTIMATORS["batch_mean_baseline"](
            rewards=namespace["rewards"], action_mask=namespace["mask"]
        )
        assert advantages.shape == (4, 5)
        per_token, _ = POLICY_LOSSES["capped_pg"](
            namespace["old_logprobs"], namespace["old_logprobs"], advantages, namespace["mask"]
        )
        assert per_token.shape == (4, 5)
    finally:
        ADVANTAGE_ESTIMATORS.pop("batch_mean_baseline", None)
        POLICY_LOSSES.pop("capped_pg", None)


def test_readme_objective_example_runs_and_gives_a_gradient():
    namespace = tiny_batch()
    logits, labels = namespace["logits"], namespace["labels"]
    namespace["logprobs"] = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    namespace["rollout_logprobs"] = namespace["old_logprobs"] - 0.05
    namespace["advantages"] = torch.randn(4, 5) * namespace["mask"]
    namespace["entropy"] = torch.rand(4, 5)
    exec(block_with("policy_objective("), namespace)
    loss = namespace["loss"]
    assert loss.dim() == 0
    loss.backward()
    assert logits.grad.abs().sum() > 0


def test_readme_distillation_example_rewards_tokens_the_teacher_prefers():
    namespace = tiny_batch()
    namespace["outcome"] = namespace["rewards"]
    # the teacher likes every sampled token more than the student does (d < 0): the reward is positive
    namespace["teacher_logprobs"] = namespace["old_logprobs"] + 0.5
    exec(block_with("reverse_kl_rewards"), namespace)
    mask = namespace["mask"].bool()
    assert namespace["kl_to_teacher"].item() == pytest.approx(-0.5)
    assert namespace["advantages"].shape == (4, 5)
    assert (namespace["token_rewards"][mask] >= 0.5 - 1e-6).all()
