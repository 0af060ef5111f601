"""The named rollout corrections (`rl_algos.CORRECTIONS`): the same weights and metrics, bit for
bit, as the `rollout_correction` keyword table rl-learner used before the registry, for every
combination that table accepted."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from rl_algos import CORRECTION_GATINGS, CORRECTION_LEVELS, CORRECTIONS, Registry, rollout_correction

# The names PolicyLossConfig.correction took before the registry, and its keyword table.
OLD_NAMES = ("tis", "icepop", "seq-mask", "seq-mask-tis", "truncate", "mask")
BOUNDS = ((0.5, 5.0), (0.9, 1.2), (0.0, 0.05), (0.0, 0.5), (1.0, 3.0))


def old_options(correction: str, level: str, gating: str, bounds: tuple[float, float]) -> dict[str, Any]:
    low, high = bounds
    if correction == "seq-mask":
        return {"mode": "none", "sequence_mask_range": (low, high)}
    if correction == "seq-mask-tis":
        return {"mode": "mask", "level": "geometric", "mask_weight": "token", "low": low, "high": high}
    if correction in ("tis", "truncate"):
        return {"mode": "truncate", "level": level, "gating": gating, "low": low, "high": high}
    if correction == "icepop":
        return {"method": "icepop", "level": level, "gating": gating, "low": low, "high": high}
    return {
        "mode": "mask",
        "level": level,
        "gating": gating,
        "mask_weight": "token",
        "low": low,
        "high": high,
    }


def new_options(correction: str, level: str, gating: str, bounds: tuple[float, float]) -> dict[str, Any]:
    low, high = bounds
    if correction in ("seq-mask", "seq-mask-tis"):
        return {"low": low, "high": high}
    if correction in ("tis", "truncate"):  # truncation gates on the ratio only
        assert gating == "ratio"
        return {"level": level, "low": low, "high": high}
    return {"level": level, "gating": gating, "low": low, "high": high}


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rollout = -torch.rand(6, 7, generator=generator) * 3
    delta = torch.randn(6, 7, generator=generator) * torch.tensor([0.01, 0.1, 0.5, 1.0, 2.0, 0.3])[:, None]
    old = rollout + delta
    old[1, 2] = rollout[1, 2] + math.log(8.0)  # one clear outlier token
    mask = torch.ones(6, 7, dtype=torch.long)
    mask[2, 4:] = 0
    mask[4, 1:] = 0
    mask[5] = 0  # a row without action tokens
    return old, rollout, mask


def valid_old_combinations():
    one = torch.zeros(1, 1)
    for correction, level, gating, bounds in itertools.product(
        OLD_NAMES, CORRECTION_LEVELS, CORRECTION_GATINGS, BOUNDS
    ):
        if correction in ("seq-mask", "seq-mask-tis") and gating != "ratio":
            continue  # refused by the old PolicyLossConfig
        try:
            rollout_correction(one, one, torch.ones(1, 1), **old_options(correction, level, gating, bounds))
        except ValueError:
            continue
        yield correction, level, gating, bounds


COMBINATIONS = list(valid_old_combinations())


def test_every_old_name_has_valid_combinations():
    assert {combination[0] for combination in COMBINATIONS} == set(OLD_NAMES)
    assert len(COMBINATIONS) > 60


@pytest.mark.parametrize(("correction", "level", "gating", "bounds"), COMBINATIONS)
def test_registry_entry_equals_the_old_keyword_table(correction, level, gating, bounds):
    old, rollout, mask = batch()
    expected, expected_metrics = rollout_correction(
        old, rollout, mask, **old_options(correction, level, gating, bounds)
    )
    weights, metrics = CORRECTIONS[correction](
        old, rollout, mask, **new_options(correction, level, gating, bounds)
    )
    assert weights.dtype == torch.float32
    assert not weights.requires_grad
    assert torch.equal(weights, expected)
    assert metrics.keys() == expected_metrics.keys()
    for key, value in metrics.items():
        assert torch.equal(value, expected_metrics[key]), key


def test_truncate_is_tis():
    assert CORRECTIONS["truncate"] is CORRECTIONS["tis"]


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("tis", {}, [2.0, 5.0, 0.5]),
        ("tis", {"level": "sequence"}, [4.0, 4.0, 4.0]),
        ("icepop", {}, [2.0, 0.0, 0.0]),
        ("icepop", {"level": "geometric"}, [4 ** (1 / 3)] * 3),
        ("mask", {}, [2.0, 0.0, 0.0]),
        ("mask", {"level": "geometric"}, [2.0, 8.0, 0.25]),
        ("seq-mask", {}, [1.0, 1.0, 1.0]),
        ("seq-mask", {"high": 1.5}, [0.0, 0.0, 0.0]),
        ("seq-mask-tis", {}, [2.0, 8.0, 0.25]),
        ("seq-mask-tis", {"high": 1.5}, [0.0, 0.0, 0.0]),
    ],
)
def test_docstring_worked_values(name, options, expected):
    old = torch.tensor([[math.log(2.0), math.log(8.0), math.log(0.25)]])
    weights, _ = CORRECTIONS[name](old, torch.zeros(1, 3), torch.ones(1, 3), **options)
    torch.testing.assert_close(weights, torch.tensor([expected]))


def test_an_option_an_entry_does_not_take_is_a_type_error():
    one = torch.zeros(1, 1)
    with pytest.raises(TypeError, match="gating"):
        CORRECTIONS["tis"](one, one, torch.ones(1, 1), gating="tv")


def test_users_register_their_own_correction():
    corrections = Registry("rollout correction")
    corrections.update(CORRECTIONS)

    @corrections.register("unit")
    def unit(old_logprobs, rollout_logprobs, action_mask, *, scale: float = 1.0):
        return (action_mask.float() * scale), {}

    assert corrections["unit"](None, None, torch.ones(1, 2), scale=2.0)[0].tolist() == [[2.0, 2.0]]
    with pytest.raises(ValueError, match="already registered"):
        corrections.register("tis", unit)
