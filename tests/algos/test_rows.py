"""From TRL's layout (groups as consecutive rows, one advantage per row) to rl_algos': the helpers,
and the README's "Coming from TRL" recipe giving the loss TRL 1.16's GRPOTrainer computes (its
formulas written out here from its `_compute_loss`, as TRL is not a test dependency)."""

from __future__ import annotations

import pytest
import torch

from rl_algos import (
    POLICY_LOSSES,
    aggregate_loss,
    contiguous_group_ids,
    expand_to_tokens,
    join_segments,
    segment_layout,
    split_segments,
)

from .test_readme_examples import python_blocks


def test_contiguous_group_ids_number_consecutive_rows():
    assert contiguous_group_ids(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    assert contiguous_group_ids(0, 4).tolist() == []


@pytest.mark.parametrize(
    ("rows", "size", "error"), [(5, 2, ValueError), (4, 0, ValueError), (4, 2.0, TypeError)]
)
def test_contiguous_group_ids_refuse_incomplete_groups_and_bad_sizes(rows, size, error):
    with pytest.raises(error):
        contiguous_group_ids(rows, size)


def test_expand_to_tokens_puts_each_value_on_its_action_tokens_only():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    expanded = expand_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert expanded.tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]


def test_expand_to_tokens_names_a_row_mismatch():
    with pytest.raises(ValueError, match="action_mask has 3 rows"):
        expand_to_tokens(torch.zeros(2), torch.ones(3, 4))


def test_join_segments_lays_an_episodes_rows_end_to_end_and_split_inverts_it():
    # rows 0 and 1 are segments of episode 7 (2 and 1 response tokens), row 2 is episode 9
    layout = segment_layout(torch.tensor([2, 1, 3]), torch.tensor([7, 7, 9]), 3)
    values = torch.tensor([[1.0, 2.0, -5.0], [3.0, -5.0, -5.0], [4.0, 5.0, 6.0]])  # -5: padding
    joined = join_segments(values, layout)
    assert joined.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert (layout.first.tolist(), layout.last.tolist()) == ([0, 2], [1, 2])
    assert split_segments(joined, layout).tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [4.0, 5.0, 6.0]]
    mask = torch.tensor([[True, False, False], [True, False, False], [True, True, True]])
    assert join_segments(mask, layout).tolist() == [[True, False, True], [True, True, True]]


def test_segment_layout_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"lengths must be in \[0, seq = 2\]"):
        segment_layout(torch.tensor([3]), torch.tensor([0]), 2)
    with pytest.raises(TypeError, match="episode_ids must be an integer tensor"):
        segment_layout(torch.tensor([1]), torch.tensor([0.5]), 2)
    layout = segment_layout(torch.tensor([1]), torch.tensor([0]), 2)
    with pytest.raises(ValueError, match=r"values must have shape \[1, 2\]"):
        join_segments(torch.zeros(2, 2), layout)


def _trl_batch():
    generator = torch.Generator().manual_seed(3)
    rows, length, generations = 6, 5, 3
    mask = (torch.rand(rows, length, generator=generator) < 0.8).long()
    mask[:, 0] = 1
    old = -torch.rand(rows, length, generator=generator) * 3
    new = (old + 0.7 * torch.randn(rows, length, generator=generator)).requires_grad_()
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 0.0])
    return {
        "rewards": rewards,
        "num_generations": generations,
        "completion_mask": mask,
        "per_token_logps": new,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
        "num_processes": 1,
        "gradient_accumulation_steps": 2,
        "steps_per_generation": 2,
    }


def _trl_advantages(rewards, generations):
    grouped = rewards.view(-1, generations)
    mean = grouped.mean(1).repeat_interleave(generations)
    std = grouped.std(1).repeat_interleave(generations)  # TRL's nanstd: unbiased
    return (rewards - mean) / (std + 1e-4)


def test_readme_trl_recipe_gives_trl_cispo_loss_and_gradient():
    (block,) = [block for block in python_blocks() if "contiguous_group_ids(" in block]
    namespace = _trl_batch()
    exec(block, namespace)
    batch = _trl_batch()
    logps, old, mask = batch["per_token_logps"], batch["old_per_token_logps"], batch["completion_mask"]
    advantages = _trl_advantages(batch["rewards"], batch["num_generations"])[:, None]
    clamped = torch.clamp((logps - old).exp(), max=5.0).detach()  # TRL: epsilon_high=5.0
    per_token = -clamped * advantages * logps
    normalizer = batch["num_items_in_batch"] / 1 * 2 / 2
    expected = (per_token * mask).sum() / normalizer
    torch.testing.assert_close(namespace["loss"], expected)
    (ours,) = torch.autograd.grad(namespace["loss"], namespace["per_token_logps"])
    (theirs,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(ours, theirs)


def test_trl_sequence_level_importance_sampling_equals_gspo():
    batch = _trl_batch()
    logps, old, mask = (
        batch["per_token_logps"],
        batch["old_per_token_logps"],
        batch["completion_mask"].float(),
    )
    advantages = _trl_advantages(batch["rewards"], batch["num_generations"])
    epsilon_low, epsilon_high = 3e-4, 4e-4
    # TRL, importance_sampling_level="sequence", loss_type="grpo"
    log_weight = ((logps - old) * mask).sum(-1) / mask.sum(-1)
    ratio = log_weight.exp()[:, None]
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
    expected = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    ours_per_token, _ = POLICY_LOSSES["gspo"](
        logps,
        old,
        expand_to_tokens(advantages, mask),
        mask,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
    )
    ours = aggregate_loss(ours_per_token, mask, "seq-mean-token-mean")
    torch.testing.assert_close(ours, expected)
    (ours_grad,) = torch.autograd.grad(ours, logps)
    (trl_grad,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(ours_grad, trl_grad)
