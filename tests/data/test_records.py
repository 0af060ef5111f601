"""Trajectory and PromptSample: lists in, typed tensors stored, bad records refused at the door."""

from __future__ import annotations

import pytest
import torch

from rl_data.errors import DataError
from rl_data.records import PromptSample, Trajectory, total_tokens


def test_lists_become_typed_tensors_and_defaults_fill_in():
    record = Trajectory(prompt_ids=[1, 2, 3], response_ids=[4, 5], reward=1)
    assert record.prompt_ids.dtype == torch.int64
    assert record.response_ids.tolist() == [4, 5]
    assert record.action_mask.dtype == torch.bool
    assert record.action_mask.tolist() == [True, True]
    assert record.rollout_logprobs is None
    assert isinstance(record.reward, float)
    assert record.score == 1.0
    assert (record.num_tokens, record.num_actions) == (5, 2)


def test_multi_turn_mask_counts_only_policy_tokens():
    record = Trajectory(
        prompt_ids=[1],
        response_ids=[10, 11, 90, 91, 12],
        action_mask=[1, 1, 0, 0, 1],
        rollout_logprobs=[-0.5, -0.25, 0.0, 0.0, -1.0],
        score=0.0,
        reward=0.5,
    )
    assert record.action_mask.tolist() == [True, True, False, False, True]
    assert record.num_actions == 3
    assert record.rollout_logprobs.dtype == torch.float32
    assert record.score == 0.0


def test_tensors_are_stored_as_contiguous_cpu_copies_of_the_right_dtype():
    response = torch.arange(10, dtype=torch.int32)[::2]
    record = Trajectory(
        prompt_ids=torch.tensor([7]), response_ids=response, rollout_logprobs=torch.zeros(5).double()
    )
    assert record.response_ids.dtype == torch.int64
    assert record.response_ids.is_contiguous()
    assert record.rollout_logprobs.dtype == torch.float32


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"action_mask": [1, 0]}, "action_mask: length 2 does not match response_ids length 3"),
        ({"rollout_logprobs": [0.0]}, "rollout_logprobs: length 1 does not match response_ids length 3"),
        ({"finish_reason": "eos"}, "finish_reason: 'eos' is not one of"),
        ({"action_mask": [1, 2, 0]}, "action_mask: expected 0/1 values"),
        ({"response_ids": [1.5, 2.0, 3.0]}, "response_ids: expected integers"),
        ({"response_ids": [[1, 2, 3]]}, "response_ids: expected a 1-D sequence"),
        ({"response_ids": "abc"}, "response_ids: expected a list or a 1-D tensor, got str"),
    ],
)
def test_malformed_trajectories_name_the_field(fields, message):
    arguments = {"prompt_ids": [1], "response_ids": [4, 5, 6], **fields}
    with pytest.raises((ValueError, TypeError), match=message):
        Trajectory(**arguments)


def test_empty_response_is_allowed_and_has_no_actions():
    record = Trajectory(prompt_ids=[1, 2], response_ids=[], finish_reason="abort")
    assert record.response_ids.shape == (0,)
    assert record.num_actions == 0


def test_prompt_sample_and_total_tokens():
    sample = PromptSample(prompt_ids=[5, 6], prompt="hi", label="4", index=3, source="a.jsonl", row=9)
    assert sample.prompt_ids.tolist() == [5, 6]
    records = [
        Trajectory(prompt_ids=[1, 2], response_ids=[3]),
        Trajectory(prompt_ids=[1], response_ids=[2, 3, 4]),
    ]
    assert total_tokens(records) == 7


def test_data_error_names_the_location_and_survives_pickling_between_processes():
    import pickle

    error = DataError("expected a string, got int", source="train.jsonl", row=17, key="prompt")
    assert str(error) == "train.jsonl, row 17, key 'prompt': expected a string, got int"
    copy = pickle.loads(pickle.dumps(error))  # our own object: how Ray and multiprocessing ship errors
    assert (str(copy), copy.row, copy.key, copy.source) == (str(error), 17, "prompt", "train.jsonl")
    assert str(DataError("bad", source="f.jsonl", line=3)) == "f.jsonl, line 3: bad"


def test_token_versions_default_to_the_policy_version_and_round_trip_the_wire():
    from rl_data import decode, encode

    uniform = Trajectory(prompt_ids=[1], response_ids=[4, 5, 6], policy_version=3)
    assert uniform.token_versions is None
    assert uniform.versions().tolist() == [3, 3, 3]
    mixed = Trajectory(prompt_ids=[1], response_ids=[4, 5, 6], policy_version=3, token_versions=[3, 4, 4])
    assert mixed.versions().dtype == torch.int64
    [back] = decode(encode([mixed]), list[Trajectory])
    assert back.token_versions.tolist() == [3, 4, 4]


def test_records_encoded_before_token_versions_decode_with_none():
    import msgspec

    from rl_data import decode, encode

    older = msgspec.defstruct(
        "Trajectory",
        [("prompt_ids", torch.Tensor), ("response_ids", torch.Tensor), ("policy_version", int)],
        kw_only=True,
    )
    sent = older(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2, 3]), policy_version=5)
    [back] = decode(encode([sent]), list[Trajectory])
    assert back.token_versions is None
    assert back.versions().tolist() == [5, 5]


@pytest.mark.parametrize(
    ("versions", "message"),
    [([3, 4], "length 2 does not match"), ([4, 3, 4], "non-decreasing"), ([2, 3, 3], "non-decreasing")],
)
def test_token_versions_that_go_back_or_predate_the_record_are_refused(versions, message):
    with pytest.raises(ValueError, match=message):
        Trajectory(prompt_ids=[1], response_ids=[4, 5, 6], policy_version=3, token_versions=versions)
