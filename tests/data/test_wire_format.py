"""Wire-format versions: messages written before the version existed still decode (golden bytes
from rl-data 0.2 in fixtures/), every record names its format, and another major is refused with
both versions and the side to upgrade."""

from __future__ import annotations

import pathlib

import msgspec
import pytest
import torch

from rl_data import (
    WIRE_FORMAT,
    DataError,
    ExperienceBatch,
    PromptSample,
    Trajectory,
    WeightSyncReport,
    decode,
    encode,
)
from rl_data.sync.base import WeightSyncSpec

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TYPES = {
    "trajectories": list[Trajectory],
    "prompt_sample": PromptSample,
    "experience": ExperienceBatch,
    "weight_sync_spec": WeightSyncSpec,
    "weight_sync_report": WeightSyncReport,
}


@pytest.mark.parametrize("name", sorted(TYPES))
def test_messages_written_by_rl_data_0_2_decode_as_format_1(name):
    data = (FIXTURES / f"wire_unversioned_{name}.msgpack").read_bytes()
    assert b"wire_format" not in data
    message = decode(data, TYPES[name])
    records = message if isinstance(message, list) else [message]
    assert all(record.wire_format == 1 for record in records)


def test_golden_trajectories_keep_their_values():
    (first, second) = decode(
        (FIXTURES / "wire_unversioned_trajectories.msgpack").read_bytes(), list[Trajectory]
    )
    assert first.response_ids.tolist() == [4, 5]
    assert first.finish_reason == "length"
    assert (first.group_id, first.policy_version, first.label, first.extra) == (7, 3, "42", {"turns": 2})
    assert second.rollout_logprobs.tolist() == [-2.0]


def test_every_cross_process_record_writes_its_format():
    record = Trajectory(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2]))
    assert msgspec.msgpack.decode(encode(record))["wire_format"] == WIRE_FORMAT


@pytest.mark.parametrize("name", sorted(TYPES))
def test_a_newer_major_is_refused_naming_both_formats_and_the_side_to_upgrade(name):
    raw = msgspec.msgpack.decode((FIXTURES / f"wire_unversioned_{name}.msgpack").read_bytes())
    for item in raw if isinstance(raw, list) else [raw]:
        item["wire_format"] = WIRE_FORMAT + 1
    with pytest.raises(
        DataError,
        match=rf"wire format {WIRE_FORMAT + 1} .*writes {WIRE_FORMAT}; upgrade rl-data on this process's side",
    ):
        decode(msgspec.msgpack.encode(raw), TYPES[name])


def test_an_older_unreadable_format_says_to_upgrade_the_sender():
    with pytest.raises(ValueError, match="upgrade rl-data on the sending process's side"):
        WeightSyncReport(version=1, num_bytes=0, seconds=0.0, checksums=(), wire_format=0)
