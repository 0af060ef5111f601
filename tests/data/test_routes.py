"""`Trajectory.routed_experts` on the wire: checked on construction, packed by `build_experience`,
moved by `select`, and round-tripped by msgpack; a record without it decodes as before."""

from __future__ import annotations

import pytest
import torch

from rl_data import DataError, ExperienceBatch, Trajectory, build_experience, decode, encode


def _record(prompt: int, response: int, *, routes: bool = True, layers: int = 2) -> Trajectory:
    tokens = prompt + response
    return Trajectory(
        prompt_ids=list(range(3, 3 + prompt)),
        response_ids=list(range(10, 10 + response)),
        routed_experts=torch.arange(tokens * layers * 2).reshape(tokens, layers, 2) % 8 if routes else None,
    )


def test_routes_travel_with_their_tokens_and_survive_the_wire():
    records = [_record(2, 3), _record(3, 1)]
    assert records[0].routed_experts.dtype == torch.int16
    batch = build_experience(records)
    assert tuple(batch.routed_experts.shape) == (9, 2, 2)
    assert torch.equal(batch.select([1]).routed_experts, records[1].routed_experts)
    again = decode(encode(records), list[Trajectory])
    assert torch.equal(again[0].routed_experts, records[0].routed_experts)
    assert torch.equal(decode(encode(batch), ExperienceBatch).routed_experts, batch.routed_experts)
    assert decode(encode([_record(2, 3, routes=False)]), list[Trajectory])[0].routed_experts is None


def test_routes_of_the_wrong_shape_or_mixed_records_are_refused():
    with pytest.raises(ValueError, match=r"routed_experts: expected shape \[tokens = 5, layers, top_k\]"):
        Trajectory(
            prompt_ids=[1, 2], response_ids=[3, 4, 5], routed_experts=torch.zeros(4, 2, 2, dtype=torch.long)
        )
    with pytest.raises(ValueError, match=r"must lie in \[-1, 32767\]"):
        Trajectory(prompt_ids=[1], response_ids=[3], routed_experts=torch.full((2, 1, 1), -2))
    with pytest.raises(DataError, match="either every record carries routes"):
        build_experience([_record(2, 3), _record(2, 3, routes=False)])
    with pytest.raises(DataError, match="either every record carries routes"):
        build_experience([_record(2, 3), _record(2, 3, layers=3)])
