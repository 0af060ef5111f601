"""From TRL's layout (groups as consecutive rows, one advantage per row) to rl_algos': the helpers,
and the README's "Coming from TRL" classes giving the loss and advantages TRL 1.16's GRPOTrainer
computes (its formulas written out here from its `_compute_loss`, on a stand-in for the trainer;
tests/trl_recipe_driver.py runs the same classes inside TRL, in the slow release test)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

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


class _FakeGRPOTrainer:
    """What the README's TRL classes use of TRL 1.16's GRPOTrainer, for the fast tier (the slow
    tests/trl_recipe_driver.py runs them inside TRL itself)."""

    def __init__(self, *, logps=None, rewards_per_func=None, rows=0, process_index=0, num_processes=1,
                 accumulation=1, steps_per_generation=1, num_generations=1):  # fmt: skip
        self.accelerator = SimpleNamespace(num_processes=num_processes, process_index=process_index)
        self.args = SimpleNamespace(steps_per_generation=steps_per_generation)
        self.current_gradient_accumulation_steps = accumulation
        self.max_completion_length = 5
        self.num_generations = self.num_generations_eval = num_generations
        self.model = SimpleNamespace(training=True)
        self.logps, self.rewards_per_func, self.rows = logps, rewards_per_func, rows
        if rewards_per_func is not None:
            self.reward_weights = torch.tensor([1.0, 0.5])

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep):
        assert input_ids.shape == attention_mask.shape
        assert logits_to_keep == self.logps.shape[1]
        return self.logps, None, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return self.rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._calculate_rewards(inputs, None, None, None)
        return {"advantages": torch.full((self.rows,), float("nan"))}


def _readme_trl_classes(monkeypatch) -> dict:
    monkeypatch.setitem(sys.modules, "trl", SimpleNamespace(GRPOTrainer=_FakeGRPOTrainer))
    namespace: dict = {}
    for block in [block for block in python_blocks() if "GRPOTrainer" in block]:
        exec(block, namespace)
    return namespace


def test_readme_trl_loss_class_gives_trl_cispo_loss_and_gradient(monkeypatch):
    classes = _readme_trl_classes(monkeypatch)
    batch = _trl_batch()
    logps, old, mask = batch["per_token_logps"], batch["old_per_token_logps"], batch["completion_mask"]
    advantages = _trl_advantages(batch["rewards"], batch["num_generations"])
    generation_tokens = mask.sum() * 2 + 3  # this micro-batch is one of two (steps_per_generation)
    trainer = classes["RLAlgosGRPOTrainer"](
        logps=logps, accumulation=2, steps_per_generation=2, loss=("cispo", {"epsilon_high": 4.0})
    )
    inputs = {
        "prompt_ids": torch.zeros(6, 2, dtype=torch.long),
        "prompt_mask": torch.ones(6, 2, dtype=torch.long),
        "completion_ids": torch.zeros(6, 5, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": generation_tokens,
        "old_per_token_logps": old,
    }
    loss = trainer.compute_loss(None, inputs)
    # TRL 1.16, loss_type="cispo", epsilon_high=5.0
    clamped = torch.clamp((logps - old).exp(), max=5.0).detach()
    per_token = -clamped * advantages[:, None] * logps
    expected = (per_token * mask).sum() / (generation_tokens / 1 * 2 / 2)
    torch.testing.assert_close(loss, expected)
    (ours,) = torch.autograd.grad(loss, logps)
    (theirs,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(ours, theirs)


def test_readme_trl_advantages_class_gives_trl_advantages_and_this_ranks_slice(monkeypatch):
    classes = _readme_trl_classes(monkeypatch)
    rewards_per_func = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.5, 0.0], [2.0, 0.0]] * 2)
    rewards_per_func[4:] *= torch.tensor([[1.0], [3.0], [0.0], [1.0]])
    rewards = rewards_per_func[:, 0] + 0.5 * rewards_per_func[:, 1]  # reward_weights [1, 0.5]
    options = {"rewards_per_func": rewards_per_func, "rows": 2, "process_index": 1, "num_processes": 4}
    trl_like = classes["RLAlgosAdvantagesGRPOTrainer"](
        num_generations=4, estimator=("grpo", {"preset": "trl"}), **options
    )
    advantages = trl_like._generate_and_score_completions({})["advantages"]
    torch.testing.assert_close(advantages, _trl_advantages(rewards, 4)[2:4])
    rloo = classes["RLAlgosAdvantagesGRPOTrainer"](num_generations=4, **options)  # the default: RLOO
    grouped = rewards.view(2, 4)
    others = (grouped.sum(1, keepdim=True) - grouped) / 3
    torch.testing.assert_close(
        rloo._generate_and_score_completions({})["advantages"], (grouped - others).flatten()[2:4]
    )


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
