"""Tests of rl_data.experience: packing trajectories into the batch a learner consumes."""

from __future__ import annotations

import pytest
import torch

from rl_data.batching import plan_micro_batches
from rl_data.errors import DataError
from rl_data.experience import ExperienceBatch, build_experience, micro_batches
from rl_data.records import Trajectory


def single_turn():
    return Trajectory(
        prompt_ids=[11, 12],
        response_ids=[13, 14, 15],
        rollout_logprobs=[-0.25, -0.5, -0.75],
        reward=1.0,
        group_id=0,
        policy_version=2,
    )


def multi_turn():
    # Policy token, two environment tokens (action mask 0, log-prob 0), policy token.
    return Trajectory(
        prompt_ids=[21],
        response_ids=[22, 23, 24, 25],
        action_mask=[1, 0, 0, 1],
        rollout_logprobs=[-1.0, 0.0, 0.0, -2.0],
        reward=0.5,
        score=1.0,
        group_id=7,
        policy_version=3,
        finish_reason="length",
    )


def test_build_experience_packs_every_field_token_aligned():
    batch = build_experience([single_turn(), multi_turn()], indices=[4, 9])
    assert batch.input_ids.tolist() == [11, 12, 13, 14, 15, 21, 22, 23, 24, 25]
    assert batch.input_ids.dtype == torch.int64
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert batch.cu_seqlens.tolist() == [0, 5, 10]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.prompt_lengths.tolist() == [2, 1]
    assert batch.response_lengths.tolist() == [3, 4]
    assert batch.prompt_lengths.dtype == batch.response_lengths.dtype == torch.int64
    assert batch.action_mask.tolist() == [False, False, True, True, True, False, True, False, False, True]
    assert batch.rollout_logprobs.dtype == torch.float32
    assert batch.rollout_logprobs.tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, 0.0, -1.0, 0.0, 0.0, -2.0]
    assert batch.rewards.tolist() == [1.0, 0.5]
    assert batch.scores.tolist() == [1.0, 1.0]
    assert batch.rewards.dtype == batch.scores.dtype == torch.float32
    assert batch.group_ids.tolist() == [0, 7]
    assert batch.policy_versions.tolist() == [2, 3]
    assert batch.group_ids.dtype == batch.policy_versions.dtype == torch.int64
    assert batch.finish_reasons == ["stop", "length"]
    assert batch.indices.tolist() == [4, 9]
    for slot in ("old_logprobs", "ref_logprobs", "teacher_logprobs", "values", "advantages", "returns"):
        assert getattr(batch, slot) is None
    assert (batch.num_sequences, batch.num_tokens, batch.num_actions) == (2, 10, 5)


def test_indices_default_to_record_positions():
    assert build_experience([single_turn(), multi_turn()]).indices.tolist() == [0, 1]


def test_rollout_logprobs_are_none_when_no_record_has_them():
    record = Trajectory(prompt_ids=[1], response_ids=[2, 3])
    batch = build_experience([record, record])
    assert batch.rollout_logprobs is None
    assert batch.action_mask.tolist() == [False, True, True, False, True, True]


def test_rollout_logprob_at_a_token_is_predicted_from_the_logits_one_position_before():
    # A bigram "model": the logits at a position depend only on the token there. The sampler
    # scores each response token from the token before it in its own sequence.
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(32, 32, generator=generator)

    def sampled(prompt, response, action_mask):
        sequence = torch.tensor(prompt + response)
        scores = torch.log_softmax(table[sequence[:-1]], dim=-1).gather(1, sequence[1:, None])[:, 0]
        logprobs = scores[len(prompt) - 1 :] * torch.tensor(action_mask)
        return Trajectory(
            prompt_ids=prompt, response_ids=response, action_mask=action_mask, rollout_logprobs=logprobs
        )

    records = [sampled([1, 2], [3, 4, 5], [1, 1, 1]), sampled([6], [7, 8, 9, 10], [1, 0, 0, 1])]
    batch = build_experience(records)
    logprobs = torch.log_softmax(table[batch.input_ids], dim=-1)
    from_previous = torch.zeros(batch.num_tokens)
    from_previous[1:] = logprobs[:-1].gather(1, batch.input_ids[1:, None])[:, 0]
    # The shift reads across a sequence boundary only at position 0, never an action.
    assert not (batch.action_mask & (batch.position_ids == 0)).any()
    torch.testing.assert_close(batch.rollout_logprobs[batch.action_mask], from_previous[batch.action_mask])


def test_response_view_and_back_on_a_hand_example():
    batch = build_experience([single_turn(), multi_turn()])
    per_token = torch.arange(10.0)
    view = batch.response_view(per_token, pad_value=-1.0)
    assert view.tolist() == [[2.0, 3.0, 4.0, -1.0], [6.0, 7.0, 8.0, 9.0]]
    assert batch.response_action_mask().tolist() == [[True, True, True, False], [True, False, False, True]]
    back = batch.from_response_view(view)
    assert back.tolist() == [0.0, 0.0, 2.0, 3.0, 4.0, 0.0, 6.0, 7.0, 8.0, 9.0]


def test_response_view_round_trips_and_passes_gradients():
    batch = build_experience([multi_turn(), single_turn(), multi_turn()])
    per_token = torch.randn(batch.num_tokens, dtype=torch.float64, requires_grad=True)
    view = batch.response_view(per_token)
    is_response = batch.position_ids >= torch.repeat_interleave(
        batch.prompt_lengths, batch.prompt_lengths + batch.response_lengths
    )
    back = batch.from_response_view(view)
    assert torch.equal(back, torch.where(is_response, per_token, torch.zeros_like(per_token)))
    back.sum().backward()
    assert torch.equal(per_token.grad, is_response.to(torch.float64))

    advantages = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    per_token_advantages = batch.from_response_view(advantages)
    assert torch.equal(
        batch.response_view(per_token_advantages) * batch.response_action_mask(),
        advantages.detach() * batch.response_action_mask(),
    )
    per_token_advantages.sum().backward()
    assert torch.equal(
        advantages.grad, (batch.response_view(torch.ones(batch.num_tokens)) > 0).to(torch.float64)
    )


def test_response_view_rejects_values_that_are_not_token_aligned():
    batch = build_experience([single_turn()])
    with pytest.raises(ValueError, match=r"values must have shape \[N, ...\] with N = 5 tokens, got \(4,\)"):
        batch.response_view(torch.zeros(4))
    with pytest.raises(
        ValueError, match=r"values must have shape \[S, R_max, ...\] with S = 1, got \(2, 3\)"
    ):
        batch.from_response_view(torch.zeros(2, 3))


def test_build_experience_errors():
    with pytest.raises(ValueError, match="records is empty"):
        build_experience([])
    with pytest.raises(ValueError, match="indices has 1 entries but records has 2"):
        build_experience([single_turn(), multi_turn()], indices=[0])
    without = Trajectory(prompt_ids=[1], response_ids=[2])
    with pytest.raises(
        DataError, match=r"records, row 2, key 'rollout_logprobs': rollout_logprobs is missing"
    ):
        build_experience([single_turn(), multi_turn(), without])
    with pytest.raises(DataError, match=r"row 1: expected a Trajectory, got dict"):
        build_experience([single_turn(), {"prompt_ids": [1]}])


def test_experience_batch_checks_shapes_on_construction():
    batch = build_experience([single_turn()])
    with pytest.raises(
        ValueError, match=r"ExperienceBatch.advantages: shape \(3,\) is not aligned with N = 5"
    ):
        ExperienceBatch(
            **{**{f: getattr(batch, f) for f in batch.__struct_fields__}, "advantages": torch.zeros(3)}
        )


def test_micro_batches_cover_the_records_of_a_rank_exactly_once():
    records = [single_turn(), multi_turn()] * 5 + [
        Trajectory(prompt_ids=[1] * 6, response_ids=[2] * 6, rollout_logprobs=[0.0] * 6)
    ]
    lengths = [record.num_tokens for record in records]
    plan = plan_micro_batches(lengths, max_tokens=12, num_ranks=2)
    seen = []
    for rank in range(2):
        batches = micro_batches(records, plan, rank)
        assert len(batches) == plan.num_micro_batches
        for step, batch in enumerate(batches):
            assert batch.indices.tolist() == plan.ranks[rank][step]
            assert batch.num_tokens == plan.micro_batch_tokens[rank][step] <= 12
            expected = torch.cat(
                [torch.cat([records[i].prompt_ids, records[i].response_ids]) for i in plan.ranks[rank][step]]
            )
            assert torch.equal(batch.input_ids, expected)
            seen += batch.indices.tolist()
    assert sorted(seen) == list(range(len(records)))


def test_empty_micro_batch_becomes_an_empty_batch():
    records = [single_turn()] * 3
    plan = plan_micro_batches([r.num_tokens for r in records], max_tokens=5, num_ranks=2)
    assert plan.num_empty_micro_batches == 1
    batches = [b for rank in range(2) for b in micro_batches(records, plan, rank)]
    empty = [b for b in batches if b.num_sequences == 0]
    assert len(empty) == 1
    assert empty[0].num_tokens == 0
    assert empty[0].cu_seqlens.tolist() == [0]
    assert empty[0].rollout_logprobs is not None
    assert empty[0].rollout_logprobs.numel() == 0


def test_micro_batches_reject_a_plan_for_other_records_and_bad_ranks():
    records = [single_turn(), multi_turn()]
    plan = plan_micro_batches([5, 6], max_tokens=20)
    with pytest.raises(ValueError, match=r"plan.ranks\[0\]\[0\] has 11 tokens in the plan but 10"):
        micro_batches(records, plan, 0)
    plan = plan_micro_batches([5, 5, 5], max_tokens=20)
    with pytest.raises(ValueError, match="refers to record 2 but there are 2 records"):
        micro_batches(records, plan, 0)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 1\), got 1"):
        micro_batches(records, plan, 1)


def test_to_moves_every_tensor_and_keeps_the_rest():
    batch = build_experience([single_turn(), multi_turn()])
    batch.advantages = torch.zeros(batch.num_tokens)
    moved = batch.to("meta")
    assert moved.input_ids.device.type == "meta"
    assert moved.advantages.device.type == "meta"
    assert moved.finish_reasons == batch.finish_reasons
    assert batch.input_ids.device.type == "cpu"


def assert_same_batch(left: ExperienceBatch, right: ExperienceBatch) -> None:
    for field in left.__struct_fields__:
        a, b = getattr(left, field), getattr(right, field)
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor), field
            assert a.dtype == b.dtype, field
            assert torch.equal(a, b), field
        else:
            assert a == b, field


def test_select_equals_building_from_the_chosen_records_and_carries_filled_slots():
    records = [single_turn(), multi_turn(), single_turn(), multi_turn()]
    full = build_experience(records)
    full.advantages = torch.arange(full.num_tokens, dtype=torch.float32)
    full.teacher_logprobs = -torch.arange(full.num_tokens, dtype=torch.float32)
    chosen = full.select([3, 0])
    expected = build_experience([records[3], records[0]], indices=[3, 0])
    expected.advantages = torch.cat([full.advantages[15:20], full.advantages[0:5]])
    expected.teacher_logprobs = torch.cat([full.teacher_logprobs[15:20], full.teacher_logprobs[0:5]])
    assert_same_batch(chosen, expected)


def test_select_of_nothing_is_an_empty_batch_and_out_of_range_is_refused():
    full = build_experience([single_turn(), multi_turn()])
    full.values = torch.zeros(full.num_tokens)
    empty = full.select([])
    assert (empty.num_sequences, empty.num_tokens) == (0, 0)
    assert empty.values.shape == (0,)
    with pytest.raises(IndexError, match=r"\[0, 2\)"):
        full.select([2])


def test_micro_batches_from_a_packed_batch_match_those_from_records():
    records = [single_turn() if i % 3 else multi_turn() for i in range(9)]
    plan = plan_micro_batches([r.num_tokens for r in records], max_tokens=12, num_ranks=2)
    full = build_experience(records)
    for rank in range(2):
        from_records = micro_batches(records, plan, rank)
        from_batch = micro_batches(full, plan, rank)
        assert len(from_records) == len(from_batch) == plan.num_micro_batches
        for left, right in zip(from_records, from_batch):
            assert_same_batch(left, right)
