"""Running moments (reward normalisation): golden values, merge invariance, exact resume."""

from __future__ import annotations

import math

import pytest
import torch

from rl_algos import RunningMoments, merge_moments


def test_merge_moments_golden_values():
    # [1, 2] and [3, 4]: each (2, mean, M2 = 0.5); the union [1, 2, 3, 4] has mean 2.5, M2 = 5
    assert merge_moments(2, 1.5, 0.5, 2, 3.5, 0.5) == (4.0, 2.5, 5.0)
    assert merge_moments(0, 0.0, 0.0, 3, 2.0, 2.0) == (3.0, 2.0, 2.0)
    assert merge_moments(0, 0.0, 0.0, 0, 0.0, 0.0) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        merge_moments(-1, 0.0, 0.0, 1, 0.0, 0.0)


def test_running_moments_equal_the_moments_of_everything_seen_whatever_the_batches():
    values = torch.tensor([0.3, -1.2, 4.0, 2.5, 0.0, 7.1, -3.3])
    whole = RunningMoments()
    whole.update(values)
    pieces = RunningMoments()
    for part in (values[:1], values[1:4], values[4:]):
        pieces.update(part)
    expected_var = float(values.double().var(unbiased=False))
    for moments in (whole, pieces):
        assert moments.count == 7
        assert moments.mean == pytest.approx(float(values.double().mean()), abs=1e-12)
        assert moments.var == pytest.approx(expected_var, rel=1e-12)


def test_normalize_uses_the_statistics_including_the_batch_golden_values():
    moments = RunningMoments()
    first = moments.normalize(torch.tensor([1.0, 3.0]))  # mean 2, std 1
    assert first.tolist() == [-1.0, 1.0]
    second = moments.normalize(torch.tensor([5.0, 7.0]))  # now [1, 3, 5, 7]: mean 4, std sqrt(5)
    assert second.tolist() == pytest.approx([1 / math.sqrt(5), 3 / math.sqrt(5)])
    assert (moments.mean, moments.std) == (4.0, pytest.approx(math.sqrt(5)))
    scale_only = RunningMoments(center=False)
    assert scale_only.normalize(torch.tensor([1.0, 3.0])).tolist() == [1.0, 3.0]  # / std 1


def test_equal_rewards_normalise_to_zero_not_to_a_division_by_zero():
    moments = RunningMoments()
    assert moments.normalize(torch.tensor([2.0, 2.0, 2.0])).tolist() == [0.0, 0.0, 0.0]
    assert moments.normalize(torch.tensor([2.0])).tolist() == [0.0]


def test_a_resumed_normaliser_continues_exactly():
    batches = [torch.randn(6, generator=torch.Generator().manual_seed(seed)) * 3 + 1 for seed in range(4)]
    straight = RunningMoments()
    outputs = [straight.normalize(batch) for batch in batches]
    first = RunningMoments()
    for batch in batches[:2]:
        first.normalize(batch)
    import json

    resumed = RunningMoments()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a JSON checkpoint holds it
    for batch, expected in zip(batches[2:], outputs[2:]):
        assert torch.equal(resumed.normalize(batch), expected)
    assert resumed.state_dict() == straight.state_dict()


def test_non_finite_values_and_bad_states_are_refused():
    with pytest.raises(ValueError, match="must be finite"):
        RunningMoments().update(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="m2 >= 0"):
        RunningMoments().load_state_dict({"count": 2, "mean": 0.0, "m2": -1.0})
