"""The wire format's version: every message that crosses processes and packages carries it.

`Trajectory`, `PromptSample`, `ExperienceBatch`, `WeightSyncSpec` and `WeightSyncReport` hold a
`wire_format` field (default `WIRE_FORMAT`). A reader refuses a message of another major format
with both versions named and the side to upgrade, instead of failing later with a decode error
or, worse, misreading a field whose meaning changed.

Rules for the next change of a record:
- adding a field with a default is not a new format: older messages decode (the default fills it)
  and older readers skip the unknown key (msgspec's default);
- renaming or removing a field, or changing a field's meaning or encoding, is: bump `WIRE_FORMAT`,
  keep reading the previous one where a translation exists (`READABLE` lists the formats read) and
  keep its golden bytes in tests/data/fixtures.

Messages written before the field existed (rl-data 0.2) carry no `wire_format` key and are format 1:
the records' layout did not change when the field was added.
"""

from __future__ import annotations

from .__about__ import __version__

__all__ = ["READABLE", "WIRE_FORMAT", "check_wire_format"]

WIRE_FORMAT = 1
"""The major wire format this rl-data writes."""

READABLE = frozenset({1})
"""The formats this rl-data reads."""


def check_wire_format(value: int, what: str) -> None:
    """Raise ValueError unless `value` is a readable format; `what` names the record."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}.wire_format must be an integer, got {value!r}")
    if value in READABLE:
        return
    upgrade = "this process's" if value > WIRE_FORMAT else "the sending process's"
    raise ValueError(
        f"{what}: wire format {value} is not readable by rl-data {__version__}, which reads "
        f"{sorted(READABLE)} and writes {WIRE_FORMAT}; upgrade rl-data on {upgrade} side "
        "(and the packages that send and receive it: rl-rollout, rl-learner, rl-launch) so both "
        "sides share one wire format"
    )
