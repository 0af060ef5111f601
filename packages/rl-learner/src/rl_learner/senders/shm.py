"""The "shm" transport's sender: shared-memory slots for engines on its machine (`rl_data.sync.shm`)."""

from __future__ import annotations

from typing import Any

from rl_data import WeightSyncReport
from rl_data.errors import check_integer
from rl_data.sync import WeightSyncSpec
from rl_data.sync.shm import ShmPublisher

from ..sender_base import SENDERS, WeightSender

__all__ = ["ShmSender"]


@SENDERS.register("shm")
class ShmSender(WeightSender):
    """Shared memory for engines on the sender's machine (`rl_data.sync.shm.ShmPublisher` in `spec.directory`).

    The sending rank owns the folder: the constructor creates it with `slots` slot files of the
    layout's size (pre-faulted, so a send writes into resident pages: `slots` x the layout's
    bytes of RAM), each `send` announces the version, then packs every bucket straight into a
    free slot (the only copy on this side) and marks it ready with its checksum, so receivers
    load bucket i while bucket i+1 is packed; `close` removes the folder. Receivers
    (`rl_rollout.WeightReceiver`) may call `receive(version)` before or while `send` runs: they
    wait for the version and then for each bucket. The report's checksums are
    `rl_data.sync.shm.page_checksum`s, compared with the receivers' by `compare_checksums`. A
    receiver still reading the slot a send wants makes it wait, up to
    `spec.timeout_s`; with 2 slots that happens only to a receiver two versions behind.
    """

    transport = "shm"

    def __init__(
        self, model: Any, spec: WeightSyncSpec, *, slots: int = 2, is_sender: bool | None = None
    ) -> None:
        super().__init__(model, spec, is_sender=is_sender)
        check_integer("ShmSender: slots", slots, 1)
        self.directory = spec.directory
        self._publisher = (
            ShmPublisher(spec.directory, self.layout, slots=slots, timeout_s=spec.timeout_s)
            if self.is_sender
            else None
        )

    def _send(self, version: int) -> WeightSyncReport:
        return self._publisher.publish(self._produce, version=version)

    def close(self) -> None:
        """Unmap the slots and remove the folder (receivers keep what they mapped until they close)."""
        super().close()
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.close()
