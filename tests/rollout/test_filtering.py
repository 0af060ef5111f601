"""DAPO dynamic filtering with refill (never dropping accepted groups) and reward shaping."""

from __future__ import annotations

import pytest

from rl_data import PromptSample, Trajectory
from rl_rollout.episodes import segment_extra
from rl_rollout.filtering import DynamicSampler, dynamic_sample, filter_groups, shape_rewards


def group(group_id, scores, *, length=3, finish="stop"):
    return [
        Trajectory(
            prompt_ids=[1, 2],
            response_ids=list(range(length)),
            reward=s,
            score=s,
            group_id=group_id,
            finish_reason=finish,
        )
        for s in scores
    ]


def ids(records):
    return [r.group_id for r in records]


def test_filter_keeps_groups_with_mean_strictly_inside_the_bounds():
    records = group(0, [1, 1]) + group(1, [0, 1]) + group(2, [0, 0]) + group(3, [1, 0, 0, 0])
    kept, filtered = filter_groups(records)
    assert [members[0].group_id for members in kept] == [1, 3]
    assert [members[0].group_id for members in filtered] == [0, 2]
    # custom bounds: mean 0.25 (group 3) is below low = 0.3
    kept, _ = filter_groups(records, low=0.3, high=1.0)
    assert [members[0].group_id for members in kept] == [1]


def test_rows_of_a_group_need_not_be_contiguous():
    records = group(5, [1])[:1] + group(6, [0]) + group(5, [0]) + group(6, [0])
    kept, filtered = filter_groups(records)
    assert [len(m) for m in kept] == [2]
    assert kept[0][0].group_id == 5
    assert filtered[0][0].group_id == 6


def test_the_segments_of_one_episode_count_once_in_the_group_mean():
    # episode 0 of group 7 was trained as three segments (rl_rollout.episodes), episode 1 as one
    # record: the group's mean score is (1 + 0) / 2 = 0.5, not (1 + 1 + 1 + 0) / 4 = 0.75
    records = group(7, [1, 1, 1, 0])
    for index, record in enumerate(records[:3]):
        record.extra["segment"] = segment_extra(0, index, 3)
    kept, _ = filter_groups(records, low=0.0, high=0.6)
    assert [len(members) for members in kept] == [4]  # the group keeps all its records
    assert filter_groups(records[3:] + records[:3], low=0.6, high=1.0)[0] == []


def test_refill_draws_until_the_target_and_trims_the_excess():
    draws = []
    batches = iter(
        [group(10, [0, 1]) + group(11, [1, 1]), group(12, [1, 0]) + group(13, [0, 1]) + group(14, [0.5])]
    )

    def draw(count):
        draws.append(count)
        return next(batches)

    first = group(0, [0, 0]) + group(1, [1, 0])
    result = dynamic_sample(first, draw, num_groups=3, max_draws=5)
    assert draws == [2, 1]  # missing 2, then missing 1
    assert ids(result.records) == [1, 1, 10, 10, 12, 12]
    assert result.num_groups == 3
    assert result.complete
    assert result.metrics == {
        "filter/draws": 2.0,
        "filter/groups_seen": 7.0,
        "filter/groups_kept": 5.0,
        "filter/groups_filtered": 2.0,
        "filter/groups_trimmed": 2.0,
        "filter/keep_rate": pytest.approx(5 / 7),
    }


def test_accepted_groups_survive_when_replacements_run_out():
    # OpenRLHF bug 1310: when refills ran out, the accepted groups were dropped.
    batches = iter([group(10, [1, 1]), []])
    result = dynamic_sample(
        group(0, [0, 1]) + group(1, [0, 0]), lambda count: next(batches), num_groups=4, max_draws=10
    )
    assert ids(result.records) == [0, 0]
    assert result.num_groups == 1
    assert not result.complete
    assert result.metrics["filter/draws"] == 2.0
    capped = dynamic_sample(
        group(0, [0, 1]), lambda count: group(99, [1, 1]) if count else [], num_groups=2, max_draws=0
    )
    assert ids(capped.records) == [0, 0]
    assert capped.metrics["filter/draws"] == 0.0


def test_oversample_asks_for_more_prompts():
    asked = []

    def draw(count):
        asked.append(count)
        return []

    dynamic_sample(group(0, [0, 0]), draw, num_groups=3, oversample=1.5)
    assert asked == [5]  # ceil(3 * 1.5)


def test_reused_group_ids_and_bad_arguments_are_errors():
    with pytest.raises(ValueError, match=r"draw 1: group id 0 was already seen"):
        dynamic_sample(group(0, [0, 1]), lambda count: group(0, [1, 0]), num_groups=2)
    with pytest.raises(ValueError, match=r"num_groups: 0 is not allowed"):
        dynamic_sample([], None, num_groups=0)
    with pytest.raises(ValueError, match=r"oversample: 0.5 is not allowed"):
        dynamic_sample([], None, num_groups=1, oversample=0.5)


def test_dynamic_sampler_pulls_prompts_from_the_stream():
    prompts = [PromptSample(prompt_ids=[1, 2, 3], label=i, index=i) for i in range(6)]
    next_group = iter(range(100))

    def rollout(batch):
        # prompt i gets mixed scores when i is odd, all-equal scores when even
        records = []
        for sample in batch:
            records += group(next(next_group), [0, 1] if sample.label % 2 else [1, 1])
        return records

    sampler = DynamicSampler(rollout, prompts, num_groups=2)
    result = sampler.next_batch()
    assert result.complete
    assert result.num_groups == 2
    assert result.metrics["filter/prompts_used"] == 4.0  # 2, then 1 (kept 1), then 1
    rest = sampler.next_batch()  # only prompts 4 and 5 are left: one kept group
    assert rest.num_groups == 1
    assert not rest.complete
    assert rest.metrics["filter/prompts_used"] == 6.0


def test_overlong_penalty_golden_values():
    # max_new 10, buffer 4: penalty starts above 6 tokens; f = 0.5
    records = (
        group(0, [1.0], length=5)
        + group(1, [1.0], length=8)
        + group(2, [0.0], length=10)
        + group(3, [1.0], length=12)
    )
    shaped, metrics = shape_rewards(records, max_new_tokens=10, overlong_buffer=4, overlong_factor=0.5)
    assert [r.reward for r in shaped] == pytest.approx([1.0, 0.75, -0.5, 0.5])
    assert [r.score for r in shaped] == [1.0, 1.0, 0.0, 1.0]  # scores untouched
    assert [r.extra["unshaped_reward"] for r in shaped] == [1.0, 1.0, 0.0, 1.0]
    assert [r.reward for r in records] == [1.0, 1.0, 0.0, 1.0]  # inputs unchanged
    assert metrics["shaping/overlong_fraction"] == 0.75


def test_overlong_counts_action_tokens_only():
    record = Trajectory(
        prompt_ids=[1], response_ids=list(range(8)), action_mask=[1, 1, 1, 0, 0, 0, 0, 1], reward=1.0
    )
    shaped, _ = shape_rewards([record], max_new_tokens=6, overlong_buffer=4)
    assert shaped[0].reward == pytest.approx(1.0 - 2 / 4)  # 4 actions, 2 past 6 - 4


@pytest.mark.parametrize(
    ("coefficient", "expected"), [(0.5, [0.5, 1.0, -0.25]), (-1.0, [-1.0, 1.0, -1.0]), (0.0, [0.0, 1.0, 0.0])]
)
def test_stop_properly_penalty_golden_values(coefficient, expected):
    records = group(0, [1.0], finish="length") + group(1, [1.0]) + group(2, [-0.5], finish="length")
    shaped, metrics = shape_rewards(records, stop_properly_coef=coefficient)
    assert [r.reward for r in shaped] == pytest.approx(expected)
    assert metrics["shaping/truncated_fraction"] == pytest.approx(2 / 3)


def test_shaping_composes_and_keeps_the_first_unshaped_reward():
    records = group(0, [1.0], length=10, finish="length")
    once, _ = shape_rewards(records, max_new_tokens=10, overlong_buffer=4, stop_properly_coef=0.5)
    assert once[0].reward == pytest.approx(0.0)  # 1 - 1 = 0, then scaled by 0.5
    twice, _ = shape_rewards(once, stop_properly_coef=-1.0)
    assert twice[0].reward == -1.0
    assert twice[0].extra["unshaped_reward"] == 1.0
    with pytest.raises(ValueError, match=r"max_new_tokens: required when overlong_buffer is given"):
        shape_rewards(records, overlong_buffer=4)
